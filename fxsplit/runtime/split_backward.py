"""Split backward: the I (input gradients) and W (weight gradients) halves of one backward.

Terms (fxsplit.runtime.executor, fxsplit.schedule.ir): a stage's backward of microbatch i is
either one action B, or I then W (zero-bubble schedules): I computes the gradients of the
stage inputs and sends them upstream at once, W the parameter gradients later. **roots**: the
tensors differentiated from (the weighted loss, or the stage outputs with their received
gradients); **leaves**: the stage inputs that need a gradient; **intermediates**: the autograd
nodes where a parameter's gradient branches off the input path. The whole method is
[Note: split backward] below; the executor's step is [Note: pipeline step].

Representative use (an eager runner's I and W actions, fxsplit.runtime.runners)::

    split = SplitBackward(roots, root_grads, leaves, params)
    with split.capturing():                                   # I
        dx = torch.autograd.grad(roots, leaves, root_grads, retain_graph=True, allow_unused=True)
    split.weight_grads()                                      # W: accumulates into p.grad
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["SplitBackward"]


class SplitBackward:
    """[Note: split backward] The W half of a backward split into I and W, without redoing I.

    The approach of torch.distributed.pipelining's ``stage_backward_input/weight``: before I,
    walk the autograd graph from the roots. The I pass (``autograd.grad`` to the stage inputs)
    runs exactly the nodes from which an input is reachable (set ``I``). For each parameter, walk
    up from its gradient accumulator through nodes outside ``I``; the nodes of ``I`` met on the
    way ("intermediates") are where its gradient branches off the input path. A pre-hook
    captures the gradient flowing into each intermediate during I; W then runs
    ``autograd.grad(GradientEdge(intermediate), params, captured)`` per group of parameters that
    share intermediates, which computes only the weight branches. A parameter reached from a
    root outside ``I`` (e.g. every parameter of stage 0, whose inputs need no gradient) is
    differentiated from the roots instead. I + W thus cost about one full backward.
    """

    def __init__(self, roots: list[torch.Tensor], root_grads: list[torch.Tensor | None],
                 leaves: list[torch.Tensor], params: list[nn.Parameter]):
        self.roots, self.root_grads = roots, root_grads
        self.captured: dict[Node, tuple] = {}
        root_nodes = [r.grad_fn for r in roots if r.grad_fn is not None]
        parents: dict[Node, list[Node]] = defaultdict(list)
        seen, queue = set(root_nodes), deque(root_nodes)
        while queue:  # reverse edges of the graph below the roots
            node = queue.popleft()
            for child, _ in node.next_functions:
                if child is not None:
                    parents[child].append(node)
                    if child not in seen:
                        seen.add(child)
                        queue.append(child)
        on_input_path: set[Node] = set()
        queue = deque(get_gradient_edge(x).node for x in leaves)
        while queue:
            node = queue.popleft()
            for par in parents.get(node, ()):
                if par not in on_input_path:
                    on_input_path.add(par)
                    queue.append(par)
        roots_set = set(root_nodes)
        groups: list[tuple[set[Node], list[nn.Parameter]]] = []
        self.from_roots: list[nn.Parameter] = []
        for p in params:
            acc = get_gradient_edge(p).node
            if acc not in seen:
                continue  # not used by this microbatch's graph
            inter: set[Node] = set()
            top = False
            visited, queue = {acc}, deque([acc])
            while queue:
                node = queue.popleft()
                top |= node in roots_set
                for par in parents.get(node, ()):
                    if par in visited:
                        continue
                    visited.add(par)
                    if par in on_input_path:
                        inter.add(par)
                    else:
                        queue.append(par)
            if top or not inter:
                self.from_roots.append(p)
                continue
            merged = [g for g in groups if g[0] & inter]
            for g in merged:
                groups.remove(g)
                inter |= g[0]
            groups.append((inter, [q for g in merged for q in g[1]] + [p]))
        self.groups = groups

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        def hook_for(node: Node) -> Callable:
            def hook(grad_outputs: tuple) -> None:
                self.captured[node] = tuple(grad_outputs)
            return hook

        handles = [node.register_prehook(hook_for(node)) for nodes, _ in self.groups for node in nodes]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def weight_grads(self) -> None:
        """Accumulate the parameter gradients into ``.grad`` (the W action)."""
        if self.from_roots:
            torch.autograd.backward(self.roots, self.root_grads, inputs=self.from_roots, retain_graph=True)
        for nodes, params in self.groups:
            edges, grads = [], []
            for node in nodes:
                for i, g in enumerate(self.captured.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue
            got = torch.autograd.grad(edges, params, grads, retain_graph=True, allow_unused=True)
            for p, g in zip(params, got):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
        self.captured.clear()
