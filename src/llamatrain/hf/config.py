"""An HF ``config.json`` ⇄ our ``ModelConfig``.

The keys are transformers' ``LlamaConfig`` (and ``Qwen2Config``, ``Qwen3Config``,
``SmolLM3Config``, which share them); a key the file leaves out takes transformers' default for
its model type (``rms_norm_eps`` 1e-6, ``rope_theta`` 10000, no bias, untied; Qwen3's
``head_dim`` 128, SmolLM3's tied embeddings and ``rope_theta`` 2e6), so a folder imports as the
model transformers itself would build from it. Only what one of our families is passes:
model_type ``llama``, ``mistral`` without sliding-window attention (then it is a llama),
``qwen2``, ``qwen3`` or ``smollm3`` without sliding windows (SmolLM3 with llama.cpp's NoPE
pattern: no rope on every 4th layer), with SiLU feed-forwards and a rope llama.cpp runs (see
``llamatrain.hf.rope``). Gemma 3 is model_type ``gemma3_text`` (``Gemma3ForCausalLM`` with a
``Gemma3TextConfig``): GELU-tanh, llama.cpp's layer pattern (5 sliding-window layers, then a
full one), its attention scale (``query_pre_attn_scalar`` = head_dim, or dim / n_heads at 62
layers), a rope per layer type (``rope_parameters`` per type, or ``rope_theta`` +
``rope_local_base_freq`` + ``rope_scaling``, linear scaling on the full layers only) and no
attention-logit soft-capping.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llamatrain.errors import CheckpointError, ConfigError, shown
from llamatrain.hf.rope import first_number, rope_scaling_of, rope_theta_of
from llamatrain.model_config import ModelConfig
from llamatrain.tokenizer import Tokenizer

__all__ = [
    "HF_ARCHITECTURE",
    "HF_ARCHITECTURES",
    "hf_config",
    "model_config_from_hf",
    "read_json_object",
]

HF_ARCHITECTURE = "LlamaForCausalLM"
HF_ARCHITECTURES = {
    "llama": HF_ARCHITECTURE,
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
"""The transformers class of each of our families (``ModelConfig.arch``; also its model_type)."""
HF_MODEL_TYPES = {**{arch: arch for arch in HF_ARCHITECTURES}, "gemma3": "gemma3_text"}
"""Our arch -> config.json's model_type."""
_MODEL_TYPES = {**{t: arch for arch, t in HF_MODEL_TYPES.items()}, "mistral": "llama"}
"""config.json's model_type -> our arch."""
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_TRANSFORMERS_DEFAULTS = {
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
"""``LlamaConfig``'s values for keys a config.json may leave out."""
_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128},
    "smollm3": {"max_position_embeddings": 32768, "tie_word_embeddings": True},
    "gemma3_text": {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
    },
}
"""Where another model type's config class defaults differently from ``LlamaConfig``."""
_ROPE_THETA_DEFAULTS = {"smollm3": 2000000.0}


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object from one of an HF folder's files (config.json, tokenizer_config.json);
    {} when the file is absent, as the optional ones may be."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # not JSON, not UTF-8, or an integer past 4,300 digits
        raise CheckpointError(
            f"{path} is not valid JSON ({shown(str(e))}); fix or remove it"
        ) from None
    except RecursionError:
        raise CheckpointError(
            f"{path} nests deeper than Python can read (thousands of [ or {{); it is no model's "
            "config — fix or remove it"
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def model_config_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    """The ModelConfig of the model an HF ``config.json`` describes.

    Raises CheckpointError, naming the key, for anything that is not a model we can run: a
    value of the wrong type (a string, a bool or a fraction for a count) included, before any
    is believed; a number out of its field's range (NaN, infinity, <= 0) is the ModelConfig's
    one rule for every source. The counts are checked against the weights
    by ``llamatrain.hf.weights.check_weights_fit`` before anything is built from them.
    """
    _check_is_llama(hf, source)
    missing = [key for key in _REQUIRED if hf.get(key) is None]
    if missing:
        raise CheckpointError(f"{source} lacks {', '.join(missing)}; it is not a complete config")
    _check_value_types(hf, source)
    model_type = hf["model_type"]
    arch = _MODEL_TYPES[model_type]
    given = {k: v for k, v in hf.items() if v is not None}
    given |= {k: int(given[k]) for k in _COUNTS if k in given}  # 4096.0, checked whole above
    if "hidden_activation" in given:  # Gemma's name for it
        given["hidden_act"] = given["hidden_activation"]
    get = {**_TRANSFORMERS_DEFAULTS, **_TYPE_DEFAULTS.get(model_type, {}), **given}.get
    act = "gelu_pytorch_tanh" if arch == "gemma3" else "silu"
    if get("hidden_act") != act:
        raise CheckpointError(
            f"{source} has hidden_act {get('hidden_act')!r}; a {model_type}'s feed-forward is "
            f"{act!r}"
        )
    if arch == "gemma3":
        gemma = _gemma3_fields(hf, get, source)
        scaling = {"rope_type": "linear", "factor": gemma.pop("factor")}
        theta = gemma.pop("rope_theta")
    else:
        gemma = {}
        scaling = rope_scaling_of(hf, source) or {}
        theta = rope_theta_of(hf, _ROPE_THETA_DEFAULTS.get(model_type, 10000.0))
    dim, n_heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim")
    try:
        cfg = ModelConfig(
            arch=arch,
            vocab_size=get("vocab_size"),
            dim=dim,
            n_layers=get("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=get("num_key_value_heads", n_heads),
            ffn_dim=get("intermediate_size"),
            max_seq_len=get("max_position_embeddings"),
            norm_eps=float(get("rms_norm_eps")),
            rope_theta=theta,
            rope_scaling_factor=float(scaling["factor"]) if _is(scaling, "linear") else 1.0,
            rope_freq_factors=_is(scaling, "llama3"),
            key_length=None if head_dim in (None, dim / n_heads) else head_dim,
            attention_bias=bool(get("attention_bias")),
            mlp_bias=bool(get("mlp_bias")),
            tie_embeddings=bool(get("tie_word_embeddings")),
            **gemma,
        )
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source} describes an invalid {model_type} model: {e}") from e
    if arch == "smollm3":
        _check_no_rope_layers(hf, cfg, source)
    if arch == "gemma3":
        _check_gemma3_layers(hf, get, cfg, source)
    return cfg


def _gemma3_fields(hf: Mapping[str, Any], get: Any, source: str) -> dict[str, Any]:
    """Gemma 3's rope bases and linear factor (full layers), window and final soft-cap."""
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(key):
            raise CheckpointError(
                f"{source} sets {key} = {hf[key]!r}; llama.cpp's gemma3 has no such attention "
                "— set it to null/false"
            )
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        params = {}
    full = params.get("full_attention") or {}
    sliding = params.get("sliding_attention") or {}
    if params and not (full or sliding):  # one dict for every layer type
        full = params
    legacy = hf.get("rope_scaling") or {}
    kind = full.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if kind not in ("default", "linear") or sliding.get("rope_type", "default") != "default":
        raise CheckpointError(
            f"{source} uses {kind!r} rope scaling ({sliding.get('rope_type')!r} on sliding "
            "layers); llama.cpp's gemma3 runs linear scaling on the full-attention layers only"
        )
    factor = float(full.get("factor", legacy.get("factor", 1.0))) if kind == "linear" else 1.0
    cap = hf.get("final_logit_softcapping")
    return dict(
        factor=factor,
        rope_theta=first_number(full.get("rope_theta"), hf.get("rope_theta"), 1_000_000.0),
        rope_theta_swa=first_number(
            sliding.get("rope_theta"), hf.get("rope_local_base_freq"), 10000.0
        ),
        sliding_window=int(get("sliding_window")),
        final_logit_softcap=None if cap is None else float(cap),
    )


def _check_gemma3_layers(hf: Mapping[str, Any], get: Any, cfg: ModelConfig, source: str) -> None:
    """The layer types and attention scale must be those llama.cpp's gemma3 has."""
    pattern = hf.get("layer_types")
    if pattern is None:
        given = hf.get("sliding_window_pattern") or cfg.family.swa_every
        step = _count_value(given, source, "sliding_window_pattern")
        if _other_period(step, cfg.family.swa_every, cfg.n_layers):
            raise CheckpointError(
                f"{source} has sliding_window_pattern = {step}; llama.cpp's gemma3 has sliding "
                f"windows on {cfg.family.swa_every - 1} of every {cfg.family.swa_every} layers"
            )
    else:
        n = min(cfg.n_layers, len(pattern) if isinstance(pattern, list) else 0)
        ours = ["sliding_attention" if cfg.is_sliding(i) else "full_attention" for i in range(n)]
        if not isinstance(pattern, list) or pattern != ours or len(pattern) != cfg.n_layers:
            raise CheckpointError(
                f"{source} has the layer types {shown(json.dumps(pattern))} for "
                f"{cfg.n_layers} layers; llama.cpp's gemma3 has sliding windows on 5 of every 6 "
                "layers, the 6th full_attention"
            )
    scalar, expected = get("query_pre_attn_scalar"), cfg.attention_scalar
    if scalar != expected:
        raise CheckpointError(
            f"{source} has query_pre_attn_scalar = {scalar!r}; llama.cpp's gemma3 scales "
            f"attention by 1/sqrt({expected}) for this model — set it to {expected}"
        )


def _check_no_rope_layers(hf: Mapping[str, Any], cfg: ModelConfig, source: str) -> None:
    """SmolLM3's NoPE layers must be the ones llama.cpp leaves rope out of (every 4th)."""
    pattern = hf.get("no_rope_layers")
    if pattern is None:
        given = hf.get("no_rope_layer_interval") or 4
        interval = _count_value(given, source, "no_rope_layer_interval")
        if _other_period(interval, cfg.family.no_rope_every, cfg.n_layers):
            raise CheckpointError(
                f"{source} has no_rope_layer_interval = {interval}; llama.cpp's smollm3 leaves "
                f"rope out of every {cfg.family.no_rope_every}th layer"
            )
        return
    n = min(cfg.n_layers, len(pattern) if isinstance(pattern, list) else 0)
    ours = [int(cfg.uses_rope(i)) for i in range(n)]
    if (
        not isinstance(pattern, list)
        or len(pattern) != cfg.n_layers
        or [int(x) if type(x) in (int, bool) else x for x in pattern] != ours
    ):
        raise CheckpointError(
            f"{source} applies rope on layers {shown(json.dumps(pattern))} (no_rope_layers) of "
            f"{cfg.n_layers}; llama.cpp's smollm3 leaves it out of every 4th layer only"
        )


def _other_period(given: int, ours: int, n_layers: int) -> bool:
    """Whether a layer pattern repeating every ``given`` layers differs from ours (every
    ``ours``) in a model of ``n_layers``: unless equal, both must be past its last layer."""
    return given != ours and min(given, ours) <= n_layers


_COUNTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "head_dim",
    "sliding_window",
    "query_pre_attn_scalar",
    "original_max_position_embeddings",
)
"""config.json's whole-number keys."""
_NUMBERS = (
    "rms_norm_eps",
    "rope_theta",
    "rope_local_base_freq",
    "final_logit_softcapping",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "partial_rotary_factor",
)
"""Its real-number keys (top level, or in a rope dict)."""
_FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
"""Its true/false keys."""


