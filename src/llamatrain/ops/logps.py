"""Each target's log-probability under the lm head, a chunk of rows at a time.

Why: a preference objective (``llamatrain.objectives.preference``) needs every scored token's
``log π(y_t) = Z[y_t] − logsumexp(Z)``, ``Z = softcap(h·Wᵀ)``. Taken from the model's full
logits that is a (tokens × vocab) tensor — 8 rows × 256 × 32000 float32 = 262 MB, and as much
again for its softmax and its gradient — where SFT's loss never holds one
(``ops.fused.linear_cross_entropy``). ``linear_logps(h, W, targets)`` walks the same row chunks
with the same pieces (``chunk_softmax``, ``chunk_gradients``), but returns one number per row
rather than their mean: the caller weighs each token (DPO by its pair's sigmoid), so the
gradient a row's logits get is not known in the forward.

With ``g_r`` the incoming gradient of row r's log-prob:

    dZ_r = g_r·(onehot_r − softmax(Z_r))     (times 1 − t², t = tanh(Z/cap), under a cap)
    dH_r = dZ_r·W = g_r·a_r,   a_r = (onehot_r − softmax(Z_r))·W
    dW   = Σ_r dZ_rᵀ·H_r

dH is linear in each row's own ``g_r``, so the forward computes ``a`` (tokens × dim) while each
chunk's softmax is at hand and the backward scales its rows, as ``linear_cross_entropy`` keeps
its gradients. dW mixes the rows' ``g``: the backward recomputes each chunk's logits and
softmax and accumulates it — and only when the head trains (a LoRA run's head is frozen). A
LoRA step so costs two head products (Z, a), a full finetune's four (and Z again, dW), against
three for autograd of the full logits, and one chunk of logits in memory instead of all.
Without grad mode (a reference forward) only Z is computed. Double backward is not supported.

``linear_logps_and_entropy`` also gives each scored row's entropy of softmax(Z), in nats, what
GRPO logs (TRL's ``entropy`` metric) — from the chunk's softmax the log-probs already computed,
so still no B×T×V logits: with ``p = 2^(Z2 − max)`` (the chunk's unnormalised softmax) and
``D = Σ p``, ``H = −Σ (p/D)·ln(p/D) = ln D + Σ entr(p) / D``, ``entr(p) = −p·ln p`` (one more
chunk-sized buffer). It is for watching, not training: it carries no gradient.

Only the rows whose target is scored are computed: a preference row is mostly prompt and
padding, whose log-probs nobody reads (``mid`` in bench/preference.py scores 1152 of its
2048 positions). Picking them (``nonzero``) syncs with the device on CUDA.

Precision as ``linear_cross_entropy``'s: float32 for float32 / float16 / bfloat16 inputs
(autocast switched off inside), float64 for float64; the log-probs come back in that dtype,
dH and dW in the inputs' dtypes. Scores are in base 2 (``ops.fused``'s module docstring).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from llamatrain.ops.dtypes import compute_dtype
from llamatrain.ops.fused import ChunkSoftmax, chunk_gradients, chunk_softmax, head_arguments

__all__ = ["linear_logps", "linear_logps_and_entropy", "to_all_rows"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@dataclass
class _Head:
    """The head's inputs as its chunks read them, in the computation dtype: the scored rows
    (``rows``, their indices among all) pre-scaled by log2(e), the weight, their targets and
    the cap in base 2. Only scored rows: an ignored target's row (a prompt's, padding) has no
    log-prob to compute, and a preference row is mostly such rows."""

    h2: torch.Tensor
    w: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor
    cap2: float | None
    chunk_rows: int

    @classmethod
    def of(
        cls,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        softcap: float | None,
        chunk_rows: int,
    ) -> _Head:
        cdt = compute_dtype(h.dtype, weight.dtype)
        flat = targets.reshape(-1)
        rows = (flat != ignore_index).nonzero().squeeze(-1)
        h2 = h.reshape(-1, h.shape[-1])[rows].to(cdt) * _LOG2E
        picked = flat[rows].long().unsqueeze(-1)  # gather/scatter need int64 indices
        cap2 = None if softcap is None else softcap * _LOG2E
        return cls(h2, weight.to(cdt), rows, picked, cap2, chunk_rows)

    def chunks(self) -> Iterator[tuple[slice, ChunkSoftmax]]:
        """Each chunk's scored rows and softmax, computed in one reused buffer (two with a
        cap)."""
        n = self.h2.shape[0]
        z_buffer = self.h2.new_empty(min(self.chunk_rows, n), self.w.shape[0])
        t_buffer = None if self.cap2 is None else torch.empty_like(z_buffer)
        for r0 in range(0, n, self.chunk_rows):
            s = slice(r0, min(r0 + self.chunk_rows, n))
            z = chunk_softmax(self.h2[s], self.w, self.targets[s], z_buffer, t_buffer, self.cap2)
            yield s, z


class _LinearLogps(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        chunk_rows: int,
        softcap: float | None,
        with_grad: bool,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.autocast(h.device.type, enabled=False):
            head = _Head.of(h, weight, targets, ignore_index, softcap, chunk_rows)
            scored = head.h2.new_empty(head.h2.shape[0])
            entropy = torch.empty_like(scored) if with_entropy else None
            # a = (onehot − softmax)·W per scored row: dlogp/dH for an incoming gradient of 1
            along = torch.empty_like(head.h2) if with_grad and ctx.needs_input_grad[0] else None
            minus_one = head.h2.new_full((min(chunk_rows, head.h2.shape[0]), 1), -1.0)
            for s, chunk in head.chunks():
                scored[s] = (chunk.picked - chunk.lse2) * _LN2  # base 2 back to nats
                if entropy is not None:  # before chunk_gradients consumes the softmax
                    entropy[s] = _chunk_entropy(chunk)
                if along is not None:  # dZ = −(softmax − onehot)
                    scale = minus_one[: s.stop - s.start]
                    rows = head.h2[s]
                    chunk_gradients(
                        chunk, head.targets[s], scale, head.w, rows, along[s], None, False
                    )
            logps, entropies = (to_all_rows(x, head.rows, targets) for x in (scored, entropy))
        need_w = with_grad and ctx.needs_input_grad[1]
        ctx.save_for_backward(along, head.rows, *((h, weight, targets) if need_w else (None,) * 3))
        ctx.options = (ignore_index, chunk_rows, softcap, h.shape, h.dtype)
        if entropies is not None:  # a metric: no gradient flows back from it
            ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad: torch.Tensor, _entropy_grad: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        along, rows, h, weight, targets = ctx.saved_tensors
        ignore_index, chunk_rows, softcap, h_shape, h_dtype = ctx.options
        d_h = d_w = None
        if ctx.needs_input_grad[0]:
            if along is None:
                raise RuntimeError(_NO_GRADIENT)
            g = grad.reshape(-1)[rows].to(along.dtype).unsqueeze(-1)
            d_h = along.new_zeros(math.prod(h_shape[:-1]), h_shape[-1])
            d_h = d_h.index_copy_(0, rows, along * g).reshape(h_shape).to(h_dtype)
        if ctx.needs_input_grad[1]:
            if weight is None:
                raise RuntimeError(_NO_GRADIENT)
            with torch.autocast(grad.device.type, enabled=False):
                head = _Head.of(h, weight, targets, ignore_index, softcap, chunk_rows)
                d_w = _weight_gradient(head, grad.reshape(-1)[rows]).to(weight.dtype)
        return d_h, d_w, None, None, None, None, None, None


def _chunk_entropy(chunk: ChunkSoftmax) -> torch.Tensor:
    """(rows,) each row's entropy of its softmax, in nats: ``ln D + Σ entr(p) / D`` over the
    chunk's unnormalised softmax ``p`` (``D = Σ p``), which is left as it was."""
    spread = torch.special.entr(chunk.p).sum(-1, keepdim=True)
    return spread.div_(chunk.denom).add_(chunk.denom.log()).squeeze(-1)


