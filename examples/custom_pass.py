"""Write your own graph passes with fxsplit's public pass API, and run them with the PassManager.

Terms:
    pass: ``(gm, ctx) -> PassResult(gm, modified)``; options are bound with functools.partial.
    block: the nodes whose module path (``fxsplit.graph.inspection.module_path``) is a given module
        path or lies below it, e.g. every node that came from ``blocks.0``.

Two passes, written only against ``fxsplit.graph.pass_api`` and ``fxsplit.graph.inspection`` (public modules):

* ``gelu_to_tanh``: replace exact GELU by its tanh approximation wherever it appears: an
  ``nn.GELU`` module (``call_module``), ``F.gelu`` (``call_function``) or ``aten.gelu`` (exported
  graphs).
* ``checkpoint_blocks(blocks=...)``: move each chosen block's nodes into a small GraphModule that
  takes the block's place in the module tree (so parameter names do not change) and call it through
  ``torch.utils.checkpoint.checkpoint``, so its activations are recomputed in backward instead of
  kept.

On a graph from ``fxsplit.trace`` the GELU pass keeps fxsplit's metadata contract (new nodes get
``meta["val"]`` and ``meta["fxsplit"]`` via ``fxsplit.graph.meta.annotate_node``). The checkpointing
pass gives its new nodes ``meta["val"]`` only, and the cost model sees a checkpointed block as one
opaque call: run it after the passes that read costs.

Run ``python examples/custom_pass.py`` (add ``--debug DIR`` for per-pass dumps): it prints the
graph diff, the node table, and checks the output and every gradient against the model.

Under torchrun the GELU pass goes to ``fxsplit.parallelize(passes=[gelu_to_tanh])`` instead: a
small GPT split over the launched ranks (``--tp``, ``--pp``; default pp = world size) trains a few
steps, and rank 0 prints each step's loss next to the same model rewritten by the same pass and
trained in one process; the exit status is 1 when they differ::

    torchrun --standalone --nproc-per-node 2 examples/custom_pass.py

The contract a pass keeps (metadata, what the PassManager checks) is in docs/passes.md.
"""

from __future__ import annotations

import argparse
import copy
import functools
import operator
import os
import sys
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from fxsplit.graph.inspection import graph_diff, graph_table, module_path
from fxsplit.graph.meta import annotate_node
from fxsplit.graph.pass_api import PassContext, PassManager, PassResult, register_pass, this_before_that


# --------------------------------------------------------------------------- pass 1: GELU -> tanh