def _check_value_types(hf: Mapping[str, Any], source: str) -> None:
    """CheckpointError naming the first key whose value is not of its kind: a count a
    positive whole number (a bool, a fraction or a string is not; neither is ``4096.0``'s
    kin ``"4096"``), a number a JSON number, a flag true or false; rope dicts are checked too.
    A number's range (finite, positive) is the field's rule, ``settings.check_rules``, which
    holds every source to it (llama3's rope factors, no field's, ``hf.rope``'s)."""
    rope = [(key, hf.get(key)) for key in ("rope_scaling", "rope_parameters")]
    for key, value in rope:
        if value is not None and not isinstance(value, Mapping):
            raise CheckpointError(f"{source}: {key} must be an object or null, not {_kind(value)}")
    places = [("", hf)] + [(f"{key}.", value) for key, value in rope if value]
    places += [
        (f"{key}.{kind}.", sub)
        for key, value in rope
        if value
        for kind, sub in value.items()
        if isinstance(sub, Mapping)  # gemma3's rope dict per layer type
    ]
    for prefix, values in places:
        for key in _COUNTS:
            if values.get(key) is not None:
                _count_value(values[key], source, prefix + key)
        for key in _NUMBERS:
            value = values.get(key)
            if value is not None and type(value) not in (int, float):
                raise CheckpointError(f"{source}: {prefix}{key} = {_shown(value)} must be a number")
    for key in _FLAGS:
        if hf.get(key) is not None and type(hf[key]) is not bool:
            raise CheckpointError(f"{source}: {key} = {_shown(hf[key])} must be true or false")


