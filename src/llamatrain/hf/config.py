"""An HF ``config.json`` ⇄ our ``ModelConfig``.

The keys are transformers' ``LlamaConfig`` (and ``Qwen2Config``, ``Qwen3Config``,
``SmolLM3Config``, which share them); a key the file leaves out takes transformers' default for
its model type (``rms_norm_eps`` 1e-6, ``rope_theta`` 10000, no bias, untied; Qwen3's
``head_dim`` 128, SmolLM3's tied embeddings and ``rope_theta`` 2e6), so a folder imports as the
model transformers itself would build from it. Only what one of our families is passes:
model_type ``llama``, ``mistral`` without sliding-window attention (then it is a llama),
``qwen2``, ``qwen3`` or ``smollm3`` without sliding windows (SmolLM3 with llama.cpp's NoPE
pattern: no rope on every 4th layer), with SiLU feed-forwards and a rope llama.cpp runs (see
``llamatrain.hf.rope``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llamatrain.errors import CheckpointError, ConfigError
from llamatrain.hf.rope import rope_scaling_of, rope_theta_of
from llamatrain.model import ModelConfig
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
}
"""The transformers class of each of our families (``ModelConfig.arch``; also its model_type)."""
_MODEL_TYPES = {**{arch: arch for arch in HF_ARCHITECTURES}, "mistral": "llama"}
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
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); fix or remove it") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def model_config_from_hf(hf: Mapping[str, Any], source: str) -> ModelConfig:
    """The ModelConfig of the model an HF ``config.json`` describes.

    Raises CheckpointError, naming the key, for anything that is not a model we can run.
    """
    _check_is_llama(hf, source)
    missing = [key for key in _REQUIRED if hf.get(key) is None]
    if missing:
        raise CheckpointError(f"{source} lacks {', '.join(missing)}; it is not a complete config")
    model_type = hf["model_type"]
    arch = _MODEL_TYPES[model_type]
    given = {k: v for k, v in hf.items() if v is not None}
    get = {**_TRANSFORMERS_DEFAULTS, **_TYPE_DEFAULTS.get(model_type, {}), **given}.get
    if get("hidden_act") != "silu":
        raise CheckpointError(
            f"{source} has hidden_act {get('hidden_act')!r}; a llama's feed-forward is 'silu'"
        )
    scaling = rope_scaling_of(hf, source) or {}
    dim, n_heads = int(get("hidden_size")), int(get("num_attention_heads"))
    head_dim = get("head_dim")
    try:
        cfg = ModelConfig(
            arch=arch,
            vocab_size=int(get("vocab_size")),
            dim=dim,
            n_layers=int(get("num_hidden_layers")),
            n_heads=n_heads,
            n_kv_heads=int(get("num_key_value_heads", n_heads)),
            ffn_dim=int(get("intermediate_size")),
            max_seq_len=int(get("max_position_embeddings")),
            norm_eps=float(get("rms_norm_eps")),
            rope_theta=rope_theta_of(hf, _ROPE_THETA_DEFAULTS.get(model_type, 10000.0)),
            rope_scaling_factor=float(scaling["factor"]) if _is(scaling, "linear") else 1.0,
            rope_freq_factors=_is(scaling, "llama3"),
            key_length=None if head_dim in (None, dim / n_heads) else int(head_dim),
            attention_bias=bool(get("attention_bias")),
            mlp_bias=bool(get("mlp_bias")),
            tie_embeddings=bool(get("tie_word_embeddings")),
        )
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source} describes an invalid {model_type} model: {e}") from e
    if arch == "smollm3":
        _check_no_rope_layers(hf, cfg, source)
    return cfg


def _check_no_rope_layers(hf: Mapping[str, Any], cfg: ModelConfig, source: str) -> None:
    """SmolLM3's NoPE layers must be the ones llama.cpp leaves rope out of (every 4th)."""
    interval = int(hf.get("no_rope_layer_interval") or 4)
    pattern = hf.get("no_rope_layers")
    if pattern is None:
        pattern = [int((i + 1) % interval != 0) for i in range(cfg.n_layers)]
    ours = [int(cfg.uses_rope(i)) for i in range(cfg.n_layers)]
    if [int(bool(x)) for x in pattern] != ours:
        raise CheckpointError(
            f"{source} applies rope on layers {list(pattern)} (no_rope_layers); llama.cpp's "
            f"smollm3 leaves it out of every 4th layer only, {ours}"
        )


def _is(scaling: Mapping[str, Any], kind: str) -> bool:
    return scaling.get("rope_type") == kind


def _check_is_llama(hf: Mapping[str, Any], source: str) -> None:
    """Refuse any model but one of our families (or a mistral that is a llama), by name."""
    model_type = hf.get("model_type")
    architectures = list(hf.get("architectures") or [])
    if model_type not in _MODEL_TYPES:
        named = f"{model_type!r}" + (f" ({', '.join(architectures)})" if architectures else "")
        raise CheckpointError(
            f"{source} describes a {named} model; llamatrain imports the model types "
            f"{', '.join(repr(t) for t in HF_ARCHITECTURES)} (and 'mistral' without "
            "sliding-window attention)"
        )
    if model_type != "mistral" and hf.get("use_sliding_window"):
        raise CheckpointError(
            f"{source} is a {model_type} with sliding-window attention (use_sliding_window = "
            "true); llamatrain's models attend to the whole context — set it to false"
        )
    window = hf.get("sliding_window")
    if model_type == "mistral" and window is not None:
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
        "model_type": cfg.arch,
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
    return config
