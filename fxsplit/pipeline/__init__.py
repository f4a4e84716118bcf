"""Pipeline parallelism up to the runtime: the balanced split and the stage graphs.

Owns the exact partitioner (the ``partition`` package: minimum-bottleneck contiguous stages under a
per-rank memory cap), the split plan of a traced graph (``split``), the stage GraphModules with
their inputs, outputs and tied parameters (``stage``), the communication plan (``comm``: which
message goes to which rank in what order, derived from a schedule and the stages' boundaries),
and the memory model (``memory``: what a stage holds per microbatch, and parameters, gradients,
optimizer state, activations at the peak of a step; [Note: memory model]), shared by
``Plan.memory()`` and the auto-planner.

May import: ``fxsplit.graph``, ``fxsplit.schedule``, ``fxsplit.errors``, ``fxsplit.config`` and
torch; not ``fxsplit.tp``, the runtime or the API.
"""
