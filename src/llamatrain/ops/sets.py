"""The two op sets a model runs on, as objects with named methods, and the reference
attentions they choose among.

``GgmlOps`` calls our autograd Functions (ggml's backward formulas); ``TorchOps`` calls plain
PyTorch (F.embedding, F.rms_norm, F.silu, F.cross_entropy), so each can check the other.
Attention is a choice of its own, held by the op set: ``flash`` (memory-efficient: our
blockwise ``flash_attn`` with the 2023 ``flash_attn_back``, or SDPA for the torch op set),
``softmax`` (the 2023 program's non-flash graph: scores, ``diag_mask_inf``, ``soft_max``) or
``sdpa`` (PyTorch's fused kernels, the fast choice on CUDA).

:func:`run_choices` says what the choice ``auto`` becomes on a device, and :func:`op_set` is
the one place the choice is made: the model's modules and LoRA's adapted projections call the
methods of the object it returns. Tensor math only, like the rest of ``llamatrain.ops``: the
choice comes in as two strings, not as a config.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from llamatrain import ops as ggml
from llamatrain.ops.activation import geglu as ggml_geglu
from llamatrain.ops.fused import scored_rows
from llamatrain.ops.layout import document_layout, layout_positions
from llamatrain.ops.lora import torch_lora_linear
from llamatrain.ops.softcap import softcap as ggml_softcap

OPS = ("ggml", "torch")
ATTENTIONS = ("flash", "softmax", "sdpa")
AUTO = "auto"
"""The ``ops`` or ``attention`` choice left to the device the model runs on:
:func:`run_choices`."""
IGNORE_INDEX = -100
"""A target of this value is not scored (PyTorch's convention, and every loss op's default)."""


@dataclass(frozen=True)
class OpSet(ABC):
    """The functions a model calls, for one op set and one attention choice (``attend``, one
    of :data:`ATTENTIONS`). Shapes: x (..., dim); q (batch, heads, t, head_dim); k, v (batch,
    kv_heads, t_kv, head_dim), each kv head shared by heads / kv_heads query heads."""

    attend: str = "flash"
    name: ClassVar[str]
    """The set's ``model.ops`` choice (one of :data:`OPS`)."""

    def __post_init__(self) -> None:
        if self.attend not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attend!r}")

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None,
        *,
        window: int | None = None,
        scale: float | None = None,
        padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention (batch, heads, t, head_dim), the mask aligned to the end of the
        keys (queries are their last rows, as when decoding against a KV cache).
        ``documents`` (batch, t): packed document ids; a query sees its own document only; or
        (batch, t, 2): ids and branch ids, a query seeing its document's trunk and its own
        branch (``llamatrain.ops.attention``'s module docstring). ``window``: sliding window
        w, query i sees keys ``i - w < j <= i`` (llama.cpp's standard SWA; in rope positions
        with documents); ``scale``: score scale, default ``1/sqrt(head_dim)``. ``padding``
        (batch, t_kv) bools: the keys that are a ragged batch's left padding, hidden from
        every query but the padding's own (``flash_attn``'s ``padding``)."""
        masks = dict(window=window, scale=scale, padding=padding)
        if self.attend == "sdpa":
            return sdpa_attention(q, k, v, documents, **masks)
        if self.attend == "softmax":
            return self.softmax_attention(q, k, v, documents, **masks)
        return self.flash_attention(q, k, v, documents, **masks)

    @abstractmethod
    def embedding(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``table`` (vocab, dim) that ``ids`` name."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(mean(x²) + eps) over the last dimension, without a weight."""

    @abstractmethod
    def rope(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        *,
        theta: float,
        freq_scale: float,
        freq_factors: torch.Tensor | None,
        mode: str = "norm",
    ) -> torch.Tensor:
        """Rope of x (batch, t, heads, head_dim) at ``pos``: ``mode`` "norm" turns adjacent
        pairs (llama.cpp NORM), "neox" element i with i + head_dim/2 (NEOX, HF's)."""

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x·Wᵀ for W (out, in)."""

    @abstractmethod
    def lora_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scale: float,
        adapter_input: torch.Tensor | None,
        *,
        qtype: str | None = None,
    ) -> torch.Tensor:
        """x·Wᵀ + scale·B·A·x' (``ops.lora.lora_linear``): a LoRA-adapted projection."""

    @abstractmethod
    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu(gate)·up."""

    @abstractmethod
    def geglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate)·up (Gemma's feed-forward)."""

    @abstractmethod
    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """cap·tanh(x / cap) (final-logit soft-capping)."""

    @abstractmethod
    def flash_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None,
        *,
        window: int | None = None,
        scale: float | None = None,
        padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`attention` for ``attend == "flash"``."""

    @abstractmethod
    def softmax_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: torch.Tensor | None,
        *,
        window: int | None = None,
        scale: float | None = None,
        padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`attention` for ``attend == "softmax"``: the scores as one tensor."""

    @abstractmethod
    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of ``logits`` (..., vocab) over the targets that are not IGNORE_INDEX."""

    @abstractmethod
    def head_loss(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        *,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``cross_entropy(linear(hidden, weight), targets)``, however the set computes it;
        with ``softcap`` the logits are ``softcap(linear(...), softcap)`` first."""


