"""Whether an op's autograd Function is needed at all.

Why: a ``torch.autograd.Function`` costs ~10 us a call on the CPU before any arithmetic (its
context, saved tensors, the graph node), as much as a decoding step's small ops themselves
(an RMS norm or a rope over one token's 576 values: ~10 us). Where no graph is recorded
(generation, evaluation, a rollout's sampling: grad mode off, or inputs that need no
gradient), an op runs its Function's forward arithmetic directly: the same operations in the
same order, so the values are the Function's to the bit.
"""

from __future__ import annotations

import torch

__all__ = ["records_graph"]


def records_graph(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op over ``tensors``: grad mode on and one of them needs a
    gradient (None entries are skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
