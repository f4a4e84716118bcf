"""The graph layer: a model becomes an fx graph whose nodes carry what every later layer reads.

Owns tracing (``trace``: fx or ``torch.export``, symbolic batch and sequence; ``export``: the
torch.export frontend; ``decompose``:
torch's attention modules traced as plain ops when asked; ``examples``: example inputs
resized along the batch, [Note: a static batch]), node metadata
(``meta``: ``NodeInfo``, ``TraceInfo``, and ``TensorMeta`` and ``to_expr`` from ``shapes``,
which sits below the cost model), the op vocabulary (``ops``: one op name
per node, the op classes, the dotted-path resolver), the cost model (``cost``, ``cost_ops``, ``saved``: what backward keeps, each storage once,
``profile``; the device and link figures they use are ``fxsplit.hardware``), the pass manager (``pass_api``, ``debug``), inspection (tables, DOT,
graph diffs) and the ``pipe_split()`` marker.

May import: ``fxsplit.errors``, ``fxsplit.config``, ``fxsplit.hardware`` and torch. Nothing here knows about tensor or
pipeline parallelism, schedules or processes.
"""
