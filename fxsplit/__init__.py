"""fxsplit: split an unmodified PyTorch model across devices, as an fx graph compiler.

Data flows one way: model -> :func:`trace` (graph + metadata) -> passes (user passes, tensor
parallel, pipeline split) -> plan (stage graphs, shardings, schedule) -> runtime (one rank's
stages and actions over torch.distributed).

The public API is what this module exports plus the modules named in :data:`PUBLIC_MODULES`;
built-in passes (``fxsplit.passes``) use nothing else, exactly like a user's own pass.
"""

__version__ = "0.1.0"

from .meta import NodeInfo, TensorMeta, TraceInfo, annotate_node, annotate_graph, node_info, trace_info
from .trace import TraceError, flatten_inputs, trace
from .marker import pipe_split
from .pass_api import PassContext, PassManager, PassResult, register_pass
from .split import Hardware
from .api import ParallelConfig, ParallelModel, Plan, PlanError, RankFailedError, load_full_checkpoint, parallelize, plan
from . import schedules
from .schedule import Action, ActionKind, ScheduleError
from .stage import StageGraphs, StageIO, ValueMeta, ValueSource, build_stages
from .cost import NodeCost, graph_cost, node_cost
from .runtime import PipelineError, PipelineRuntime
from .testing import run_distributed

# Modules a pass (ours or a user's) may import; everything else is internal.
PUBLIC_MODULES = (
    "fxsplit",
    "fxsplit.meta",
    "fxsplit.trace",
    "fxsplit.cost",
    "fxsplit.pass_api",
    "fxsplit.inspection",
    "fxsplit.collectives",
    "fxsplit.schedules",
    "fxsplit.stage",
    "fxsplit.partition",
    "fxsplit.split",
    "fxsplit.marker",
    "fxsplit.zoo",
    "fxsplit.hf_zoo",
    "fxsplit.passes",
    "fxsplit.mesh",
    "fxsplit.testing",
    "fxsplit.sharding",
    "fxsplit.tp_ops",
    "fxsplit.tp_plan",
    "fxsplit.profile",
    "fxsplit.api",
    "fxsplit.parallel_model",
    "fxsplit.failures",
    "fxsplit.runtime",
    "fxsplit.cli",
)

__all__ = [
    "trace",
    "flatten_inputs",
    "TraceError",
    "NodeInfo",
    "TensorMeta",
    "TraceInfo",
    "node_info",
    "trace_info",
    "annotate_node",
    "annotate_graph",
    "PUBLIC_MODULES",
    "pipe_split",
    "PassContext",
    "PassManager",
    "PassResult",
    "register_pass",
    "Hardware",
    "plan",
    "parallelize",
    "Plan",
    "ParallelConfig",
    "ParallelModel",
    "PlanError",
    "load_full_checkpoint",
    "RankFailedError",
    "schedules",
    "Action",
    "ActionKind",
    "ScheduleError",
    "StageGraphs",
    "StageIO",
    "ValueMeta",
    "ValueSource",
    "build_stages",
    "NodeCost",
    "graph_cost",
    "node_cost",
    "PipelineError",
    "PipelineRuntime",
    "run_distributed",
]
