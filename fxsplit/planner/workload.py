"""The model as the planner sees it: per-unit costs of the traced graph, traced once, as arrays.

Terms:
    unit      a compute node of the traced graph (``fxsplit.pipeline.split``'s unit).
    group     a maximal run of consecutive units with the same layer key (``blocks.3``): the
              planner cuts pipeline stages between groups only (Megatron's layer boundaries), and a
              group's first module path is the ``split_points`` entry that makes the real split cut
              there too.
    per-sample, constant   every cost is ``const + lin * b`` in the microbatch size ``b``: the
              graph's cost expressions are evaluated at batch 1 and batch 2 (exact for costs linear
              in the batch, which is every op's but a batch-independent parameter read's).
    sharded   a unit whose work tensor parallelism divides by t (the TP plan's sharded values,
              linears of a region, the vocabulary embedding and LM head); ``sp`` additionally a
              unit that sequence parallelism runs on a sequence shard.

    w = Workload.build(gm, tp_plans={2: plan2, 4: plan4}, sp_plan=plan_sp)
    w.num_groups, w.group_paths, w.param_bytes_total

[Note: planner workload]
Everything a candidate's score needs is here, computed once per model: the planner never
re-traces or re-costs a graph per candidate. Per unit: forward FLOPs and their matmul part, bytes
read and written, bytes saved for backward (each as const + lin * b), owned parameter bytes (a
get_attr's on its first user, as the split counts them), whether it reads a parameter (its
backward then has a weight-gradient half, [Note: F, I, W estimates]), the bytes crossing each
group boundary, the recompute masks and saved bytes of "selective" and "full" checkpointing (from
``fxsplit.pipeline.checkpointing``'s rules), and the tensor-parallel collectives each unit
triggers: one forward all-reduce of a region's output at its row linears (g), one backward
all-reduce of its input gradient at its column linears (f), the vocabulary embedding's forward
all-reduce and the LM head's logits all-gather (forward) and input all-reduce (backward). The TP
structure is taken from ``find_tp_plan`` at one degree and reused for the degrees dividing it
(sharding a region by t or by t' | t divides the same dims).

[Note: planner experts] The MoE layers expert parallelism can place (``fxsplit.tp.moe``'s regions,
found once at ep = 1) give three per-unit arrays: ``expert_units`` (the units of an expert FFN:
with ep the busiest ep rank runs them on more than its share of rows, ``score``'s imbalance
margin), ``expert_params`` (the fused expert weights' bytes, owned as in ``params``: with ep a rank
keeps 1/ep of them) and ``a2a_bytes`` at each layer's first grouped linear (the rows dispatched plus
the expert outputs combined: what one microbatch's exchange moves, forward and again backward).
``num_experts`` is the gcd of the layers' expert counts (0: no layer to place), so ep must divide it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np
import torch.fx

from fxsplit.errors import UsageError
from fxsplit.graph.meta import node_info
from fxsplit.graph.shapes import marker_example, substitute
from fxsplit.graph.recompute import MODES, layer_key
from fxsplit.graph.saved import first_saver_bytes, unit_saved
from fxsplit.pipeline.checkpointing import mode_held
from fxsplit.pipeline.bindings import cut_bytes as unit_cut_bytes
from fxsplit.pipeline.bindings import example_bindings, resolve_bindings
from fxsplit.pipeline.recomputable import recomputable
from fxsplit.tp.plan import TPPlan

__all__ = ["Workload", "Linear", "repeat_layers"]

_COMPUTE = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class Linear:
    """A cost ``const + lin * b`` per unit (numpy arrays of one value per unit)."""

    const: np.ndarray
    lin: np.ndarray

    def at(self, b: float) -> np.ndarray:
        return self.const + self.lin * b


def _num(x, binds) -> float:
    return float(substitute(x, binds))


def _out_bytes(node: torch.fx.Node, binds) -> float:
    info = node.meta.get("fxsplit")
    return 0.0 if info is None else info.output_bytes(binds)


@dataclass(frozen=True)
class Workload:
    """Per-unit and per-group arrays of one traced model ([Note: planner workload])."""

    num_units: int
    group_of: np.ndarray  # unit -> group index
    group_starts: tuple[int, ...]  # first unit of each group
    group_paths: tuple[str, ...]  # the layer key of each group ("" for top-level ops)
    flops: Linear
    matmul_flops: Linear
    bytes_rw: Linear  # forward bytes read + written
    bytes_bwd: Linear  # backward bytes (written + saved + read)
    saved: dict  # mode -> Linear: bytes saved for backward per unit ("none", "selective", "full")
    recompute: dict  # mode -> bool mask of units recomputed in backward
    params: np.ndarray  # owned parameter bytes per unit
    param_numel: float  # parameters of the model (elements)
    param_itemsize: float  # bytes per parameter element (the largest parameter dtype)
    reads_params: np.ndarray  # bool: the unit has a weight-gradient half
    cut: Linear  # bytes crossing each group boundary position 0..G (ends 0)
    loss_flops_per_sample: float  # the loss (not in the graph): FLOPs and bytes per sample
    loss_bytes_per_sample: float
    tp_sharded: np.ndarray  # bool: tensor parallelism divides the unit's work
    tp_params_sharded: np.ndarray  # bool: ... and its parameters
    sp_sharded: np.ndarray  # bool: sequence parallelism divides it (replicated units on a shard)
    tp_fwd_bytes: Linear  # bytes the unit's forward all-reduces over tp
    tp_bwd_bytes: Linear  # bytes the unit's backward all-reduces over tp
    tp_fwd_count: np.ndarray
    tp_bwd_count: np.ndarray
    max_tp: int  # the degree the TP structure was found at (1: no tensor parallelism)
    sequence_parallel: bool  # whether sequence parallelism applies (a token embedding starts it)
    batch_size: int  # the example's batch size
    expert_units: np.ndarray  # bool: the unit is inside an expert FFN ([Note: planner experts])
    expert_params: np.ndarray  # the expert weights' bytes among ``params``
    a2a_bytes: Linear  # bytes one exchange (dispatch + combine) of the unit's MoE layer moves
    num_experts: int  # gcd of the MoE layers' expert counts; 0: none expert parallelism can place
    experts_tp_sharded: bool  # tensor parallelism also splits the expert weights (ep x tp)
    loss_saved_per_sample: float = 0.0  # bytes the loss keeps for backward per sample (the outputs' size)

    @property
    def num_groups(self) -> int:
        return len(self.group_starts)

    @property
    def param_bytes_total(self) -> float:
        return float(self.params.sum())

    def group_sum(self, per_unit: np.ndarray) -> np.ndarray:
        """Per-unit values summed per group."""
        return np.add.reduceat(per_unit, np.asarray(self.group_starts))

    @classmethod
    def build(cls, gm: torch.fx.GraphModule, *, tp_plan: TPPlan | None = None,
              sp_plan: TPPlan | None = None) -> "Workload":
        """The workload of ``gm`` (traced by ``fxsplit.trace``, batch symbolic or not); ``tp_plan``
        the TP plan found at the largest degree tried (None: no tensor parallelism), ``sp_plan``
        the same with sequence parallelism (None: not applicable)."""
        units = [n for n in gm.graph.nodes if n.op in _COMPUTE]
        n = len(units)
        probe = _Probe.of(gm)
        costs, params = _unit_costs(units, probe)
        reads = _param_reads(gm, units, params, probe)
        keys = [layer_key(node_info(u).module_path) for u in units]  # groups: runs of one layer key
        starts = [0] + [k for k in range(1, n) if keys[k] != keys[k - 1]]
        group_of = np.zeros(n, dtype=np.int64)
        for g, s in enumerate(starts):
            group_of[s:] = g
        gpos = starts + [n]
        # values a stage recomputes instead of receiving are no pp traffic ([Note: recompute, don't ship])
        again = recomputable(gm, units, probe.b1)
        ucut1, ucut2 = unit_cut_bytes(units, probe.b1, skip=again), unit_cut_bytes(units, probe.b2, skip=again)
        cut = probe.linear(np.array([ucut1[k] for k in gpos]), np.array([ucut2[k] for k in gpos]))
        saved, recompute = _checkpointing(gm, units, probe)
        per_sample_out = _loss_output_per_sample(gm, probe)
        plist = list(gm.parameters())  # deduplicated (tied weights once)
        itemsize = float(max((p.element_size() for p in plist), default=4))
        tp = _TPArrays.of(units, tp_plan, sp_plan, probe)
        experts = _experts(gm, units, {u.name: i for i, u in enumerate(units)}, probe.b1, probe.b2, tp_plan)
        return cls(
            num_units=n, group_of=group_of, group_starts=tuple(starts), group_paths=tuple(keys[s] for s in starts),
            flops=costs["flops"], matmul_flops=costs["matmul_flops"], bytes_rw=costs["rw"],
            bytes_bwd=costs["bwd"], saved=saved, recompute=recompute, params=params,
            param_numel=float(sum(p.numel() for p in plist)), param_itemsize=itemsize, reads_params=reads, cut=cut,
            loss_flops_per_sample=8.0 * per_sample_out / max(itemsize, 1.0),
            loss_bytes_per_sample=5.0 * per_sample_out, tp_sharded=tp.sharded, tp_params_sharded=tp.params_sharded,
            sp_sharded=tp.sp & ~tp.sharded, tp_fwd_bytes=probe.linear(tp.fb1, tp.fb2),
            tp_bwd_bytes=probe.linear(tp.bb1, tp.bb2), tp_fwd_count=tp.fc, tp_bwd_count=tp.bc,
            max_tp=tp_plan.tp if tp_plan is not None else 1,
            sequence_parallel=sp_plan is not None and bool(tp.sp.any()), batch_size=probe.b0,
            loss_saved_per_sample=per_sample_out, expert_units=experts["units"], expert_params=experts["params"],
            a2a_bytes=probe.linear(experts["a2a1"], experts["a2a2"]), num_experts=experts["num"],
            experts_tp_sharded=experts["tp"],
        )


@dataclass(frozen=True)
class _Probe:
    """The graph's cost expressions evaluated at batch 1 and batch 2 (``b1``, ``b2``: the symbol
    bindings), and how a pair of evaluations becomes ``const + lin * b`` (``linear``). Without a
    batch symbol (static shapes) everything scales with the example batch ``b0``."""

    batch: object  # the batch symbol, or None
    b0: int
    b1: dict
    b2: dict

    @classmethod
    def of(cls, gm: torch.fx.GraphModule) -> "_Probe":
        info = gm.meta.get("fxsplit")
        batch = info.symbols.get("batch") if info is not None else None
        base = example_bindings(gm)

        def binds(b: int) -> dict:  # data-dependent sizes follow the batch ([Note: data-dependent sizes])
            return dict(base) if batch is None else resolve_bindings(gm, {batch: b})

        return cls(batch, _example_batch(gm), binds(1), binds(2))

    def linear(self, a1: np.ndarray, a2: np.ndarray) -> Linear:
        if self.batch is None:  # static shapes: everything scales with the example batch
            return Linear(np.zeros(len(a1)), a1 / self.b0)
        return Linear(np.maximum(2 * a1 - a2, 0.0), np.maximum(a2 - a1, 0.0))


def _unit_costs(units: list[torch.fx.Node], probe: _Probe) -> tuple[dict[str, Linear], np.ndarray]:
    """Per unit: forward FLOPs, matmul FLOPs, bytes read + written and backward bytes (as
    Linear), and the parameter bytes its own cost counts."""
    n = len(units)
    fields = ("flops", "matmul_flops", "rw", "bwd")
    v1 = {f: np.zeros(n) for f in fields}
    v2 = {f: np.zeros(n) for f in fields}
    params = np.zeros(n)
    for i, u in enumerate(units):
        c = node_info(u).cost
        if c is None:
            continue
        for vals, bb in ((v1, probe.b1), (v2, probe.b2)):
            vals["flops"][i] = _num(c.flops, bb)
            vals["matmul_flops"][i] = _num(c.matmul_flops, bb)
            vals["rw"][i] = _num(c.bytes_read, bb) + _num(c.bytes_written, bb)
            vals["bwd"][i] = _num(c.backward_bytes, bb)
        params[i] += _num(c.param_bytes, probe.b1)
    return {f: probe.linear(v1[f], v2[f]) for f in fields}, params


def _param_reads(gm: torch.fx.GraphModule, units: list[torch.fx.Node], params: np.ndarray,
                 probe: _Probe) -> np.ndarray:
    """Which units read a parameter (a weight-gradient half); a get_attr's parameter bytes are
    added to ``params`` at its first user, as the split counts them."""
    index = {u: i for i, u in enumerate(units)}
    reads = np.zeros(len(units), dtype=bool)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            users = [index[x] for x in node.users if x in index]
            for j in users:
                reads[j] = True
            c = node_info(node).cost
            if c is not None and c.param_bytes and users:
                params[min(users)] += _num(c.param_bytes, probe.b1)
    return reads | (params > 0)


def _checkpointing(gm: torch.fx.GraphModule, units: list[torch.fx.Node], probe: _Probe) -> tuple[dict, dict]:
    """Per checkpointing mode: the saved bytes (each storage once) and the recompute mask, by the
    split's own rules (fxsplit.graph.saved, fxsplit.pipeline.checkpointing.mode_held)."""
    h1, h2 = unit_saved(gm, units, probe.b1), unit_saved(gm, units, probe.b2)
    saved, recompute = {}, {}
    for mode in MODES:
        m1, rec = mode_held(gm, units, probe.b1, h1, mode)
        a1 = np.array(first_saver_bytes(m1), dtype=float)
        a2 = np.array(first_saver_bytes(mode_held(gm, units, probe.b2, h2, mode)[0]), dtype=float)
        saved[mode] = probe.linear(a1, a2)
        recompute[mode] = np.array(rec, dtype=bool)
    return saved, recompute