class GgmlOps(OpSet):
    """llamatrain's autograd Functions, whose backward is ggml's."""

    name: ClassVar[str] = "ggml"

    def embedding(self, table, ids):
        return ggml.get_rows(table, ids)

    def rms_norm(self, x, eps):
        return ggml.rms_norm(x, eps)

    def rope(self, x, pos, *, theta, freq_scale, freq_factors, mode="norm"):
        return ggml.rope(
            x, pos, mode=mode, theta=theta, freq_scale=freq_scale, freq_factors=freq_factors
        )

    def linear(self, x, weight):
        return ggml.mul_mat(x, weight)

    def lora_linear(self, x, weight, lora_a, lora_b, scale, adapter_input, *, qtype=None):
        return ggml.lora_linear(x, weight, lora_a, lora_b, scale, adapter_input, qtype=qtype)

    def swiglu(self, gate, up):
        return ggml.swiglu(gate, up)

    def geglu(self, gate, up):
        return ggml_geglu(gate, up)

    def softcap(self, x, cap):
        return ggml_softcap(x, cap)

    def flash_attention(self, q, k, v, documents, *, window=None, scale=None, padding=None):
        branches = None
        if documents is not None:
            documents, branches = document_layout(documents)
        if window is None and scale is None and branches is None and padding is None:
            return ggml.flash_attn(q, k, v, documents=documents)
        masks = dict(window=window, scale=scale, branches=branches, padding=padding)
        return ggml.flash_attn(q, k, v, documents=documents, **masks)

    def softmax_attention(self, q, k, v, documents, *, window=None, scale=None, padding=None):
        return ggml_softmax_attention(
            q, k, v, documents, window=window, scale=scale, padding=padding
        )

    def cross_entropy(self, logits, targets):
        return ggml.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)

    def head_loss(self, hidden, weight, targets, *, softcap=None):
        """Fused over row chunks: the (tokens x vocab) logits never exist at once."""
        if softcap is not None:
            return ggml.linear_cross_entropy(
                hidden, weight, targets, ignore_index=IGNORE_INDEX, softcap=softcap
            )
        return ggml.linear_cross_entropy(hidden, weight, targets, ignore_index=IGNORE_INDEX)


