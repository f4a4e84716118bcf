"""Pipeline runtime: one pipeline rank executes its action list over torch.distributed.

- `executor.PipelineRuntime`: runs a rank's :class:`~fxsplit.pipeline.rank_plan.RankPlan` with its
  stage modules (training step, inference, generation's decode programs) under `options.RuntimeOptions`.
- `step`: the state of one call (`Step`: microbatches, saved activations, handed-over values,
  outputs, loss) and its messages, passed to every action as an argument.
- `runners`: how one stage computes: `EagerRunner` (its module on autograd), `GraphRunner` (the
  graph split's F, I and W graphs of a zero-bubble stage), `CompiledRunner` (those graphs compiled).
- `p2p`: the channel that posts the sends/receives of a rank's communication plan
  (``fxsplit.pipeline.comm``, [Note: message order]) with a timeout on every wait.
- `microbatch`: split inputs and targets into microbatches, merge outputs, concrete shapes.
- `compile/`: the graph compiler: a stage's forward, I and W graphs (``compile.split_graph``, the
  default for zero-bubble schedules, [Note: graph split backward]), ``torch.compile`` of them
  (``compile.compiling``, ``compile=True``, [Note: compiled stages]) and CPU matmul routing
  (``compile.cpu_matmul``). `split_backward`: the I / W halves on autograd's graph ([Note: split
  backward]), for stages the graph split refuses and ``split_backward="autograd"``.
- `mesh`: process-group set-up from torchrun's environment, the ("dp", "pp", "tp") DeviceMesh
  (("dp", "dp_shard", "pp", "tp") with sharded data parallelism) and every process group of a run
  as one typed `Groups` (``build_groups``, [Note: process groups]).
- `pipe_group`: the pipeline group's bounded waits; `tied`: tied parameters' gradient sums.
- `data_parallel`: the data-parallel gradient mean in buckets, started per stage through the
  runtime's ``grad_hooks`` while the pipeline still runs.
- `fsdp`: sharded data parallelism on one rank: FSDP2 ``fully_shard`` over its stages and the
  once-per-step gather / reduce-scatter around the pipeline.
- `failures`: the end-of-call error exchange that makes every rank fail together ([Note: failures]).

May import: ``fxsplit.pipeline``, ``fxsplit.tp``, ``fxsplit.schedule``, ``fxsplit.graph``,
``fxsplit.errors``, ``fxsplit.config`` and torch; never ``fxsplit.api`` or the passes. The runtime
runs what the plan holds and never plans.
"""

from fxsplit.runtime.executor import PipelineRuntime
from fxsplit.runtime.options import RuntimeOptions
from fxsplit.runtime.microbatch import (
    MicrobatchSplit,
    bind_symbols,
    concrete_shape,
    merge_microbatches,
    split_microbatches,
    split_target,
)
from fxsplit.runtime.p2p import P2PChannel, PipelineError

__all__ = [
    "MicrobatchSplit",
    "P2PChannel",
    "PipelineError",
    "PipelineRuntime",
    "RuntimeOptions",
    "bind_symbols",
    "concrete_shape",
    "merge_microbatches",
    "split_microbatches",
    "split_target",
]
