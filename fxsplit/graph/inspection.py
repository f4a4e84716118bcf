"""Look at a graph: a table of its nodes, a diff of two graphs, op counts, and Graphviz DOT.

Terms:
    module path: FQN of the module a node came from ("" for top level), from
        ``node.meta["fxsplit"].module_path`` when the tracer set it, else the innermost entry of
        ``node.meta["nn_module_stack"]``, else the target of a ``call_module`` node or the owner
        of a ``get_attr`` target.
    shape: from ``node.meta["fxsplit"].outputs`` (NodeInfo), else ``node.meta["val"]`` (fake
        tensors, possibly with symbolic sizes), else ``node.meta["tensor_meta"]`` (ShapeProp).
    FLOPs: ``node.meta["fxsplit"].cost.flops`` when present (int or sympy expression), else blank.
    symbol names: fxsplit.trace's symbols (``gm.meta["fxsplit"].symbols``, e.g. batch -> s26)
        print by name, so shapes read ``[batch, 16]`` and FLOPs ``36*batch``.
    params: ``node.meta["fxsplit"].params`` when present, else the parameter/buffer FQNs a node
        reads (its own target for ``get_attr``, the module's parameters for ``call_module``, the
        ``get_attr`` arguments of a ``call_function``).
    op key: how ``op_counts`` names a node: ``"call_function:aten.gelu.default"``,
        ``"call_module:Linear"`` (module class), ``"call_method:view"``, or the bare op for
        placeholder / get_attr / output.

Signatures::

    graph_rows(gm) -> tuple[NodeRow, ...]
    graph_table(gm, *, max_width=40) -> str
    graph_diff(before, after) -> GraphDiff          # GraphModule or Graph on either side
    op_counts(gm) -> collections.Counter[str]
    format_op_count_diff(before: Counter, after: Counter) -> str
    to_dot(gm, path=None, *, color_by="module", stage_of=None, module_depth=None) -> str

Everything here reads a graph and never changes it; it works on any GraphModule, before or
after fxsplit's tracer has added its metadata.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.fx

from fxsplit.errors import ArgumentTypeError, UsageError
from fxsplit.graph.shapes import batch_dims

__all__ = [
    "PALETTE",
    "dot_quote",
    "write_dot",
    "GraphDiff",
    "NodeChange",
    "NodeRow",
    "NodeSummary",
    "format_flops",
    "format_op_count_diff",
    "graph_diff",
    "graph_rows",
    "graph_table",
    "module_path",
    "node_flops",
    "node_params",
    "node_shape",
    "op_counts",
    "symbol_names",
    "target_name",
    "to_dot",
]

logger = logging.getLogger(__name__)

GraphLike = torch.fx.GraphModule | torch.fx.Graph


# ---------------------------------------------------------------------------------------------
# per-node facts


def target_name(node: torch.fx.Node) -> str:
    """A readable, stable name for a node's target (``aten.gelu.default``, ``operator.add``)."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    name = getattr(target, "__name__", None) or type(target).__name__
    module = getattr(target, "__module__", None)
    if module in (None, "builtins"):
        return name
    if module == "_operator":
        module = "operator"
    elif module.startswith("torch._C._nn"):
        module = "torch.nn.functional"
    elif module.startswith("torch._C._VariableFunctions") or module == "torch._C":
        module = "torch"
    qualname = getattr(target, "__qualname__", name)
    if qualname.startswith("_VariableFunctionsClass."):  # torch.relu and friends
        return f"torch.{name}"
    return f"{module}.{qualname}"


def _info(node: torch.fx.Node) -> Any:
    return node.meta.get("fxsplit")


def _owning_module(graph: torch.fx.Graph) -> torch.nn.Module | None:
    return graph.owning_module


def module_path(node: torch.fx.Node) -> str:
    """The module path of ``node`` (see Terms)."""
    info = _info(node)
    path = getattr(info, "module_path", None)
    if isinstance(path, str):
        return path
    stack = node.meta.get("nn_module_stack")
    if stack:
        last = list(stack.values())[-1]
        if isinstance(last, tuple) and last and isinstance(last[0], str):
            return last[0]
    if node.op == "call_module" and isinstance(node.target, str):
        return node.target
    if node.op == "get_attr" and isinstance(node.target, str):
        return node.target.rpartition(".")[0]
    return ""