def to_all_rows(
    values: torch.Tensor | None, rows: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor | None:
    """The scored rows' ``values`` (``rows`` their indices) put back among all rows, 0 where a
    target is ignored, ``targets``-shaped; None stays None. (``ops.table_head``'s too.)"""
    if values is None:
        return None
    return values.new_zeros(targets.numel()).index_copy_(0, rows, values).reshape(targets.shape)


_NO_GRADIENT = "linear_logps: the forward ran without grad mode, so no gradient can be computed"


def _weight_gradient(head: _Head, grad: torch.Tensor) -> torch.Tensor:
    """dW = Σ_r g_r·(onehot_r − softmax(Z_r))ᵀ·H_r over the scored rows (``grad`` theirs),
    each chunk's softmax recomputed."""
    scale = grad.to(head.w.dtype).neg().unsqueeze(-1)
    dw = torch.zeros_like(head.w) if head.h2.shape[0] == 0 else torch.empty_like(head.w)
    for s, chunk in head.chunks():
        chunk_gradients(chunk, head.targets[s], scale[s], head.w, head.h2[s], None, dw, s.start > 0)
    return dw.mul_(_LN2)  # the rows carried log2(e)


def linear_logps(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Log-probability of each target under the logits ``h @ weight.T``, chunk by chunk.

    Args:
        h: hidden states (..., dim), e.g. the final-normed (batch, seq, dim).
        weight: lm head (vocab, dim) - ``output.weight`` or the tied token embedding.
        targets: integer ids shaped like ``h`` without its last dim; a row whose target is
            ``ignore_index`` gives 0 and no gradient.
        chunk_rows: rows of logits computed at once (default: ``default_chunk_rows``).
            Only memory and speed depend on it, never the result beyond rounding.
        softcap: cap the logits first, ``cap·tanh(logits/cap)``, as Gemma's
            ``final_logit_softcapping``; ``None`` for none.

    Returns:
        ``targets``-shaped log-probs (float32, or float64 for float64 inputs), equal to
        ``log_softmax(F.linear(h, weight)).gather(targets)`` to float32 rounding.
    """
    return _apply(h, weight, targets, ignore_index, chunk_rows, softcap, False)[0]


def linear_logps_and_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear_logps` (arguments as there), and each scored row's entropy (nats) of
    ``softmax(F.linear(h, weight))`` (soft-capped first), from the same chunks: ``targets``-
    shaped, 0 where a target is ignored, detached (a metric, no gradient)."""
    return _apply(h, weight, targets, ignore_index, chunk_rows, softcap, True)


def _apply(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    chunk_rows: int | None,
    softcap: float | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Function on checked arguments: (log-probs, entropies or None)."""
    chunk_rows, softcap = head_arguments("linear_logps", h, weight, targets, chunk_rows, softcap)
    with_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _LinearLogps.apply(
        h, weight, targets, int(ignore_index), chunk_rows, softcap, with_grad, with_entropy
    )
