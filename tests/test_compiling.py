"""torch.compile of stage graphs ([Note: compiled stages] in fxsplit.runtime.compiling), in one
process: what a compile leaves behind for later tracing, and the runners' shapes."""

import inspect

import torch
import torch.fx
from torch import nn
from torch.fx._symbolic_trace import Tracer

from fxsplit.graph.marker import find_pipe_splits, pipe_split


class _Marked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        pipe_split()
        return self.b(x)


def test_pipe_split_is_traced_after_a_compile():
    """[Note: Tracer.trace under dynamo]: after a torch.compile has run in the process, dynamo has
    wrapped Tracer.trace for good; a pipe_split() under symbolic tracing is still one marker node."""
    f = torch.compile(lambda x: x.sin() + 1, backend="eager", fullgraph=True)
    torch.testing.assert_close(f(torch.ones(3)), torch.ones(3).sin() + 1)
    assert Tracer.trace is not inspect.unwrap(Tracer.trace)  # the state the test is about
    gm = torch.fx.symbolic_trace(_Marked())
    assert len(find_pipe_splits(gm)) == 1
