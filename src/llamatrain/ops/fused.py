"""The lm head and the cross-entropy loss fused into one pass over row chunks.

Why: with a 32000-token vocabulary and a small model, the (tokens × vocab) logits are by far
the largest tensor of a training step (2048 tokens × 32000 × 4 bytes = 262 MB, against
0.5 MB for the hidden states at dim 64), and writing them, reading them for the softmax and
again for its backward dominates the step. The loss needs only one number per row, so the
logits never have to exist all at once.

``linear_cross_entropy(h, W, targets)`` equals ``cross_entropy(mul_mat(h, W), targets)``
(the lm-head ``mul_mat`` followed by ggml's ``cross_entropy_loss`` with one-hot targets). It
walks over chunks of ``chunk_rows`` rows and, per chunk, does the forward *and* the backward
of both ops at once, while that chunk's logits are still in cache:

    Z_c  = H_c·Wᵀ                                   (mul_mat forward)
    loss += Σ_rows [lse(Z_c) − Z_c[target]]          (cross_entropy_loss forward)
    dZ_c = (softmax(Z_c) − onehot_c) / n_valid       (cross_entropy_loss_back, grad = 1)
    dH_c = dZ_c·W                                    (mul_mat backward: dX = G·W)
    dW  += dZ_cᵀ·H_c                                 (mul_mat backward: dW = out_prod(X, G))

Autograd then saves only dH (tokens × dim) and dW (vocab × dim, the size the weight's
gradient has anyway) instead of the logits; ``backward`` just scales both by the incoming
gradient, which is exact because both are linear in it. Peak memory of the loss is one
chunk of logits. The cost: the gradient work is done even if backward is never called, so
the function computes it only when grad mode is on and an input requires grad. Double
backward is not supported (the backward is ``once_differentiable``).

With ``softcap`` (Gemma's ``final_logit_softcapping``) the chunk's logits are capped,
``Z' = cap·tanh(Z/cap)`` (``ops.softcap``), before the loss, and the chunk's gradient is taken
through the cap as ``dZ = dZ'·(1 − t²)``, ``t = tanh(Z/cap)``: one more chunk-sized buffer.

Scores are computed in base 2 (h is pre-scaled by log2(e), ``exp2`` replaces ``exp``): the
softmax is identical, and on CPU ``torch.exp`` takes a slow path for inputs that underflow
while ``exp2`` does not (the same trick as ``ops/attention.py``).

Precision: float32 for float32 / float16 / bfloat16 inputs (autocast is switched off inside,
so a bf16 ``h`` under autocast is computed in float32), float64 for float64. The loss is
returned in that computation dtype; dH and dW are cast back to the inputs' dtypes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from llamatrain.ops.dtypes import compute_dtype

__all__ = [
    "CHUNK_BYTES",
    "ChunkSoftmax",
    "chunk_gradients",
    "chunk_softmax",
    "default_chunk_rows",
    "head_arguments",
    "linear_cross_entropy",
    "scored_rows",
]

# Bytes of float32 logits per chunk: 16 MiB = 131 rows at vocab 32000, a sixteenth of the
# unfused logits of 2048 tokens, and about half a server CPU's L3 cache.
CHUNK_BYTES = 16 << 20

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def default_chunk_rows(vocab: int, dim: int, element_size: int = 4) -> int:
    """Rows per chunk: about ``CHUNK_BYTES`` of logits, and at least ``dim`` rows.

    Every chunk's ``dW += dZᵀ·H`` reads and writes all of dW (vocab × dim), as much memory
    traffic as ``dim`` rows of logits; with chunks of at least ``dim`` rows that overhead
    stays below the chunk's own logits traffic. Larger chunks gain nothing measurable
    (the timings per chunk size are in bench/README.md).
    """
    return max(1, CHUNK_BYTES // (vocab * element_size), dim)


class ChunkSoftmax(NamedTuple):
    """One chunk of rows' softmax over the vocabulary, in base 2 (:func:`chunk_softmax`)."""

    p: torch.Tensor
    """(rows, vocab) the unnormalised softmax 2^(Z2 − max Z2), in the logits' buffer."""
    denom: torch.Tensor
    """(rows, 1) Σ p."""
    lse2: torch.Tensor
    """(rows,) log2 Σ 2^Z2."""
    picked: torch.Tensor
    """(rows,) Z2 of each row's target."""
    t: torch.Tensor | None
    """(rows, vocab) tanh(Z/cap) with a soft cap, for its gradient; else None."""


