"""Tensor parallelism (Megatron-LM style), found from the graph.

Owns the TP plan (``plan``: which parameters are column / row / vocab-parallel or replicated, and
why; the linears and embeddings it reads off the graph, any spelling, are ``linears``), the
node-level recipe the pass applies (``rewrite``: ``TPRewrite``, typed records), the search for
regions (``regions``), sharding propagation through the graph (``propagate``, with the per-op rule table in
``rules``, the shape arithmetic they share in ``shapes``, and heads merged as the inner factor of
a dim, BLOOM's ``B * heads``, in ``merged``), the sequence-parallel decisions
recorded in the plan (``sequence``), shard specs and per-rank
materialization (``sharding``), the conjugate collectives f / g (``collectives``) and the fused
parallel autograd functions (``functional``) and the random-number streams of sharded and
replicated regions (``random``, [Note: RNG streams]). The pass that applies a TP plan to a graph is
``fxsplit.passes.tensor_parallel``.

May import: ``fxsplit.graph``, ``fxsplit.errors``, ``fxsplit.config`` and torch; not
``fxsplit.pipeline`` (the two parallelisms are independent), the runtime or the API.
"""
