"""Sequence parallelism (Megatron-3) together with the operand steps of the TP pass: the f's on
replicated operands with partial gradients and the scatters of OLMo 2's whole-projection q/k
norm ([Note: reductions over the sharded dim]), and the f's on the whole k / v rows of
GPTBigCode's multi-query ``c_attn`` ([Note: whole blocks]). Each plan is checked by
``fxsplit.verify`` (all ranks in one process, outputs and every gradient vs the unsplit model),
and its stage graph must really run sequence-sharded (reduce-scatters in it)."""

import pytest

import fxsplit
from fxsplit.testing import tp_coverage as tc
from fxsplit.tp import collectives as C
from test_tp_plan import _count  # by qualified name (see test_tp_plan._count)

pytestmark = pytest.mark.hf
_HW = fxsplit.Hardware(link_bytes_per_s=float("inf"))


@pytest.mark.parametrize("arch,operand", [("olmo2", C.scatter_to_region), ("gpt_bigcode", C.copy_to_region)])
def test_sequence_parallel_with_operand_collectives(arch, operand):
    pytest.importorskip("transformers")
    model, args, kwargs = tc.build(arch)
    the_plan = fxsplit.plan(model, args, kwargs, tp=2, sequence_parallel=True, hardware=_HW)
    assert the_plan.tp_plan.sequence_parallel and not [p for p, _ in the_plan.tp_plan.replicated if ".h." in p
                                                         or ".layers." in p], the_plan.tp_plan
    gm = the_plan.stages.modules[0]
    assert _count(gm, C.reduce_scatter_to_region) >= 4 and _count(gm, operand) >= 2, gm.graph
    report = fxsplit.verify(model, args, the_plan, kwargs)
    assert report.max_gradient_error < 1e-4 and report.max_output_error < 1e-4, report