def _count_value(value: Any, source: str, key: str) -> int:
    """``value`` as a positive whole number (``4096.0`` is one), or CheckpointError."""
    if type(value) is float and math.isfinite(value) and value.is_integer():
        value = int(value)
    if type(value) is not int or value < 1:
        raise CheckpointError(f"{source}: {key} = {_shown(value)} must be a whole number >= 1")
    return value


def _shown(value: Any) -> str:
    """A config value as JSON writes it, cut short for a one-line message."""
    return shown(json.dumps(value) if type(value) in (bool, int, float, str) else _kind(value))


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list"}.get(type(value), type(value).__name__)


def _is(scaling: Mapping[str, Any], kind: str) -> bool:
    return scaling.get("rope_type") == kind


def _check_is_llama(hf: Mapping[str, Any], source: str) -> None:
    """Refuse any model but one of our families (or a mistral that is a llama), by name."""
    model_type = hf.get("model_type")
    listed = hf.get("architectures")
    architectures = [shown(a) for a in listed if isinstance(a, str)] if type(listed) is list else []
    if not isinstance(model_type, str) or model_type not in _MODEL_TYPES:
        named = f"'{shown(model_type)}'" if isinstance(model_type, str) else _kind(model_type)
        named += f" ({', '.join(architectures)})" if architectures else ""
        raise CheckpointError(
            f"{source} describes a {named} model; llamatrain imports the model types "
            f"{', '.join(repr(t) for t in HF_MODEL_TYPES.values())} (and 'mistral' without "
            "sliding-window attention)"
        )
    if model_type not in ("mistral", "gemma3_text") and hf.get("use_sliding_window"):
        raise CheckpointError(
            f"{source} is a {model_type} with sliding-window attention (use_sliding_window = "
            "true); llamatrain's models attend to the whole context — set it to false"
        )
    window = hf.get("sliding_window")
    if model_type == "mistral" and window is not None:  # gemma3's window is its own
        raise CheckpointError(
            f"{source} is a mistral with sliding-window attention (sliding_window = {window}); "
            "llamatrain's llama attends to the whole context — only a mistral with "
            "sliding_window null is a llama"
        )