def _loss_output_per_sample(gm: torch.fx.GraphModule, probe: _Probe) -> float:
    """Bytes of the model's outputs per sample: what a cross-entropy-like loss over them reads
    and keeps (as fxsplit.api.plan charges it)."""
    out = next(x for x in reversed(gm.graph.nodes) if x.op == "output")
    lb1 = sum(_out_bytes(x, probe.b1) for x in out.all_input_nodes)
    lb2 = sum(_out_bytes(x, probe.b2) for x in out.all_input_nodes)
    return (lb2 - lb1) if probe.batch is not None else lb1 / probe.b0


@dataclass
class _TPArrays:
    """Per unit, what tensor (and sequence) parallelism does to it ([Note: planner workload]):
    sharded work and parameters, the bytes and counts of its forward (g, vocabulary all-reduce,
    logits all-gather) and backward (f) collectives at batch 1 and 2."""

    sharded: np.ndarray
    params_sharded: np.ndarray
    sp: np.ndarray
    fb1: np.ndarray
    fb2: np.ndarray
    bb1: np.ndarray
    bb2: np.ndarray
    fc: np.ndarray
    bc: np.ndarray

    @classmethod
    def of(cls, units: list[torch.fx.Node], tp_plan: TPPlan | None, sp_plan: TPPlan | None,
           probe: _Probe) -> "_TPArrays":
        n = len(units)
        z = lambda: np.zeros(n)  # noqa: E731
        arrays = cls(np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool), z(), z(), z(), z(), z(), z())
        by_name = {u.name: i for i, u in enumerate(units)}
        if tp_plan is not None and not tp_plan.is_identity:
            arrays._add_tp(units, by_name, tp_plan, probe)
        if sp_plan is not None:
            for name in sp_plan.sequence_plan.sharded:
                if name in by_name:
                    arrays.sp[by_name[name]] = True
        return arrays

    def _forward(self, i: int, node: torch.fx.Node, probe: _Probe, count: float) -> None:
        self.fb1[i] += _out_bytes(node, probe.b1)
        self.fb2[i] += _out_bytes(node, probe.b2)
        self.fc[i] += count

    def _backward_bytes(self, i: int, node: torch.fx.Node, probe: _Probe) -> None:
        self.bb1[i] += _out_bytes(node, probe.b1)
        self.bb2[i] += _out_bytes(node, probe.b2)

    def _add_tp(self, units: list, by_name: dict, tp_plan: TPPlan, probe: _Probe) -> None:
        for name in tp_plan.sharded_nodes:
            if name in by_name:
                self.sharded[by_name[name]] = True
        for region in tp_plan.regions:
            for name in region.columns + region.rows:
                if name in by_name:
                    self.sharded[by_name[name]] = self.params_sharded[by_name[name]] = True
            for name in region.rows:  # g: forward all-reduce of the row output
                if name in by_name:
                    self._forward(by_name[name], units[by_name[name]], probe, 1)
            first = next((by_name[c] for c in region.columns if c in by_name), None)
            if first is not None:  # f: backward all-reduce of the input gradient
                for name in region.inputs:
                    x = next((u for u in units if u.name == name), None) if name not in by_name else units[by_name[name]]
                    if x is not None:
                        self._backward_bytes(first, x, probe)
                self.bc[first] += 1
        for name in tp_plan.vocab_embeddings:
            if name in by_name:
                i = by_name[name]
                self.sharded[i] = self.params_sharded[i] = True
                self._forward(i, units[i], probe, 1)
        for name in tp_plan.lm_heads:
            if name in by_name:
                i = by_name[name]
                self.sharded[i] = self.params_sharded[i] = True
                # logits all-gathered (bytes of the full output); an all-gather is half a ring all-reduce
                self._forward(i, units[i], probe, 0.5)
                x = units[i].all_input_nodes[0] if units[i].all_input_nodes else None
                if x is not None:
                    self._backward_bytes(i, x, probe)
                    self.bc[i] += 1


