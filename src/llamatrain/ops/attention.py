"""Memory-efficient (flash) attention with an explicit, recomputing backward.

Why this exists: ggml's 2023 ``flash_attn_back`` trained attention without ever storing the
T×T attention matrix -- the backward recomputed the scores and softmax from Q, K and the
per-row normaliser. Today's ggml has no backward for flash attention at all (llama.cpp turns
it off to train), so this is something we offer that llama.cpp cannot: attention whose saved
state is linear in the sequence length.

The forward walks over blocks of query rows. For each block it computes the score tile
``S = Q_b·Kᵀ·scale`` against only the key/value columns that block can see, takes a softmax,
multiplies by V and keeps the per-row log-sum-exp. Autograd saves only q, k, v, the output and
that log-sum-exp; the backward repeats the per-block walk and rebuilds each tile from them.
Peak extra memory is one score tile of ``B·H·block·seq_kv`` elements, linear in the sequence.

Grouped-query attention never materialises repeated K/V: q is viewed as
``(B, Hkv, G, T, D)`` and the G query heads that share a kv head are flattened into the rows
of one batched matmul, so their K/V gradients are summed by the matmul itself.

Packed documents: with ``documents`` (B, T) ids, non-decreasing along each row, the mask adds
``-inf`` wherever ``doc_i != doc_j`` as well as where ``j > i``:
``S_ij = Q_i·K_jᵀ·scale`` if ``j <= i`` and ``doc_i == doc_j``, else ``-inf``. Each block builds
that mask as one (B, block, kv) bias tile from the ids (never T×T), and its kv columns start at
the first document its rows belong to: earlier documents are invisible to all of them.

Branches (shared prompts): ``branches`` (B, T) ids beside ``documents`` split a document into
a *trunk* (branch 0, first) and branches 1, 2, ... after it, each of which continues the trunk
as if the others were not there: query i sees key j iff same document, ``j <= i``, and key j is
in the trunk or in i's own branch. A preference pair is one document: its prompt but the last
token is the trunk, and the chosen and the rejected reply (each after that last prompt token)
are branches 1 and 2, so the prompt is computed once for both. A token's rope *position* is
the number of keys before it that it sees: its index within the document, less the tokens of
its earlier sibling branches -- exactly its index in the unshared sequence trunk + own branch
(``llamatrain.ops.layout.layout_positions``). The kv columns of a block still start at its
first row's document (the trunk precedes every branch). The model and the op sets carry the
two id tensors as one (B, T, 2) ``documents`` tensor (ids, branch ids;
``llamatrain.ops.layout.document_layout``), so whatever cuts or moves a batch's documents
moves both; plain (B, T) ids are a layout without branches.

Sliding window: with ``window`` = w, query i (at kv position ``i + seq_kv - seq``) sees key j
only if ``i - w < j <= i`` -- itself and the w - 1 keys before it. That is llama.cpp's
``LLAMA_SWA_TYPE_STANDARD`` (``llama_hparams::is_masked_swa``: key p0 is masked for query p1
when ``p1 - p0 >= n_swa``) and HF's ``sliding_window``. A block of rows [i0, i1) then needs only
kv columns [i0 - w + 1, i1): the columns before that are never multiplied, which is where the
speed comes from (each block's tile is ``block + w - 1`` columns wide instead of up to T). The
window composes with documents (a key must be in the window *and* in the same document) and
with GQA, and the backward walks the same trimmed tiles. With documents the window counts rope
positions, ``pos_i - pos_j < w``: within a plain document that is ``i - j < w``, and across a
branch gap it is the distance the unshared sequence has (a rejected reply's token is as far
from a prompt token as it is with no chosen reply in between). A block's first kv column is
then the least over its rows of ``document start + max(0, pos - w + 1)``.

Left padding (a ragged batch decoded together): ``padding`` (B, seq_kv) bools mark the key
columns that hold padding, not tokens. A padding key is hidden from every query but the one at
its own position: a real query never sees one, and a padding query sees only itself, so its
softmax is never empty (an all ``-inf`` row would be NaN, and the NaN would reach the real rows
through the padding's keys and values in the next layer). A real row's output is then its
unpadded one's: the hidden columns add exact zeros to its sums. Each block adds it as one
(B, block, kv) bias tile, on top of whatever else masks the tile.

Soft-capping (Gemma 2's ``attn_logit_softcapping``): ``S = cap·tanh(Q·Kᵀ·scale / cap)`` before
the mask, as ggml's ``flash_attn_ext`` applies ``logit_softcap``. The backward rebuilds
``t = tanh(·)`` per tile and multiplies dS by ``1 − t²``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from llamatrain.ops.attention_inference import fused_attention, takes_fused
from llamatrain.ops.attention_inputs import (
    check_branches,
    check_documents,
    check_inputs,
    check_padding,
)
from llamatrain.ops.dtypes import compute_dtype
from llamatrain.ops.layout import layout_positions

__all__ = ["BLOCK_SIZE", "flash_attn"]

# Query rows per block. A block's score tile holds B·H·BLOCK_SIZE·seq_kv elements, so memory
# is linear in the sequence. Smaller tiles stay in cache and let causal blocks skip more of
# the kv columns they cannot see, until the per-block overhead shows; 64 was the fastest on
# CPU across the shapes bench/ops.py covers.
BLOCK_SIZE = 64

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)

_bias_cache: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _causal_bias(rows: int, groups: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive (groups·rows, rows) mask for the last ``rows`` kv columns of a causal block.

    With end-aligned causality and kv columns trimmed to the block's last visible position,
    query row r of a block sees every earlier column and, of the last ``rows`` columns, only
    the first r+1: the masked part is always a strict upper triangle (-inf), repeated for the
    G query heads flattened into the block's rows. Adding a float tile is ~10x faster on CPU
    than ``masked_fill_`` with a broadcast boolean mask.
    """
    if torch.compiler.is_compiling():  # a traced constant; a cache lookup would be a guard
        return _build_causal_bias(rows, groups, dtype, device)
    key = (rows, groups, dtype, device)
    bias = _bias_cache.get(key)
    if bias is None:
        bias = _bias_cache[key] = _build_causal_bias(rows, groups, dtype, device)
    return bias


