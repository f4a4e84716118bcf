"""fxsplit.Hardware: presets, the collective formulas, measure() and its cache, the rates an estimate divides by."""

from __future__ import annotations

import json
import math
import time

import pytest

import fxsplit
from fxsplit.hardware import measure as _hardware_measure
from fxsplit.hardware import PRESETS, Hardware
from fxsplit.testing import run_distributed


def test_exported_at_top_level():
    assert fxsplit.Hardware is Hardware


def test_legacy_defaults_and_arguments_keep_their_meaning():
    hw = Hardware()
    assert (hw.flops_per_s, hw.bytes_per_s, hw.link_bytes_per_s) == (100e12, 1.5e12, 25e9)
    inf = Hardware(link_bytes_per_s=float("inf"))
    assert inf.link_bytes_per_s == math.inf and inf.flops_per_s == 100e12
    assert inf.p2p_time(1e9) == 0.0  # no latency given, infinite link: communication is free
    cpu = Hardware.cpu(cores=2)
    assert (cpu.flops_per_s, cpu.bytes_per_s, cpu.link_bytes_per_s) == (100e9, 20e9, 5e9)
    assert Hardware.cpu().flops_per_s == 50e9
    positional = Hardware(1e12, 1e11, 1e9)
    assert (positional.flops_per_s, positional.bytes_per_s, positional.link_bytes_per_s) == (1e12, 1e11, 1e9)
    assert positional.matmul_time(2e12, "fp32") == 2.0 and positional.memory_time(1e11) == 1.0
    assert Hardware() == Hardware() and hash(Hardware()) == hash(Hardware())  # still a frozen value


def test_presets_have_sane_cited_numbers():
    a100, h100 = Hardware.preset("a100-80gb"), Hardware.preset("H100-SXM")
    for hw in (a100, h100):
        assert hw.devices_per_node == 8 and hw.memory_bytes == 80e9
        assert 0 < hw.matmul_efficiency < 1 and 0 < hw.memory_efficiency < 1
        assert hw.flops_per_s == pytest.approx(hw.peak_bf16_flops_per_s * hw.matmul_efficiency)
        assert hw.bytes_per_s == pytest.approx(hw.peak_bytes_per_s * hw.memory_efficiency)
        assert hw.peak_fp32_flops_per_s < hw.peak_bf16_flops_per_s / 4  # fp32 is not tensor-core bf16
        assert hw.intra_node_bytes_per_s > 5 * hw.inter_node_bytes_per_s  # NVLink vs one IB port
        assert 0 < hw.intra_node_latency_s <= hw.inter_node_latency_s < 1e-4
        assert hw.link_bytes_per_s == hw.inter_node_bytes_per_s  # pipeline stages cross nodes
    assert a100.peak_bf16_flops_per_s == 312e12 and h100.peak_bf16_flops_per_s == 989.4e12
    assert a100.inter_node_bytes_per_s == 25e9 and h100.inter_node_bytes_per_s == 50e9
    assert h100.peak_bf16_flops_per_s > 3 * a100.peak_bf16_flops_per_s
    assert h100.peak_bytes_per_s > a100.peak_bytes_per_s
    assert h100.intra_node_bytes_per_s > a100.intra_node_bytes_per_s
    assert h100.matmul_time(1e15, "bf16") < a100.matmul_time(1e15, "bf16")
    assert set(PRESETS) == {"a100-80gb", "h100-hbm2e", "h100-sxm"}
    # torchtitan's H100s: the SXM part at 500 W with HBM2e (its benchmark's "Hardware" section)
    titan = Hardware.preset("h100-hbm2e")
    assert titan.peak_bytes_per_s == 2.4e12 < h100.peak_bytes_per_s and titan.memory_bytes > h100.memory_bytes
    assert titan.inter_node_bytes_per_s == h100.inter_node_bytes_per_s and titan.flops_per_s < h100.flops_per_s


def test_unknown_preset_names_the_presets():
    with pytest.raises(ValueError, match="a100-80gb, h100-hbm2e, h100-sxm"):
        Hardware.preset("tpu-v5")


def test_inconsistent_or_invalid_fields_raise():
    with pytest.raises(ValueError, match="flops_per_s .* != peak bf16"):
        Hardware(flops_per_s=1e12, peak_bf16_flops_per_s=1e12, matmul_efficiency=0.5)
    with pytest.raises(ValueError, match="matmul_efficiency must be in"):
        Hardware(matmul_efficiency=1.5)
    with pytest.raises(ValueError, match="link_bytes_per_s must be > 0"):
        Hardware(link_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="no matmul rate for dtype"):
        Hardware().matmul_time(1.0, "float64")


