"""Attention when no gradient is asked of it: PyTorch's fused kernel under the same mask.

Why: ``flash_attn``'s blockwise walk exists for training (its saved state linear in the
sequence, its backward recomputing tiles); for the few query rows of a decoding step it is
a dozen small PyTorch ops and ~160-200 us a call on one core (B 1, 9 heads over 3 kv heads,
40 keys), where ``F.scaled_dot_product_attention`` takes ~12 us: ~5 ms of a ~30 ms batch-1
decode step over SmolLM2-135M's 30 layers. Without gradients the mask is all that must agree,
and it is built here from the same rules (the module docstring of ``ops.attention``):
end-aligned causality, left padding hidden from every query but its own position, the
sliding window. Packed documents, branches and soft-capping stay on the blockwise path
(training's inputs, never a decoder's). The result equals the blockwise one to float
rounding: the same softmax over the same visible keys.

Only for decoding steps, calls whose keys reach past their queries (a KV cache holds the
earlier tokens): a forward over whole sequences without gradients (GRPO's old-policy and
reference log-probs, a prompt's first pass) keeps the blockwise arithmetic, so that it computes
what the training forward computes bit for bit (an importance ratio starts at exactly 1; with
the fused kernel there, a two-rank GRPO run drifted from the one-process run 20x further in its
first LoRA update, 8e-5 against 4.5e-6). And only while the mask stays small
(:data:`MAX_MASK_VALUES` booleans), never the (B, T, S) mask a long prompt would need.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from llamatrain.ops.dtypes import compute_dtype

__all__ = ["MAX_MASK_VALUES", "fused_attention", "takes_fused"]

MAX_MASK_VALUES = 1 << 22
"""Booleans of the (B, T, S) mask the fused path may build: 4 MiB, a 2048-token prompt's
2048 x 2048; anything larger walks the blocks."""


def takes_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plain: bool) -> bool:
    """Whether :func:`fused_attention` serves this call: a decoding step (more keys than
    queries), no tensor needs a gradient (grad mode off, or inputs that need none), ``plain``
    (no documents, branches or soft-cap) and a small mask."""
    wanted = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    small = q.shape[0] * q.shape[2] * k.shape[2] <= MAX_MASK_VALUES
    return plain and k.shape[2] > q.shape[2] and not wanted and small


def _visible(
    rows: int, keys: int, causal: bool, window: int | None, padding: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:  # fmt: skip
    """(B or 1, 1, rows, keys) True where query i may read key j (None: every key, as for a
    single query at the last key under causality alone)."""
    if padding is None and window is None and (not causal or rows == 1):
        return None
    at = torch.arange(keys - rows, keys, device=device)[:, None]  # query i's kv position
    j = torch.arange(keys, device=device)[None, :]
    seen = j <= at if causal else torch.ones(rows, keys, dtype=torch.bool, device=device)
    if window is not None:
        seen &= j > at - window
    seen = seen[None]
    if padding is not None:  # a padding key is hidden from all but itself
        seen = seen & (~padding[:, None, :] | (j == at)[None])
    return seen[:, None]


_last_mask = threading.local()


def _mask_of_step(
    rows: int, keys: int, causal: bool, window: int | None, padding: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:  # fmt: skip
    """:func:`_visible`, made once for a decoding step's layers: each of them asks with the
    same settings and a new view of the cache's one padding tensor (``KVCache.padding_until``),
    and rebuilding the mask (~8 small ops) was ~1 ms of a batch-8 step over 30 layers. The memo
    holds the padding's base tensor (so its memory names no other tensor while kept) and its
    version, which every in-place write to it or its views moves on; padding made under
    ``torch.inference_mode`` keeps no version and is not memoised."""
    if padding is None or padding.is_inference():
        return _visible(rows, keys, causal, window, padding, device)
    base = padding if padding._base is None else padding._base
    key = (rows, keys, causal, window, padding.data_ptr(), padding.shape, padding.stride())
    known = getattr(_last_mask, "entry", None)
    if known is not None and known[0] is base and known[1] == base._version and known[2] == key:
        return known[3]
    mask = _visible(rows, keys, causal, window, padding, device)
    _last_mask.entry = (base, base._version, key, mask)
    return mask


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    window: int | None,
    padding: torch.Tensor | None,
) -> torch.Tensor:
    """``flash_attn``'s result for a call :func:`takes_fused` accepts, in q's dtype (bf16/f16
    computed in float32, as the blockwise path computes them)."""
    cdt = compute_dtype(q.dtype)
    mask = _mask_of_step(q.shape[2], k.shape[2], causal, window, padding, q.device)
    out = F.scaled_dot_product_attention(
        q.to(cdt), k.to(cdt), v.to(cdt), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    return out.to(q.dtype)
