"""The llama model as one readable ``nn.Module``, and ``ModelConfig``, the ``[model]`` section.

Parameter names *are* llama.cpp's GGUF tensor names (``token_embd.weight``,
``blk.0.attn_q.weight``, ...): the module tree is laid out so that ``state_dict()`` keys need
no translation, which makes :func:`tensor_shapes` the single name map that export and import
consult. Rope uses llama.cpp's NORM convention (adjacent pairs), so Q/K are exported unpermuted.

The same module runs on two interchangeable op sets: ``ops="ggml"`` (our autograd Functions
with ggml's backward formulas) and ``ops="torch"`` (plain PyTorch: F.embedding, F.rms_norm,
F.silu, F.cross_entropy), so each can check the other. Attention is a choice of its own:
``flash`` (memory-efficient: our blockwise ``flash_attn`` with the 2023 ``flash_attn_back``, or
SDPA for the torch op set), ``softmax`` (the 2023 program's non-flash graph: scores,
``diag_mask_inf``, ``soft_max``) or ``sdpa`` (PyTorch's fused kernels, the fast choice on CUDA).

The model knows nothing of files, activation checkpointing, LoRA or parallelism: those wrap it
from outside (``llamatrain.activation_checkpointing`` swaps ``blk`` for a container that
recomputes segments; the names stay the same).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from llamatrain import ops as ggml_ops
from llamatrain.errors import ConfigError
from llamatrain.sampling import SamplingParams, sample_next
from llamatrain.settings import check_rules, divisors, setting

IGNORE_INDEX = -100
OPS = ("ggml", "torch")
ATTENTIONS = ("flash", "softmax", "sdpa")
RUN_CHOICES = ("ops", "attention", "init_from")
"""Fields that choose how a model is built or run, not what the network computes."""


def _nowhere(key: str) -> str:
    return ""


@dataclass
class ModelConfig:
    """Architecture of a llama (ignored when ``init_from`` names a GGUF model)."""

    dim: int = setting(256, "embedding width (llama.embedding_length)", gt=0)
    n_layers: int = setting(4, "number of transformer blocks (llama.block_count)", gt=0)
    n_heads: int = setting(8, "attention heads; head_dim = dim / n_heads must be even", gt=0)
    n_kv_heads: int | None = setting(
        None, "key/value heads for grouped-query attention; unset = n_heads", gt=0
    )
    ffn_dim: int | None = setting(
        None, "feed-forward width; unset = 2/3·4·dim rounded up to multiple_of", gt=0
    )
    multiple_of: int = setting(32, "rounding of the default ffn_dim", gt=0)
    norm_eps: float = setting(
        1e-5, "RMSNorm epsilon (llama.attention.layer_norm_rms_epsilon)", gt=0
    )
    rope_theta: float = setting(10000.0, "RoPE frequency base (llama.rope.freq_base)", gt=0)
    rope_scaling_factor: float = setting(
        1.0, "linear RoPE scaling: positions are divided by it (llama.rope.scaling.factor)", gt=0
    )
    rope_freq_factors: bool = setting(
        False,
        "per-pair RoPE frequency divisors in a rope_freqs.weight tensor (Llama 3.1+ long "
        "context); kept as loaded, never trained",
    )
    key_length: int | None = setting(
        None, "attention head width (llama.attention.key_length); unset = dim / n_heads", gt=0
    )
    attention_bias: bool = setting(False, "q/k/v/output projections carry bias vectors")
    mlp_bias: bool = setting(False, "gate/up/down projections carry bias vectors")
    tie_embeddings: bool = setting(
        False, "share token embedding and output head (no output.weight)"
    )
    ops: str = setting(
        "ggml",
        "'ggml' = ops with ggml's backward semantics; 'torch' = PyTorch's built-in ops",
        choices=OPS,
    )
    attention: str = setting(
        "flash",
        "'flash' = memory-efficient attention (ggml: blockwise with the 2023 flash_attn_back; "
        "torch: SDPA); 'softmax' = scores, diag_mask_inf and soft_max as the 2023 graph "
        "without --use-flash; 'sdpa' = PyTorch's fused kernels (fastest on CUDA)",
        choices=ATTENTIONS,
    )
    init_from: str | None = setting(
        None,
        "model to finetune from: a llama GGUF or an HF folder (config.json + safetensors); its "
        "architecture then overrides this section",
    )
    vocab_size: int | None = setting(None, "vocabulary size: the tokenizer's", gt=0, derived=True)
    max_seq_len: int | None = setting(
        None, "trained context length (llama.context_length): data.n_ctx", gt=0, derived=True
    )

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.key_length or self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        """FFN width: explicit, or Meta's rule 2/3·4·dim rounded up to ``multiple_of``."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def architecture(self) -> dict:
        """The fields that define the network (what a GGUF file records)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in RUN_CHOICES}

    def validate(self, where: Callable[[str], str] = _nowhere) -> None:
        """Raise ConfigError for an impossible architecture; ``where(key)`` names the source."""
        check_rules(self, "model", where)
        if self.key_length is None and self.dim % self.n_heads:
            fits = [x for x in divisors(self.dim) if x <= 64 and (self.dim // x) % 2 == 0]
            raise ConfigError(
                f"model.dim = {self.dim} must be divisible by model.n_heads = {self.n_heads}"
                f"{where('model.n_heads')}; n_heads could be one of {fits}"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head_dim = {self.head_dim} (model.key_length, or model.dim / "
                f"model.n_heads = {self.dim}/{self.n_heads}) must be even (RoPE rotates pairs)"
                f"{where('model.n_heads')}; change dim, n_heads or key_length"
            )
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_kv_heads = {self.n_kv_heads} must divide model.n_heads = "
                f"{self.n_heads}{where('model.n_kv_heads')}; choose one of "
                f"{divisors(self.n_heads)}"
            )


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF names and torch shapes of a model's tensors: ``Llama(cfg).state_dict()``.

    The one name map that export and import consult. Computed from the config rather than
    by building a ``Llama`` on the meta device (the first meta-device initialisation in a
    process is slow); a test pins it to ``Llama.state_dict()`` and
    ``load_state_dict(strict=True)`` re-checks every load.
    """
    e, f, v = cfg.dim, cfg.hidden_dim, cfg.vocab_size
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, e)}
    if cfg.rope_freq_factors:
        shapes["rope_freqs.weight"] = (cfg.head_dim // 2,)
    projections = {  # name: (out, in, has a bias)
        "attn_q": (q, e, cfg.attention_bias),
        "attn_k": (kv, e, cfg.attention_bias),
        "attn_v": (kv, e, cfg.attention_bias),
        "attn_output": (e, q, cfg.attention_bias),
        "ffn_gate": (f, e, cfg.mlp_bias),
        "ffn_up": (f, e, cfg.mlp_bias),
        "ffn_down": (e, f, cfg.mlp_bias),
    }
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (e,)
        shapes[b + "ffn_norm.weight"] = (e,)
        for name, (n_out, n_in, bias) in projections.items():
            shapes[f"{b}{name}.weight"] = (n_out, n_in)
            if bias:
                shapes[f"{b}{name}.bias"] = (n_out,)
    shapes["output_norm.weight"] = (e,)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (v, e)
    return shapes


# ---- the two op sets ---------------------------------------------------------------------


def torch_rope(
    x: torch.Tensor,
    pos: torch.Tensor,
    *,
    theta: float,
    freq_scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Adjacent-pair (llama.cpp NORM) rope written with differentiable PyTorch ops."""
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
    pairs = x.to(compute).unflatten(-1, (half, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Rope positions (B, T) of packed documents: each token's index within its document.

    ``documents`` holds non-decreasing ids per row, so a document starts at the first index
    holding its id, which ``searchsorted`` finds for every token at once.
    """
    if documents.dim() != 2 or bool((documents.diff(dim=1) < 0).any()):
        raise ValueError(
            f"documents must be (batch, seq) ids, non-decreasing along seq; got shape "
            f"{tuple(documents.shape)}"
        )
    ids = documents.contiguous()
    starts = torch.searchsorted(ids, ids)
    return torch.arange(ids.shape[1], device=ids.device) - starts


def _document_visible(documents: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean: query i sees key j iff j <= i in the same document (reference)."""
    same = documents[:, :, None] == documents[:, None, :]
    return same.tril_()[:, None]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """SDPA with causal masking aligned to the end (queries are the last rows of the keys)."""
    t, t_kv = q.shape[-2], k.shape[-2]
    if documents is not None:
        mask = _document_visible(documents)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if t == t_kv:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    rows = torch.arange(t, device=q.device)[:, None] + (t_kv - t)
    mask = torch.arange(t_kv, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Q·Kᵀ with the G query heads of a group sharing one kv head (ggml's broadcasting)."""
    group = q.shape[1] // k.shape[1]
    return q @ k.repeat_interleave(group, dim=1).transpose(-1, -2)


def _values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return p @ v.repeat_interleave(p.shape[1] // v.shape[1], dim=1)


def _ggml_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """The 2023 graph without flash attention: KQ, diag_mask_inf, soft_max(scale), KQV.

    Packed documents add soft_max's additive mask (-inf across documents), as ggml's
    ``soft_max_ext`` takes a KQ mask.
    """
    masked = ggml_ops.diag_mask_inf(_scores(q, k), n_past=k.shape[-2] - q.shape[-2])
    mask = None
    if documents is not None:
        hidden = ~_document_visible(documents)
        mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(
            hidden, float("-inf")
        )
    return _values(ggml_ops.soft_max(masked, mask, scale=1.0 / math.sqrt(q.shape[-1])), v)


def _torch_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None
) -> torch.Tensor:
    t, t_kv = q.shape[-2], k.shape[-2]
    scores = _scores(q, k) / math.sqrt(q.shape[-1])
    if documents is not None:
        hidden = ~_document_visible(documents)
    else:
        hidden = torch.ones(t, t_kv, dtype=torch.bool, device=q.device).triu_(t_kv - t + 1)
    return _values(torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1), v)


def _torch_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    rows = logits.flatten(0, -2)
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    return F.cross_entropy(rows, targets.flatten(), ignore_index=IGNORE_INDEX)


_OP_SETS = {
    "ggml": dict(
        embedding=ggml_ops.get_rows,
        rms_norm=ggml_ops.rms_norm,
        rope=lambda x, rope: ggml_ops.rope(x, rope.pos, mode="norm", **rope.frequencies()),
        linear=ggml_ops.mul_mat,
        swiglu=ggml_ops.swiglu,
        flash=ggml_ops.flash_attn,
        softmax=_ggml_softmax_attention,
        cross_entropy=lambda z, t: ggml_ops.cross_entropy(z, t, ignore_index=IGNORE_INDEX),
        head_loss=lambda h, w, t: ggml_ops.linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX),
    ),
    "torch": dict(
        embedding=lambda table, ids: F.embedding(ids, table),
        rms_norm=lambda x, eps: F.rms_norm(x, (x.shape[-1],), eps=eps),
        rope=lambda x, rope: torch_rope(x, rope.pos, **rope.frequencies()),
        linear=F.linear,
        swiglu=lambda gate, up: F.silu(gate) * up,
        flash=_sdpa,
        softmax=_torch_softmax_attention,
        cross_entropy=_torch_cross_entropy,
        head_loss=lambda h, w, t: _torch_cross_entropy(F.linear(h, w), t),
    ),
}


def op_set(ops: str, attention: str) -> SimpleNamespace:
    """The functions a model calls, for one op set and one attention choice."""
    table = dict(_OP_SETS[ops])
    table["attention"] = _sdpa if attention == "sdpa" else table[attention]
    return SimpleNamespace(**table)


# ---- the modules -------------------------------------------------------------------------


class Rope(NamedTuple):
    """What rotary embedding needs, made once per forward and handed to every block (as Meta's
    llama hands its ``freqs_cis`` down): token positions and the model's frequency settings."""

    pos: torch.Tensor
    theta: float
    freq_scale: float = 1.0
    freq_factors: torch.Tensor | None = None

    def frequencies(self) -> dict:
        """The keyword arguments both op sets' rope take besides ``x`` and ``pos``."""
        return dict(theta=self.theta, freq_scale=self.freq_scale, freq_factors=self.freq_factors)


class RMSNorm(nn.Module):
    """RMS normalisation followed by a learned per-channel scale (ggml: rms_norm then mul)."""

    def __init__(self, dim: int, eps: float, ops: SimpleNamespace) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.eps) * self.weight


