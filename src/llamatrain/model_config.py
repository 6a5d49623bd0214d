"""``ModelConfig``, the ``[model]`` section, and what it decides: the model families' switches
(:class:`Family`, :data:`FAMILIES`) and :func:`tensor_shapes`, the GGUF name map.

llama.cpp fixes a family's switches by its architecture (its GGUF has no key for them), so
``ModelConfig.arch`` chooses them all at once; the modules of ``llamatrain.model`` read the
switches, never the family's name. Parameter names *are* llama.cpp's GGUF tensor names, so
:func:`tensor_shapes`, computed from the config alone, is the single name map that export and
import consult.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from llamatrain.errors import ConfigError
from llamatrain.ops.sets import ATTENTIONS, AUTO, OPS
from llamatrain.settings import check_rules, divisors, setting

PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
"""A block's linear layers, by their llama.cpp names (``blk.N.<name>.weight``): the one list
the name map, LoRA's targets and the adapter format use."""
VOCAB_TABLES = ("token_embd.weight", "output.weight")
"""The tensors whose rows are the vocabulary: the token table and an untied lm head (a QLoRA
run keeps them as its file stores them, ``lora.FrozenTable``)."""
UINT32_MAX = 2**32 - 1
"""The largest count or width a GGUF holds (llama.cpp's hyper-parameter keys are uint32): a
larger one is refused here, not at export, where it would not fit the key."""
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
    dim: int = setting(256, "embedding width (llama.embedding_length)", gt=0, le=UINT32_MAX)
    n_layers: int = setting(
        4, "number of transformer blocks (llama.block_count)", gt=0, le=UINT32_MAX
    )
    n_heads: int = setting(
        8, "attention heads; head_dim = dim / n_heads must be even", gt=0, le=UINT32_MAX
    )
    n_kv_heads: int | None = setting(
        None, "key/value heads for grouped-query attention; unset = n_heads", gt=0, le=UINT32_MAX
    )
    ffn_dim: int | None = setting(
        None, "feed-forward width; unset = 2/3·4·dim rounded up to multiple_of", gt=0, le=UINT32_MAX
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
        le=UINT32_MAX,
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
        None,
        "attention head width (llama.attention.key_length); unset = dim / n_heads",
        gt=0,
        le=UINT32_MAX,
    )
    attention_bias: bool = setting(False, "q/k/v/output projections carry bias vectors")
    mlp_bias: bool = setting(False, "gate/up/down projections carry bias vectors")
    tie_embeddings: bool = setting(
        False, "share token embedding and output head (no output.weight)"
    )
    ops: str = setting(
        AUTO,
        "'ggml' = ops with ggml's backward semantics; 'torch' = PyTorch's built-in ops; "
        "'auto' = 'torch' on CUDA, 'ggml' on the CPU",
        choices=(*OPS, AUTO),
    )
    attention: str = setting(
        AUTO,
        "'flash' = memory-efficient attention (ggml: blockwise with the 2023 flash_attn_back; "
        "torch: SDPA); 'softmax' = scores, diag_mask_inf and soft_max as the 2023 graph "
        "without --use-flash; 'sdpa' = PyTorch's fused kernels (fastest on CUDA); 'auto' = "
        "'sdpa' on CUDA with the torch ops, else 'flash'",
        choices=(*ATTENTIONS, AUTO),
    )
    init_from: str | None = setting(
        None,
        "model to finetune from: a llama GGUF or an HF folder (config.json + safetensors); its "
        "architecture then overrides this section",
    )
    vocab_size: int | None = setting(
        None, "vocabulary size: the tokenizer's", gt=0, le=UINT32_MAX, derived=True
    )
    max_seq_len: int | None = setting(
        None,
        "trained context length (llama.context_length): data.n_ctx",
        gt=0,
        le=UINT32_MAX,
        derived=True,
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