def chunk_softmax(
    hc: torch.Tensor,
    w: torch.Tensor,
    safe: torch.Tensor,
    z_buffer: torch.Tensor,
    t_buffer: torch.Tensor | None,
    cap2: float | None,
) -> ChunkSoftmax:
    """The softmax of the logits of rows ``hc`` (pre-scaled by log2(e)) under ``w``,
    soft-capped at ``cap2`` (the cap in base 2) when given, in the first rows of the
    reusable ``z_buffer`` (and ``t_buffer`` for the cap); ``safe`` (rows, 1) the targets
    whose scores to pick (any valid id where a row is ignored). Shared by every loss that
    walks the lm head a chunk of rows at a time."""
    n = hc.shape[0]
    # mul_mat forward: this chunk's logits (base 2)
    z = torch.mm(hc, w.t(), out=z_buffer[:n])
    t = None
    if t_buffer is not None:  # softcap forward: Z' = cap·tanh(Z/cap)
        t = torch.div(z, cap2, out=t_buffer[:n]).tanh_()
        z = torch.mul(t, cap2, out=z)
    picked = z.gather(-1, safe).squeeze(-1)
    m = z.amax(dim=-1, keepdim=True)
    p = z.sub_(m).exp2_()  # unnormalised softmax, in the logits' buffer
    denom = p.sum(dim=-1, keepdim=True)
    lse2 = denom.log2().add_(m).squeeze(-1)
    return ChunkSoftmax(p, denom, lse2, picked, t)


def chunk_gradients(
    chunk: ChunkSoftmax,
    safe: torch.Tensor,
    scale: torch.Tensor,
    w: torch.Tensor,
    hc: torch.Tensor,
    dh: torch.Tensor | None,
    dw: torch.Tensor | None,
    accumulate: bool,
) -> None:
    """The lm head's gradients for logit gradients ``dZ = scale·(softmax − onehot)``
    (``scale`` (rows, 1), per row), taken through the cap: ``dH = dZ·W`` written to ``dh``,
    ``dZᵀ·hc`` written to (``accumulate``: added to) ``dw`` — in base 2, so the caller
    multiplies dW by ln 2 at the end. Consumes ``chunk``'s buffers."""
    # cross_entropy_loss_back with one-hot targets: dZ = scale·(softmax(Z) − onehot).
    dz = chunk.p.mul_(scale / chunk.denom)
    dz.scatter_add_(-1, safe, -scale)
    if chunk.t is not None:  # softcap backward: dZ = dZ'·(1 − t²)
        dz.mul_(chunk.t.mul_(chunk.t).neg_().add_(1.0))
    # mul_mat backward (ggml): dX = G·W, dW = out_prod(X, G) = Gᵀ·X. hc carries the
    # log2(e) factor, removed from dW by the caller.
    if dh is not None:
        torch.mm(dz, w, out=dh)
    if dw is not None:
        dw.addmm_(dz.t(), hc, beta=1.0 if accumulate else 0.0)


