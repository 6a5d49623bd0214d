"""GELU (tanh approximation) and GEGLU, the gated feed-forward of Gemma.

ggml's ``GGML_UNARY_OP_GELU`` and ``GGML_GLU_OP_GEGLU`` use the tanh approximation

    gelu(x) = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))

(``ggml_vec_gelu_f32``), which is ``F.gelu(x, approximate="tanh")``. ggml has a forward for
both but no backward: ``ggml_compute_backward`` aborts on "unsupported glu op for backward
pass: GEGLU", so llama-finetune cannot train Gemma. The backward here is the exact
derivative, written out as ggml writes ``silu_back`` for SwiGLU:

    gelu_back(dy, x) = dy·(0.5·(1 + t) + 0.5·x·(1 − t²)·√(2/π)·(1 + 3·0.044715·x²)),
    t = tanh(√(2/π)·(x + 0.044715·x³))

``geglu`` mirrors ``swiglu`` (``ops/activation.py``): one Function, so the feed-forward keeps
only its two inputs for the backward. Half-precision inputs are computed in float32 and cast
back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from llamatrain.ops.dtypes import compute_dtype

__all__ = ["gelu", "geglu"]


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_back(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dx = dy · d/dx gelu_tanh(x) (the formula in the module docstring).

    ATen's ``gelu_backward`` with ``approximate="tanh"`` evaluates exactly that expression in
    one fused pass.
    """
    return torch.ops.aten.gelu_backward(dy, x, approximate="tanh")


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        cdt = compute_dtype(x.dtype)
        return _gelu(x.to(cdt)).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        # gelu_back: dx = dy·(0.5(1+t) + 0.5x(1−t²)·√(2/π)(1 + 3a·x²)), t = tanh(√(2/π)(x + a·x³))
        (x,) = ctx.saved_tensors
        cdt = compute_dtype(x.dtype)
        return _gelu_back(grad.to(cdt), x.to(cdt)).to(x.dtype)


class _GEGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.shape != up.shape:
            raise ValueError(
                f"geglu: gate and up must have the same shape, got {tuple(gate.shape)} "
                f"and {tuple(up.shape)}"
            )
        ctx.save_for_backward(gate, up)
        cdt = compute_dtype(gate.dtype)
        return _gelu(gate.to(cdt)).mul_(up.to(cdt)).to(gate.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # For out = gelu(gate)·up, as ggml's split SwiGLU with silu → gelu:
        #   d_gate = gelu_back(grad·up, gate),   d_up = gelu(gate)·grad
        gate, up = ctx.saved_tensors
        cdt = compute_dtype(gate.dtype)
        g, u, dy = gate.to(cdt), up.to(cdt), grad.to(cdt)
        d_gate = d_up = None
        if ctx.needs_input_grad[1]:
            d_up = _gelu(g).mul_(dy).to(up.dtype)
        if ctx.needs_input_grad[0]:
            d_gate = _gelu_back(dy * u, g).to(gate.dtype)
        return d_gate, d_up


def gelu(x: torch.Tensor) -> torch.Tensor:
    """``gelu`` with the tanh approximation (ggml's GELU); backward is its exact derivative."""
    return _GELU.apply(x)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma's feed-forward gating, ggml's split GEGLU) as one op."""
    return _GEGLU.apply(gate, up)
