"""The pipeline split pass: plan a balanced contiguous split of the graph into stages.

Written only against fxsplit's public API. The pass does not change the graph: it records the
plan (``fxsplit.pipeline.split.SplitPlan``) in ``ctx.report["pipeline_split"]`` and ``gm.meta["fxsplit_split"]``
and each node's stage in ``node.meta["fxsplit_stage"]``; ``plan.build(gm)`` makes the stage
GraphModules. Bind options with ``functools.partial``:

    PassManager([partial(pipeline_split, num_stages=8, num_ranks=4)])(gm, ctx)
"""

from __future__ import annotations

from typing import Any

import torch.fx

from fxsplit.graph.pass_api import PassContext, PassResult
from fxsplit.pipeline.split import plan_split

__all__ = ["pipeline_split"]


def pipeline_split(gm: torch.fx.GraphModule, ctx: PassContext, *, num_stages: int, **options: Any) -> PassResult:
    """Assign every compute node to a stage; options as the fields of
    :class:`fxsplit.pipeline.split.SplitRequest`."""
    ep_plan = ctx.report.get("expert_parallel")  # its token exchanges stay inside one stage
    if ep_plan is not None and ep_plan.spans and "atomic" not in options:
        options = {**options, "atomic": ep_plan.spans}
    if ep_plan is not None and ep_plan.ep > 1 and "kept_fraction" not in options:  # a rank keeps E / ep experts
        options = {**options, "kept_fraction": {w: 1 / ep_plan.ep for w in ep_plan.expert_params}}
    plan = plan_split(gm, num_stages=num_stages, **options)
    for node in gm.graph.nodes:
        if node.name in plan.stage_of:
            node.meta["fxsplit_stage"] = plan.stage_of[node.name]
    gm.meta["fxsplit_split"] = plan
    ctx.report["pipeline_split"] = plan
    ctx.logger.info("pipeline_split:\n%s", plan)
    return PassResult(gm, False)
