"""fxsplit.tp.sharding: ShardSpec round trips, errors, state dicts and per-rank materialization.

All in one process (no process group): sharding is pure tensor code.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fxsplit.tp.sharding import (
    default_init,
    ShardedParam,
    ShardingError,
    ShardSpec,
    materialize_module,
    padded_size,
    shard_state_dict,
    unshard_state_dict,
    valid_degrees,
)

# ----------------------------------------------------------------------------- ShardSpec


@st.composite
def _case(draw):
    """A (tensor, spec) pair: plain, blocked or padded split of a random dim."""
    t = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim)]
    d = draw(st.integers(-ndim, ndim - 1))
    kind = draw(st.sampled_from(["plain", "blocks", "pad"]))
    if kind == "plain":
        shape[d] = t * draw(st.integers(1, 4))
        spec = ShardSpec(dim=d, num_shards=t)
    elif kind == "blocks":
        blocks = tuple(t * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3))))
        shape[d] = sum(blocks)
        spec = ShardSpec(dim=d, num_shards=t, blocks=blocks)
    else:
        shape[d] = draw(st.integers(1, 13))
        extra = draw(st.integers(1, 3))
        spec = ShardSpec(dim=d, num_shards=t, pad_to=padded_size(shape[d], t, extra),
                         size=shape[d])
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1
    return full, spec


@settings(max_examples=150, deadline=None)
@given(_case())
def test_shard_unshard_round_trip(case):
    full, spec = case
    t, d = spec.num_shards, spec.dim % full.dim()
    shards = [spec.shard(full, r) for r in range(t)]
    local = spec.local_shape(full.shape)
    for r, s in enumerate(shards):
        assert tuple(s.shape) == local
        assert s.is_contiguous()
        # local_range says exactly which global indices the shard holds (padding reads zero)
        idx = torch.cat([torch.arange(a, b) for a, b in spec.local_range(r, full.shape[d])])
        assert len(idx) == local[d]
        real = idx < full.shape[d]
        expect = full.index_select(d, idx.clamp(max=full.shape[d] - 1))
        mask_shape = [1] * full.dim()
        mask_shape[d] = len(idx)
        expect = expect * real.reshape(mask_shape)
        torch.testing.assert_close(s, expect, rtol=0, atol=0)
    # the shards are copies: writing one leaves the full tensor alone
    before = full.clone()
    shards[0].fill_(-1.0)
    assert torch.equal(full, before)
    shards[0] = spec.shard(full, 0)
    assert torch.equal(spec.unshard(shards), full)
    # every index of the full tensor is held by exactly one rank
    held = sorted(i for r in range(t) for a, b in spec.local_range(r, full.shape[d]) for i in range(a, b))
    total = spec.pad_to if spec.pad_to is not None else full.shape[d]
    assert held == list(range(total))


def test_fused_qkv_blocks_gqa():
    # GQA fused [q | k | v]: C=8 query rows, kv=4 key and value rows each, t=2
    w = torch.arange(16.0).unsqueeze(1)
    spec = ShardSpec(dim=0, num_shards=2, blocks=(8, 4, 4))
    assert spec.shard(w, 1).flatten().tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    assert spec.local_range(1) == [(4, 8), (10, 12), (14, 16)]
    assert spec.local_shape((16, 1)) == (8, 1)


def test_padding_rows_are_zero_and_unshard_needs_size():
    spec = ShardSpec(dim=0, num_shards=4, pad_to=12)
    w = torch.arange(1.0, 11.0).unsqueeze(1)  # V=10
    shards = [spec.shard(w, r) for r in range(4)]
    assert shards[3].flatten().tolist() == [10, 0, 0]
    assert spec.local_range(3) == [(9, 12)]
    with pytest.raises(ShardingError, match=r"unshard\(shards, size=V\)"):
        spec.unshard(shards)
    assert torch.equal(spec.unshard(shards, size=10), w)


def test_errors_name_sizes_and_nearest_degrees():
    with pytest.raises(ShardingError) as e:
        ShardSpec(dim=-1, num_shards=4).shard(torch.zeros(2, 50257), 0)
    msg = str(e.value)
    for part in ("50257", "t=4", "t=1 or t=29", "pad_to=padded_size(50257, 4) = 50260"):
        assert part in msg, msg
    with pytest.raises(ShardingError, match=r"t=6 cannot split.*nearest valid t: t=4 or t=8"):
        ShardSpec(dim=0, num_shards=6).local_shape((24 + 8, 3))  # 32 rows
    with pytest.raises(ShardingError, match=r"block sizes \(12, 6, 6\).*t=4.*\[6, 6\].*t=3 or t=6"):
        ShardSpec(dim=0, num_shards=4, blocks=(12, 6, 6))
    with pytest.raises(ShardingError, match=r"pad_to=10 must be a positive multiple of num_shards=4"):
        ShardSpec(dim=0, num_shards=4, pad_to=10)
    with pytest.raises(ShardingError, match=r"blocks .* sum to 24"):
        ShardSpec(dim=0, num_shards=2, blocks=(8, 8, 8)).local_shape((20, 4))
    with pytest.raises(ShardingError, match=r"rank=2 is out of range for num_shards=2"):
        ShardSpec(dim=0, num_shards=2).shard(torch.zeros(4), 2)
    with pytest.raises(ShardingError, match="expected 2 shards"):
        ShardSpec(dim=0, num_shards=2).unshard([torch.zeros(2)])
    with pytest.raises(ShardingError, match=r"size=50257 cannot be split into t=8.*t=1 or t=29"):
        ShardSpec(dim=0, num_shards=8, size=50257)
    with pytest.raises(ShardingError, match=r"has size 12, but the spec says size=16"):
        ShardSpec(dim=0, num_shards=2, size=16).shard(torch.zeros(12), 0)
    assert ShardSpec(dim=0, num_shards=2, size=16).local_range(1) == [(8, 16)]
    with pytest.raises(ShardingError, match="num_shards must be an int >= 1"):
        ShardSpec(dim=0, num_shards=0)
    assert valid_degrees(12, upto=8) == [1, 2, 3, 4, 6]
    assert padded_size(50257, 8) == 50264 and padded_size(50257, 8, 64) == 50688
    with pytest.raises(ShardingError, match=r"\(5, 3\).*t=2"):
        ShardedParam("lin.weight", (5, 3), ShardSpec(dim=0, num_shards=2))
    assert ShardedParam("lin.weight", (6, 3), ShardSpec(0, 2)).local_shape == (3, 3)
    assert ShardedParam("ln.weight", (6,), None).local_shape == (6,)


def test_state_dict_round_trip_and_errors():
    torch.manual_seed(0)
    sd = {"emb": torch.randn(11, 4), "qkv": torch.randn(12, 4), "fc": torch.randn(4, 6),
          "ln": torch.randn(4)}
    specs = {"emb": ShardSpec(0, 2, pad_to=12, size=11), "qkv": ShardSpec(0, 2, blocks=(4, 4, 4)),
             "fc": ShardSpec(1, 2)}
    per_rank = [shard_state_dict(sd, specs, r) for r in range(2)]
    assert per_rank[1]["emb"].shape == (6, 4) and per_rank[1]["fc"].shape == (4, 3)
    assert per_rank[0]["ln"] is sd["ln"]
    back = unshard_state_dict(per_rank, specs)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    with pytest.raises(ShardingError, match=r"\['nope'\]"):
        shard_state_dict(sd, {"nope": ShardSpec(0, 2)}, 0)
    with pytest.raises(ShardingError, match=r"'fc'.*size 6, which t=4"):
        shard_state_dict(sd, {"fc": ShardSpec(1, 4)}, 0)
    with pytest.raises(ShardingError, match=r"rank 1's keys differ.*'ln'"):
        unshard_state_dict([per_rank[0], {k: v for k, v in per_rank[1].items() if k != "ln"}],
                           specs)


# ----------------------------------------------------------------------------- materialize

V, C = 11, 8


class _TiedLM(nn.Module):
    """Embedding tied to the LM head, a column linear, a norm, a frozen parameter, buffers."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.up = nn.Linear(C, 2 * C)
        self.down = nn.Linear(2 * C, C)
        self.ln = nn.LayerNorm(C)
        self.head = nn.Linear(C, V, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = nn.Parameter(torch.randn(C), requires_grad=False)
        self.register_buffer("scale", torch.full((C,), 2.0))
        self.register_buffer("tmp", torch.ones(2 * C), persistent=False)

    def forward(self, ids):
        h = self.emb(ids) * self.scale
        h = h + self.down(torch.relu(self.up(h)) * self.tmp)
        return self.head(self.ln(h + self.frozen))


def _specs(t):
    return {
        "emb.weight": ShardSpec(0, t, pad_to=padded_size(V, t), size=V),
        "up.weight": ShardSpec(0, t),
        "up.bias": ShardSpec(0, t),
        "down.weight": ShardSpec(1, t),
        "tmp": ShardSpec(0, t),
    }


def _meta_graph(traced=True):
    with torch.device("meta"):
        model = _TiedLM()
    return torch.fx.symbolic_trace(model) if traced else model


class _Sizes(TorchDispatchMode):
    """Records the number of elements of every tensor an op allocates (views excluded)."""

    def __init__(self):
        super().__init__()
        self.numels = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.numels.append((str(func), o.numel()))
        return out


def _check_structure(gm, t):
    assert gm.emb.weight is gm.head.weight, "tied parameters must stay one object"
    assert isinstance(gm.emb.weight, nn.Parameter) and gm.emb.weight.requires_grad
    assert isinstance(gm.frozen, nn.Parameter) and not gm.frozen.requires_grad
    if not isinstance(gm, torch.fx.GraphModule):  # (fx's copy makes every buffer persistent)
        assert "tmp" not in gm.state_dict() and "scale" in gm.state_dict()
    assert not any(p.is_meta for p in gm.parameters()) and not any(b.is_meta for b in gm.buffers())
    assert gm.emb.weight.shape == (padded_size(V, t) // t, C)
    assert gm.up.weight.shape == (2 * C // t, C) and gm.down.weight.shape == (C, 2 * C // t)
    assert gm.ln.weight.shape == (C,) and gm.tmp.shape == (2 * C // t,)


@pytest.mark.parametrize("as_state_dict,traced", [(False, True), (True, True), (False, False)])
def test_materialize_from_real_model(as_state_dict, traced):
    torch.manual_seed(0)
    model = _TiedLM()
    source = model.state_dict(keep_vars=True) if as_state_dict else model
    if as_state_dict:  # a state dict has no non-persistent buffers
        assert "tmp" not in source
    t, specs = 2, _specs(2)
    full = dict(model.named_parameters(remove_duplicate=False))
    full.update(model.named_buffers())
    if as_state_dict:  # ... and a buffer is never zero-filled: it raises ([Note: every buffer keeps its value])
        with pytest.raises(ShardingError, match=r"buffers/constants \['tmp'\].*no source holds a real value"):
            materialize_module(_meta_graph(traced), specs, 0, source=source, device="cpu")
        return
    for rank in range(t):
        gm = _meta_graph(traced)
        sizes = _Sizes()
        with sizes:
            materialize_module(gm, specs, rank, source=source, device="cpu")
        _check_structure(gm, t)
        biggest_local = max(p.numel() for p in gm.parameters())
        assert max(n for _, n in sizes.numels) <= biggest_local, sizes.numels
        got = dict(gm.named_parameters(remove_duplicate=False))
        got.update(gm.named_buffers())
        for name, value in got.items():
            if as_state_dict and name == "tmp":
                assert torch.equal(value, torch.zeros(2 * C // t)), "default init: 1-D buffer"
                continue
            spec = specs.get("emb.weight" if name == "head.weight" else name)  # tied
            expect = full[name] if spec is None else spec.shard(full[name], rank)
            assert torch.equal(value, expect), name
            assert value.data_ptr() != full[name].data_ptr(), f"{name} must be a copy"


def test_materialize_from_meta_allocates_only_local_and_inits():
    t, specs = 4, _specs(4)
    outs = []
    for rank in range(t):
        gm = _meta_graph()
        sizes = _Sizes()
        with sizes:
            # init_fn given: the buffers (meta here, with no source) are filled by it too
            materialize_module(gm, specs, rank, source=None, init_fn=default_init)
        _check_structure(gm, t)
        full_numels = {V * C, 2 * C * C}
        assert not full_numels & {n for _, n in sizes.numels}, sizes.numels
        outs.append(gm)
        # default init: normal(0, 0.02) matrices, zero biases, unit norm scales
        assert torch.equal(gm.up.bias, torch.zeros(2 * C // t))
        assert torch.equal(gm.ln.weight, torch.ones(C)) and torch.equal(gm.ln.bias, torch.zeros(C))
        assert 0.005 < gm.up.weight.std().item() < 0.05
    # replicated tensors agree on every tp rank; sharded ones differ; a rerun is reproducible
    for gm in outs[1:]:
        assert torch.equal(gm.frozen, outs[0].frozen)
    assert not torch.equal(outs[0].up.weight, outs[1].up.weight)
    again = _meta_graph()
    rng = torch.get_rng_state()
    materialize_module(again, specs, 2, source=None, init_fn=default_init)
    assert torch.equal(torch.get_rng_state(), rng), "the caller's RNG state must not change"
    assert torch.equal(again.up.weight, outs[2].up.weight)
    seen = []
    gm = _meta_graph()
    materialize_module(gm, specs, 0, source=None,
                       init_fn=lambda fqn, x: (seen.append((fqn, tuple(x.shape))), x.fill_(3.0)))
    assert ("up.weight", (4, C)) in seen and len([s for s in seen if s[0] == "emb.weight"]) == 1
    assert torch.equal(gm.head.weight, torch.full((3, C), 3.0))


def test_materialize_local_meta_shapes():
    """A module whose meta tensors already have local shapes: from a source, or with full_shapes."""
    torch.manual_seed(1)
    model = _TiedLM()
    specs = _specs(2)
    gm = _meta_graph()
    # shrink the sharded tensors to their local shapes on meta, as a tp pass may do
    local_meta = {}
    for name, p in gm.named_parameters():
        if name in specs:
            local_meta[name] = nn.Parameter(torch.empty(specs[name].local_shape(p.shape),
                                                        device="meta"))
    for name, new in local_meta.items():
        owner, leaf = name.rsplit(".", 1)
        setattr(gm.get_submodule(owner), leaf, new)
    gm.head.weight = gm.emb.weight
    materialize_module(gm, specs, 1, source=model)
    assert torch.equal(gm.down.weight, specs["down.weight"].shard(model.down.weight, 1))
    assert gm.head.weight is gm.emb.weight
    # without a source, full_shapes says the meta shapes are already local
    gm2 = _meta_graph()
    full_shapes = {n: tuple(p.shape) for n, p in gm2.named_parameters(remove_duplicate=False)}
    for name, new in local_meta.items():
        owner, leaf = name.rsplit(".", 1)
        setattr(gm2.get_submodule(owner), leaf, nn.Parameter(torch.empty_like(new)))
    gm2.head.weight = gm2.emb.weight
    materialize_module(gm2, specs, 0, source=None, full_shapes=full_shapes, init_fn=default_init)
    assert gm2.up.weight.shape == (C, C) and gm2.emb.weight.shape == (6, C)


def test_materialize_errors():
    model = _TiedLM()
    with pytest.raises(ShardingError, match=r"'nope\.weight'.*not parameters or buffers"):
        materialize_module(_meta_graph(), {"nope.weight": ShardSpec(0, 2)}, 0, source=model)
    with pytest.raises(ShardingError, match=r"tied names \['emb.weight', 'head.weight'\]"):
        materialize_module(_meta_graph(), {"emb.weight": ShardSpec(0, 2, pad_to=12),
                                           "head.weight": ShardSpec(1, 2)}, 0, source=model)
    with pytest.raises(ShardingError, match=r"'up.weight'.*size 16, which t=3.*t=2 or t=4"):
        materialize_module(_meta_graph(), {"up.weight": ShardSpec(0, 3)}, 0, source=model)
    gm = _meta_graph()
    gm.up.weight = nn.Parameter(torch.empty(5, C, device="meta"))
    with pytest.raises(ShardingError, match=r"'up.weight' has shape \(5, 8\).*full shape is "
                                            r"\(16, 8\) and this rank's shape \(8, 8\)"):
        materialize_module(gm, {"up.weight": ShardSpec(0, 2)}, 0, source=model)
    gm = _meta_graph()
    gm.const = torch.empty(3, device="meta")  # a plain tensor attribute the graph reads
    with gm.graph.inserting_before(next(iter(gm.graph.nodes))), pytest.warns(UserWarning):
        gm.graph.get_attr("const")  # fx warns: a constant is no parameter or buffer
    with pytest.raises(ShardingError, match=r"tensor constants \['const'\] that are on the meta"):
        materialize_module(gm, {}, 0, source=model)
    assert gm.up.weight.is_meta, "nothing is replaced when materialization fails"
    with pytest.raises(TypeError, match="source must be an nn.Module"):
        materialize_module(_meta_graph(), {}, 0, source=[1, 2])
