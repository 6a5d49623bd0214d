"""The lm head over a frozen table kept as its file stores it, a chunk of vocabulary rows at a time.

Why: a QLoRA run keeps its adapted projections as the GGUF's blocks (``ops.lora``), and its
vocabulary tables are as large: Llama-3.2-1B's 128k × 2048 token table is 1 GB as float32,
where its whole Q4_0 file is 0.65 GB. Kept as stored (``qtype`` blocks, or a narrower float),
the head decodes a chunk of the table's rows (vocabulary entries), uses it and drops it. The
dense heads (``ops.fused``, ``ops.logps``) walk chunks of hidden rows over the whole float
table instead; over blocks that would decode the table once per row chunk.

``table_logps(h, table, targets)`` is each scored row's ``log softmax(Z)[target]``,
``Z = h·Wᵀ`` (soft-capped, ``cap·tanh(Z/cap)``, with ``softcap``), in one autograd Function:

    per chunk W_c: Z_c = h·W_cᵀ; the running log-sum-exp (an online max and sum, as flash
    attention keeps its softmax), each row's target logit (logp = Z_t − lse) and, with grad,
    a = (onehot − softmax(Z))·W (times 1 − t², t = tanh(Z/cap), under a cap) kept relative to
    the running maximum and rescaled when it grows (``_one_pass``), so dlogp_r/dh_r = a_r

and the backward scales ``a``'s rows by their incoming gradients (as ``ops.logps``). The table
is frozen: no dW (blocks cannot take a gradient step). One pass: each chunk is decoded once a
step, and a step costs two products with the table (Z, a), as the dense fused head's. (A first
version took two passes, the second for a once the log-sum-exp was known: decoding the table
twice made the head of a 128k × 2048 Q4_0 table ~5x the float32 head's time.)

``table_logps_and_entropy`` also gives each scored row's entropy of softmax(Z), in nats (GRPO's
``entropy`` metric; no gradient), from the same pass: beside the running sum of
``w = 2^(Z − max)`` it keeps ``S = Σ entr(w)`` (``entr(w) = −w·ln w``), which a new maximum
lower by ``d`` (base 2) turns into ``r·(S − d·ln 2·total)``, ``r = 2^−d``, so that at the end
``H = ln total + S / total`` — relative to the maximum throughout, so no large logits cancel.

``table_cross_entropy`` is minus the mean of those log-probs over the scored rows: the fused
loss's value (``ops.fused``; ignored rows skipped), so a QLoRA step and a preference or GRPO
objective's log-probs share one head. ``table_logits`` gives the logits a chunk of the table
at a time (generation, evaluation), through ``ops.lora.base_forward``.

Scores are in base 2, as ``ops.fused``'s (h pre-scaled by log2(e), ``exp2``). Precision:
float32 for float32 / float16 / bfloat16 inputs, float64 for float64, the table decoded to
that dtype. Against the dense head over the decoded table the products are the same; the
log-sum-exp is summed per chunk and combined, another order than one sum over the whole
vocabulary, so values and dH agree to float32 rounding (~1e-7 relative), not bit for bit.

Over the blocks: in float32, over a table of a kernel type (``ops.quantized_matmul``), both
products run over the chunk's stored blocks (a chunk of the table is a range of its rows,
so a view of its bytes) where :func:`~llamatrain.ops.quantized_matmul.kernel_rows` says the
kernels win at the scored rows' count, each product deciding alone: the forward at any
count, so the logits are the same with and without grad (a GRPO ratio's old and new
log-probs); with grad the backward too up to the kernels' backward limit (256 rows in
float32), past that over a decoded chunk. Within it no chunk is decoded, only the targets'
rows. Z_c carries the rows' 8-bit rounding (h·log2(e) quantized per 32 values, as
the base's products over the blocks and llama.cpp's own logits do): the log-probs are the
dense head's of those rounded rows to float32 rounding, and ~3e-3 of the largest log-prob
from the exact head's (tests/unit/test_table_head.py's sizes); dH is the exact product of
the softmax's weights with the stored rows. Why: the head over a
128k × 2048 Q4_0 table was 22% of a Llama-3.2-1B-shape float32 QLoRA step of 64 tokens
(profiled: every chunk decoded, then two float GEMMs); over the blocks it costs 0.60 s
where it cost 0.98 (one thread), the step ~8% less (``bench/README.md``). float64
(gradchecks) and the bf16/f16 products under autocast keep the decoded path.

Under bf16 (or f16) autocast the two products with the table run in that dtype, as autocast
runs a linear lm head: h and the decoded rows rounded to it, float32 accumulation, each
product rounded once; the softmax, its running sums and the returned log-probs stay float32.
Why, where the dense heads (``ops.fused``, ``ops.logps``) keep float32 under autocast: this
head serves QLoRA, whose base is 4-8 bits a weight and whose other products already run in
bf16, and its two float32 products were a fifth of a Llama-3.2-1B-shape 64-token step (128k
vocabulary; 0.3 of 1.9 s, 1.65 s with them in bf16). The cost: the log-probs are those of
bf16-rounded logits (off by up to 2^-9 of the largest logit; tests/unit/test_table_head.py),
the price of a bf16 run that asked for autocast. Double backward is not supported.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from llamatrain.ops.dequantize import row_bytes
from llamatrain.ops.dtypes import autocast_dtype, compute_dtype
from llamatrain.ops.logps import to_all_rows
from llamatrain.ops.lora import base_forward, dense_weight, row_chunks, rows_per_chunk
from llamatrain.ops.quantized_matmul import blocks_matmul, blocks_matmul_t, kernel_rows

__all__ = ["table_cross_entropy", "table_logits", "table_logps", "table_logps_and_entropy"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


@dataclass
class _Scored:
    """The scored rows as every chunk reads them: hidden rows (pre-scaled by log2(e)) in the
    computation dtype, their indices among all rows, their targets, the cap in base 2; and
    the table to decode. Ignored rows (a prompt's, padding) have no log-prob to compute."""

    h2: torch.Tensor
    rows: torch.Tensor
    targets: torch.Tensor
    cap2: float | None
    table: torch.Tensor
    qtype: str | None
    chunk_rows: int
    low: torch.Tensor | None
    """``h2`` in the bf16/f16 the products with the table run in under autocast, else None."""
    over_blocks: tuple[bool, bool | None]
    """Whether Z_c = h·W_cᵀ and the softmax's product with W_c (None: no grad, not computed)
    run over the chunk's blocks as stored (``ops.quantized_matmul``) rather than decoded
    rows: :func:`_over_blocks`."""

    @classmethod
    def of(
        cls,
        h: torch.Tensor,
        table: torch.Tensor,
        qtype: str | None,
        targets: torch.Tensor,
        ignore_index: int,
        softcap: float | None,
        chunk_rows: int | None,
        low: torch.dtype | None,
        with_grad: bool,
    ) -> _Scored:
        flat = targets.reshape(-1)
        rows = (flat != ignore_index).nonzero().squeeze(-1)
        h2 = h.reshape(-1, h.shape[-1])[rows].to(compute_dtype(h.dtype)) * _LOG2E
        cap2 = None if softcap is None else softcap * _LOG2E
        # vocabulary rows a chunk: CHUNK_BYTES of decoded rows and of logits, at most
        step = rows_per_chunk(max(h.shape[-1], h2.shape[0]), chunk_rows)
        h2_low = None if low is None or h2.dtype == torch.float64 else h2.to(low)
        over_blocks = _over_blocks(table, qtype, h2, with_grad) if h2_low is None else (False,) * 2
        return cls(h2, rows, flat[rows].long(), cap2, table, qtype, step, h2_low, over_blocks)

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` in the products' dtype, as ``h2``'s (float32: accumulated in float32 and
        rounded to the low dtype once, under autocast)."""
        return torch.mm(a, b).to(self.h2.dtype)

    def chunks(self) -> Iterator[_Chunk]:
        """Per chunk of the table: its rows as stored and decoded (None where no product
        needs them), each row's local target index and whether the target is in the chunk
        (index clamped into it where not), the scores Z_c (base 2, capped), and tanh(Z/cap)
        under a cap (else None)."""
        if not len(self.rows):
            return
        h2 = self.h2 if self.low is None else self.low
        for cols, w in self._decoded(h2.dtype):
            blocks = self.table[cols]
            local = self.targets - cols.start
            inside = (local >= 0) & (local < blocks.shape[0])
            if self.over_blocks[0]:
                z = blocks_matmul(h2, blocks, self.qtype)
            else:
                z = self.product(h2, w.t())
            t = None
            if self.cap2 is not None:  # softcap forward: Z' = cap·tanh(Z/cap)
                t = z.div_(self.cap2).tanh_()
                z = t * self.cap2
            clamped = local.clamp(0, blocks.shape[0] - 1).unsqueeze(-1)
            yield _Chunk(blocks, w, clamped, inside, z, t)

    def _decoded(self, dtype: torch.dtype) -> Iterator[tuple[slice, torch.Tensor | None]]:
        """The table's chunks of rows, decoded to ``dtype`` where a product needs them, else
        None."""
        dim = self.h2.shape[1]
        if False in self.over_blocks:
            yield from row_chunks(self.table, self.qtype, dim, dtype, self.chunk_rows)
            return
        for start in range(0, self.table.shape[0], self.chunk_rows):
            yield slice(start, start + self.chunk_rows), None

    def target_rows(self, chunk: _Chunk, hit: torch.Tensor) -> torch.Tensor:
        """The chunk's rows that are the ``hit`` rows' targets, decoded as the products see
        them (float32 for the softmax's sums)."""
        picked = chunk.blocks[chunk.local[hit, 0]]
        dtype = (self.h2 if self.low is None else self.low).dtype
        return dense_weight(picked, self.qtype, self.h2.shape[1], dtype).to(self.h2.dtype)

    def spread(self, weights: torch.Tensor, chunk: _Chunk) -> torch.Tensor:
        """The softmax's weights (rows, chunk) times the chunk's rows W_c: over the blocks
        (exact, float32) or the decoded rows."""
        if chunk.w is None or self.over_blocks[1]:
            return blocks_matmul_t(weights, chunk.blocks, self.qtype, self.h2.shape[1])
        return self.product(weights.to(chunk.w.dtype), chunk.w)


def _over_blocks(
    table: torch.Tensor, qtype: str | None, h2: torch.Tensor, with_grad: bool
) -> tuple[bool, bool | None]:
    """(forward, backward) over the blocks, each where ``kernel_rows`` says the kernels win
    at these rows (backward None without grad). The forward is decided alone, as the base's
    products decide theirs: so the logits (and log-probs) are the same with and without
    grad, at any number of rows."""
    rows, dim = h2.shape
    backward = kernel_rows(table, qtype, dim, rows, h2.dtype, "backward") if with_grad else None
    return kernel_rows(table, qtype, dim, rows, h2.dtype), backward


@dataclass
class _Chunk:
    blocks: torch.Tensor
    """(chunk, row bytes or dim) the rows as stored."""
    w: torch.Tensor | None
    """(chunk, dim) the rows decoded, None where no product needs them."""
    local: torch.Tensor
    """(rows, 1) each target's index in the chunk, clamped into it."""
    inside: torch.Tensor
    """(rows,) whether the target is in the chunk."""
    z: torch.Tensor
    """(rows, chunk) the scores, base 2, capped."""
    t: torch.Tensor | None
    """(rows, chunk) tanh(Z/cap) under a cap."""


@dataclass
class _Pass:
    """What one pass over the table gives per scored row: log2 Σ 2^Z, the target's Z (both
    base 2), ``a`` = dlogp/dh (with grad) and the entropy in nats (when asked)."""

    lse2: torch.Tensor
    picked: torch.Tensor
    along: torch.Tensor | None
    entropy: torch.Tensor | None


def _one_pass(scored: _Scored, with_grad: bool, with_entropy: bool) -> _Pass:
    """Each row's log-sum-exp, its target's score, ``a`` and its entropy, in one pass over
    the table (each chunk decoded once).

    The softmax needs the final log-sum-exp, which a single pass knows only at its end; as
    flash attention does, the pass keeps its sums relative to the running maximum and rescales
    them (``total``, ``spread`` = Σ 2^(Z − max)·(1 − t²)·W, and for the entropy ``mixed`` =
    Σ entr(2^(Z − max))) whenever the maximum grows, so Σ softmax·(1 − t²)·W = spread / total
    at the end. The one-hot part needs no softmax: the target's own row (times its 1 − t²),
    gathered from its chunk.
    """
    n, dim = scored.h2.shape
    high = scored.h2.new_full((n,), -math.inf)
    total, picked = scored.h2.new_zeros(n), scored.h2.new_zeros(n)
    mixed = scored.h2.new_zeros(n) if with_entropy else None
    spread = scored.h2.new_zeros(n, dim) if with_grad else None
    own = scored.h2.new_zeros(n, dim) if with_grad else None
    for chunk in scored.chunks():
        picked = torch.where(chunk.inside, chunk.z.gather(1, chunk.local).squeeze(1), picked)
        top = torch.maximum(high, chunk.z.amax(dim=1))
        rescale = torch.exp2(high - top)
        weights = chunk.z.sub_(top.unsqueeze(1)).exp2_()  # 2^(Z − max), in place of Z
        if mixed is not None:  # Σ entr(w·r) = r·(Σ entr(w) − ln r·Σ w)
            lowered = (high - top).nan_to_num(neginf=0.0).mul_(_LN2)  # ln r; 1st chunk: total 0
            mixed.sub_(lowered * total).mul_(rescale)
            mixed.add_(torch.special.entr(weights).sum(1))
        total.mul_(rescale).add_(weights.sum(1))
        high = top
        if spread is not None and own is not None:
            hit = chunk.inside.nonzero().squeeze(1)  # rows whose target is in this chunk
            target_rows = scored.target_rows(chunk, hit)
            if chunk.t is not None:  # softcap backward: dZ = dZ'·(1 − t²)
                slope = chunk.t.square_().neg_().add_(1.0)
                weights.mul_(slope)
                target_rows.mul_(slope[hit].gather(1, chunk.local[hit]))
            spread.mul_(rescale.unsqueeze(1))
            spread.add_(scored.spread(weights, chunk))
            own.index_copy_(0, hit, target_rows)
    entropy = None if mixed is None else mixed.div_(total).add_(total.log())
    lse2 = total.log2().add_(high)
    if spread is None or own is None:
        return _Pass(lse2, picked, None, entropy)
    return _Pass(lse2, picked, own.sub_(spread.div_(total.unsqueeze(1))), entropy)


class _TableLogps(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        table: torch.Tensor,
        qtype: str | None,
        targets: torch.Tensor,
        ignore_index: int,
        chunk_rows: int | None,
        softcap: float | None,
        with_grad: bool,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        low = autocast_dtype(h.device.type)
        with torch.autocast(h.device.type, enabled=False):
            scored = _Scored.of(
                h, table, qtype, targets, ignore_index, softcap, chunk_rows, low, with_grad
            )
            done = _one_pass(scored, with_grad, with_entropy)
            logps = done.picked.sub_(done.lse2).mul_(_LN2)  # base 2 to nats
            logps, entropies = (to_all_rows(x, scored.rows, targets) for x in (logps, done.entropy))
        ctx.save_for_backward(done.along, scored.rows)
        ctx.h_meta = (h.shape, h.dtype)
        if entropies is not None:  # a metric: no gradient flows back from it
            ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad: torch.Tensor, _entropy_grad: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        # dH_r = g_r·a_r: a is the row's dlogp/dh for an incoming gradient of 1.
        along, rows = ctx.saved_tensors
        h_shape, h_dtype = ctx.h_meta
        if not ctx.needs_input_grad[0]:  # a float table that requires grad: frozen here
            return (None,) * 9
        if along is None:
            raise RuntimeError(
                "table_logps: the forward ran without grad mode, so no gradient was computed"
            )
        g = grad.reshape(-1)[rows].to(along.dtype).unsqueeze(-1)
        d_h = along.new_zeros(math.prod(h_shape[:-1]), h_shape[-1]).index_copy_(0, rows, along * g)
        return d_h.reshape(h_shape).to(h_dtype), *(None,) * 8


def _check(op: str, h: torch.Tensor, table: torch.Tensor, qtype: str | None) -> None:
    dim = h.shape[-1]
    width = dim if qtype is None else row_bytes(qtype, dim)
    if table.dim() != 2 or table.shape[1] != width:
        stored = "(vocab, dim)" if qtype is None else f"{qtype} blocks (vocab, {width})"
        raise ValueError(
            f"{op}: h (..., {dim}) needs a table of {stored}, got {tuple(table.shape)}"
        )


def table_logps(
    h: torch.Tensor,
    table: torch.Tensor,
    targets: torch.Tensor,
    *,
    qtype: str | None = None,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Log-probability of each target under ``h @ W.T``, W the (vocab, dim) ``table`` decoded a
    chunk of rows at a time: floats, or with ``qtype`` (``ops.DEQUANTIZABLE``) uint8 blocks
    (vocab, row_bytes).

    ``targets``: integer ids shaped like ``h`` without its last dim; a row whose target is
    ``ignore_index`` gives 0 and no gradient. ``chunk_rows``: table rows decoded at a time
    (default: ``ops.lora.CHUNK_BYTES`` of decoded rows and of logits); only memory and speed
    depend on it, never the result beyond rounding. ``softcap``: cap the logits first
    (Gemma's ``final_logit_softcapping``). Returns float32 (float64 for float64 ``h``); the
    gradient reaches ``h`` only.
    """
    return _table_apply(h, table, targets, qtype, ignore_index, chunk_rows, softcap, False)[0]


def table_logps_and_entropy(
    h: torch.Tensor,
    table: torch.Tensor,
    targets: torch.Tensor,
    *,
    qtype: str | None = None,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`table_logps` (arguments as there), and each scored row's entropy (nats) of the
    softmax of ``h @ W.T`` (soft-capped first), from the same pass: ``targets``-shaped, 0 where
    a target is ignored, detached (a metric, no gradient)."""
    return _table_apply(h, table, targets, qtype, ignore_index, chunk_rows, softcap, True)


def _table_apply(
    h: torch.Tensor,
    table: torch.Tensor,
    targets: torch.Tensor,
    qtype: str | None,
    ignore_index: int,
    chunk_rows: int | None,
    softcap: float | None,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Function on checked arguments: (log-probs, entropies or None)."""
    _check("table_logps", h, table, qtype)
    if targets.shape != h.shape[:-1]:
        raise ValueError(
            f"table_logps: targets {tuple(targets.shape)} must be h {tuple(h.shape)} without "
            "its last dim"
        )
    with_grad = torch.is_grad_enabled() and h.requires_grad
    return _TableLogps.apply(
        h, table, qtype, targets, int(ignore_index), chunk_rows, softcap, with_grad, with_entropy
    )


def table_cross_entropy(
    h: torch.Tensor,
    table: torch.Tensor,
    targets: torch.Tensor,
    *,
    qtype: str | None = None,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of ``h @ W.T`` against ``targets`` over the rows not ``ignore_index``
    (0 with none): minus the mean of :func:`table_logps`, arguments as there."""
    logps = table_logps(
        h, table, targets, qtype=qtype, ignore_index=ignore_index, chunk_rows=chunk_rows,
        softcap=softcap,
    )  # fmt: skip
    n_valid = (targets != ignore_index).sum().clamp(min=1)
    return logps.sum().neg() / n_valid


def table_logits(
    h: torch.Tensor, table: torch.Tensor, *, qtype: str | None = None, chunk_rows: int | None = None
) -> torch.Tensor:
    """The logits ``h @ W.T`` (..., vocab), W the ``table`` (as :func:`table_logps` takes it)
    decoded a chunk of rows at a time, in ``h``'s dtype. Differentiable through autograd,
    which then keeps every decoded chunk: for generation and evaluation, under no_grad."""
    _check("table_logits", h, table, qtype)
    rows = h.reshape(-1, h.shape[-1])
    logits = base_forward(rows, table, qtype, h.shape[-1], chunk_rows)
    return logits.reshape(*h.shape[:-1], table.shape[0])
