"""The llama model as one readable ``nn.Module``, and ``ModelConfig``, the ``[model]`` section.

Parameter names *are* llama.cpp's GGUF tensor names (``token_embd.weight``,
``blk.0.attn_q.weight``, ...): the module tree is laid out so that ``state_dict()`` keys need
no translation, which makes :func:`tensor_shapes` the single name map that export and import
consult. Rope uses llama.cpp's convention for the family (NORM, adjacent pairs, for llama and
smollm3; NEOX, pairs i and i + head_dim/2, for qwen2, qwen3, gemma3), so Q/K are stored as
llama.cpp's GGUF stores them.

One decoder serves every family in :data:`FAMILIES` (llama.cpp's ``general.architecture``):
they differ from llama by a few switches (:class:`Family`) — the rope's pairing, rope left out
on some layers (NoPE), per-head q/k RMSNorm, q/k/v biases — which the modules read, never the
family's name (gemma3 adds scaled embeddings, sandwich norms, GELU gating and sliding-window
layers with their own rope base). llama.cpp fixes the switches by the architecture (its GGUF
has no key for them), so ``ModelConfig.arch`` chooses them all at once.

The same module runs on two interchangeable op sets, ``ops="ggml"`` (ggml's backward
formulas) and ``ops="torch"`` (plain PyTorch), with three attention choices: the modules
call the methods of the ``OpSet`` that ``llamatrain.ops.sets.op_set`` picks.

The model knows nothing of files, activation checkpointing, LoRA, parallelism or sampling:
those wrap it from outside (``llamatrain.activation_checkpointing`` swaps ``blk`` for a
container that recomputes segments; the names stay the same). ``llamatrain.generate``
decodes with it, handing it a :class:`KVCache`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from llamatrain.errors import ConfigError
from llamatrain.ops.sets import ATTENTIONS, OPS, OpSet, op_set
from llamatrain.ops.sets import IGNORE_INDEX as IGNORE_INDEX  # for the data and the losses
from llamatrain.settings import check_rules, divisors, setting

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
"""A block's linear layers, by their llama.cpp names (``blk.N.<name>.weight``): the one list
the name map, LoRA's targets and the adapter format use."""
RUN_CHOICES = ("ops", "attention", "init_from")
"""Fields that choose how a model is built or run, not what the network computes."""


class Family(NamedTuple):
    """How a model family's graph differs from llama's, as llama.cpp builds it
    (``src/models/<arch>.cpp``); llama's row is all defaults."""

    rope_mode: str = "norm"
    """``"norm"``: rope turns adjacent pairs; ``"neox"``: element i with i + head_dim/2."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k before rope (``blk.N.attn_q_norm`` / ``attn_k_norm``)."""
    qkv_bias: bool = False
    """q/k/v projections always carry biases (the output projection none)."""
    no_rope_every: int = 0
    """Rope is left out of layers il with (il + 1) % no_rope_every == 0 (0: none)."""
    biases: bool = True
    """llama.cpp's loader takes optional ``attention_bias`` / ``mlp_bias`` tensors."""
    rope_freqs: bool = True
    """llama.cpp's graph applies a ``rope_freqs.weight`` tensor."""
    embed_scale: bool = False
    """The input embeddings (not the tied head) are multiplied by float32 sqrt(dim)."""
    post_norms: bool = False
    """Sandwich norms: the attention and feed-forward outputs are RMS-normed before their
    residual add (``blk.N.post_attention_norm`` / ``blk.N.post_ffw_norm``)."""
    activation: str = "swiglu"
    """The feed-forward's gating: ``"swiglu"`` silu(gate)·up, ``"geglu"`` gelu_tanh(gate)·up."""
    swa_every: int = 0
    """Sliding-window attention on layers il with (il + 1) % swa_every != 0, full attention on
    the others (0: none); the sliding layers rope with their own base, unscaled."""
    scale_by_dim_at: int = 0
    """A model of this many layers scales attention by 1/sqrt(dim / n_heads) instead of
    1/sqrt(head_dim) (llama.cpp's Gemma 3 27B rule; 0: never)."""


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "qwen2": Family(rope_mode="neox", qkv_bias=True, biases=False, rope_freqs=False),
    "qwen3": Family(rope_mode="neox", qk_norm=True, biases=False, rope_freqs=False),
    # smollm3's graph would add biases, but llama.cpp's loader takes none: it refuses such a file
    "smollm3": Family(no_rope_every=4, biases=False, rope_freqs=False),
    "gemma3": Family(
        rope_mode="neox",
        qk_norm=True,
        biases=False,
        rope_freqs=False,
        embed_scale=True,
        post_norms=True,
        activation="geglu",
        swa_every=6,
        scale_by_dim_at=62,
    ),
}
"""The families llamatrain trains, by llama.cpp's architecture name (``general.architecture``,
also the prefix of the hyper-parameter keys: ``qwen3.block_count``)."""
ARCHS = tuple(FAMILIES)
SWA_DEFAULTS = {"sliding_window": 4096, "rope_theta_swa": 10000.0}
"""A sliding-window family's values for the fields a config leaves unset (transformers'
Gemma 3 defaults; llama.cpp's rope base of the sliding layers)."""


