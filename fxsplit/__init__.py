"""fxsplit: split an unmodified PyTorch model across devices.

Data flows one way: model -> trace (graph + metadata) -> passes -> plan -> runtime.
"""

__version__ = "0.1.0"
