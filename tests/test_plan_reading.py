"""Plans that read ([Note: a plan on one screen] in fxsplit.api.summary): ``print(plan)`` within 60
lines for an 80-layer model, layers with the same sharding folded into one row, the full tables
behind ``plan.tp_table()`` / ``plan.stage_table()``, one unit family (binary sizes, ms), the
hardware named on the first line, ``rank_plan`` with a legend, and the auto table within 30 lines."""

import re

import pytest

import fxsplit
from fxsplit.api.summary import MAX_LINES, fold_layers
from fxsplit.testing import zoo

DEEP = dict(n_layer=80, n_embd=16, n_head=2, vocab_size=32, block_size=8, seq_len=8, batch_size=2)


@pytest.fixture(scope="module")
def deep_plan():
    model, args, _ = zoo.make_gpt(**DEEP)
    return fxsplit.plan(model, args, tp=2, pp=2, schedule="interleaved_1f1b", stages_per_rank=10, microbatches=4,
                        hardware=fxsplit.Hardware.preset("h100-sxm"))


def test_an_80_layer_plan_prints_on_one_screen(deep_plan):
    text = str(deep_plan)
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, text
    assert "times for hardware h100-sxm" in lines[0] and "GiB" in lines[0] and "ms" in lines[0]
    assert "  blocks.0-79: q/k/v colwise, proj rowwise, up colwise, down rowwise" in lines, text
    assert "more stages (plan.stage_table() lists every one)" in text
    # the full tables: every sharded module, every stage
    assert len(deep_plan.tp_table().splitlines()) > 6 * 80
    stage_rows = [ln for ln in deep_plan.stage_table().splitlines() if re.match(r"\s+\d+\s+\d+\s", ln)]
    assert len(stage_rows) == 20


def test_one_unit_family(deep_plan):
    text = str(deep_plan)
    assert not re.search(r"\d ?(KB|MB|GB|TB)\b", text), text  # decimal-looking units are gone
    assert re.search(r"\d (KiB|MiB|GiB)\b", text) and re.search(r"\d ms\b", text)
    assert "KiB" in deep_plan.stage_table() and not re.search(r"\d ?(KB|MB|GB)\b", deep_plan.stage_table())


def test_the_default_hardware_is_named():
    model, args, _ = zoo.make_gpt(n_layer=2, n_embd=16, n_head=2, vocab_size=32, block_size=8, seq_len=8)
    first = str(fxsplit.plan(model, args, pp=2)).splitlines()[0]
    assert "times for hardware generic (Hardware(): no hardware= given)" in first, first


def test_layers_with_the_same_sharding_fold_and_a_different_one_breaks_the_run():
    styles = {f"model.layers.{i}.self_attn.{n}_proj": s for i in range(4)
              for n, s in (("q", "colwise"), ("k", "colwise"), ("v", "colwise"), ("o", "rowwise"))}
    styles["model.layers.2.self_attn.o_proj"] = "replicate"
    styles["lm_head"] = "vocab"
    styles["model.embed_tokens"] = "vocab"
    assert fold_layers(styles) == [
        "model.layers.0-1: q/k/v colwise, o rowwise",
        "model.layers.2: q/k/v colwise, o replicate",
        "model.layers.3: q/k/v colwise, o rowwise",
        "vocab: lm_head, model.embed_tokens",
    ]


def test_rank_plan_has_a_legend(deep_plan):
    text = str(deep_plan.rank_plan(0))
    assert "legend:" in text and "Sa1.0@0" in text and "W weight gradient" in text