def _nowhere(key: str) -> str:
    return ""


@dataclass
class ModelConfig:
    """Architecture of a llama or a family derived from it (ignored when ``init_from`` is set)."""

    arch: str = setting(
        "llama",
        "model family, llama.cpp's general.architecture: qwen2 = llama + q/k/v biases and "
        "NEOX rope (Qwen2/2.5); qwen3 = llama + per-head q/k RMSNorm and NEOX rope; smollm3 "
        "= llama without rope on every 4th layer; gemma3 = Gemma 3 (scaled embeddings, q/k "
        "and sandwich norms, GELU gating, sliding-window attention on 5 of 6 layers)",
        choices=ARCHS,
    )
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
    sliding_window: int | None = setting(
        None,
        "gemma3: the sliding layers' attention window, keys i-w < j <= i "
        "(gemma3.attention.sliding_window); unset = 4096",
        gt=0,
    )
    rope_theta_swa: float | None = setting(
        None,
        "gemma3: RoPE base of the sliding layers (gemma3.rope.freq_base_swa); unset = 10000",
        gt=0,
    )
    final_logit_softcap: float | None = setting(
        None,
        "gemma3: logits = c·tanh(logits / c) (gemma3.final_logit_softcapping); unset = none",
        gt=0,
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
        if FAMILIES.get(self.arch, FAMILIES["llama"]).swa_every:
            for name, value in SWA_DEFAULTS.items():
                if getattr(self, name) is None:
                    setattr(self, name, value)
        self.validate()

    @property
    def family(self) -> Family:
        """The graph's switches for ``arch``."""
        return FAMILIES[self.arch]

    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v carry biases (the family's, or ``attention_bias``'s)."""
        return self.family.qkv_bias or self.attention_bias

    def uses_rope(self, layer: int) -> bool:
        """Whether block ``layer`` applies rope (NoPE families leave it out of some)."""
        step = self.family.no_rope_every
        return step == 0 or (layer + 1) % step != 0

    def is_sliding(self, layer: int) -> bool:
        """Whether block ``layer`` attends within ``sliding_window`` (and ropes with
        ``rope_theta_swa``) rather than to the whole context."""
        step = self.family.swa_every
        return step != 0 and (layer + 1) % step != 0

    @property
    def attention_scalar(self) -> int | None:
        """Gemma's ``query_pre_attn_scalar`` as llama.cpp fixes it (it reads no key for it):
        head_dim, or dim / n_heads in a model of ``scale_by_dim_at`` layers; None for the
        families without it."""
        if not self.family.swa_every:
            return None
        by_dim = self.n_layers == self.family.scale_by_dim_at
        return self.dim // self.n_heads if by_dim else self.head_dim

    @property
    def attention_scale(self) -> float | None:
        """The attention's score scale, 1/sqrt(attention_scalar); None: the op's default
        1/sqrt(head_dim)."""
        scalar = self.attention_scalar
        return None if scalar is None else 1.0 / math.sqrt(scalar)

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
        family = FAMILIES.get(self.arch)
        if family is None:  # check_rules names the choices; a direct caller may skip them
            raise ConfigError(f"model.arch = {self.arch!r} must be one of {list(ARCHS)}")
        unsupported = [
            name
            for name, on, allowed in (
                ("attention_bias", self.attention_bias, family.biases),
                ("mlp_bias", self.mlp_bias, family.biases),
                ("rope_freq_factors", self.rope_freq_factors, family.rope_freqs),
            )
            if on and not allowed
        ]
        if not family.swa_every:
            unsupported += [
                name
                for name in ("sliding_window", "rope_theta_swa", "final_logit_softcap")
                if getattr(self, name) is not None
            ]
        if unsupported:
            key = f"model.{unsupported[0]}"
            value = getattr(self, unsupported[0])
            shown = "true" if value is True else repr(value)
            raise ConfigError(
                f"{key} = {shown}{where(key)}: llama.cpp's {self.arch!r} architecture has no "
                f"such tensors or keys; leave it unset (false) or choose another model.arch"
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
    qkv = cfg.qkv_bias
    sides = (  # (out, in, has a bias) of each of PROJECTIONS, in order
        (q, e, qkv),
        (kv, e, qkv),
        (kv, e, qkv),
        (e, q, cfg.attention_bias),
        (f, e, cfg.mlp_bias),
        (f, e, cfg.mlp_bias),
        (e, f, cfg.mlp_bias),
    )
    projections = dict(zip(PROJECTIONS, sides, strict=True))
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (e,)
        shapes[b + "ffn_norm.weight"] = (e,)
        for name, (n_out, n_in, bias) in projections.items():
            shapes[f"{b}{name}.weight"] = (n_out, n_in)
            if bias:
                shapes[f"{b}{name}.bias"] = (n_out,)
            if name == "attn_k" and cfg.family.qk_norm:  # per-head norms of q and k
                shapes[b + "attn_q_norm.weight"] = (cfg.head_dim,)
                shapes[b + "attn_k_norm.weight"] = (cfg.head_dim,)
        if cfg.family.post_norms:
            shapes[b + "post_attention_norm.weight"] = (e,)
            shapes[b + "post_ffw_norm.weight"] = (e,)
    shapes["output_norm.weight"] = (e,)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (v, e)
    return shapes


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


# ---- the modules -------------------------------------------------------------------------


class Rope(NamedTuple):
    """What rotary embedding needs, made once per forward and handed to every block (as Meta's
    llama hands its ``freqs_cis`` down): token positions and the model's frequency settings."""

    pos: torch.Tensor
    theta: float
    freq_scale: float = 1.0
    freq_factors: torch.Tensor | None = None
    mode: str = "norm"
    theta_swa: float | None = None
    """The base of the sliding-window layers, which rope unscaled (llama.cpp's
    ``rope_freq_base_train_swa`` / ``rope_freq_scale_train_swa = 1``)."""

    def frequencies(self, sliding: bool = False) -> dict:
        """The keyword arguments of ``OpSet.rope`` besides ``x`` and ``pos``, for a full or a
        sliding-window layer."""
        if sliding:
            return dict(
                theta=self.theta_swa, freq_scale=1.0, freq_factors=self.freq_factors,
                mode=self.mode,
            )  # fmt: skip
        return dict(
            theta=self.theta,
            freq_scale=self.freq_scale,
            freq_factors=self.freq_factors,
            mode=self.mode,
        )


class RMSNorm(nn.Module):
    """RMS normalisation followed by a learned per-channel scale (ggml: rms_norm then mul)."""

    def __init__(self, dim: int, eps: float, ops: OpSet) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.eps) * self.weight