def head_arguments(
    op: str,
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_rows: int | None,
    softcap: float | None,
) -> tuple[int, float | None]:
    """Check the arguments of a chunked lm-head op ``op``; its chunk rows (default
    :func:`default_chunk_rows`) and soft cap, as the Function takes them."""
    if weight.dim() != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{op}: need h (..., dim) and weight (vocab, dim), got "
            f"{tuple(h.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != h.shape[:-1]:
        raise ValueError(
            f"{op}: targets shape {tuple(targets.shape)} must equal h shape "
            f"without the feature dim {tuple(h.shape[:-1])}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"{op}: targets must be an integer tensor, got {targets.dtype}")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(weight.shape[0], weight.shape[1])
    if chunk_rows < 1:
        raise ValueError(f"{op}: chunk_rows must be positive, got {chunk_rows}")
    if softcap is None:
        return int(chunk_rows), None
    softcap = float(softcap)
    if not (0.0 < softcap < math.inf):
        raise ValueError(f"{op}: softcap must be positive, finite; got {softcap}")
    return int(chunk_rows), softcap


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        chunk_rows: int,
        with_grad: bool,
        softcap: float | None = None,
    ) -> torch.Tensor:
        with torch.autocast(h.device.type, enabled=False):
            return _LinearCrossEntropy._forward(
                ctx, h, weight, targets, ignore_index, chunk_rows, with_grad, softcap
            )

    @staticmethod
    def _forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        chunk_rows: int,
        with_grad: bool,
        softcap: float | None = None,
    ) -> torch.Tensor:
        cdt = compute_dtype(h.dtype, weight.dtype)
        dim = h.shape[-1]
        flat, tgt = h.reshape(-1, dim), targets.reshape(-1).long()  # int64: gather/scatter
        scored = scored_rows(tgt, ignore_index)
        if scored is not None:
            flat, tgt = flat[scored], tgt[scored]
        # Base-2 scores: Z2 = (log2(e)·H)·Wᵀ = log2(e)·Z, so softmax(Z) = 2^(Z2 − lse2).
        h2 = flat.to(cdt) * _LOG2E
        w = weight.to(cdt)
        rows = h2.shape[0]
        valid = tgt != ignore_index  # all of them, unless compiling
        safe = torch.where(valid, tgt, 0).unsqueeze(-1)
        # Mean over non-ignored rows; with none left the loss is 0 (not 0/0).
        n_valid = valid.sum().clamp_(min=1).to(cdt)
        # Per-row gradient factor of cross_entropy_loss_back (grad = 1): 1/n on valid rows,
        # 0 on ignored ones.
        row_scale = valid.to(cdt) / n_valid

        need_h = with_grad and ctx.needs_input_grad[0]
        need_w = with_grad and ctx.needs_input_grad[1]
        dh = torch.empty(rows, dim, dtype=cdt, device=h.device) if need_h else None
        # dW is written by the first chunk's matmul (beta = 0) and accumulated after that.
        dw = (torch.empty_like(w) if rows else torch.zeros_like(w)) if need_w else None
        loss2 = torch.zeros((), dtype=cdt, device=h.device)  # Σ (lse2 − Z2[target]) over rows
        # One logits buffer serves every chunk: no allocator round trip per chunk.
        z_buffer = torch.empty(min(chunk_rows, rows), w.shape[0], dtype=cdt, device=h.device)
        # Soft-capping keeps t = tanh(Z/cap) per chunk for the gradient; in base 2 the cap is
        # cap·log2(e): Z2' = cap2·tanh(Z2/cap2).
        cap2 = None if softcap is None else softcap * _LOG2E
        t_buffer = None if cap2 is None else torch.empty_like(z_buffer)

        for r0 in range(0, rows, chunk_rows):
            r1 = min(r0 + chunk_rows, rows)
            hc = h2[r0:r1]
            chunk = chunk_softmax(hc, w, safe[r0:r1], z_buffer, t_buffer, cap2)
            loss2 += torch.where(valid[r0:r1], chunk.lse2 - chunk.picked, 0.0).sum()
            if dh is None and dw is None:
                continue
            # cross_entropy_loss_back with grad = 1: dZ = (softmax(Z) − onehot) / n_valid on
            # valid rows, 0 on ignored rows.
            scale = row_scale[r0:r1].unsqueeze(-1)
            dh_rows = None if dh is None else dh[r0:r1]
            chunk_gradients(chunk, safe[r0:r1], scale, w, hc, dh_rows, dw, accumulate=r0 > 0)

        if dw is not None:
            dw.mul_(_LN2)
        if dh is not None and scored is not None:  # an ignored row's gradient is zero
            dh = dh.new_zeros(targets.numel(), dim).index_copy_(0, scored, dh)
        ctx.save_for_backward(dh, dw)
        ctx.h_meta = (h.shape, h.dtype)
        ctx.w_dtype = weight.dtype
        # Base-2 loss back to nats: ln Σ e^Z − Z_t = ln2·(lse2 − Z2_t).
        return loss2.mul_(_LN2).div_(n_valid)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Both stored gradients are linear in the incoming gradient: scale them.
        dh, dw = ctx.saved_tensors
        h_shape, h_dtype = ctx.h_meta
        d_h = d_w = None
        if ctx.needs_input_grad[0]:
            if dh is None:
                raise RuntimeError(
                    "linear_cross_entropy: the forward ran without grad mode, so no gradient "
                    "was computed"
                )
            d_h = _times_upstream(dh, grad).reshape(h_shape).to(h_dtype)
        if ctx.needs_input_grad[1]:
            if dw is None:
                raise RuntimeError(
                    "linear_cross_entropy: the forward ran without grad mode, so no gradient "
                    "was computed"
                )
            d_w = _times_upstream(dw, grad).to(ctx.w_dtype)
        return d_h, d_w, None, None, None, None, None