class Linear(nn.Module):
    """A projection whose matmul comes from the selected op set; llama's have no bias, some
    derived models (``attention_bias`` / ``mlp_bias``) add one after the matmul, as ggml does."""

    def __init__(
        self, in_features: int, out_features: int, ops: SimpleNamespace, bias: bool = False
    ) -> None:
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class RopeFrequencyFactors(nn.Module):
    """llama.cpp's ``rope_freqs.weight``: per-pair divisors of rope's frequencies that come with
    a model (Llama 3.1+) and stay as loaded — a buffer, so no optimizer ever updates it."""

    def __init__(self, n_pairs: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(n_pairs))


class KVCache:
    """Preallocated keys/values per layer for incremental decoding.

    Keys are stored after rope, so a decoding step only computes its own positions.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype) -> None:
        shape = (batch, cfg.kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append this step's k/v (batch, heads, t, hd) and return all keys/values so far."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Block(nn.Module):
    """One transformer layer: x + attn(norm(x)), then h + ffn(norm(h)).

    The sub-layers hang directly off the block so that parameter names read exactly like
    llama.cpp's (``blk.N.attn_q.weight``, ``blk.N.ffn_gate.weight``, ...).
    """

    def __init__(self, cfg: ModelConfig, layer: int, ops: SimpleNamespace) -> None:
        super().__init__()
        self.cfg, self.layer, self.ops = cfg, layer, ops
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        qkvo, mlp = cfg.attention_bias, cfg.mlp_bias
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.attn_q = Linear(cfg.dim, q_dim, ops, qkvo)
        self.attn_k = Linear(cfg.dim, kv_dim, ops, qkvo)
        self.attn_v = Linear(cfg.dim, kv_dim, ops, qkvo)
        self.attn_output = Linear(q_dim, cfg.dim, ops, qkvo)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.ffn_gate = Linear(cfg.dim, cfg.hidden_dim, ops, mlp)
        self.ffn_up = Linear(cfg.dim, cfg.hidden_dim, ops, mlp)
        self.ffn_down = Linear(cfg.hidden_dim, cfg.dim, ops, mlp)

    def attention(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.attn_q(x).view(b, t, self.cfg.n_heads, hd)
        k = self.attn_k(x).view(b, t, self.cfg.kv_heads, hd)
        v = self.attn_v(x).view(b, t, self.cfg.kv_heads, hd)
        q = self.ops.rope(q, rope).transpose(1, 2)
        k = self.ops.rope(k, rope).transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        out = self.ops.attention(q, k, v, documents=documents)  # (b, heads, t, hd), causal
        return self.attn_output(out.transpose(1, 2).reshape(b, t, -1))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_down(self.ops.swiglu(self.ffn_gate(x), self.ffn_up(x)))

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``documents`` (B, T): packed document ids; attention stays within each document."""
        h = x + self.attention(self.attn_norm(x), rope, cache, documents)
        return h + self.feed_forward(self.ffn_norm(h))