class Linear(nn.Module):
    """A projection whose matmul comes from the selected op set; llama's have no bias, some
    derived models (``attention_bias`` / ``mlp_bias``) add one after the matmul, as ggml does."""

    def __init__(self, in_features: int, out_features: int, ops: OpSet, bias: bool = False) -> None:
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


class KVCache(nn.Module):
    """Preallocated keys/values of every layer for incremental decoding: two buffers
    (layers, batch, kv_heads, max_len, head_dim), which ``.to()`` moves like the model's.

    Keys are stored after rope, so a decoding step only computes its own positions.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype) -> None:
        super().__init__()
        shape = (cfg.n_layers, batch, cfg.kv_heads, max_len, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append this step's k/v (batch, heads, t, hd) and return all keys/values so far."""
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Block(nn.Module):
    """One transformer layer: x + attn(norm(x)), then h + ffn(norm(h)).

    The sub-layers hang directly off the block so that parameter names read exactly like
    llama.cpp's (``blk.N.attn_q.weight``, ``blk.N.ffn_gate.weight``, ...). The family's
    switches (``cfg.family``) add q/k norms, q/k/v biases, sandwich norms (x + post(attn(...)),
    h + post(ffn(...))), GELU gating, a sliding window with its own rope base, or leave rope
    out of this layer.
    """

    def __init__(self, cfg: ModelConfig, layer: int, ops: OpSet) -> None:
        super().__init__()
        self.cfg, self.layer, self.ops = cfg, layer, ops
        self.rotates = cfg.uses_rope(layer)
        self.sliding = cfg.is_sliding(layer)
        self.window = cfg.sliding_window if self.sliding else None
        self.scale = cfg.attention_scale
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        qkv, mlp = cfg.qkv_bias, cfg.mlp_bias
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.attn_q = Linear(cfg.dim, q_dim, ops, qkv)
        self.attn_k = Linear(cfg.dim, kv_dim, ops, qkv)
        self.attn_v = Linear(cfg.dim, kv_dim, ops, qkv)
        self.attn_output = Linear(q_dim, cfg.dim, ops, cfg.attention_bias)
        if cfg.family.qk_norm:  # per head, over head_dim (llama.cpp's build_norm on 3-d q/k)
            self.attn_q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, ops)
            self.attn_k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, ops)
        else:
            self.attn_q_norm = self.attn_k_norm = None
        if cfg.family.post_norms:  # llama.cpp: attn_post_norm / ffn_post_norm
            self.post_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        else:
            self.post_attention_norm = None
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.ffn_gate = Linear(cfg.dim, cfg.hidden_dim, ops, mlp)
        self.ffn_up = Linear(cfg.dim, cfg.hidden_dim, ops, mlp)
        self.ffn_down = Linear(cfg.hidden_dim, cfg.dim, ops, mlp)
        self.post_ffw_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops) if cfg.family.post_norms else None
        self.gating = ops.geglu if cfg.family.activation == "geglu" else ops.swiglu

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
        if self.attn_q_norm is not None:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        if self.rotates:
            q = self.ops.rope(q, rope.pos, **rope.frequencies(self.sliding))
            k = self.ops.rope(k, rope.pos, **rope.frequencies(self.sliding))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        if self.window is None and self.scale is None:
            out = self.ops.attention(q, k, v, documents)  # (b, heads, t, hd), causal
        else:  # within the window (and the document), Gemma's scale
            out = self.ops.attention(q, k, v, documents, window=self.window, scale=self.scale)
        return self.attn_output(out.transpose(1, 2).reshape(b, t, -1))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_down(self.gating(self.ffn_gate(x), self.ffn_up(x)))

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``documents`` (B, T): packed document ids; attention stays within each document."""
        a = self.attention(self.attn_norm(x), rope, cache, documents)
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        h = x + a
        f = self.feed_forward(self.ffn_norm(h))
        if self.post_ffw_norm is not None:
            f = self.post_ffw_norm(f)
        return h + f


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
    """A llama-family decoder (any of :data:`FAMILIES`). ``forward(tokens)`` gives logits; with
    ``targets`` also the loss."""

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

    @property
    def embed_scale(self) -> float:
        """sqrt(dim) rounded to float32, as ggml's ``sqrtf(n_embd)`` (families with
        ``embed_scale``)."""
        return float(torch.tensor(math.sqrt(self.cfg.dim), dtype=torch.float32))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm head on final-normed hidden states, soft-capped when the config says so."""
        logits = self.ops.linear(hidden, self.lm_head_weight)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else self.ops.softcap(logits, cap)

    def rope_for(self, pos: torch.Tensor) -> Rope:
        """The rope settings for tokens at ``pos``, as every block receives them."""
        factors = None if self.rope_freqs is None else self.rope_freqs.weight
        scale = 1.0 / self.cfg.rope_scaling_factor
        mode, swa = self.cfg.family.rope_mode, self.cfg.rope_theta_swa
        return Rope(pos, self.cfg.rope_theta, scale, factors, mode, swa)

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
        if self.cfg.family.embed_scale:  # llama.cpp: ggml_scale by sqrtf(n_embd)
            x = x * self.embed_scale
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
        logits = self.head_logits(self.hidden_states(tokens, cache, documents))
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
        cap = self.cfg.final_logit_softcap
        if cap is None:
            return self.ops.head_loss(hidden, self.lm_head_weight, targets)
        return self.ops.head_loss(hidden, self.lm_head_weight, targets, softcap=cap)