def hf_config(
    cfg: ModelConfig, tokenizer: Tokenizer, rope_scaling: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The ``config.json`` transformers builds ``cfg``'s model from (``LlamaForCausalLM``,
    or the class of ``cfg.arch``: ``HF_ARCHITECTURES``).

    Written in the transformers 4 spelling (``rope_theta`` + ``rope_scaling``), which
    transformers 5 and llama.cpp's converter read as well; ``rope_scaling`` comes from
    ``llamatrain.hf.rope.hf_rope_scaling``.
    """
    config: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[cfg.arch]],
        "model_type": HF_MODEL_TYPES[cfg.arch],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if rope_scaling is None else dict(rope_scaling),
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if tokenizer.pad_id is not None or cfg.arch == "smollm3":  # its default is Llama 3's
        config["pad_token_id"] = tokenizer.pad_id
    if cfg.arch in ("qwen2", "qwen3", "smollm3"):
        config["use_sliding_window"] = False
    if cfg.arch == "qwen2":  # q/k/v biases are Qwen2's own; it has no switch for them
        del config["attention_bias"], config["mlp_bias"]
    if cfg.arch == "qwen3":
        del config["mlp_bias"]
    if cfg.arch == "smollm3":
        config["no_rope_layer_interval"] = cfg.family.no_rope_every
        config["no_rope_layers"] = [int(cfg.uses_rope(i)) for i in range(cfg.n_layers)]
    if cfg.arch == "gemma3":
        _gemma3_config(config, cfg, tokenizer)
    return config


def _gemma3_config(config: dict[str, Any], cfg: ModelConfig, tokenizer: Tokenizer) -> None:
    """Gemma3TextConfig's spelling (transformers 4 keys, which 5 reads too)."""
    del config["hidden_act"], config["mlp_bias"]
    config.update(
        hidden_activation="gelu_pytorch_tanh",
        pad_token_id=tokenizer.pad_id,
        rope_local_base_freq=cfg.rope_theta_swa,
        sliding_window=cfg.sliding_window,
        sliding_window_pattern=cfg.family.swa_every,
        layer_types=[
            "sliding_attention" if cfg.is_sliding(i) else "full_attention"
            for i in range(cfg.n_layers)
        ],
        query_pre_attn_scalar=cfg.attention_scalar,
        final_logit_softcapping=cfg.final_logit_softcap,
        attn_logit_softcapping=None,
        use_bidirectional_attention=False,
    )
    if cfg.rope_scaling_factor != 1.0:
        config["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