class TorchOps(OpSet):
    """Plain PyTorch, whose backward autograd derives."""

    name: ClassVar[str] = "torch"

    def embedding(self, table, ids):
        return F.embedding(ids, table)

    def rms_norm(self, x, eps):
        return F.rms_norm(x, (x.shape[-1],), eps=eps)

    def rope(self, x, pos, *, theta, freq_scale, freq_factors, mode="norm"):
        return torch_rope(
            x, pos, theta=theta, freq_scale=freq_scale, freq_factors=freq_factors, mode=mode
        )

    def linear(self, x, weight):
        return F.linear(x, weight)

    def lora_linear(self, x, weight, lora_a, lora_b, scale, adapter_input, *, qtype=None):
        return torch_lora_linear(x, weight, lora_a, lora_b, scale, adapter_input, qtype=qtype)

    def swiglu(self, gate, up):
        return F.silu(gate) * up

    def geglu(self, gate, up):
        return F.gelu(gate, approximate="tanh") * up

    def softcap(self, x, cap):
        return torch.tanh(x / cap) * cap

    def flash_attention(self, q, k, v, documents, *, window=None, scale=None, padding=None):
        return sdpa_attention(q, k, v, documents, window=window, scale=scale, padding=padding)

    def softmax_attention(self, q, k, v, documents, *, window=None, scale=None, padding=None):
        return torch_softmax_attention(
            q, k, v, documents, window=window, scale=scale, padding=padding
        )

    def cross_entropy(self, logits, targets):
        rows = logits.flatten(0, -2)
        rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
        return F.cross_entropy(rows, targets.flatten(), ignore_index=IGNORE_INDEX)

    def head_loss(self, hidden, weight, targets, *, softcap=None):
        # Logits of the scored rows only (as the fused ggml head); with none, the plain mean.
        scored = scored_rows(targets.flatten(), IGNORE_INDEX)
        if scored is not None and len(scored):
            hidden, targets = hidden.flatten(0, -2)[scored], targets.flatten()[scored]
        logits = F.linear(hidden, weight)
        if softcap is not None:
            logits = self.softcap(logits, softcap)
        return self.cross_entropy(logits, targets)


def run_choices(ops: str, attention: str, *, cuda: bool) -> tuple[str, str]:
    """``ops`` and ``attention`` with :data:`AUTO` made concrete for a model on CUDA or not.

    On CUDA ``auto`` is the fast path: PyTorch's ops and its fused attention kernels (SDPA),
    which autocast, fusion and ``torch.compile`` are built for. Elsewhere it is ggml's
    semantics and the blockwise flash attention: the faithful path, and on the CPU the faster
    and lighter one (its fused lm head + loss; ``bench/README.md``). Attention follows the
    ops: with ggml's ops, even on CUDA, ``auto`` keeps the blockwise kernel, so
    ``ops = "ggml"`` alone chooses the whole ggml path.
    """
    if ops == AUTO:
        ops = "torch" if cuda else "ggml"
    if attention == AUTO:
        attention = "sdpa" if cuda and ops == "torch" else "flash"
    return ops, attention


def op_set(ops: str, attention: str = "flash") -> OpSet:
    """The op set ``ops`` (one of :data:`OPS`) with the attention choice ``attention``.

    A choice still :data:`AUTO` is made for the CPU: a model is built there (its parameters
    are created on the CPU), and code that moves it to CUDA and wants CUDA's choices makes
    them first (``llamatrain.device.resolve_run_settings``), as training does.
    """
    ops, attention = run_choices(ops, attention, cuda=False)
    return {"ggml": GgmlOps, "torch": TorchOps}[ops](attention)


# ---- the reference implementations the op sets call -------------------------------------