def _exact_gelu_input(node: torch.fx.Node, gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The input of an exact-GELU node (module, F.gelu or aten.gelu), or None for other nodes."""
    if node.op == "call_module":
        mod = gm.get_submodule(node.target)
        if isinstance(mod, nn.GELU) and mod.approximate == "none":
            return node.args[0]
        return None
    if node.op == "call_function" and node.target in (F.gelu, torch.ops.aten.gelu.default):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return node.args[0] if approximate == "none" else None
    return None


def _copy_meta(src: torch.fx.Node, dst: torch.fx.Node) -> None:
    """Give a replacement node the value and module stack of the node it stands for."""
    for key in ("val", "nn_module_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


@register_pass("gelu_to_tanh")
def gelu_to_tanh(gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
    """Exact GELU -> ``gelu(x, approximate="tanh")``; records the rewritten nodes in the report."""
    rewritten = []
    for node in list(gm.graph.nodes):
        x = _exact_gelu_input(node, gm)
        if x is None:
            continue
        target = torch.ops.aten.gelu.default if node.target is torch.ops.aten.gelu.default else F.gelu
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(target, (x,), {"approximate": "tanh"})
        _copy_meta(node, new)
        if "fxsplit" in node.meta:  # traced by fxsplit.trace: keep the metadata contract
            annotate_node(new, gm, module_path=node.meta["fxsplit"].module_path)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        rewritten.append(new.name)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    ctx.report["gelu_to_tanh"] = rewritten
    return PassResult(gm, bool(rewritten))


# --------------------------------------------------------------------------- pass 2: checkpointing


def _in_block(node: torch.fx.Node, block: str) -> bool:
    if node.op in ("placeholder", "output"):
        return False
    path = module_path(node)
    if not (path == block or path.startswith(block + ".")):
        return False
    # parameters and submodules must live inside the block to move with it
    return node.op not in ("get_attr", "call_module") or node.target.startswith(block + ".")


def _outline(gm: torch.fx.GraphModule, block: str, nodes: list[torch.fx.Node]) -> torch.fx.Node:
    """Replace ``nodes`` (one block, in graph order) by ``checkpoint(self.<block>, *inputs)``."""
    inside = set(nodes)
    inputs: list[torch.fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    last = nodes[-1]
    for out in outputs:
        for user in out.users:
            if user not in inside and order[user] < order[last]:
                raise ValueError(
                    f"checkpoint_blocks: block {block!r} is not contiguous: {user.name!r} (module "
                    f"{module_path(user)!r}) reads {out.name!r} before the block ends at "
                    f"{last.name!r}; choose a block whose nodes are contiguous in the graph"
                )

    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {a: sub.placeholder(a.name) for a in inputs}
    prefix = block + "."
    for n in nodes:
        copied = sub.node_copy(n, lambda a: env[a])
        if n.op in ("get_attr", "call_module"):
            copied.target = n.target[len(prefix):]  # relative to the block module
        env[n] = copied
    sub.output(tuple(env[o] for o in outputs))
    block_gm = torch.fx.GraphModule(gm.get_submodule(block), sub, class_name="CheckpointedBlock")
    gm.set_submodule(block, block_gm)  # same child names: parameter FQNs are unchanged

    with gm.graph.inserting_after(last):
        fn = gm.graph.get_attr(block)
    with gm.graph.inserting_after(fn):
        call = gm.graph.call_function(
            torch.utils.checkpoint.checkpoint, (fn, *inputs), {"use_reentrant": False}
        )
    anchor = call
    for i, out in enumerate(outputs):
        with gm.graph.inserting_after(anchor):
            item = gm.graph.call_function(operator.getitem, (call, i))
        _copy_meta(out, item)
        out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        anchor = item
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    return call


def checkpoint_blocks(
    gm: torch.fx.GraphModule, ctx: PassContext, *, blocks: tuple[str, ...]
) -> PassResult:
    """Wrap each block in ``blocks`` (module paths) in activation checkpointing."""
    done = []
    for block in blocks:
        nodes = [n for n in gm.graph.nodes if _in_block(n, block)]
        if not nodes:
            raise ValueError(
                f"checkpoint_blocks: no node comes from module {block!r}; module paths in this "
                f"graph: {sorted({module_path(n) for n in gm.graph.nodes} - {''})[:12]}"
            )
        done.append(_outline(gm, block, nodes).name)
    ctx.report["checkpoint_blocks"] = list(blocks)
    return PassResult(gm, bool(done))


# --------------------------------------------------------------------------- demo


class Block(nn.Module):
    def __init__(self, dim: int, approximate: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU(approximate=approximate)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(self.act(self.up(self.norm(x))))  # (B, dim)


class TinyMLP(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate
        self.blocks = nn.ModuleList([Block(dim, approximate) for _ in range(depth)])
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(F.gelu(x, approximate=self.approximate))


def _saved_tensors(fn) -> int:
    """How many tensors autograd keeps for backward while running ``fn()``."""
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return count


def main(debug_dir: str | None = None, *, verbose: bool = True) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyMLP()
    x = torch.randn(4, 16)
    gm = torch.fx.symbolic_trace(model)
    before = copy.deepcopy(gm)

    ctx = PassContext(example_args=(x,))
    manager = PassManager(
        ["gelu_to_tanh", functools.partial(checkpoint_blocks, blocks=("blocks.0", "blocks.1"))],
        constraints=[this_before_that("gelu_to_tanh", "checkpoint_blocks")],
        debug=debug_dir if debug_dir is not None else False,
    )
    result = manager(gm, ctx)
    after = result.graph_module
    diff = graph_diff(before, after)

    # the same model written with the tanh approximation: the rewritten graph must match it
    tanh_model = TinyMLP(approximate="tanh")
    tanh_model.load_state_dict(model.state_dict())
    out, ref, exact = after(x), tanh_model(x), model(x)
    out.square().sum().backward()
    ref.square().sum().backward()
    params = dict(after.named_parameters())
    assert set(params) == {n for n, _ in tanh_model.named_parameters()}
    grad_diff = max(
        (params[n].grad - p.grad).abs().max().item() for n, p in tanh_model.named_parameters()
    )
    summary = {
        "diff": diff,
        "report": dict(ctx.report),
        "modified": result.modified,
        "max_abs_vs_tanh_model": (out - ref).abs().max().item(),
        "max_grad_abs_vs_tanh_model": grad_diff,
        "max_abs_vs_exact_gelu": (out - exact).abs().max().item(),
        "saved_tensors_before": _saved_tensors(lambda: tanh_model(x)),
        "saved_tensors_after": _saved_tensors(lambda: after(x)),
        "graph_module": after,
    }
    if verbose:
        print(diff, end="\n\n")
        print(graph_table(after), end="\n\n")
        print(after.code)
        for key in ("report", "max_abs_vs_tanh_model", "max_grad_abs_vs_tanh_model",
                    "max_abs_vs_exact_gelu", "saved_tensors_before", "saved_tensors_after"):
            print(f"{key}: {summary[key]}")
    return summary


# --------------------------------------------------------------------------- under torchrun


def parallel_main(argv: list[str] | None = None) -> int:
    """``gelu_to_tanh`` through ``fxsplit.parallelize(passes=...)`` on the launched ranks."""
    import torch.distributed as dist

    import fxsplit
    from fxsplit.testing import zoo

    parser = argparse.ArgumentParser(description="custom_pass.py under torchrun")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=None, help="default: world size / tp")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    model, example, kwargs = zoo.make("gpt", n_layer=2, seed=0)
    reference = copy.deepcopy(model)
    world = int(os.environ.get("WORLD_SIZE", "0")) or dist.get_world_size()
    pm = fxsplit.parallelize(model, example, kwargs, loss_fn=zoo.cross_entropy_loss, tp=args.tp,
                             pp=args.pp or world // args.tp, schedule="1f1b", microbatches=2,
                             passes=[gelu_to_tanh])
    rank = dist.get_rank()
    if rank == 0:  # the same pass on the unsplit model, trained in this process
        gm = fxsplit.trace(reference, example, kwargs)
        reference = PassManager([gelu_to_tanh])(gm, PassContext(example_args=example)).graph_module
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        print(f"gelu_to_tanh rewrote {pm.plan.pass_report['gelu_to_tanh']}", flush=True)
        tanh = [s for s, m in pm.local_stage_graphs().items() if "approximate = 'tanh'" in m.code]
        print(f"rank 0's stages with tanh GELU in their code: {tanh}", flush=True)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for i in range(args.steps):
        x = torch.randint(0, 128, example[0].shape, generator=g)
        y = zoo.make_target("gpt", torch.empty(*x.shape, 128), seed=i)
        loss = pm.step(x, target=y)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            ref_loss = zoo.cross_entropy_loss(reference(x), y)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_opt.step()
            a, b = float(loss), ref_loss.item()
            worst = max(worst, abs(a - b) / abs(b))
            print(f"step {i}: loss fxsplit {a:.6f}  single {b:.6f}", flush=True)
    verdict = torch.tensor([int(worst > 1e-5)])
    dist.broadcast(verdict, src=0)  # every rank exits with the same status
    if rank == 0:
        print(f"{'MISMATCH' if verdict.item() else 'OK'}: largest relative loss difference {worst:.2e}", flush=True)
    return int(verdict.item())


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        code = parallel_main(sys.argv[1:])
        import torch.distributed as dist

        dist.destroy_process_group()
        sys.exit(code)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--debug", metavar="DIR", help="write per-pass dumps to DIR")
    main(parser.parse_args().debug)
