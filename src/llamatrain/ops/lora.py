"""The LoRA-adapted linear layer, with its backward written out.

LoRA (Hu et al. 2021; PEFT's ``LoraLayer``; llama.cpp's ``llm_build_lora_mm``) keeps a
projection ``W`` (out, in) frozen and learns a low-rank update beside it::

    y = x·Wᵀ + s·((x'·Aᵀ)·Bᵀ),    A (r, in), B (out, r), s = alpha / r

where ``x'`` is the adapter's input: ``x`` itself, or ``x`` after dropout (PEFT drops inputs
of the adapter path only, never of the base path). The update is applied as two thin matmuls
through the rank-r bottleneck, never as ``W + s·B·A``: that sum would be a second (out, in)
matrix per projection, forward and backward, which is what LoRA exists to avoid.

Backward, with G = dL/dy flattened to rows (M, out) and U = x'·Aᵀ (M, r) kept from the
forward (r columns, a small fraction of x)::

    Gb  = s·G·B                 (M, r)
    dB  = s·Gᵀ·U                (out, r)
    dA  = Gbᵀ·x'                (r, in)
    dx  = G·W  (+ Gb·A when x' is x)
    dx' = Gb·A                  (when x' is a separate tensor; autograd carries it through
                                 the dropout to x)
    dW  = Gᵀ·x                  (only if asked: the base is normally frozen)

``torch_lora_linear`` is the same layer in plain PyTorch (PEFT's formula, autograd's
backward) for the ``torch`` op set; each checks the other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from llamatrain.ops.dtypes import autocast_dtype, autocast_like

__all__ = ["lora_linear", "torch_lora_linear"]


def _check_shapes(
    x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor
) -> None:
    n_out, n_in = weight.shape
    rank = lora_a.shape[0]
    if x.shape[-1] != n_in or lora_a.shape != (rank, n_in) or lora_b.shape != (n_out, rank):
        raise ValueError(
            f"lora_linear: need x (..., in), weight (out, in), lora_a (r, in) and lora_b "
            f"(out, r), got {tuple(x.shape)}, {tuple(weight.shape)}, {tuple(lora_a.shape)} "
            f"and {tuple(lora_b.shape)}"
        )


class _LoraLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scale: float,
        adapter_input: torch.Tensor | None,
    ) -> torch.Tensor:
        _check_shapes(x, weight, lora_a, lora_b)
        shared = adapter_input is None
        rows = x.reshape(-1, x.shape[-1])
        adapter_rows = rows if shared else adapter_input.reshape(rows.shape)
        u = torch.mm(adapter_rows, lora_a.t())
        y = torch.addmm(torch.mm(rows, weight.t()), u, lora_b.t(), alpha=scale)
        # x itself only for a trainable W's gradient: a frozen base needs just x' (which is
        # x unless dropout made a new tensor) and U.
        kept_rows = rows if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(kept_rows, adapter_rows, weight, lora_a, lora_b, u)
        ctx.scale, ctx.shared, ctx.x_shape, ctx.x_dtype = scale, shared, x.shape, x.dtype
        ctx.autocast = autocast_dtype(x.device.type)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, adapter_rows, weight, lora_a, lora_b, u = ctx.saved_tensors
        need_x, need_w, need_a, need_b, _, need_adapter_input = ctx.needs_input_grad
        g = grad.reshape(-1, weight.shape[0])
        dx = dw = da = db = d_adapter_input = None
        with autocast_like(adapter_rows.device.type, ctx.autocast):
            gb = torch.mm(g, lora_b).mul_(ctx.scale)  # s·G·B, the gradient at U
            if need_b:
                db = torch.mm(g.t(), u).mul_(ctx.scale).to(lora_b.dtype)
            if need_a:
                da = torch.mm(gb.t(), adapter_rows).to(lora_a.dtype)
            if need_x:
                dx = torch.mm(g, weight)
                if ctx.shared:
                    dx = torch.addmm(dx, gb, lora_a)
                dx = dx.reshape(ctx.x_shape).to(ctx.x_dtype)
            if need_adapter_input:
                d_adapter_input = torch.mm(gb, lora_a).reshape(ctx.x_shape).to(ctx.x_dtype)
            if need_w:
                dw = torch.mm(g.t(), rows).to(weight.dtype)
        return dx, dw, da, db, None, d_adapter_input


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    adapter_input: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x·Wᵀ + scale·((x'·Aᵀ)·Bᵀ)`` for ``x`` (..., in), W (out, in), A (r, in), B (out, r).

    ``adapter_input`` is x' (x after dropout, same shape as x); None means x itself. The
    backward is the one written out in the module docstring: no (out, in) matrix beyond W.
    """
    return _LoraLinear.apply(x, weight, lora_a, lora_b, scale, adapter_input)


def torch_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    adapter_input: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`lora_linear` composed of ``F.linear`` calls (PEFT's formula), for the torch op
    set: autograd derives its backward."""
    adapter_rows = x if adapter_input is None else adapter_input
    return F.linear(x, weight) + scale * F.linear(F.linear(adapter_rows, lora_a), lora_b)
