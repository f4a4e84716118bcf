"""The runtime's graph compiler: a stage as fx graphs instead of one autograd call.

- `split_graph`: a stage's forward, input-gradient (I) and weight-gradient (W) graphs from one
  joint graph ([Note: graph split backward]), for zero-bubble schedules and for ``compile=True``.
- `compiling`: ``torch.compile`` (inductor) of those graphs, of the inference graph and of the
  loss ([Note: compiled stages]).
- `cpu_matmul`: fp32 CPU matmuls of a compiled graph through oneDNN ([Note: CPU matmuls through
  oneDNN]).

The executor reaches these only through its stage runners (fxsplit.runtime.runners); nothing here
knows about messages, schedules or process groups.
"""