def symbol_names(graph: GraphLike) -> dict[sympy.Symbol, sympy.Symbol]:
    """Tracer symbols -> readable ones (``s26`` -> ``batch``), from the graph module's
    ``meta["fxsplit"].symbols`` (fxsplit.trace's TraceInfo); empty when there is none."""
    graph = _graph(graph)
    root = graph.owning_module
    symbols = getattr(getattr(root, "meta", {}).get("fxsplit"), "symbols", None) if root else None
    if not isinstance(symbols, Mapping):
        return {}
    return {
        sym: sympy.Symbol(name)
        for name, sym in symbols.items()
        if isinstance(sym, sympy.Symbol) and isinstance(name, str)
    }


def _readable(x: Any, names: Mapping[sympy.Symbol, sympy.Symbol]) -> Any:
    if isinstance(x, torch.SymInt):
        x = x.node.expr
    if names and isinstance(x, sympy.Basic):
        return x.xreplace(names)
    return x


def _format_shape(shape: Any, names: Mapping) -> str:
    return "[" + ", ".join(str(_readable(d, names)) for d in shape) + "]"


def _format_val(val: Any, names: Mapping) -> str:
    if isinstance(val, torch.Tensor):
        return _format_shape(batch_dims(val), names)  # [Note: a marker batch]: the batch read as one
    if isinstance(val, (tuple, list)):
        parts = [_format_val(v, names) for v in val]
        if any(parts):
            return "(" + ", ".join(p or "-" for p in parts) + ")"
        return ""
    if isinstance(val, torch.SymInt):
        return f"int {_readable(val, names)}"
    if isinstance(val, bool) or val is None:
        return ""
    if isinstance(val, int):
        return f"int {val}"
    return ""


def node_shape(node: torch.fx.Node, names: Mapping[sympy.Symbol, sympy.Symbol] | None = None) -> str:
    """The node's output shape(s) as text, e.g. ``[batch, 16]`` or ``([2, 4], [2])``; "" if unknown.

    ``names`` renames symbols; by default ``symbol_names`` of the node's graph.
    """
    names = symbol_names(node.graph) if names is None else names
    info = _info(node)
    outputs = getattr(info, "outputs", None)
    if outputs:
        parts = [
            _format_shape(o.shape, names) for o in outputs if getattr(o, "shape", None) is not None
        ]
        if parts:
            return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"
    if "val" in node.meta:
        return _format_val(node.meta["val"], names)
    tm = node.meta.get("tensor_meta")
    if tm is not None:
        if hasattr(tm, "shape"):
            return _format_shape(tm.shape, names)
        if isinstance(tm, (tuple, list)):
            return "(" + ", ".join(
                _format_shape(t.shape, names) for t in tm if hasattr(t, "shape")
            ) + ")"
    return ""


def node_flops(
    node: torch.fx.Node, names: Mapping[sympy.Symbol, sympy.Symbol] | None = None
) -> int | float | sympy.Expr | None:
    """``meta["fxsplit"].cost.flops`` (int or sympy expression, symbols renamed as in
    ``node_shape``), or None when the node is not annotated."""
    cost = getattr(_info(node), "cost", None)
    flops = getattr(cost, "flops", None)
    if flops is None:
        return None
    names = symbol_names(node.graph) if names is None else names
    return _readable(flops, names)


def format_flops(flops: int | float | sympy.Expr | None) -> str:
    """Human-readable FLOPs: 1.2M, 3.4G; symbolic counts print as their expression."""
    if flops is None:
        return ""
    if isinstance(flops, sympy.Expr):
        if not flops.is_number:
            return str(flops)
        flops = float(flops)
    value = float(flops)
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return str(int(value)) if value.is_integer() else f"{value:.3g}"


def node_params(node: torch.fx.Node) -> tuple[str, ...]:
    """FQNs of the parameters and buffers the node reads (see Terms)."""
    info = _info(node)
    params = getattr(info, "params", None)
    if params is not None:
        return tuple(params)
    if node.op == "get_attr":
        return (str(node.target),)
    if node.op == "call_module":
        root = _owning_module(node.graph)
        try:
            sub = root.get_submodule(node.target) if root is not None else None
        except AttributeError:
            sub = None
        if sub is None:
            return ()
        names = [f"{node.target}.{n}" for n, _ in sub.named_parameters()]
        names += [f"{node.target}.{n}" for n, _ in sub.named_buffers()]
        return tuple(names)
    return tuple(str(a.target) for a in node.all_input_nodes if a.op == "get_attr")


