"""Linear layer as ggml's ``mul_mat`` with its ``out_prod`` weight gradient.

``mul_mat(x, w)`` is ``x @ w.T`` with ``w`` shaped (out, in) - an ``nn.Linear`` weight, which
is also how GGUF stores llama's projection matrices, so weights export unchanged. All leading
dims of ``x`` are flattened into one 2-D matrix product, so forward and backward are each
one BLAS call (as fast as ``F.linear``, no bias).
"""

from __future__ import annotations

from typing import Any

import torch

from llamatrain.ops.dtypes import autocast_dtype, autocast_like


class _MulMat(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if w.dim() != 2 or x.shape[-1] != w.shape[1]:
            raise ValueError(
                f"mul_mat: need x (..., in) and w (out, in), got {tuple(x.shape)} and "
                f"{tuple(w.shape)}"
            )
        ctx.save_for_backward(x, w)
        ctx.autocast = autocast_dtype(x.device.type)
        y = torch.mm(x.reshape(-1, x.shape[-1]), w.t())
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # ggml mul_mat backward: dW = out_prod(X, G) = G^T X summed over all rows (all
        # leading dims flattened), dX = G W. Under the forward's autocast (bf16 training)
        # both products run in its dtype too; gradients come back in the inputs' dtypes.
        x, w = ctx.saved_tensors
        g = grad.reshape(-1, w.shape[0])
        dx = dw = None
        with autocast_like(x.device.type, ctx.autocast):
            if ctx.needs_input_grad[0]:
                dx = torch.mm(g, w).reshape(x.shape).to(x.dtype)
            if ctx.needs_input_grad[1]:
                dw = torch.mm(g.t(), x.reshape(-1, x.shape[-1])).to(w.dtype)
        return dx, dw


def mul_mat(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``x`` (..., in) and ``w`` (out, in), like ``F.linear`` without bias.

    Backward is ggml's: ``dW = out_prod(X, G)`` (Gᵀ·X over all rows), ``dX = G·W``.
    """
    return _MulMat.apply(x, w)