def _build_causal_bias(
    rows: int, groups: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    tri = torch.ones(rows, rows, dtype=torch.bool, device=device).triu_(1)
    bias = torch.zeros(rows, rows, dtype=dtype, device=device).masked_fill_(tri, -math.inf)
    return bias.repeat(groups, 1)


class _Layout(NamedTuple):
    """What a packed or padded call's mask needs besides the shapes: document and branch ids,
    the rope positions the window measures (documents and a window only), each query block's
    first kv column (documents only; :func:`_block_kv_starts`) and the padding keys."""

    documents: torch.Tensor | None
    branches: torch.Tensor | None
    positions: torch.Tensor | None
    kv_starts: list[int] | None
    padding: torch.Tensor | None = None

    def first_column(self, i0: int, block: int, off: int, window: int | None) -> int:
        """The first kv column the query block starting at row ``i0`` multiplies: no earlier
        column is visible to any of its rows."""
        if self.kv_starts is not None:
            return self.kv_starts[i0 // block]
        if window is not None:  # columns before the first row's window
            return max(0, i0 + off - window + 1)
        return 0


class _FlashAttn(torch.autograd.Function):
    """Blockwise attention; see the module docstring.

    Scores are kept in base 2 (q is pre-scaled by ``scale·log2(e)`` and ``exp2`` replaces
    ``exp``): on CPU ``torch.exp`` takes a slow path for every input that underflows (each
    masked -inf, each very unlikely key) while ``exp2`` does not, and the softmax is the
    same. The saved log-sum-exp is in natural log.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        block: int,
        documents: torch.Tensor | None,
        window: int | None = None,
        softcap: float | None = None,
        branches: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, H, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        G = H // Hkv
        cdt = compute_dtype(q.dtype)
        off = S - T  # end alignment: row i sees kv columns j <= i + off

        # Pre-scale q once (into base-2 units) so every score tile is a plain matmul.
        q2 = (q.to(cdt) * (scale * _LOG2E)).reshape(B, Hkv, G, T, D)
        kt = k.to(cdt).transpose(-1, -2)
        vc = v.to(cdt)

        positions = None  # the window's distances, with documents (see the module docstring)
        if documents is not None and window is not None:
            positions = layout_positions(documents, branches)
        kv_starts = None
        if documents is not None:
            kv_starts = _block_kv_starts(documents, block, positions, window)
        layout = _Layout(documents, branches, positions, kv_starts, padding)
        out = torch.empty(B, Hkv, G, T, D, dtype=cdt, device=q.device)
        lse = torch.empty(B, Hkv, G, T, 1, dtype=cdt, device=q.device)
        cap2 = None if softcap is None else softcap * _LOG2E  # the cap in base-2 units
        for i0 in range(0, T, block):
            i1 = min(i0 + block, T)
            n = i1 - i0
            kv_end = i1 + off if causal else S  # causal: later columns are all masked
            qb = q2[:, :, :, i0:i1].reshape(B, Hkv, G * n, D)
            kv_start = layout.first_column(i0, block, off, window)
            s = torch.matmul(qb, kt[..., kv_start:kv_end])  # (B, Hkv, G·n, kv), base-2 scores
            if cap2 is not None:
                s = s.div_(cap2).tanh_().mul_(cap2)
            _mask_tile(s, layout, causal, window, i0, i1, off, kv_start, G, cdt)
            m = s.amax(dim=-1, keepdim=True)
            p = s.sub_(m).exp2_()  # unnormalised softmax
            denom = p.sum(dim=-1, keepdim=True)
            ob = torch.matmul(p, vc[:, :, kv_start:kv_end]).div_(denom)
            out[:, :, :, i0:i1] = ob.view(B, Hkv, G, n, D)
            # lse = ln Σ_j exp(S_ij) = ln2·(m + log2 Σ_j 2^(S2_ij − m))
            lse[:, :, :, i0:i1] = denom.log2_().add_(m).mul_(_LN2).view(B, Hkv, G, n, 1)

        out = out.view(B, H, T, D).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, documents, branches, positions, padding)
        ctx.kv_starts = kv_starts
        ctx.causal = causal
        ctx.scale = scale
        ctx.block = block
        ctx.window = window
        ctx.softcap = softcap
        return out

    @staticmethod
    @once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """Recompute each query block's softmax and push the gradient through it.

        Per query block (rows b), against the kv columns it can see:
            S  = Q_b·Kᵀ·scale, masked            P  = exp(S − lse_b)
            dV += Pᵀ·dO_b                        dP = dO_b·Vᵀ
            D_b = rowsum(dO_b ⊙ O_b)             dS = P ⊙ (dP − D_b)·scale
            dQ_b = dS·K                          dK += dSᵀ·Q_b
        as ggml's 2023 ``flash_attn_back``; no T×T matrix outlives its block. With a window
        the kv columns are the same trimmed range the forward used; with soft-capping
        ``S = cap·t``, ``t = tanh(Q_b·Kᵀ·scale/cap)`` and dS is multiplied by ``1 − t²``.
        """
        q, k, v, out, lse, documents, branches, positions, padding = ctx.saved_tensors
        layout = _Layout(documents, branches, positions, ctx.kv_starts, padding)
        causal: bool = ctx.causal
        scale: float = ctx.scale
        block: int = ctx.block
        window: int | None = ctx.window
        softcap: float | None = ctx.softcap
        B, H, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        G = H // Hkv
        cdt = compute_dtype(q.dtype)
        off = S - T
        dev = q.device
        cap2 = None if softcap is None else softcap * _LOG2E

        # Row terms are folded into the matmuls by appending one column to each operand:
        #   [Q2 | −lse2]·[K | 1]ᵀ = S2 − lse2   and   [dO | −D]·[V | 1]ᵀ = dP − D,
        # which saves two full passes over every score tile. O(T·D) extra memory.
        q2 = (q.to(cdt) * (scale * _LOG2E)).reshape(B, Hkv, G, T, D)
        qa = torch.cat([q2, lse.mul(-_LOG2E)], dim=-1)  # (B, Hkv, G, T, D+1)
        ones = torch.ones(B, Hkv, S, 1, dtype=cdt, device=dev)
        kc = k.to(cdt)
        ka_t = torch.cat([kc, ones], dim=-1).transpose(-1, -2)  # (B, Hkv, D+1, S)
        va_t = torch.cat([v.to(cdt), ones], dim=-1).transpose(-1, -2)
        do = dout.to(cdt).reshape(B, Hkv, G, T, D)
        # D_i = rowsum(dO ⊙ O) = Σ_j P_ij·dP_ij, the softmax-backward row term, from the
        # saved output instead of a materialised P ⊙ dP.
        delta = (do * out.to(cdt).view(B, Hkv, G, T, D)).sum(dim=-1, keepdim=True)
        doa = torch.cat([do, delta.neg_()], dim=-1)  # (B, Hkv, G, T, D+1)

        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq = torch.empty(B, Hkv, G, T, D, dtype=cdt, device=dev) if need_q else None
        dk = dv = None
        # Last block first: it sees every kv column, so its dK/dV products initialise the
        # accumulators (no zero fill, no add) and the earlier blocks add into their prefix.
        for i0 in reversed(range(0, T, block)):
            i1 = min(i0 + block, T)
            n = i1 - i0
            kv_end = i1 + off if causal else S
            kv_start = layout.first_column(i0, block, off, window)
            qab = qa[:, :, :, i0:i1].reshape(B, Hkv, G * n, D + 1)
            doab = doa[:, :, :, i0:i1].reshape(B, Hkv, G * n, D + 1)
            tanh = None
            if cap2 is None:
                # S − lse, with S = Q·Kᵀ·scale (base 2), masked to -inf where a key is hidden.
                p = torch.matmul(qab, ka_t[..., kv_start:kv_end])
            else:
                # The cap sits between the scores and the lse: t = tanh(S_raw/cap), S = cap·t.
                tanh = torch.matmul(qab[..., :D], ka_t[..., :D, kv_start:kv_end])
                tanh.div_(cap2).tanh_()
                p = torch.mul(tanh, cap2).add_(qab[..., D:])  # cap·t − lse (base 2)
            _mask_tile(p, layout, causal, window, i0, i1, off, kv_start, G, cdt)
            # P = exp(S − lse): the forward softmax, rebuilt from the saved log-sum-exp.
            p.exp2_()
            # dV += Pᵀ·dO (the G heads sharing a kv head are rows of P, so this sums them).
            if need_v:
                dv = _accumulate(dv, torch.matmul(p.transpose(-1, -2), doab[..., :D]), kv_start, S)
            if not (need_q or need_k):
                continue
            # dP = dO·Vᵀ, and dS = P ⊙ (dP − D)·scale (the scale is applied to dQ, dK below).
            ds = torch.matmul(doab, va_t[..., kv_start:kv_end]).mul_(p)
            if tanh is not None:  # through the cap: dS_raw = dS·(1 − t²)
                ds = torch.ops.aten.tanh_backward(ds, tanh)
            # dQ = dS·K
            if need_q:
                dq_b = torch.matmul(ds, kc[:, :, kv_start:kv_end])
                dq[:, :, :, i0:i1] = dq_b.view(B, Hkv, G, n, D)
            # dK += dSᵀ·Q (summed over the G heads sharing the kv head, like dV). qab carries
            # scale·log2(e); the final ln(2) removes the log2(e).
            if need_k:
                dk = _accumulate(dk, torch.matmul(ds.transpose(-1, -2), qab[..., :D]), kv_start, S)

        return (
            None if dq is None else dq.mul_(scale).view(B, H, T, D).to(q.dtype),
            None if dk is None else dk.mul_(_LN2).to(k.dtype),
            None if dv is None else dv.to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _mask_tile(
    s: torch.Tensor,
    layout: _Layout,
    causal: bool,
    window: int | None,
    i0: int,
    i1: int,
    off: int,
    kv_start: int,
    groups: int,
    dtype: torch.dtype,
) -> None:
    """Add -inf, in place, to the score tile ``s`` (B, Hkv, G·n, kv) wherever a key is hidden.

    The tile holds query rows [i0, i1) and kv columns [kv_start, i1 + off) (all of seq_kv when
    not causal). Without a window this is the mask the op always had, added the same way.
    """
    n = i1 - i0
    if layout.padding is not None:
        bias = _padding_bias(layout.padding, i0 + off, n, kv_start, s.shape[-1], dtype)
        s.view(*s.shape[:2], groups, n, -1).add_(bias)
    if layout.documents is not None:
        bias = _document_bias(layout, i0, i1, kv_start, dtype, window)
        s.view(*s.shape[:2], groups, n, -1).add_(bias)
    elif causal:
        cols = s.shape[-1]
        s[..., cols - n :] += _causal_bias(n, groups, dtype, s.device)
        if window is not None:
            # Row r (query i0 + r) hides column c (key kv_start + c) when c - r <= lo; those
            # entries lie in the first n + lo columns.
            lo = i0 + off - window - kv_start
            width = min(cols, n + lo)
            if width > 0:
                s[..., :width] += _window_bias(n, width, lo, groups, dtype, s.device)


def _padding_bias(
    padding: torch.Tensor, first_row: int, rows: int, kv_start: int, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive (B, 1, 1, rows, cols) tile: -inf at each padding key column, except where the
    query (kv position ``first_row + r``) is that very column (the module docstring's
    "Left padding")."""
    keys = padding[:, None, kv_start : kv_start + cols]
    at = torch.arange(first_row, first_row + rows, device=padding.device)[:, None]
    own = at == torch.arange(kv_start, kv_start + cols, device=padding.device)
    bias = torch.zeros(keys.shape[0], rows, cols, dtype=dtype, device=padding.device)
    return bias.masked_fill_(keys & ~own, -math.inf)[:, None, None]


_window_cache: dict[tuple[int, int, int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _window_bias(
    rows: int, cols: int, lo: int, groups: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Additive (groups·rows, cols) tile, -inf where ``c - r <= lo`` (keys left of the window).

    Blocks whose window start lies inside the kv sequence all have ``lo = -1``, so one tile
    serves them; only the first few blocks (window clipped at column 0) differ.
    """
    key = (rows, cols, lo, groups, dtype, device)
    bias = None if torch.compiler.is_compiling() else _window_cache.get(key)
    if bias is None:
        hidden = torch.ones(rows, cols, dtype=torch.bool, device=device).tril_(lo)
        bias = torch.zeros(rows, cols, dtype=dtype, device=device).masked_fill_(hidden, -math.inf)
        bias = bias.repeat(groups, 1)
        if not torch.compiler.is_compiling():
            _window_cache[key] = bias
    return bias


def _accumulate(
    total: torch.Tensor | None, part: torch.Tensor, start: int, length: int
) -> torch.Tensor:
    """``total[..., start:start+len(part), :] += part`` over ``length`` kv rows.

    The first part usually covers all of ``total`` and becomes it (no zero fill, no add); a
    packed last block that skips earlier documents starts from zeros instead.
    """
    if total is None:
        if start == 0 and part.shape[2] == length:
            return part
        total = part.new_zeros(*part.shape[:2], length, part.shape[3])
    total[:, :, start : start + part.shape[2]] += part
    return total


def _block_kv_starts(
    documents: torch.Tensor,
    block: int,
    positions: torch.Tensor | None = None,
    window: int | None = None,
) -> list[int]:
    """First kv column any row of each query block can see, over the batch.

    A row sees nothing before its document's start (ids are non-decreasing, so that is the
    first index holding its id; a branch's trunk comes before it) and, with a window, nothing
    more than ``window - 1`` positions back: ``start + max(0, pos - window + 1)``. Positions
    restart at a branch, so the least over a block's rows is taken, not its first row's. One
    host sync per forward.
    """
    ids = documents.contiguous()
    starts = torch.searchsorted(ids, ids)
    if positions is not None:
        starts = starts + (positions - (window - 1)).clamp_(min=0)
    rows, length = starts.shape
    blocks = -(-length // block)
    tail = starts.new_full((rows, blocks * block - length), length)
    return torch.cat([starts, tail], dim=1).view(rows, blocks, block).amin(dim=(0, 2)).tolist()


def _document_bias(
    layout: _Layout,
    i0: int,
    i1: int,
    kv_start: int,
    dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:
    """Additive (B, 1, 1, rows, kv) mask of a packed block: -inf unless same document, j <= i,
    key j in the trunk or in i's branch (with branches), and ``pos_i - pos_j < window`` (with a
    window).

    Broadcast over the kv heads and the G query heads of the block's rows; B·block·kv
    elements, never T×T.
    """
    documents = layout.documents
    hidden = documents[:, i0:i1, None] != documents[:, None, kv_start:i1]
    # Causality: key kv_start + c lies after query i0 + r where c - r > i0 - kv_start.
    hidden |= torch.ones(i1 - i0, i1 - kv_start, dtype=torch.bool, device=documents.device).triu_(
        1 + i0 - kv_start
    )
    if layout.branches is not None:  # another branch's key: neither trunk nor the query's own
        theirs = layout.branches[:, None, kv_start:i1]
        hidden |= (theirs != 0) & (theirs != layout.branches[:, i0:i1, None])
    if window is not None:  # window - 1 positions back at most
        positions = layout.positions
        hidden |= positions[:, i0:i1, None] - positions[:, None, kv_start:i1] >= window
    bias = torch.zeros(hidden.shape, dtype=dtype, device=documents.device)
    return bias.masked_fill_(hidden, -math.inf)[:, None, None]


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_size: int = BLOCK_SIZE,
    documents: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    branches: torch.Tensor | None = None,
    padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention ``softmax(Q·Kᵀ·scale + mask)·V`` without storing the attention matrix.

    Args:
        q: (batch, n_heads, seq, head_dim).
        k, v: (batch, n_kv_heads, seq_kv, head_dim); n_heads must be a multiple of
            n_kv_heads. Query head h uses kv head ``h // (n_heads // n_kv_heads)`` (the
            grouping of HF ``repeat_kv`` and of ggml's broadcasting).
        causal: mask future positions. The mask is aligned to the end of the kv sequence:
            query row i sees kv positions ``j <= i + (seq_kv - seq)``, which is what
            incremental decoding against a KV cache needs (for seq_kv == seq it is the usual
            lower triangle).
        scale: score scale; defaults to ``1/sqrt(head_dim)``. Gemma passes
            ``query_pre_attn_scalar ** -0.5`` (llama.cpp's ``f_attention_scale``).
        block_size: query rows per block; only memory and speed depend on it, never the
            result beyond rounding.
        documents: (batch, seq) integer ids of the packed documents each token belongs to,
            non-decreasing along seq; query i then sees key j only if ``j <= i`` and both are
            in the same document. Needs ``causal`` and seq_kv == seq.
        branches: (batch, seq) integer ids splitting each document into its trunk (0, first)
            and branches after it (non-decreasing within a document); query i then also needs
            key j in the trunk or in its own branch, and a window counts rope positions
            (``llamatrain.ops.layout.layout_positions``). Needs ``documents``.
        window: sliding-window size w >= 1 (needs ``causal``): query i sees key j only if
            ``i - w < j <= i`` (positions end-aligned as for ``causal``), i.e. itself and the
            w - 1 keys before it -- llama.cpp's standard SWA (masked iff ``p1 - p0 >= n_swa``)
            and HF's ``sliding_window``. kv columns left of a block's window are skipped, not
            masked. ``None``, or w >= seq_kv, is plain causal attention.
        softcap: ``S = softcap·tanh(S / softcap)`` before the mask (Gemma 2's
            ``attn_logit_softcapping``; ggml ``flash_attn_ext``'s ``logit_softcap``).
        padding: (batch, seq_kv) bools, True at the key columns holding left padding: hidden
            from every query but the one at the same position (the module docstring's "Left
            padding"), as HF's ``attention_mask`` hides a batch's padding.

    Returns:
        (batch, n_heads, seq, head_dim) in q's dtype. bf16/fp16 inputs are computed with
        float32 accumulation.
    """
    check_inputs(q, k, v, causal)
    if documents is not None:
        check_documents(documents, q, k.shape[2], causal)
    if branches is not None:
        check_branches(branches, documents)
    if padding is not None:
        check_padding(padding, k)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    block = int(block_size)
    if block < 1:
        raise ValueError(f"block_size must be positive; got {block}")
    if window is not None:
        if isinstance(window, bool) or int(window) != window or window < 1:
            raise ValueError(f"window must be a positive integer; got {window!r}")
        if not causal:
            raise ValueError("window needs causal attention")
        window = int(window)
        if window >= k.shape[2]:
            window = None  # every visible key is inside it: plain causal
    if softcap is not None:
        softcap = float(softcap)
        if not (0.0 < softcap < math.inf):
            raise ValueError(f"softcap must be a positive finite number; got {softcap}")
    if takes_fused(q, k, v, plain=documents is None and softcap is None):
        return fused_attention(q, k, v, causal, float(scale), window, padding)
    if window is None and softcap is None and branches is None and padding is None:
        return _FlashAttn.apply(q, k, v, causal, float(scale), block, documents)
    return _FlashAttn.apply(
        q, k, v, causal, float(scale), block, documents, window, softcap, branches, padding
    )
