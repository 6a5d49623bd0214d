"""Softmax and causal masking with ggml's ``soft_max`` / ``soft_max_back`` / ``diag_mask``.

ggml fuses the attention-score scale and the additive mask into ``soft_max``
(``softmax(scale*x + mask)``), and its backward needs only the output y, not the scores.
Masked entries (mask = -inf) come out of the forward as exact zeros, so the backward's
factor y makes their gradient exactly zero as well. The mask itself gets no gradient.

``diag_mask_inf`` / ``diag_mask_zero`` are the causal masks of the 2023 ggml training graphs:
over the last two dims, entries above the diagonal shifted right by ``n_past`` are set to
-inf / 0. Their backward zeroes the same entries of the gradient (``diag_mask_zero``).

Half-precision inputs are computed in float32 and the output cast back.
"""

from __future__ import annotations

from typing import Any

import torch

from llamatrain.ops.dtypes import compute_dtype


class _SoftMax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        cdt = compute_dtype(x.dtype)
        z = x.to(cdt)
        if mask is not None:
            z = torch.add(mask.to(cdt), z, alpha=scale)  # scale*x + mask in one pass
        elif scale != 1.0:
            z = z * scale
        y = torch.softmax(z, dim=-1).to(x.dtype)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # ggml soft_max_back: dx = scale * y * (dy - <y, dy>) per row; no gradient for the mask.
        # Masked entries have y == 0 exactly, so their gradient is exactly 0.
        # ATen's softmax-backward kernel computes y * (dy - <y, dy>) in one fused pass (2-3x
        # faster than composing it); the scale is applied after.
        (y,) = ctx.saved_tensors
        cdt = compute_dtype(y.dtype)
        yc, dy = y.to(cdt), grad.to(cdt)
        dx = torch.ops.aten._softmax_backward_data(dy, yc, -1, cdt)
        if ctx.scale != 1.0:
            dx.mul_(ctx.scale)
        return dx.to(y.dtype), None, None


def _upper_mask(x: torch.Tensor, n_past: int) -> torch.Tensor:
    """Boolean (rows, cols) mask, True where col > n_past + row."""
    rows, cols = x.shape[-2], x.shape[-1]
    return torch.ones(rows, cols, dtype=torch.bool, device=x.device).triu_(n_past + 1)


class _DiagMaskInf(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n_past: int) -> torch.Tensor:
        ctx.n_past = n_past
        return x.masked_fill(_upper_mask(x, n_past), float("-inf"))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # ggml: the backward of diag_mask_inf is diag_mask_zero(grad, n_past).
        return grad.masked_fill(_upper_mask(grad, ctx.n_past), 0.0), None


class _DiagMaskZero(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n_past: int) -> torch.Tensor:
        ctx.n_past = n_past
        return x.masked_fill(_upper_mask(x, n_past), 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # ggml: the backward of diag_mask_zero is diag_mask_zero(grad, n_past).
        return grad.masked_fill(_upper_mask(grad, ctx.n_past), 0.0), None


def soft_max(x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """``softmax(scale * x + mask)`` over the last dim.

    ``mask`` is additive, broadcastable to ``x`` and may hold -inf (a fully masked row is not
    supported: it gives NaN, as in ggml). Backward is ggml's ``soft_max_back``; the mask
    gets no gradient and masked entries get exactly zero.
    """
    if mask is not None and not mask.dtype.is_floating_point:
        raise ValueError(
            f"soft_max: mask must be an additive float mask (0 / -inf), got {mask.dtype}"
        )
    return _SoftMax.apply(x, mask, float(scale))


def diag_mask_inf(x: torch.Tensor, n_past: int = 0) -> torch.Tensor:
    """Set ``x[..., i, j]`` to -inf where ``j > n_past + i`` (causal mask before softmax)."""
    if x.dim() < 2:
        raise ValueError(f"diag_mask_inf: x needs at least 2 dims, got shape {tuple(x.shape)}")
    return _DiagMaskInf.apply(x, int(n_past))


def diag_mask_zero(x: torch.Tensor, n_past: int = 0) -> torch.Tensor:
    """Set ``x[..., i, j]`` to 0 where ``j > n_past + i``."""
    if x.dim() < 2:
        raise ValueError(f"diag_mask_zero: x needs at least 2 dims, got shape {tuple(x.shape)}")
    return _DiagMaskZero.apply(x, int(n_past))
