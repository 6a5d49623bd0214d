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

The frozen base W comes as float32 (a trainable-shaped parameter, frozen), as a narrower
float (bf16/f16), or as its GGUF blocks (uint8 (out, row_bytes) plus the ggml type: QLoRA).
A float W of the compute dtype is used as it is. Any other is never widened whole: ``x·Wᵀ``
and ``G·W`` run a chunk of W's rows at a time (:data:`CHUNK_BYTES` of float32), each chunk
dequantized or cast to x's (G's) dtype, multiplied, and dropped::

    y[:, rows] = x·W[rows]ᵀ         dx = Σ_chunks G[:, rows]·W[rows]

so a base held at a quarter of float32's size (or less) stays that size through the step.

``torch_lora_linear`` is the same layer in plain PyTorch (PEFT's formula, autograd's
backward) for the ``torch`` op set; each checks the other. It dequantizes W whole: it is
the reference, not the memory-lean path.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from llamatrain.ops.dequantize import dequantize, row_bytes
from llamatrain.ops.dtypes import autocast_dtype, autocast_like
from llamatrain.ops.quantized_matmul import kernel_backward, kernel_forward

__all__ = [
    "CHUNK_BYTES",
    "base_forward",
    "dense_weight",
    "lora_linear",
    "row_chunks",
    "rows_per_chunk",
    "torch_lora_linear",
]

CHUNK_BYTES = 1 << 24
"""Float32 bytes of the base rows widened at a time (16 MiB). Large enough that each chunk's
matmul is still a big GEMM (4096 rows of a 1024-wide W, 1024 of a 4096-wide one), small
enough that the widened copy is noise beside the model: widening W whole would add 2x a
bf16 base's size and 7x a Q4_0 one's, the memory QLoRA exists to save."""


