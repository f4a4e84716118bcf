"""The node-level recipe of a tensor-parallel plan: what ``fxsplit.passes.tensor_parallel`` applies.

Terms (see ``fxsplit.tp.plan`` for t, column / row, region, blocks):
- **sharded value**: a node whose value holds 1/t of one dim on each rank (:class:`ShardedValue`).
- **shape argument**: a size in a node's arguments (a view's shape, a split's sizes, a slice's
  bounds) that becomes the local size once its value is sharded (:class:`ShapeArg`).
- **f / g**: Megatron's conjugate collectives (``fxsplit.tp.collectives``): f is identity
  forward, all-reduce backward; g is all-reduce forward, identity backward.

A :class:`fxsplit.tp.plan.TPPlan` is what a user reads (styles per module path, parameter
shard specs, regions, what stays replicated and why); it holds one :class:`TPRewrite`, found
with it, that names graph nodes and says what to insert at each:

    plan = find_tp_plan(gm, 2)                        # the zoo's GPT, n_embd=32, 4 heads
    plan.rewrite.sharded_nodes["blocks_0_attn_q"]    # ShardedValue(dim=2, size=32)
    plan.rewrite.shape_args[0]                       # ShapeArg(node='view', path=(3,), value=2): 2 heads a rank
    plan.rewrite.grad_sums                           # (): no replicated operand with a partial gradient

Every record is frozen and prints with its field names, so a plan diff in a test names what
differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Union

from fxsplit.errors import TPPlanError
from fxsplit.tp.linears import EmbeddingInfo, LinearInfo
from fxsplit.tp.sequence import SequenceParallelPlan
from fxsplit.tp.shapes import LocalSize

__all__ = ["ShardedValue", "ShapeArg", "GradSum", "Scatter", "PartialSum", "TPRewrite", "PARTIAL_KINDS"]

PARTIAL_KINDS = ("sum", "mean")


@dataclass(frozen=True)
class ShardedValue:
    """A value carrying a shard: ``dim`` (global dim sharded) and ``size``, the global size of
    that dim, -1 when it is symbolic or the value is a split's tuple of outputs (the local shape
    then comes from the traced one)."""

    dim: int
    size: int


@dataclass(frozen=True)
class ShapeArg:
    """The argument at ``path`` (indices into ``node.args``) of node ``node`` becomes ``value``: a
    local int, a ``slice`` with local bounds (fx indexing), or a :class:`LocalSize` (a size
    computed at run time, divided by t there)."""

    node: str
    path: tuple
    value: Union[int, slice, LocalSize]


@dataclass(frozen=True)
class GradSum:
    """One f (``copy_to_region``: backward all-reduce) on ``operand``, a replicated value read by
    the sharded node ``node`` whose gradient on each rank is partial ([Note: partial gradients
    of replicated operands] in ``fxsplit.tp.plan``). ``operand`` is ``"<module>"`` for a
    ``call_module`` node with trainable parameters of its own (fx ``nn.LayerNorm``): the pass
    makes it a function call first."""

    node: str
    operand: str


@dataclass(frozen=True)
class Scatter:
    """``operand``, replicated, with the sharded dim's full size on ``dim`` (a per-head score
    bias), read by ``node`` through ``scatter_to_region`` ([Note: scattered operands] in
    ``fxsplit.tp.rules``). ``heads``: the dim merges the heads as its inner factor (``[N, H]``,
    H sharded), so each rank's range is strided; None for a contiguous range."""

    node: str
    operand: str
    dim: int
    heads: int | None = None


@dataclass(frozen=True)
class PartialSum:
    """``node`` reduces over the sharded dim (``kind`` "sum" or "mean"); a g after it makes the
    value whole ([Note: reductions over the sharded dim] in ``fxsplit.tp.rules``)."""

    node: str
    kind: str

    def __post_init__(self) -> None:
        if self.kind not in PARTIAL_KINDS:
            raise TPPlanError(f"PartialSum({self.node!r}): kind is {self.kind!r}; the kinds are {PARTIAL_KINDS}")


@dataclass(frozen=True)
class TPRewrite:
    """What the pass applies, node by node (frozen data found with the plan).

    sharded_nodes: node name -> :class:`ShardedValue` for every value carrying a shard.
    shape_args: shape arguments rewritten to local sizes. linears / embeddings: node name ->
    what the graph computes there (every linear and embedding, sharded or not).
    vocab_embeddings, lm_heads: node names of vocabulary-parallel embeddings and LM heads.
    grad_sums, scatters, partial_sums: the operands and reductions that need a collective of
    their own (see each record). merged: sharded node -> H for values whose sharded dim merges
    the heads as its inner factor ([Note: heads merged as an inner factor] in
    ``fxsplit.tp.merged``; rank r holds its heads' rows of every outer index).
    sequence_plan: the sequence-parallel decisions (empty unless ``sequence_parallel``).
    """

    sharded_nodes: Mapping[str, ShardedValue] = field(default_factory=dict)
    shape_args: tuple[ShapeArg, ...] = ()
    linears: Mapping[str, LinearInfo] = field(default_factory=dict)
    embeddings: Mapping[str, EmbeddingInfo] = field(default_factory=dict)
    vocab_embeddings: tuple[str, ...] = ()
    lm_heads: tuple[str, ...] = ()
    grad_sums: tuple[GradSum, ...] = ()
    scatters: tuple[Scatter, ...] = ()
    partial_sums: tuple[PartialSum, ...] = ()
    merged: Mapping[str, int] = field(default_factory=dict)
    sequence_plan: SequenceParallelPlan = field(default_factory=SequenceParallelPlan)