def _experts(gm: torch.fx.GraphModule, units: list, by_name: dict, b1: dict, b2: dict,
             tp_plan: TPPlan | None) -> dict:
    """The per-unit arrays of [Note: planner experts]."""
    from math import gcd

    from fxsplit.pipeline.memory import exchange_bytes
    from fxsplit.tp.moe import find_moe_layers

    n = len(units)
    mask, params, a1, a2 = np.zeros(n, bool), np.zeros(n), np.zeros(n), np.zeros(n)
    layers = find_moe_layers(gm, 1).layers
    nodes = {x.name: x for x in gm.graph.nodes}
    for layer in layers:
        for name in layer.region:
            if name in by_name:
                mask[by_name[name]] = True
        at = min(by_name[f] for f in layer.first if f in by_name)
        a1[at] += exchange_bytes(nodes[layer.rows], nodes[layer.last], b1)  # as Plan.memory() counts it
        a2[at] += exchange_bytes(nodes[layer.rows], nodes[layer.last], b2)
        for w in layer.weights:  # owned by the first unit reading it, as ``params`` counts it
            attr = next((x for x in gm.graph.nodes if x.op == "get_attr" and x.target == w), None)
            users = [by_name[u.name] for u in attr.users if u.name in by_name] if attr is not None else []
            if users:
                params[min(users)] += float(gm.get_parameter(w).numel() * gm.get_parameter(w).element_size())
    num = 0
    for layer in layers:
        num = gcd(num, layer.experts)
    specs = tp_plan.param_specs if tp_plan is not None else {}
    tp = bool(layers) and all(w in specs for layer in layers for w in layer.weights)
    return dict(units=mask, params=params, a2a1=a1, a2a2=a2, num=num, tp=tp)