# ---------------------------------------------------------------------------------------------
# table


@dataclass(frozen=True)
class NodeRow:
    """One line of ``graph_table``: the facts about a node, already formatted as text."""

    name: str
    op: str
    target: str
    module_path: str
    shape: str
    flops: str
    params: str


_COLUMNS = ("name", "op", "target", "module_path", "shape", "flops", "params")
_HEADERS = ("node", "op", "target", "module path", "shape", "FLOPs", "params")


def graph_rows(gm: GraphLike) -> tuple[NodeRow, ...]:
    """One NodeRow per node of ``gm``, in graph order."""
    graph = _graph(gm)
    names = symbol_names(graph)
    rows = []
    for node in graph.nodes:
        target = "" if node.op in ("placeholder", "output") else target_name(node)
        rows.append(
            NodeRow(
                name=node.name,
                op=node.op,
                target=target,
                module_path=module_path(node),
                shape=node_shape(node, names),
                flops=format_flops(node_flops(node, names)),
                params=", ".join(node_params(node)),
            )
        )
    return tuple(rows)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def graph_table(gm: GraphLike, *, max_width: int = 40) -> str:
    """An aligned text table of ``gm``: node, op, target, module path, shape, FLOPs, params.

    Cells longer than ``max_width`` characters are cut with "…". The last line gives the node
    count and the total FLOPs over annotated nodes (an expression when any count is symbolic).
    """
    if max_width < 4:
        raise UsageError(f"graph_table(max_width={max_width}) must be at least 4")
    graph = _graph(gm)
    rows = graph_rows(graph)
    cells = [list(_HEADERS)] + [
        [_clip(getattr(r, c), max_width) for c in _COLUMNS] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines = []
    for k, row in enumerate(cells):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    total: Any = 0
    annotated = 0
    names = symbol_names(graph)
    for node in graph.nodes:
        flops = node_flops(node, names)
        if flops is not None:
            total = total + flops
            annotated += 1
    summary = f"{len(rows)} nodes"
    if annotated:
        summary += f", total FLOPs {format_flops(total)} over {annotated} annotated nodes"
    lines.append(summary)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# op counts


def _op_key(node: torch.fx.Node) -> str:
    if node.op in ("placeholder", "get_attr", "output"):
        return node.op
    if node.op == "call_module":
        root = _owning_module(node.graph)
        try:
            sub = root.get_submodule(node.target) if root is not None else None
        except AttributeError:
            sub = None
        label = type(sub).__name__ if sub is not None else str(node.target)
        return f"call_module:{label}"
    if node.op == "call_method":
        return f"call_method:{node.target}"
    return f"call_function:{target_name(node)}"


def op_counts(gm: GraphLike) -> Counter:
    """How many nodes of each op key (see Terms) the graph holds."""
    return Counter(_op_key(n) for n in _graph(gm).nodes)


def format_op_count_diff(before: Counter, after: Counter) -> str:
    """Lines ``key: 2 -> 0 (-2)`` for every op key whose count changed; "no change" if none."""
    lines = []
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key, 0), after.get(key, 0)
        if a != b:
            lines.append(f"{key}: {b} -> {a} ({a - b:+d})")
    total_b, total_a = sum(before.values()), sum(after.values())
    if not lines:
        return f"no change ({total_b} nodes)"
    lines.append(f"total nodes: {total_b} -> {total_a} ({total_a - total_b:+d})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# graph diff


def _fmt_arg(a: Any, rename: Mapping[str, str]) -> str:
    """An argument as text: nodes as ``%name`` (renamed), tensors by shape and dtype only."""
    if isinstance(a, torch.fx.Node):
        return "%" + rename.get(a.name, a.name)
    if isinstance(a, torch.Tensor):
        return f"tensor({list(a.shape)}, {str(a.dtype).replace('torch.', '')})"
    if isinstance(a, tuple):
        inner = ", ".join(_fmt_arg(x, rename) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, list):
        return "[" + ", ".join(_fmt_arg(x, rename) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_fmt_arg(v, rename)}" for k, v in a.items()) + "}"
    if isinstance(a, slice):
        return f"slice({_fmt_arg(a.start, rename)}, {_fmt_arg(a.stop, rename)}, {_fmt_arg(a.step, rename)})"
    return repr(a)


