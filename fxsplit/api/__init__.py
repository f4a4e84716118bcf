"""The public entry points: ``plan()``, ``parallelize()``, ``Plan`` and ``ParallelModel``.

Owns the options (``options``: one typed dataclass shared by ``plan``, ``parallelize`` and the
CLI), planning (``plan``: trace -> user passes -> tensor parallel -> split -> schedule ->
communication plan, in one process), ``parallelize`` (per-rank materialization and the runtime)
and ``ParallelModel`` (``model``) with its checkpoints (``checkpoint``), the whole model's gradient norm
for ``ParallelModel.clip_grad_norm_`` (``grad_norm``), and ``strategy="auto"``: the planner's
search turned into a config (``auto``), and ``verify`` (its lockstep interpreter: ``lockstep``).

May import every layer below it: ``fxsplit.runtime``, ``fxsplit.passes``, ``fxsplit.planner``, ``fxsplit.tp``,
``fxsplit.pipeline``, ``fxsplit.schedule``, ``fxsplit.graph``, ``fxsplit.errors``,
``fxsplit.config``.
"""

from fxsplit.api.options import SCHEDULES, ParallelConfig
from fxsplit.api.plan import Plan, plan
from fxsplit.api.checkpoint import load_full_checkpoint
from fxsplit.api.model import ParallelModel
from fxsplit.api.parallelize import parallelize
from fxsplit.api.verify import VerifyReport, verify
from fxsplit.errors import CheckpointError, PlanError, RankFailedError

__all__ = ["ParallelConfig", "Plan", "plan", "parallelize", "ParallelModel", "PlanError", "RankFailedError",
           "load_full_checkpoint", "CheckpointError", "SCHEDULES", "verify", "VerifyReport"]