def torch_rope(
    x: torch.Tensor,
    pos: torch.Tensor,
    *,
    theta: float,
    freq_scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
    mode: str = "norm",
) -> torch.Tensor:
    """Rope written with differentiable PyTorch ops: adjacent pairs (llama.cpp NORM), or with
    ``mode="neox"`` element i with i + head_dim/2 (HF's ``rotate_half``)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) * 2 / (2 * half))
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    compute = torch.promote_types(x.dtype, torch.float32)
    angles = (pos.to(torch.float64) * freq_scale)[..., None] * inv_freq  # (..., T, half)
    if angles.dim() == 2:
        angles = angles[None]
    cos = angles.cos().to(compute)[:, :, None, :]
    sin = angles.sin().to(compute)[:, :, None, :]
    if mode == "neox":
        x0, x1 = x.to(compute).chunk(2, dim=-1)
        return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).to(x.dtype)
    pairs = x.to(compute).unflatten(-1, (half, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def _visible(
    t: int,
    t_kv: int,
    window: int | None,
    documents: torch.Tensor | None,
    device: torch.device,
    padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """The explicit-mask form of ``flash_attn``'s: boolean (t, t_kv), or (B, 1, t, t_kv) with
    ``documents`` (a layout, :meth:`OpSet.attention`) or ``padding``. Query i (at kv position
    i + t_kv - t) sees key j iff ``j <= i``, and, with documents, both are in the same document
    and key j is in the trunk or i's branch; a ``window`` w keeps ``i - j < w``, with documents
    counted in rope positions (``flash_attn``'s ``window``); a padding key j only when it is
    the query's own position."""
    visible = _causal_visible(t, t_kv, window, documents, device)
    if padding is None:
        return visible
    own = torch.arange(t, device=device)[:, None] + (t_kv - t) == torch.arange(t_kv, device=device)
    return visible & (~padding[:, None, None, :] | own)


def _causal_visible(
    t: int, t_kv: int, window: int | None, documents: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """:func:`_visible` without padding."""
    if documents is None:
        rows = torch.arange(t, device=device)[:, None] + (t_kv - t)
        cols = torch.arange(t_kv, device=device)[None, :]
        visible = cols <= rows
        return visible if window is None else visible & (cols > rows - window)
    ids, branches = document_layout(documents)
    visible = (ids[:, :, None] == ids[:, None, :]).tril_()
    if branches is not None:
        theirs = branches[:, None, :]
        visible &= (theirs == 0) | (theirs == branches[:, :, None])
    if window is not None:
        positions = layout_positions(ids, branches)
        visible &= positions[:, :, None] - positions[:, None, :] < window
    return visible[:, None]


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor | None = None,
    *,
    window: int | None = None,
    scale: float | None = None,
    padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA with causal masking aligned to the end (queries are the last rows of the keys);
    a sliding ``window``, documents or padding are an explicit boolean mask."""
    t, t_kv = q.shape[-2], k.shape[-2]
    if window is None and documents is None and padding is None and t == t_kv:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    mask = _visible(t, t_kv, window, documents, q.device, padding)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Q·Kᵀ with the G query heads of a group sharing one kv head (ggml's broadcasting)."""
    group = q.shape[1] // k.shape[1]
    return q @ k.repeat_interleave(group, dim=1).transpose(-1, -2)


def _values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return p @ v.repeat_interleave(p.shape[1] // v.shape[1], dim=1)


def ggml_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor | None = None,
    *,
    window: int | None = None,
    scale: float | None = None,
    padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """The 2023 graph without flash attention: KQ, diag_mask_inf, soft_max(scale), KQV.

    Packed documents, a sliding window and padding add soft_max's additive mask (-inf across
    documents, left of the window and at padding keys), as ggml's ``soft_max_ext`` takes a
    KQ mask (llama.cpp's hides a batch's other sequences so).
    """
    t, t_kv = q.shape[-2], k.shape[-2]
    masked = ggml.diag_mask_inf(_scores(q, k), n_past=t_kv - t)
    mask = None
    if documents is not None or window is not None or padding is not None:
        hidden = ~_visible(t, t_kv, window, documents, q.device, padding)
        mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(
            hidden, float("-inf")
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _values(ggml.soft_max(masked, mask, scale=scale), v)


def torch_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: torch.Tensor | None = None,
    *,
    window: int | None = None,
    scale: float | None = None,
    padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same graph in PyTorch: scores, a -inf mask, torch.softmax."""
    t, t_kv = q.shape[-2], k.shape[-2]
    scores = _scores(q, k) / math.sqrt(q.shape[-1]) if scale is None else _scores(q, k) * scale
    if documents is not None or window is not None or padding is not None:
        hidden = ~_visible(t, t_kv, window, documents, q.device, padding)
    else:
        hidden = torch.ones(t, t_kv, dtype=torch.bool, device=q.device).triu_(t_kv - t + 1)
    return _values(torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1), v)