def test_collective_formulas_against_hand_computed_values():
    hw = Hardware(intra_node_bytes_per_s=100.0, intra_node_latency_s=1.0,
                  inter_node_bytes_per_s=10.0, inter_node_latency_s=5.0)
    assert hw.link_bytes_per_s == 10.0  # unset, the pipeline link is the inter-node one
    assert hw.p2p_time(200.0) == 1.0 + 2.0
    assert hw.p2p_time(200.0, intra_node=False) == 5.0 + 20.0
    # n = 4, 400 bytes: ring all-reduce 2*3*1 + 2*3/4*400/100 = 6 + 6 = 12
    assert hw.allreduce_time(400.0, 4) == pytest.approx(12.0)
    # inter: 2*3*5 + 2*3/4*400/10 = 30 + 60 = 90
    assert hw.allreduce_time(400.0, 4, intra_node=False) == pytest.approx(90.0)
    # all-gather and reduce-scatter: 3*1 + 3/4*400/100 = 3 + 3 = 6, half an all-reduce
    assert hw.allgather_time(400.0, 4) == pytest.approx(6.0)
    assert hw.reduce_scatter_time(400.0, 4) == pytest.approx(6.0)
    assert hw.allgather_time(400.0, 4) + hw.reduce_scatter_time(400.0, 4) == pytest.approx(hw.allreduce_time(400.0, 4))
    assert hw.allreduce_time(1e9, 1) == 0.0
    with pytest.raises(ValueError, match="n >= 1"):
        hw.allreduce_time(1.0, 0)
    # measured ring figures replace the link pair in their own scope only
    ring = Hardware(intra_node_bytes_per_s=100.0, intra_node_latency_s=1.0,
                    ring_latency_s=2.0, ring_bytes_per_s=50.0, ring_intra_node=True)
    assert ring.allreduce_time(400.0, 2) == pytest.approx(2 * (2.0 + 0.5 * 400 / 50))
    assert ring.p2p_time(100.0) == 2.0
    assert ring.allreduce_time(400.0, 2, intra_node=False) == pytest.approx(2 * (0.0 + 0.5 * 400 / 25e9))
    a100 = Hardware.preset("a100-80gb")
    # 8 GPUs in a node, 1 GB of bf16 gradients: 14 * 3.4 us + 1.75 * 1e9 / 300e9
    assert a100.allreduce_time(1e9, 8) == pytest.approx(14 * 3.4e-6 + 1.75e9 / 300e9)
    assert a100.same_node(0, 7) and not a100.same_node(7, 8)


def test_dict_round_trip():
    for hw in (Hardware(), Hardware.cpu(2), Hardware.preset("h100-sxm"), Hardware(link_bytes_per_s=float("inf"))):
        assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw


def test_fit_alpha_beta_recovers_a_line():
    alpha, slope = _hardware_measure.fit_alpha_beta([1.0, 2.0, 4.0, 8.0], [3.0 + 0.5 * x for x in (1, 2, 4, 8)])
    assert alpha == pytest.approx(3.0) and slope == pytest.approx(0.5)
    alpha, slope = _hardware_measure.fit_alpha_beta([1.0, 2.0], [2.0, 1.0])  # noise: no negative slope
    assert alpha >= 0 and slope > 0


def test_measure_is_positive_finite_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FXSPLIT_CACHE_DIR", str(tmp_path))
    t0 = time.perf_counter()
    hw = Hardware.measure(cache=True, budget_s=0.1)
    assert time.perf_counter() - t0 < 5.0
    for value in (hw.flops_per_s, hw.bytes_per_s, hw.peak_bf16_flops_per_s, hw.peak_fp32_flops_per_s,
                  hw.memory_bytes):
        assert 0 < value < math.inf
    assert hw.compute_dtype == "fp32" and hw.matmul_time(hw.flops_per_s, "fp32") == pytest.approx(1.0)
    assert hw.link_bytes_per_s == Hardware().link_bytes_per_s and "links not measured" in hw.source
    files = list(tmp_path.glob("hardware-*.json"))
    assert len(files) == 1
    # the second call reads the cache: prove it by planting a figure no machine measures
    data = json.loads(files[0].read_text())
    data["hardware"]["flops_per_s"] = data["hardware"]["peak_fp32_flops_per_s"] = 123.0
    files[0].write_text(json.dumps(data))
    assert Hardware.measure(cache=True).flops_per_s == 123.0
    fresh = Hardware.measure(cache=False, budget_s=0.05)
    assert fresh.flops_per_s != 123.0 and 0 < fresh.flops_per_s < math.inf
    assert Hardware.measure(cache=True).flops_per_s == fresh.flops_per_s  # cache=False rewrote it
    # a different key (another torch version) in the same file is not trusted
    data = json.loads(files[0].read_text())
    real_key = dict(data["key"])
    assert _hardware_measure._read(files[0], real_key) is not None
    data["key"]["torch"] = "0.0.0"
    files[0].write_text(json.dumps(data))
    assert _hardware_measure._read(files[0], real_key) is None


def _measure_on_rank(rank, world_size):
    first = Hardware.measure(cache=True, budget_s=0.05)
    second = Hardware.measure(cache=True)
    return first.to_dict(), second.to_dict()


@pytest.mark.dist
def test_measure_under_gloo_fits_links_and_agrees_across_ranks(tmp_path):
    results = run_distributed(_measure_on_rank, 2, env={"FXSPLIT_CACHE_DIR": str(tmp_path)}, timeout=60)
    (first0, second0), (first1, second1) = results
    assert first0 == first1 == second0 == second1  # rank 0's figures, broadcast; then cached
    hw = Hardware.from_dict(first0)
    assert 0 < hw.intra_node_bytes_per_s < math.inf and hw.intra_node_latency_s >= 0
    assert hw.link_bytes_per_s == hw.intra_node_bytes_per_s  # one host: the pipeline link is this one
    assert 0 < hw.ring_bytes_per_s < math.inf and hw.ring_intra_node
    assert hw.devices_per_node == 2 and "gloo on 2 ranks" in hw.source
