"""Activations and gated feed-forwards with ggml's gradients: SiLU/SwiGLU (llama) and
GELU-tanh/GEGLU (Gemma).

A gated op is one Function rather than ``act(gate) * up`` so the feed-forward block keeps only
its two inputs for the backward (not the intermediate ``act(gate)`` as well) and the backward
is the one ggml computes for that pair of nodes:

    d_gate = act_back(dy · up, gate),   d_up = act(gate) · dy

``silu_back`` is ggml's: dx = dy · s · (1 + x · (1 − s)), s = sigmoid(x). ggml's GELU is the
tanh approximation (``ggml_vec_gelu_f32``), gelu(x) = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)));
ggml has no backward for it (``ggml_compute_backward`` aborts on "unsupported glu op for
backward pass: GEGLU", so llama-finetune cannot train Gemma), and ``gelu_back`` here is its
exact derivative, dy·(0.5·(1 + t) + 0.5·x·(1 − t²)·√(2/π)·(1 + 3·0.044715·x²)),
t = tanh(√(2/π)·(x + 0.044715·x³)). ATen's ``silu_backward`` / ``gelu_backward(approximate=
"tanh")`` kernels evaluate exactly these expressions in one fused pass (~2x faster than
composing them). Half-precision inputs are computed in float32 and cast back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from llamatrain.ops.dtypes import compute_dtype
from llamatrain.ops.grad_mode import records_graph

__all__ = ["geglu", "gelu", "silu", "swiglu"]

_Act = Callable[[torch.Tensor], torch.Tensor]
_ActBack = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _silu_back(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward(dy, x)


def _gelu_back(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(dy, x, approximate="tanh")


def _unary(act: _Act, act_back: _ActBack) -> type[torch.autograd.Function]:
    """The Function ``act(x)`` whose backward is ``act_back(dy, x)``."""

    class Unary(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return act(x.to(compute_dtype(x.dtype))).to(x.dtype)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            cdt = compute_dtype(x.dtype)
            return act_back(grad.to(cdt), x.to(cdt)).to(x.dtype)

    return Unary


def _gated_forward(name: str, act: _Act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up`` in the computation dtype, cast back to gate's."""
    if gate.shape != up.shape:
        raise ValueError(
            f"{name}: gate and up must have the same shape, got {tuple(gate.shape)} "
            f"and {tuple(up.shape)}"
        )
    cdt = compute_dtype(gate.dtype)
    return act(gate.to(cdt)).mul_(up.to(cdt)).to(gate.dtype)


def _gated(name: str, act: _Act, act_back: _ActBack) -> type[torch.autograd.Function]:
    """The Function ``act(gate) * up`` with ggml's gated backward (module docstring)."""

    class Gated(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(gate, up)
            return _gated_forward(name, act, gate, up)

        @staticmethod
        def backward(
            ctx: Any, grad: torch.Tensor
        ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            # d_gate = act_back(grad * up, gate),   d_up = act(gate) * grad
            gate, up = ctx.saved_tensors
            cdt = compute_dtype(gate.dtype)
            g, u, dy = gate.to(cdt), up.to(cdt), grad.to(cdt)
            d_gate = d_up = None
            if ctx.needs_input_grad[1]:
                d_up = act(g).mul_(dy).to(up.dtype)
            if ctx.needs_input_grad[0]:
                d_gate = act_back(dy * u, g).to(gate.dtype)
            return d_gate, d_up

    return Gated


_SiLU, _GELU = _unary(F.silu, _silu_back), _unary(_gelu_tanh, _gelu_back)
_SwiGLU, _GEGLU = _gated("swiglu", F.silu, _silu_back), _gated("geglu", _gelu_tanh, _gelu_back)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``; backward is ggml's ``silu_back``."""
    return _SiLU.apply(x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (llama's feed-forward gating) as one op with ggml's gradients;
    where no graph is recorded, its forward alone (``ops.grad_mode``)."""
    if records_graph(gate, up):
        return _SwiGLU.apply(gate, up)
    return _gated_forward("swiglu", F.silu, gate, up)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """``gelu`` with the tanh approximation (ggml's GELU); backward is its exact derivative."""
    return _GELU.apply(x)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma's feed-forward gating, ggml's GEGLU) as one op; where
    no graph is recorded, its forward alone (``ops.grad_mode``)."""
    if records_graph(gate, up):
        return _GEGLU.apply(gate, up)
    return _gated_forward("geglu", _gelu_tanh, gate, up)
