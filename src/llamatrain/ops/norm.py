"""RMS normalisation with ggml's ``rms_norm`` / ``rms_norm_back`` semantics.

ggml's ``rms_norm`` has no weight: the learned gain is a separate elementwise multiply in the
graph, so its gradient comes from that multiply, and this op's backward only has to carry
the gradient through the normalisation. Keeping the two apart is what lets the model mirror
llama.cpp's graph (and its ``*_norm.weight`` tensors) one to one.

Precision: ggml accumulates the row sums in double. We accumulate in the computation dtype,
which is float32 for float32 / float16 / bfloat16 inputs (PyTorch's float32 reductions are
cascaded, ~1e-7 relative for the row lengths we use) and float64 for float64 inputs.
Half-precision inputs are upcast to float32 and the result cast back.
"""

from __future__ import annotations

from typing import Any

import torch

from llamatrain.ops.dtypes import compute_dtype
from llamatrain.ops.grad_mode import records_graph


def _normalized(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / sqrt(mean(x^2) + eps) in x's dtype, rstd = 1 / sqrt(mean(x^2) + eps) per row)."""
    xc = x.to(compute_dtype(x.dtype))
    rstd = torch.rsqrt(xc.square().mean(-1, keepdim=True).add_(eps))
    return (xc * rstd).to(x.dtype), rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = _normalized(x, eps)
        ctx.save_for_backward(x, rstd)  # rstd, one value per row: all we keep besides x
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # ggml rms_norm_back, per row of length N:
        #   dx = (dz - x * sum(x*dz) / (sum(x^2) + N*eps)) / sqrt(mean(x^2) + eps)
        # With rstd = 1/sqrt(mean(x^2) + eps) we have sum(x^2) + N*eps = N / rstd^2, so
        #   dx = rstd * (dz - x * rstd^2 * mean(x*dz)).
        x, rstd = ctx.saved_tensors
        cdt = compute_dtype(x.dtype)
        xc = x.to(cdt)
        dz = grad.to(cdt)
        coef = (xc * dz).mean(-1, keepdim=True).mul_(rstd.square())
        dx = torch.addcmul(dz, xc, coef, value=-1.0).mul_(rstd)
        return dx.to(x.dtype), None


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise ``x`` over its last dim to unit root-mean-square: ``x / sqrt(mean(x^2) + eps)``.

    No weight is applied (multiply by the norm weight separately, as llama.cpp does).
    Backward is ggml's ``rms_norm_back``. Where no graph is recorded, the same arithmetic
    without the autograd Function (``ops.grad_mode``).
    """
    if records_graph(x):
        return _RMSNorm.apply(x, float(eps))
    return _normalized(x, float(eps))[0]
