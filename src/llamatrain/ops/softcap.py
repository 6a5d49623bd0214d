"""Logit soft-capping: ``cap·tanh(x / cap)`` (Gemma 2's final and attention soft-capping).

llama.cpp builds it as three nodes, ``ggml_scale(1/cap) → ggml_tanh → ggml_scale(cap)``
(``final_logit_softcapping`` in ``src/models/gemma2*.cpp``; ``gemma3.cpp`` has the same
three nodes in its non-SWA variant). Their backward chained together is

    dx = dy·cap · (1 − tanh²(x/cap)) · (1/cap) = dy·(1 − (y/cap)²),   y = cap·tanh(x/cap)

which needs only the output y. Saving y rather than x costs no memory when the next op (the
cross-entropy loss) saves its input logits anyway: they are the same tensor. Half-precision
inputs are computed in float32 and cast back.
"""

from __future__ import annotations

from typing import Any

import torch

from llamatrain.ops.dtypes import compute_dtype

__all__ = ["softcap"]


class _SoftCap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cap: float) -> torch.Tensor:
        cdt = compute_dtype(x.dtype)
        y = torch.tanh(x.to(cdt) / cap).mul_(cap).to(x.dtype)
        ctx.save_for_backward(y)
        ctx.cap = cap
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # scale(cap) ∘ tanh ∘ scale(1/cap): dx = dy·(1 − t²), t = y/cap (tanh_back on the output)
        (y,) = ctx.saved_tensors
        cdt = compute_dtype(y.dtype)
        t = y.to(cdt) / ctx.cap
        # ATen's tanh_backward computes dy·(1 − t²) in one fused pass.
        return torch.ops.aten.tanh_backward(grad.to(cdt), t).to(y.dtype), None


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap · tanh(x / cap)``: x squashed smoothly into (−cap, cap); ``cap > 0``.

    Backward: ``dx = dy·(1 − (y/cap)²)`` from the saved output (see the module docstring).
    """
    cap = float(cap)
    if not cap > 0 or cap == float("inf"):
        raise ValueError(f"softcap: cap must be a positive finite number, got {cap}")
    if not x.is_floating_point():
        raise ValueError(f"softcap: x must be floating point, got {x.dtype}")
    return _SoftCap.apply(x, cap)