def _args_text(node: torch.fx.Node, rename: Mapping[str, str]) -> str:
    parts = [_fmt_arg(a, rename) for a in node.args]
    parts += [f"{k}={_fmt_arg(v, rename)}" for k, v in node.kwargs.items()]
    return ", ".join(parts)


@dataclass(frozen=True)
class NodeSummary:
    """A node as the diff shows it: ``name = op target(args)`` with arguments as ``%name``."""

    name: str
    op: str
    target: str
    args: str

    def __str__(self) -> str:
        if self.op in ("placeholder", "get_attr") and not self.args:
            return f"{self.name} = {self.op} {self.target}"
        return f"{self.name} = {self.op} {self.target}({self.args})"


@dataclass(frozen=True)
class NodeChange:
    """A node present in both graphs whose ``fields`` (op, target, args) differ."""

    before: NodeSummary
    after: NodeSummary
    fields: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.before}\n    -> {self.after}   [{', '.join(self.fields)}]"


@dataclass(frozen=True)
class GraphDiff:
    """Nodes added, removed, changed and renamed between two graphs (see ``graph_diff``)."""

    added: tuple[NodeSummary, ...]
    removed: tuple[NodeSummary, ...]
    changed: tuple[NodeChange, ...]
    renamed: tuple[tuple[str, str], ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed or self.renamed)

    def __str__(self) -> str:
        head = (
            f"graph diff: {len(self.added)} added, {len(self.removed)} removed, "
            f"{len(self.changed)} changed, {len(self.renamed)} renamed"
        )
        lines = [head]
        lines += [f"- {s}" for s in self.removed]
        lines += [f"+ {s}" for s in self.added]
        lines += [f"~ {c}" for c in self.changed]
        lines += [f"> {old} renamed to {new}" for old, new in self.renamed]
        return "\n".join(lines)


def _summary(node: torch.fx.Node, rename: Mapping[str, str]) -> NodeSummary:
    target = "" if node.op in ("placeholder", "output") else target_name(node)
    if node.op == "placeholder":
        target = str(node.target)
    return NodeSummary(rename.get(node.name, node.name), node.op, target, _args_text(node, rename))


def graph_diff(before: GraphLike, after: GraphLike) -> GraphDiff:
    """Compare two graphs node by node.

    Nodes are matched first by name, then (for the rest, in graph order) by (op, target, args)
    with arguments already matched mapped to their names in ``before``, so renamed nodes and
    their users are recognised. Matched nodes whose op, target or arguments differ are
    ``changed``; unmatched nodes of ``after`` are ``added`` and of ``before`` are ``removed``.
    """
    g_before, g_after = _graph(before), _graph(after)
    before_nodes = {n.name: n for n in g_before.nodes}
    # after-name -> before-name for matched nodes
    match: dict[str, str] = {}
    for node in g_after.nodes:
        if node.name in before_nodes:
            match[node.name] = node.name
    matched_before = set(match.values())

    no_rename: dict[str, str] = {}
    pool: dict[tuple, list[str]] = {}
    for node in g_before.nodes:
        if node.name not in matched_before:
            s = _summary(node, no_rename)
            pool.setdefault((s.op, s.target, s.args), []).append(node.name)
    for node in g_after.nodes:
        if node.name in match:
            continue
        s = _summary(node, match)
        candidates = pool.get((s.op, s.target, s.args))
        if candidates:
            match[node.name] = candidates.pop(0)
    matched_before = set(match.values())

    added, changed, renamed = [], [], []
    for node in g_after.nodes:
        if node.name not in match:
            added.append(_summary(node, no_rename))
            continue
        old = before_nodes[match[node.name]]
        s_old, s_new = _summary(old, no_rename), _summary(node, match)
        fields = tuple(f for f in ("op", "target", "args") if getattr(s_old, f) != getattr(s_new, f))
        if fields:
            changed.append(NodeChange(s_old, _summary(node, no_rename), fields))
        if old.name != node.name:
            renamed.append((old.name, node.name))
    removed = [_summary(n, no_rename) for n in g_before.nodes if n.name not in matched_before]
    return GraphDiff(tuple(added), tuple(removed), tuple(changed), tuple(renamed))


# ---------------------------------------------------------------------------------------------
# DOT


# ColorBrewer Set3 and Pastel1: light fills that keep black text readable.
PALETTE = (
    "#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
    "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f", "#fbb4ae", "#b3cde3", "#decbe4", "#fed9a6",
)
_NO_GROUP = "#ffffff"
_RENDER_FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf"}


def dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(
    gm: GraphLike,
    path: str | Path | None = None,
    *,
    color_by: str = "module",
    stage_of: Mapping[str, int] | None = None,
    module_depth: int | None = None,
) -> str:
    """Graphviz DOT text for ``gm``: one box per node (name, op, target, shape), one edge per use.

    ``color_by="module"`` fills nodes by module path (cut to its first ``module_depth``
    components when given, e.g. 2 for ``layers.0``); ``color_by="stage"`` fills by
    ``stage_of[node.name]`` (nodes without a stage stay white). A legend names the colors.
    ``path``: where to write; ``.svg``/``.png``/``.pdf`` writes the DOT beside it (``.dot``) and
    renders it with the ``dot`` program when installed (logged and skipped otherwise); any other
    suffix gets the DOT text itself. Returns the DOT text.
    """
    if color_by not in ("module", "stage"):
        raise UsageError(f"to_dot(color_by={color_by!r}): use 'module' or 'stage'")
    if color_by == "stage" and stage_of is None:
        raise UsageError(
            "to_dot(color_by='stage') needs stage_of={node name: stage}, e.g. the assignment "
            "passed to fxsplit.pipeline.stage.build_stages"
        )
    if module_depth is not None and module_depth < 1:
        raise UsageError(f"to_dot(module_depth={module_depth}) must be >= 1 or None")
    graph = _graph(gm)

    def group_of(node: torch.fx.Node) -> str | None:
        if color_by == "stage":
            stage = stage_of.get(node.name)
            return None if stage is None else f"stage {stage}"
        mp = module_path(node)
        if module_depth is not None:
            mp = ".".join(mp.split(".")[:module_depth])
        return mp or "(top level)"

    names = symbol_names(graph)
    groups: dict[str, str] = {}
    lines = [
        "digraph fxsplit {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];',
    ]
    for node in graph.nodes:
        group = group_of(node)
        if group is not None and group not in groups:
            if color_by == "stage":
                groups[group] = PALETTE[stage_of[node.name] % len(PALETTE)]
            else:
                groups[group] = PALETTE[len(groups) % len(PALETTE)]
        color = groups.get(group, _NO_GROUP) if group is not None else _NO_GROUP
        label_parts = [node.name, node.op if node.op in ("placeholder", "output", "get_attr")
                       else f"{node.op} {target_name(node)}"]
        shape = node_shape(node, names)
        if shape:
            label_parts.append(shape)
        if group is not None:
            label_parts.append(group)
        lines.append(
            f"  {dot_quote(node.name)} [label={dot_quote(chr(10).join(label_parts))}, "
            f'fillcolor="{color}"];'
        )
    for node in graph.nodes:
        for src in node.all_input_nodes:
            lines.append(f"  {dot_quote(src.name)} -> {dot_quote(node.name)};")
    if groups:
        lines.append("  subgraph cluster_legend {")
        lines.append('    label="legend"; fontname="monospace";')
        for k, (group, color) in enumerate(groups.items()):
            lines.append(
                f'    "__legend_{k}" [label={dot_quote(group)}, fillcolor="{color}"];'
            )
        lines.append("  }")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    if path is not None:
        write_dot(text, Path(path))
    return text


def write_dot(text: str, path: Path) -> None:
    """Write DOT ``text`` to ``path``; ``.svg``/``.png``/``.pdf`` beside a ``.dot``, rendered by
    graphviz's ``dot`` when installed (logged and skipped otherwise)."""
    fmt = _RENDER_FORMATS.get(path.suffix.lower())
    if fmt is None:
        path.write_text(text)
        return
    dot_path = path.with_suffix(".dot")
    dot_path.write_text(text)
    exe = shutil.which("dot")
    if exe is None:
        logger.warning(
            "graphviz 'dot' not found; wrote %s but not %s (install graphviz to render)",
            dot_path, path,
        )
        return
    subprocess.run([exe, f"-T{fmt}", str(dot_path), "-o", str(path)], check=True)


def _graph(gm: GraphLike) -> torch.fx.Graph:
    if isinstance(gm, torch.fx.GraphModule):
        return gm.graph
    if isinstance(gm, torch.fx.Graph):
        return gm
    raise ArgumentTypeError(
        f"expected a torch.fx.GraphModule or torch.fx.Graph, got {type(gm).__name__}"
    )
