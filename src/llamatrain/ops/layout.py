"""The layout of packed training rows: document ids, branch ids, and the rope positions
they give each token.

Packed documents and their branches (a preference pair's shared prompt and its two replies)
are one concept, described with the mask they make in ``llamatrain.ops.attention``'s module
docstring; these are the two functions that read it, for the attention paths
(``flash_attn``, the op sets' explicit masks) and for the model's rope.
"""

from __future__ import annotations

import torch

__all__ = ["document_layout", "layout_positions"]


def document_layout(documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(document ids, branch ids or None) of a model's ``documents``: (B, T) ids, or (B, T, 2)
    ids and branch ids stacked (see the module docstring)."""
    if documents.dim() == 3 and documents.shape[-1] == 2:
        return documents[..., 0], documents[..., 1]
    return documents, None


def layout_positions(documents: torch.Tensor, branches: torch.Tensor | None = None) -> torch.Tensor:
    """Rope positions (B, T): how many earlier tokens each token sees -- its index within its
    document, less the tokens of the sibling branches before its own.

    Ids are non-decreasing along each row and, within a document, so are branch ids (the
    trunk, 0, first). A token's segment (its document's trunk, or one branch) starts where
    its (id, branch) pair first appears; the trunk tokens before that segment are the ones
    it sees besides its segment's.
    """
    ids = documents.contiguous()
    index = torch.arange(ids.shape[1], device=ids.device)
    doc_starts = torch.searchsorted(ids, ids)
    if branches is None:
        return index - doc_starts
    change = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    change[:, 1:] = (ids.diff(dim=1) != 0) | (branches.diff(dim=1) != 0)
    seg_starts = torch.where(change, index, 0).cummax(dim=1).values
    trunk = (branches == 0).to(torch.int64)
    trunk_before = trunk.cumsum(dim=1) - trunk  # trunk tokens at indices < i
    seen_trunk = trunk_before.gather(1, seg_starts) - trunk_before.gather(1, doc_starts)
    return index - seg_starts + seen_trunk
