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
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from llamatrain.ops.dtypes import compute_dtype

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

        out = torch.empty(B, Hkv, G, T, D, dtype=cdt, device=q.device)
        lse = torch.empty(B, Hkv, G, T, 1, dtype=cdt, device=q.device)
        for i0 in range(0, T, block):
            i1 = min(i0 + block, T)
            n = i1 - i0
            kv_end = i1 + off if causal else S  # causal: later columns are all masked
            qb = q2[:, :, :, i0:i1].reshape(B, Hkv, G * n, D)
            s = torch.matmul(qb, kt[..., :kv_end])  # (B, Hkv, G·n, kv_end), base-2 scores
            if causal:
                s[..., kv_end - n :] += _causal_bias(n, G, cdt, q.device)
            m = s.amax(dim=-1, keepdim=True)
            p = s.sub_(m).exp2_()  # unnormalised softmax
            denom = p.sum(dim=-1, keepdim=True)
            ob = torch.matmul(p, vc[:, :, :kv_end]).div_(denom)
            out[:, :, :, i0:i1] = ob.view(B, Hkv, G, n, D)
            # lse = ln Σ_j exp(S_ij) = ln2·(m + log2 Σ_j 2^(S2_ij − m))
            lse[:, :, :, i0:i1] = denom.log2_().add_(m).mul_(_LN2).view(B, Hkv, G, n, 1)

        out = out.view(B, H, T, D).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        ctx.scale = scale
        ctx.block = block
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
        as ggml's 2023 ``flash_attn_back``; no T×T matrix outlives its block.
        """
        q, k, v, out, lse = ctx.saved_tensors
        causal: bool = ctx.causal
        scale: float = ctx.scale
        block: int = ctx.block
        B, H, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        G = H // Hkv
        cdt = compute_dtype(q.dtype)
        off = S - T
        dev = q.device

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
            qab = qa[:, :, :, i0:i1].reshape(B, Hkv, G * n, D + 1)
            doab = doa[:, :, :, i0:i1].reshape(B, Hkv, G * n, D + 1)
            # S − lse, with S = Q·Kᵀ·scale (base 2), masked to -inf where causality hides a key.
            p = torch.matmul(qab, ka_t[..., :kv_end])
            if causal:
                p[..., kv_end - n :] += _causal_bias(n, G, cdt, dev)
            # P = exp(S − lse): the forward softmax, rebuilt from the saved log-sum-exp.
            p.exp2_()
            # dV += Pᵀ·dO (the G heads sharing a kv head are rows of P, so this sums them).
            if need_v:
                dv = _accumulate(dv, torch.matmul(p.transpose(-1, -2), doab[..., :D]))
            if not (need_q or need_k):
                continue
            # dP = dO·Vᵀ, and dS = P ⊙ (dP − D)·scale (the scale is applied to dQ, dK below).
            ds = torch.matmul(doab, va_t[..., :kv_end]).mul_(p)
            # dQ = dS·K
            if need_q:
                dq[:, :, :, i0:i1] = torch.matmul(ds, kc[:, :, :kv_end]).view(B, Hkv, G, n, D)
            # dK += dSᵀ·Q (summed over the G heads sharing the kv head, like dV). qab carries
            # scale·log2(e); the final ln(2) removes the log2(e).
            if need_k:
                dk = _accumulate(dk, torch.matmul(ds.transpose(-1, -2), qab[..., :D]))

        return (
            None if dq is None else dq.mul_(scale).view(B, H, T, D).to(q.dtype),
            None if dk is None else dk.mul_(_LN2).to(k.dtype),
            None if dv is None else dv.to(v.dtype),
            None,
            None,
            None,
        )


def _accumulate(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """``total[..., :len(part), :] += part``, where the first part covers all of ``total``."""
    if total is None:
        return part
    total[:, :, : part.shape[2]] += part
    return total


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "flash_attn expects q, k, v shaped (batch, heads, seq, head_dim); got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    B, H, T, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if Bk != B:
        raise ValueError(f"q and k/v batch sizes differ: {B} vs {Bk}")
    if Dk != D:
        raise ValueError(f"q and k/v head_dim differ: {D} vs {Dk}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"n_heads ({H}) must be a multiple of n_kv_heads ({Hkv}) for grouped-query attention"
        )
    if T == 0 or S == 0:
        raise ValueError(f"seq and seq_kv must be positive; got seq={T}, seq_kv={S}")
    if causal and S < T:
        raise ValueError(
            f"causal attention needs seq_kv >= seq (the mask is aligned to the end); "
            f"got seq={T}, seq_kv={S}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"flash_attn needs floating-point inputs; got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")


def flash_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_size: int = BLOCK_SIZE,
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
        scale: score scale; defaults to ``1/sqrt(head_dim)``.
        block_size: query rows per block; only memory and speed depend on it, never the
            result beyond rounding.

    Returns:
        (batch, n_heads, seq, head_dim) in q's dtype. bf16/fp16 inputs are computed with
        float32 accumulation.
    """
    _validate(q, k, v, causal)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    block = int(block_size)
    if block < 1:
        raise ValueError(f"block_size must be positive; got {block}")
    return _FlashAttn.apply(q, k, v, causal, float(scale), block)