def scored_rows(targets: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """The indices of the rows (of flat ``targets``) whose target is scored, or None when all
    are. Only those rows need the head: an ignored row adds nothing to the loss and gets a
    zero gradient, and chat SFT ignores every prompt token (often half the rows; with Qwen's
    152k vocabulary the head is a quarter of a 0.5B model's FLOPs). Under torch.compile
    every row goes through (their count would be data-dependent, a shape the trace cannot
    fix)."""
    if torch.compiler.is_compiling():
        return None
    valid = targets != ignore_index
    return None if bool(valid.all()) else valid.nonzero().squeeze(1)


def _times_upstream(stored: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A stored gradient times the upstream one, out of place while the graph is retained,
    so a second backward sees the stored values unchanged. Otherwise an upstream gradient of
    exactly 1 (``loss.backward()`` on this loss alone, the usual step) returns the stored
    tensor itself, which autograd adopts as ``.grad``, where a product would allocate and
    write the whole (vocab, dim) table again (113 MB a step for SmolLM2). The graph task's
    ``keep_graph`` flag is private API; torch.compile's AOTAutograd reads it to the same end
    (freeing saved tensors early). A traced backward (torch.compile) takes the product: the
    flag is no tensor op, and the compiler schedules the buffers itself."""
    hand_over = (
        not torch.compiler.is_compiling()
        and not torch._C._autograd._get_current_graph_task_keep_graph()
        and grad.numel() == 1
        and bool(grad == 1)
    )
    return stored if hand_over else stored * grad.to(stored.dtype)


def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight.T`` against integer ``targets``, chunk by chunk.

    Args:
        h: hidden states (..., dim), e.g. the final-normed (batch, seq, dim).
        weight: lm head (vocab, dim) - ``output.weight`` or the tied token embedding.
        targets: integer class ids shaped like ``h`` without its last dim; rows whose target
            is ``ignore_index`` are left out of the mean and get zero gradient. If every row
            is ignored the loss is 0 and the gradients are zero.
        chunk_rows: rows of logits computed at once (default: ``default_chunk_rows``,
            about ``CHUNK_BYTES`` of float32 logits). Only memory and speed depend on it,
            never the result beyond rounding.
        softcap: cap the logits first, ``cap·tanh(logits/cap)`` (``ops.softcap``), as
            Gemma's ``final_logit_softcapping``; ``None`` for none.

    Returns:
        The scalar mean loss (float32, or float64 for float64 inputs), equal to
        ``F.cross_entropy(F.linear(h, weight), targets, ignore_index=ignore_index)`` to
        float32 rounding, with ggml's gradients (``cross_entropy_loss_back`` through the
        ``mul_mat`` backward).
    """
    chunk_rows, softcap = head_arguments(
        "linear_cross_entropy", h, weight, targets, chunk_rows, softcap
    )
    with_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if softcap is None:
        return _LinearCrossEntropy.apply(
            h, weight, targets, int(ignore_index), chunk_rows, with_grad
        )
    return _LinearCrossEntropy.apply(
        h, weight, targets, int(ignore_index), chunk_rows, with_grad, softcap
    )