def _example_batch(gm: torch.fx.GraphModule) -> int:
    """The example's batch size: the first tensor input's first dimension (1 without one)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if hasattr(val, "shape") and len(val.shape) > 0:
                if marker_example(val) is not None:  # [Note: a marker batch]
                    return int(marker_example(val))
                s = val.shape[0]
                return int(s.node.hint) if hasattr(s, "node") and s.node.hint is not None else int(s)
    return 1


_LAYER = re.compile(r"(.+)\.(\d+)")


def repeat_layers(w: Workload, num_layers: int) -> Workload:
    """The workload of the same model with ``num_layers`` layers: ``w``'s last layer group repeated.

    A transformer's layers are identical, so the workload of a model traced with a few of them is
    the full model's with the last layer's units copied (their costs, memory, TP collectives and
    the layer-to-layer boundary bytes): the planner then needs no trace of a 126-layer model
    (fx or torch.export cost seconds per layer on the meta device; the planner's arrays are the
    same). The layers are the groups ``<prefix>.0`` .. ``<prefix>.<L-1>`` in order (``layers.3``,
    ``model.layers.3``); ``w`` needs L >= 2, so that the boundary between two layers is a
    measured one (a value every layer reads, such as a mask or rotary table, crosses it), and its
    last two layers must cost the same (else UsageError: the layers are not identical)."""
    paths = w.group_paths
    found = [(g, m.group(1), int(m.group(2))) for g, p in enumerate(paths) if (m := _LAYER.fullmatch(p))]
    if not found:
        raise UsageError(f"repeat_layers: no layer groups (paths '<name>.<index>') among {list(paths)[:8]}")
    prefix = found[0][1]
    layers = [(g, k) for g, pre, k in found if pre == prefix]
    L = len(layers)
    if [k for _, k in layers] != list(range(L)) or [g for g, _ in layers] != list(range(layers[0][0], layers[0][0] + L)):
        raise UsageError(f"repeat_layers: the groups of '{prefix}' are not layers 0..{L - 1} in order: "
                         f"{[paths[g] for g, _ in layers][:8]}")
    if L < 2 or num_layers < L:
        raise UsageError(f"repeat_layers: needs a workload of >= 2 layers and num_layers >= its {L}, got "
                         f"num_layers={num_layers} (trace the model with 2 layers)")
    last = layers[-1][0]
    ends = list(w.group_starts) + [w.num_units]
    s, e = ends[last], ends[last + 1]
    ps, pe = ends[last - 1], ends[last]
    extra = num_layers - L

    def splice(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a[:e], np.tile(a[s:e], extra), a[e:]])

    def same(a: np.ndarray) -> bool:
        return pe - ps == e - s and np.allclose(a[ps:pe], a[s:e], rtol=1e-9, atol=0)

    fields: dict = {}
    for f in dataclasses.fields(w):
        v = getattr(w, f.name)
        if f.name in ("group_of", "cut"):
            continue
        if isinstance(v, Linear):
            if not (same(v.const) and same(v.lin)):
                raise UsageError(f"repeat_layers: layers {L - 2} and {L - 1} of '{prefix}' differ in {f.name}")
            fields[f.name] = Linear(splice(v.const), splice(v.lin))
        elif isinstance(v, np.ndarray) and v.shape == (w.num_units,):
            fields[f.name] = splice(v)
        elif isinstance(v, dict):
            fields[f.name] = {k: (Linear(splice(x.const), splice(x.lin)) if isinstance(x, Linear) else splice(x))
                              for k, x in v.items()}
    size = e - s
    starts = list(w.group_starts[:last + 1]) + [e + k * size for k in range(extra)] \
        + [st + extra * size for st in w.group_starts[last + 1:]]
    group_paths = paths[:last + 1] + tuple(f"{prefix}.{L + k}" for k in range(extra)) + paths[last + 1:]
    n = w.num_units + extra * size
    group_of = np.zeros(n, dtype=np.int64)
    for g, st in enumerate(starts):
        group_of[st:] = g
    between = lambda a: np.concatenate([a[:last + 1], np.full(extra, a[last]), a[last + 1:]])  # noqa: E731
    numel = w.param_numel + extra * float(w.params[s:e].sum()) / w.param_itemsize
    return dataclasses.replace(w, **fields, num_units=n, group_of=group_of, group_starts=tuple(starts),
                               group_paths=group_paths, cut=Linear(between(w.cut.const), between(w.cut.lin)),
                               param_numel=numel)
