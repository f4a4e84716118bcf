"""Packed rows given as document ids: the ``position_ids`` that Hugging Face models read a packed
row from.

Terms
- **document ids** ``(B, T)``: equal, consecutive values mark one document of a row (``[[0, 0, 0, 1,
  1, 2]]``: three documents of 3, 2 and 1 tokens).
- **restarting position ids** ``(B, T)``: each token's index inside its document (``[[0, 1, 2, 0, 1,
  0]]``). transformers finds the documents from where they do not count up by one, and confines
  attention to each (``find_packed_sequence_indices`` in its ``masking_utils``; under torch.export it
  always builds that mask: docs/training.md, packed rows).

    pos = position_ids_from_documents(doc_ids)
    pm.step(input_ids, position_ids=pos, target=labels)
"""

from __future__ import annotations

import torch

from fxsplit.errors import ArgumentTypeError

__all__ = ["position_ids_from_documents"]


def position_ids_from_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """Restarting position ids (int64, the shape of ``doc_ids``) from document ids (B, T): a
    document begins at each row's first token and wherever the id changes."""
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 2 or doc_ids.is_floating_point():
        got = f"a {doc_ids.dim()}-d {doc_ids.dtype} tensor" if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise ArgumentTypeError(f"document ids must be an integer tensor (batch, sequence), got {got}")
    rows, length = doc_ids.shape
    index = torch.arange(length, device=doc_ids.device).expand(rows, -1)
    begins = torch.ones_like(doc_ids, dtype=torch.bool)
    begins[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.cummax(torch.where(begins, index, torch.zeros_like(index)), dim=1).values
    return (index - start).long()