def dense_weight(
    weight: torch.Tensor,
    qtype: str | None,
    n_in: int,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A base weight as (out, n_in) ``dtype`` floats: ``qtype`` blocks dequantized (into
    ``out``, float32, if given), a float tensor cast (no copy if it is ``dtype`` already)."""
    if qtype is None:
        return weight.to(dtype)
    return dequantize(weight, qtype, n_in, dtype=dtype, out=out)


def _check_shapes(
    x: torch.Tensor,
    weight: torch.Tensor,
    qtype: str | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
) -> None:
    n_out = weight.shape[0]
    rank, n_in = lora_a.shape
    stored_in = n_in if qtype is None else row_bytes(qtype, n_in)
    if x.shape[-1] != n_in or weight.shape != (n_out, stored_in) or lora_b.shape != (n_out, rank):
        raise ValueError(
            f"lora_linear: need x (..., in), weight (out, in) or its {qtype} blocks, lora_a "
            f"(r, in) and lora_b (out, r), got {tuple(x.shape)}, {tuple(weight.shape)}, "
            f"{tuple(lora_a.shape)} and {tuple(lora_b.shape)}"
        )


def rows_per_chunk(width: int, chunk_rows: int | None) -> int:
    """Rows of ``width`` values widened at a time: ``chunk_rows``, or :data:`CHUNK_BYTES` of
    float32 (read when called, so a test may shrink it)."""
    return chunk_rows or max(1, CHUNK_BYTES // (4 * width))


def row_chunks(
    weight: torch.Tensor, qtype: str | None, n_in: int, dtype: torch.dtype, chunk_rows: int | None
) -> Iterator[tuple[slice, torch.Tensor]]:
    """(rows, W[rows] as ``dtype``) a chunk at a time; see :data:`CHUNK_BYTES`.

    Blocks are decoded into one float32 buffer, chunk after chunk, when no autograd graph is
    being recorded (grad mode off, as in an autograd Function's forward and backward): each
    chunk is then valid only until the next is yielded, here or by any other call in this
    thread (:func:`_scratch`). Memory the previous chunk already paged in is faster to decode
    into than a new tensor's fresh pages (a QLoRA product over Q4_0 blocks ~1.5x,
    ``bench/dequantize.py``). With grad mode on, a product may keep its chunk for its
    backward, so each chunk is a new tensor.
    """
    step = rows_per_chunk(n_in, chunk_rows)
    reuse = qtype is not None and not torch.is_grad_enabled()
    held = min(step, weight.shape[0])  # rows: no more than W has
    buffer = _scratch(held * n_in, weight.device).view(held, n_in) if reuse else None
    for start in range(0, weight.shape[0], step):
        rows = slice(start, start + step)
        part = weight[rows]
        out = None if buffer is None else buffer[: part.shape[0]]
        yield rows, dense_weight(part, qtype, n_in, dtype, out)


_scratches = threading.local()


def _scratch(n_values: int, device: torch.device) -> torch.Tensor:
    """``n_values`` float32 of this thread's one decode buffer for ``device``, grown when a
    chunk needs more (:data:`CHUNK_BYTES`: 16 MiB as a rule) and kept for the process.

    Why one buffer, not one per product: a QLoRA step asks for a chunk buffer twice per
    projection, and 16 MiB blocks freed and asked for again between the step's other tensors
    fragment the heap, whose free pages then stay resident: a Llama-2-7B-shape step (Q4_0,
    16 tokens) held 2.2 GB of anonymous memory where its tensors in use were 0.43 GB; with
    the one buffer, 0.88 GB (and its steps ran ~25% faster, no pages faulted in again)."""
    buffers = _scratches.__dict__.setdefault("by_device", {})
    held = buffers.get(device)
    if held is None or held.numel() < n_values:
        held = buffers[device] = torch.empty(n_values, device=device)
    return held[:n_values]


def _whole(
    weight: torch.Tensor, qtype: str | None, x: torch.Tensor, chunk_rows: int | None
) -> bool:
    """Whether W is used as it is: a float W of x's dtype (float32 as a rule), unless the
    caller asked for chunks."""
    return qtype is None and weight.dtype == x.dtype and chunk_rows is None


def _in_matmul_dtype(operand: torch.Tensor) -> torch.Tensor:
    """``operand`` in the dtype its matmuls with widened chunks of W run in: autocast's, if
    on, else its own: cast once here, where autocast would cast it again for each chunk's
    product; the chunks are then widened straight to that dtype (the float32 decode rounded
    once, as autocast's cast of a float32 chunk gives)."""
    dtype = autocast_dtype(operand.device.type)
    return operand if dtype is None else operand.to(dtype)


def base_forward(
    rows: torch.Tensor, weight: torch.Tensor, qtype: str | None, n_in: int, chunk_rows: int | None
) -> torch.Tensor:
    """x·Wᵀ: whole for a W of x's dtype, else a chunk of W's rows (y's columns) at a time
    (one chunk when W fits in one: its product is y, not copied into y)."""
    if _whole(weight, qtype, rows, chunk_rows):
        return torch.mm(rows, weight.t())
    y = None if chunk_rows else kernel_forward(rows, weight, qtype, n_in)
    if y is not None:  # over the blocks as stored (ops.quantized_matmul)
        return y
    rows = _in_matmul_dtype(rows)
    if weight.shape[0] <= rows_per_chunk(n_in, chunk_rows):
        return torch.mm(rows, dense_weight(weight, qtype, n_in, rows.dtype).t())
    y = None
    for cols, chunk in row_chunks(weight, qtype, n_in, rows.dtype, chunk_rows):
        part = torch.mm(rows, chunk.t())
        if y is None:  # the matmul's dtype (autocast's, if on) decides y's
            y = part.new_empty(rows.shape[0], weight.shape[0])
        y[:, cols] = part
    return y


def _add_low_rank(
    base: torch.Tensor, left: torch.Tensor, right: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """base + scale·left·right: into ``base`` itself (a fresh product nobody else holds), so
    the (M, out) result is not copied; out of place under autocast, which casts the factors
    (``addmm_`` would refuse the mixed dtypes). The same one BLAS call either way."""
    if torch.is_autocast_enabled(base.device.type):
        return torch.addmm(base, left, right, alpha=scale)
    return base.addmm_(left, right, alpha=scale)


def _base_backward(
    g: torch.Tensor, weight: torch.Tensor, qtype: str | None, n_in: int, chunk_rows: int | None
) -> torch.Tensor:
    """G·W: whole for a W of G's dtype, else summed over the same row chunks as the forward
    (in float32 at least, so a bf16 backward rounds the sum once, not once per chunk). A
    float32 G's chunks are added by the product itself (``addmm_``: no (M, in) product to
    add afterwards, ~10% of a Q4_0 backward); under autocast or with a narrower G each
    chunk's product is made in G's precision and added in float32."""
    if _whole(weight, qtype, g, chunk_rows):
        return torch.mm(g, weight)
    dx = None if chunk_rows else kernel_backward(g, weight, qtype, n_in)
    if dx is not None:  # W decoded a panel at a time (ops.quantized_matmul)
        return dx
    g = _in_matmul_dtype(g)
    total = torch.promote_types(g.dtype, torch.float32)
    fused = g.dtype == total and not torch.is_autocast_enabled(g.device.type)
    dx = None
    for rows, chunk in row_chunks(weight, qtype, n_in, g.dtype, chunk_rows):
        if dx is None:
            dx = torch.mm(g[:, rows], chunk).to(total)
        elif fused:
            dx.addmm_(g[:, rows], chunk)
        else:
            dx.add_(torch.mm(g[:, rows], chunk))
    return dx


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
        qtype: str | None,
        chunk_rows: int | None,
    ) -> torch.Tensor:
        _check_shapes(x, weight, qtype, lora_a, lora_b)
        shared = adapter_input is None
        rows = x.reshape(-1, x.shape[-1])
        adapter_rows = rows if shared else adapter_input.reshape(rows.shape)
        u = torch.mm(adapter_rows, lora_a.t())
        base = base_forward(rows, weight, qtype, x.shape[-1], chunk_rows)
        y = _add_low_rank(base, u, lora_b.t(), scale)
        # x itself only for a trainable W's gradient: a frozen base needs just x' (which is
        # x unless dropout made a new tensor) and U.
        kept_rows = rows if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(kept_rows, adapter_rows, weight, lora_a, lora_b, u)
        ctx.scale, ctx.shared, ctx.x_shape, ctx.x_dtype = scale, shared, x.shape, x.dtype
        ctx.qtype, ctx.chunk_rows = qtype, chunk_rows
        ctx.autocast = autocast_dtype(x.device.type)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, adapter_rows, weight, lora_a, lora_b, u = ctx.saved_tensors
        need_x, need_w, need_a, need_b, _, need_adapter_input, _, _ = ctx.needs_input_grad
        g = grad.reshape(-1, weight.shape[0])
        dx = dw = da = db = d_adapter_input = None
        with autocast_like(adapter_rows.device.type, ctx.autocast):
            gb = torch.mm(g, lora_b).mul_(ctx.scale)  # s·G·B, the gradient at U
            if need_b:
                db = torch.mm(g.t(), u).mul_(ctx.scale).to(lora_b.dtype)
            if need_a:
                da = torch.mm(gb.t(), adapter_rows).to(lora_a.dtype)
            if need_x:
                dx = _base_backward(g, weight, ctx.qtype, lora_a.shape[1], ctx.chunk_rows)
                if ctx.shared:
                    dx = _add_low_rank(dx, gb, lora_a)
                dx = dx.reshape(ctx.x_shape).to(ctx.x_dtype)
            if need_adapter_input:
                d_adapter_input = torch.mm(gb, lora_a).reshape(ctx.x_shape).to(ctx.x_dtype)
            if need_w:
                dw = torch.mm(g.t(), rows).to(weight.dtype)
        return dx, dw, da, db, None, d_adapter_input, None, None


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    adapter_input: torch.Tensor | None = None,
    *,
    qtype: str | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``x·Wᵀ + scale·((x'·Aᵀ)·Bᵀ)`` for ``x`` (..., in), W (out, in), A (r, in), B (out, r).

    ``adapter_input`` is x' (x after dropout, same shape as x); None means x itself. W is
    floats, or with ``qtype`` (a ggml type name, ``ops.DEQUANTIZABLE``) its uint8 blocks
    (out, row_bytes). ``chunk_rows`` forces W's rows to be widened that many at a time
    (tests); None means whole for a W of x's dtype, :data:`CHUNK_BYTES` chunks otherwise.
    The backward is the one written out in the module docstring: no (out, in) float matrix
    beyond a float W.
    """
    return _LoraLinear.apply(x, weight, lora_a, lora_b, scale, adapter_input, qtype, chunk_rows)


def torch_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    adapter_input: torch.Tensor | None = None,
    *,
    qtype: str | None = None,
) -> torch.Tensor:
    """:func:`lora_linear` composed of ``F.linear`` calls (PEFT's formula), for the torch op
    set: autograd derives its backward. A base of another storage is widened whole to x's
    dtype first."""
    adapter_rows = x if adapter_input is None else adapter_input
    base = dense_weight(weight, qtype, lora_a.shape[1], x.dtype)
    return F.linear(x, base) + scale * F.linear(F.linear(adapter_rows, lora_a), lora_b)