class Blocks(nn.ModuleList):
    """The stack of blocks, run in order (a container others may replace; see module doc)."""

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for block in self:
            x = block(x, rope, cache, documents)
        return x


class Llama(nn.Module):
    """A llama decoder. ``forward(tokens)`` gives logits; with ``targets`` also the loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        for name in ("vocab_size", "max_seq_len"):
            if getattr(cfg, name) is None:
                raise ConfigError(f"ModelConfig.{name} must be set to build a Llama")
        self.cfg = cfg
        ops = op_set(cfg.ops, cfg.attention)
        self.token_embd = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope_freqs = RopeFrequencyFactors(cfg.head_dim // 2) if cfg.rope_freq_factors else None
        self.blk = Blocks(Block(cfg, i, ops) for i in range(cfg.n_layers))
        self.output_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, ops)
        self.ops = ops
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """GPT-2 / nanoGPT initialisation.

        Matrices ~ N(0, 0.02); the two projections that write into the residual stream
        (attn_output, ffn_down) are scaled down by sqrt(2·n_layers) so the residual's variance
        does not grow with depth; norm weights start at 1, biases at 0.
        """
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(("attn_output.weight", "ffn_down.weight")):
                nn.init.normal_(param, 0.0, residual_std)
            elif param.dim() >= 2:
                nn.init.normal_(param, 0.0, std)
            elif name.endswith(".bias"):
                nn.init.zeros_(param)
            else:
                nn.init.ones_(param)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; ``non_embedding`` leaves out the token table (the N of 6·N)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.token_embd.weight.numel() if non_embedding else n

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.token_embd.weight if self.output is None else self.output.weight

    def rope_for(self, pos: torch.Tensor) -> Rope:
        """The rope settings for tokens at ``pos``, as every block receives them."""
        factors = None if self.rope_freqs is None else self.rope_freqs.weight
        return Rope(pos, self.cfg.rope_theta, 1.0 / self.cfg.rope_scaling_factor, factors)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states (batch, seq, dim) — everything but the lm head.

        ``documents`` (batch, seq): ids of the documents packed into each row (non-decreasing);
        each document then runs as if alone: rope positions restart at 0 at its first token
        and its tokens attend only within it. Training only (no KV cache).
        """
        if documents is not None and cache is not None:
            raise ValueError("documents (packed training rows) cannot be used with a KV cache")
        start = cache.length if cache is not None else 0
        if documents is None:
            pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        else:
            pos = document_positions(documents)
        x = self.ops.embedding(self.token_embd.weight, tokens)
        x = self.blk(x, self.rope_for(pos), cache, documents)
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.output_norm(x)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (batch, seq, vocab); with ``targets`` (-100 = ignore) also the mean loss.

        ``documents``: see :meth:`hidden_states`.
        """
        hidden = self.hidden_states(tokens, cache, documents)
        logits = self.ops.linear(hidden, self.lm_head_weight)
        if targets is None:
            return logits
        return logits, self.ops.cross_entropy(logits, targets)

    def loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean next-token loss for training, without returning logits.

        With the ggml op set the lm head and cross-entropy run fused over row chunks, so the
        (tokens x vocab) logits never exist at once — the largest tensor of a small-model,
        large-vocabulary step. Same value and gradients as ``forward(tokens, targets)[1]``.
        ``documents``: see :meth:`hidden_states`.
        """
        hidden = self.hidden_states(tokens, documents=documents)
        return self.ops.head_loss(hidden, self.lm_head_weight, targets)

    @torch.no_grad()
    def generate_stream(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams | None = None,
        seed: int | None = None,
        stop_tokens: frozenset[int] = frozenset(),
        allowed: torch.Tensor | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield the next token (batch,) one step at a time, decoding with a KV cache.

        Like llama.cpp, generation goes on past the context the model was trained for (rope
        extends to any position) and warns once when it does: what comes out there is the
        model's, and llama.cpp's, best guess outside its training. ``allowed``: see
        ``sampling.sample_next``.
        """
        if tokens.dim() == 1:
            tokens = tokens[None]
        if max_new_tokens < 1:
            return
        total = tokens.shape[1] + max_new_tokens
        if total > self.cfg.max_seq_len:
            warnings.warn(
                f"generating {total} tokens, past the {self.cfg.max_seq_len} the model was "
                "trained on (llama.context_length); llama.cpp continues too, quality may drop",
                stacklevel=3,  # the line that asked for tokens (past the no_grad wrapper)
            )
        param = next(self.parameters())
        cache = KVCache(self.cfg, tokens.shape[0], total, param.device, param.dtype)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        history = tokens.to(param.device)
        logits = self(history, cache=cache)[:, -1]
        params = params or SamplingParams()
        while True:
            next_token = sample_next(logits, params, history, generator, allowed)
            yield next_token
            history = torch.cat((history, next_token[:, None]), dim=1)
            if history.shape[1] >= total or (stop_tokens and next_token[0].item() in stop_tokens):
                return
            logits = self(next_token[:, None], cache=cache)[:, -1]

    def generate(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams | None = None,
        seed: int | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prompt + ``max_new_tokens`` sampled tokens (LongTensor, same batch shape).

        ``params`` defaults to llama.cpp's sampler settings; ``SamplingParams(temperature=0)``
        is greedy decoding.
        """
        squeeze = tokens.dim() == 1
        prompt = tokens[None] if squeeze else tokens
        was_training = self.training
        self.eval()
        try:
            stream = self.generate_stream(prompt, max_new_tokens, params, seed, allowed=allowed)
            new = list(stream)
        finally:
            self.train(was_training)
        out = torch.cat([prompt.to(self.token_embd.weight.device)] + [t[:, None] for t in new], 1)
        return out[0] if squeeze else out
