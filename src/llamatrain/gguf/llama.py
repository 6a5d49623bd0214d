"""The llama mapping of GGUF: which keys and tensors make a file llama.cpp runs as a llama.

llama.cpp expects ``general.architecture`` (``"llama"``, or another family of
``llamatrain.model_config.FAMILIES``: ``"qwen2"``, ``"qwen3"``, ``"smollm3"``, ``"gemma3"``), the
hyper-parameter keys under that name (``llama.block_count``, ``qwen3.block_count``, …), the
``tokenizer.ggml.*`` keys and *exactly* the model's tensors (an extra tensor makes it refuse
the file). An exported model, a training checkpoint (the model plus ``training.*`` keys and
``optimizer.*`` / ``training.*`` tensors) and a vocabulary are all written by ``write_model`` /
``write_vocab`` here, so a checkpoint is guaranteed to carry exactly what an exported model
carries; ``read_model`` reads any of them, ours or llama.cpp's, back into a ``ModelConfig``, the
model's tensors and the tokenizer (the caller builds the ``Llama``). The ``tokenizer.ggml.*``
keys themselves are ``llamatrain.gguf.vocab``'s mapping; this module puts them in files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llamatrain.errors import ConfigError, GGUFError
from llamatrain.gguf.export_types import general_file_type
from llamatrain.gguf.file import (
    INTEGER_TYPES,
    GGUFContents,
    GGUFSource,
    load_tensor_data,
    read_gguf,
    read_gguf_metadata,
    typed_value,
)
from llamatrain.gguf.key_kinds import CONFIG_KEY, check_key_kinds
from llamatrain.gguf.vocab import tokenizer_from_metadata, tokenizer_metadata
from llamatrain.gguf.write import DeferredTensor, TensorData, TensorToWrite, write_gguf
from llamatrain.model_config import ARCHS, FAMILIES, ModelConfig, tensor_shapes
from llamatrain.tokenizer import Tokenizer

__all__ = [
    "ARCHITECTURE",
    "ARCHS",
    "CHECKPOINT_TENSOR_PREFIXES",
    "CONFIG_KEY",
    "LlamaFile",
    "check_extras",
    "check_key_kinds",
    "check_tensors",
    "inherited_metadata",
    "model_config_from_metadata",
    "model_metadata",
    "read_model",
    "read_tokenizer",
    "write_model",
    "write_vocab",
]

ARCHITECTURE = "llama"
"""The architecture of a vocab-only file, and the default family."""
CHECKPOINT_TENSOR_PREFIXES = ("optimizer.", "training.")
"""Tensors under these prefixes are a checkpoint's training state, never model weights."""
REQUIRED_MODEL_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "attention.head_count",
    "attention.layer_norm_rms_epsilon",
)
"""Hyper-parameter keys every model file has, after its ``<arch>.`` prefix."""
_DERIVED_FIELDS = {
    "vocab_size": "the tokenizer's vocabulary size",
    "max_seq_len": "the context length the model is trained for",
}
_NOT_INHERITED = {
    "general.architecture",
    "general.file_type",
    "general.quantization_version",
    "general.alignment",
}
"""``general.*`` keys that describe the file, not the model: the writer sets them itself."""
_TENSOR_FIX = "a model GGUF holds exactly Llama(config).state_dict() — re-export the model"
_INTEGER_TYPE_NAMES = {dtype: qtype.name for qtype, dtype in INTEGER_TYPES.items()}


# ----------------------------------------------------------------------------- the config


def model_metadata(cfg: ModelConfig) -> dict[str, Any]:
    """The ``<arch>.*`` keys (the set llama.cpp's own model saver writes) and ``CONFIG_KEY``.

    Values carry the numpy types llama.cpp reads them as (UINT32, FLOAT32).
    """
    for name, meaning in _DERIVED_FIELDS.items():
        if getattr(cfg, name) is None:
            raise GGUFError(
                f"the model config has no {name}; a GGUF records it — set it to {meaning}"
            )
    u32, f32, a = np.uint32, np.float32, cfg.arch
    metadata = {
        a + ".context_length": u32(cfg.max_seq_len),
        a + ".embedding_length": u32(cfg.dim),
        a + ".block_count": u32(cfg.n_layers),
        a + ".feed_forward_length": u32(cfg.hidden_dim),
        a + ".attention.head_count": u32(cfg.n_heads),
        a + ".attention.head_count_kv": u32(cfg.kv_heads),
        a + ".attention.layer_norm_rms_epsilon": f32(cfg.norm_eps),
        a + ".rope.freq_base": f32(cfg.rope_theta),
        a + ".rope.dimension_count": u32(cfg.head_dim),
        a + ".vocab_size": u32(cfg.vocab_size),
        CONFIG_KEY: json.dumps(cfg.architecture(), sort_keys=True),
    }
    if cfg.key_length is not None:
        metadata[a + ".attention.key_length"] = u32(cfg.key_length)
        metadata[a + ".attention.value_length"] = u32(cfg.key_length)
    if cfg.rope_scaling_factor != 1.0:
        metadata[a + ".rope.scaling.type"] = "linear"
        metadata[a + ".rope.scaling.factor"] = f32(cfg.rope_scaling_factor)
    if cfg.family.swa_every:  # the pattern itself is llama.cpp's for the architecture
        metadata[a + ".attention.sliding_window"] = u32(cfg.sliding_window)
        metadata[a + ".rope.freq_base_swa"] = f32(cfg.rope_theta_swa)
    if cfg.final_logit_softcap is not None:
        metadata[a + ".final_logit_softcapping"] = f32(cfg.final_logit_softcap)
    return metadata


def model_config_from_metadata(contents: GGUFContents) -> ModelConfig:
    """The ModelConfig a model GGUF describes: ours from ``CONFIG_KEY``, checked against the
    ``<arch>.*`` keys and tensor shapes; a foreign file's from those alone."""
    meta, p = contents.metadata, contents.path
    arch = _check_architecture(meta, p)
    check_key_kinds(meta, p)
    hp = _hyper_parameters(meta, arch)
    _check_required_keys(hp, arch, p)
    _check_dense(hp, arch, p)
    derived = _architecture_from_keys(contents, arch, hp)
    try:
        cfg = ModelConfig(**derived)  # the keys held to the rules every source is held to
        if CONFIG_KEY in meta:
            cfg = _config_from_json(meta[CONFIG_KEY], derived, arch, p)
        cfg.validate()
    except (ConfigError, TypeError, ValueError) as e:
        raise GGUFError(f"{p} describes an invalid {arch} model: {e}") from e
    return cfg


def _hyper_parameters(meta: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The ``<arch>.*`` keys without their prefix (``qwen3.block_count`` -> ``block_count``)."""
    prefix = arch + "."
    return {k.removeprefix(prefix): v for k, v in meta.items() if k.startswith(prefix)}


def _check_required_keys(hp: Mapping[str, Any], arch: str, p: Path) -> None:
    missing = [f"{arch}.{k}" for k in REQUIRED_MODEL_KEYS if k not in hp]
    if missing:
        raise GGUFError(
            f"{p} lacks the required key(s) {', '.join(missing)}; it is not a complete {arch} "
            "model — re-export it with llamatrain or llama.cpp's converter"
        )


def _check_dense(hp: Mapping[str, Any], arch: str, p: Path) -> None:
    if int(hp.get("expert_count", 0) or 0) > 0:
        raise GGUFError(
            f"{p} is a mixture-of-experts {arch}; llamatrain supports dense models only"
        )


def _rope_scaling_factor(hp: Mapping[str, Any], arch: str, p: Path) -> float:
    """The linear rope scaling factor, read as llama.cpp reads it.

    llama.cpp's own saver writes type "linear" with factor 0, which means no scaling; older
    files say ``<arch>.rope.scale_linear``. YaRN and the other extrapolation schemes change the
    attention itself; llamatrain does not train them.
    """
    scaling = hp.get("rope.scaling.type", "linear")
    factor = float(hp.get("rope.scaling.factor", 0.0) or 0.0)
    if scaling not in ("none", "linear"):
        raise GGUFError(
            f"{p} uses {scaling!r} rope scaling ({arch}.rope.scaling.type); llamatrain "
            "supports linear scaling and rope_freqs frequency factors only — finetune a model "
            "without it"
        )
    if scaling == "none" or factor == 0.0:
        factor = float(hp.get("rope.scale_linear", 1.0) or 1.0)
    return factor


def _architecture_from_keys(
    contents: GGUFContents, arch: str, hp: Mapping[str, Any]
) -> dict[str, Any]:
    """ModelConfig keyword arguments from the ``<arch>.*`` keys, the vocabulary and tensors."""
    meta, p, tensors = contents.metadata, contents.path, contents.tensors
    dim = int(hp["embedding_length"])
    n_heads = int(hp["attention.head_count"])
    key_length = _key_length(hp, arch, dim, n_heads, p)
    if "feed_forward_length" in hp:
        ffn_dim = int(hp["feed_forward_length"])
    elif "blk.0.ffn_gate.weight" in tensors:
        ffn_dim = int(tensors["blk.0.ffn_gate.weight"].shape[0])
    else:
        raise GGUFError(f"{p} lacks {arch}.feed_forward_length and blk.0.ffn_gate.weight")
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError(f"{p} has no vocabulary (tokenizer.ggml.tokens); re-export the model")
    return _sliding_window_keys(hp, arch, p) | dict(
        arch=arch,
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        dim=dim,
        n_layers=int(hp["block_count"]),
        n_heads=n_heads,
        n_kv_heads=int(hp.get("attention.head_count_kv", n_heads)),
        ffn_dim=ffn_dim,
        max_seq_len=int(hp["context_length"]),
        norm_eps=float(hp["attention.layer_norm_rms_epsilon"]),
        rope_theta=float(hp.get("rope.freq_base", 10000.0)),
        rope_scaling_factor=_rope_scaling_factor(hp, arch, p),
        rope_freq_factors="rope_freqs.weight" in tensors,
        key_length=key_length,
        attention_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_gate.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
    )


def _sliding_window_keys(hp: Mapping[str, Any], arch: str, p: Path) -> dict[str, Any]:
    """ModelConfig's sliding-window fields from a sliding-window family's keys ({} for the
    others): the window (required: without it llama.cpp runs every layer on the whole
    context), the sliding layers' rope base (llama.cpp's default 10000) and the optional final
    logit soft-cap. The layer pattern is the architecture's; a file that sets another is
    refused."""
    step = FAMILIES[arch].swa_every
    if not step:
        return {}
    window = int(hp.get("attention.sliding_window", 0) or 0)
    if window <= 0:
        raise GGUFError(
            f"{p} has no {arch}.attention.sliding_window; llamatrain's {arch} has "
            "sliding-window layers — set the key to the model's window"
        )
    pattern = hp.get("attention.sliding_window_pattern", step)
    if not isinstance(pattern, (int, np.integer)) or int(pattern) != step:
        raise GGUFError(
            f"{p}: {arch}.attention.sliding_window_pattern = {pattern!r}; llamatrain's {arch} "
            f"has full attention on every {step}th layer only"
        )
    cap = hp.get("final_logit_softcapping")  # 0 is llama.cpp's "none"; NaN or < 0 is no cap
    return dict(
        sliding_window=window,
        rope_theta_swa=float(hp.get("rope.freq_base_swa", 10000.0)),
        final_logit_softcap=None if cap is None or cap == 0 else float(cap),
    )


def _key_length(hp: Mapping[str, Any], arch: str, dim: int, n_heads: int, p: Path) -> int | None:
    """The head width when it is not ``dim / n_heads`` (None when it is).

    llama.cpp takes ``<arch>.attention.key_length`` for it; values must be as wide as keys
    and rope must turn the whole head, as in every model of these families.
    """
    if n_heads < 1:
        raise GGUFError(f"{p}: head_count {n_heads} must be positive")
    width = int(hp.get("attention.key_length", 0) or 0)
    if not width:
        if dim % n_heads:
            raise GGUFError(
                f"{p}: embedding_length {dim} is not divisible by head_count {n_heads} and "
                f"the file gives no {arch}.attention.key_length"
            )
        width = dim // n_heads
    for key in ("rope.dimension_count", "attention.value_length"):
        if key in hp and int(hp[key]) != width:
            raise GGUFError(
                f"{p}: {arch}.{key} = {hp[key]} differs from the head width {width}; "
                "llamatrain supports full-width rope and values as wide as keys only"
            )
    return None if width * n_heads == dim else width


def _config_from_json(text: str, derived: Mapping[str, Any], arch: str, p: Path) -> ModelConfig:
    """Our recorded config, which must agree with what the ``<arch>.*`` keys say on every field
    they carry: an edit of the keys (gguf's metadata scripts) is refused, never silently
    overruled by the record — and so never reverted by a later export.

    Only architecture fields are taken: a file may predate a field's removal, and run choices
    (which op set, which attention) belong to the run that loads the file, not to the file.
    A file from before ``arch`` existed records none: it is a llama.
    """
    architecture_fields = ModelConfig().architecture().keys()
    recorded = {k: v for k, v in _recorded_config(text, p).items() if k in architecture_fields}
    cfg = ModelConfig(**recorded)
    ours = dict(
        arch=cfg.arch,
        vocab_size=cfg.vocab_size,
        dim=cfg.dim,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.kv_heads,
        ffn_dim=cfg.hidden_dim,
        max_seq_len=cfg.max_seq_len,
        tie_embeddings=cfg.tie_embeddings,
        rope_scaling_factor=cfg.rope_scaling_factor,
        rope_freq_factors=cfg.rope_freq_factors,
        key_length=None if cfg.head_dim * cfg.n_heads == cfg.dim else cfg.head_dim,
        attention_bias=cfg.attention_bias,
        mlp_bias=cfg.mlp_bias,
        norm_eps=_as_read(cfg.norm_eps),
        rope_theta=_as_read(cfg.rope_theta),
    )
    if cfg.family.swa_every:
        ours |= dict(
            sliding_window=cfg.sliding_window,
            rope_theta_swa=float(np.float32(cfg.rope_theta_swa)),
            final_logit_softcap=None
            if cfg.final_logit_softcap is None
            else float(np.float32(cfg.final_logit_softcap)),
        )
    disagreeing = [k for k, v in ours.items() if derived[k] != v]
    if disagreeing:
        raise GGUFError(
            f"{p}: {CONFIG_KEY} disagrees with the {arch}.* keys/tensors on {disagreeing}; "
            "the file was edited inconsistently — to keep an edit of the keys, remove "
            f"{CONFIG_KEY} (gguf-new-metadata --remove-metadata {CONFIG_KEY}), else re-export it"
        )
    return cfg


def _recorded_config(text: str, p: Path) -> dict[str, Any]:
    """``CONFIG_KEY``'s JSON object; GGUFError when it is not one (an edit or damage)."""
    try:
        recorded = json.loads(text)
    except (ValueError, RecursionError):
        recorded = None
    if not isinstance(recorded, dict):
        raise GGUFError(
            f"{p}: {CONFIG_KEY} is not the JSON object llamatrain records; the file was edited "
            f"or damaged — remove the key (gguf-new-metadata --remove-metadata {CONFIG_KEY}) "
            "or re-export the model"
        )
    return recorded


def _as_read(value: float) -> float:
    """A float as its float32 key reads back (the shortest decimal of the float32)."""
    return float(str(np.float32(value)))


# ---------------------------------------------------------------------------- the tensors


def check_tensors(
    cfg: ModelConfig,
    tensors: Mapping[str, torch.Tensor | DeferredTensor],
    path: str | os.PathLike[str],
) -> None:
    """Raise GGUFError unless ``tensors`` are exactly the float tensors of ``Llama(cfg)``.

    Checked before writing, because llama.cpp refuses a file with a missing or an extra
    tensor, and after reading, because a model that silently lacks a weight is worse than a
    refused file.
    """
    if cfg.n_layers > len(tensors):  # every block has several: checked before they are named
        raise GGUFError(
            f"{path}: the config claims {cfg.n_layers:,} blocks but there are only "
            f"{len(tensors)} tensors; {_TENSOR_FIX}"
        )
    expected = tensor_shapes(cfg)
    missing = sorted(k for k in expected if k not in tensors)
    unexpected = sorted(k for k in tensors if k not in expected)
    if missing or unexpected:
        raise GGUFError(
            f"{path}: the tensors are not those of the {cfg.arch} its config describes (missing: "
            f"{_first_few(missing)}; unexpected: {_first_few(unexpected)}); {_TENSOR_FIX}"
        )
    for name, shape in expected.items():
        tensor = tensors[name]
        if not tensor.is_floating_point():
            stored = _INTEGER_TYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
            raise GGUFError(
                f"{path}: tensor {name} has type {stored}; model weights must be F32, F16, "
                f"BF16 or a quantized float type — {_TENSOR_FIX}"
            )
        if tuple(tensor.shape) != shape:
            raise GGUFError(
                f"{path}: tensor {name} has shape {tuple(tensor.shape)} but the config needs "
                f"{shape}; {_TENSOR_FIX}"
            )


def _first_few(names: list[str], n: int = 6) -> str:
    return f"{names[:n]}{' …' if len(names) > n else ''}"


# -------------------------------------------------------------------------------- writing


def write_model(
    path: str | os.PathLike[str],
    cfg: ModelConfig,
    tensors: Mapping[str, TensorData],
    tokenizer: Tokenizer,
    *,
    type: str = "f32",
    inherited: Mapping[str, Any] | None = None,
    extra_kv: Mapping[str, Any] | None = None,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    checksums: bool = False,
) -> Path:
    """Write a llama GGUF atomically: a model llama.cpp runs, or with extras a checkpoint.

    ``tensors`` must be exactly ``Llama(cfg).state_dict()``; their matrices are stored as
    ``type`` (one of ``EXPORT_TYPES``). ``inherited``: a base model's keys to keep
    (:func:`inherited_metadata`: its name, license, chat template …); the keys llamatrain
    derives from ``cfg`` and ``tokenizer`` win over them. ``extra_kv`` / ``extra_tensors``
    carry a checkpoint's state: keys of its own, and tensors under
    ``CHECKPOINT_TENSOR_PREFIXES`` written F32 (or their integer type), which readers never
    take for weights. ``checksums`` records each
    tensor's sha256 (``llamatrain.gguf.file.verify_gguf`` checks them).
    """
    file_type = general_file_type(type)
    if cfg.vocab_size != tokenizer.vocab_size:
        raise GGUFError(
            f"the model has vocab_size {cfg.vocab_size} but the tokenizer has "
            f"{tokenizer.vocab_size} tokens; build the model with "
            f"vocab_size={tokenizer.vocab_size}"
        )
    check_tensors(cfg, tensors, path)
    metadata = {
        "general.name": "llamatrain",
        **{k: v for k, v in (inherited or {}).items() if k not in _NOT_INHERITED},
        "general.file_type": np.uint32(file_type),
        **model_metadata(cfg),
        **tokenizer_metadata(tokenizer),
    }
    extra_kv, extra_tensors = dict(extra_kv or {}), dict(extra_tensors or {})
    check_extras(metadata, extra_kv, extra_tensors)
    to_write: dict[str, TensorToWrite] = {name: (t, type) for name, t in tensors.items()}
    to_write.update({name: (t, "f32") for name, t in extra_tensors.items()})
    return write_gguf(path, cfg.arch, {**metadata, **extra_kv}, to_write, checksums=checksums)


def check_extras(
    metadata: Mapping[str, Any],
    extra_kv: Mapping[str, Any],
    extra_tensors: Mapping[str, Any],
    writer: str = "llamatrain",
    tensor_kind: str = "a model weight",
) -> None:
    """A checkpoint's extras (training keys and tensors a model or adapter file carries)
    must neither replace a key ``writer`` writes itself nor pass for ``tensor_kind`` when the
    file is read back."""
    for key in extra_kv:
        if key in metadata or key == "general.architecture":
            raise GGUFError(f"extra_kv key {key!r} collides with a key {writer} writes itself")
    for name in extra_tensors:
        if not name.startswith(CHECKPOINT_TENSOR_PREFIXES):
            raise GGUFError(
                f"extra tensor {name!r} would be read back as {tensor_kind}; name it "
                f"{' or '.join(p + '*' for p in CHECKPOINT_TENSOR_PREFIXES)}"
            )


def write_vocab(path: str | os.PathLike[str], tokenizer: Tokenizer) -> Path:
    """A vocab-only GGUF (tokenizer keys, no tensors), like llama.cpp's models/ggml-vocab-*."""
    metadata = {"general.name": "llamatrain-vocab", **tokenizer_metadata(tokenizer)}
    return write_gguf(path, ARCHITECTURE, metadata, {})


# -------------------------------------------------------------------------------- reading


@dataclass
class LlamaFile:
    """A llama GGUF read back: what ``Llama(config).load_state_dict(tensors)`` needs.

    ``tensors`` holds the model's weights only; a checkpoint's ``optimizer.*`` / ``training.*``
    tensors and keys stay in ``contents`` (None for a model read from elsewhere, such as an
    HF folder). ``inherited``: the keys an export of this model keeps
    (:func:`inherited_metadata`).
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    inherited: dict[str, Any]
    contents: GGUFContents | None = None


def read_model(source: GGUFSource, *, tensor_data: bool = True) -> LlamaFile:
    """Read a llama model or checkpoint (ours or llama.cpp's, any type gguf can dequantize),
    from its path or its already parsed header.

    ``tensor_data=False`` checks names and shapes from the header alone and leaves the
    weights as meta-device placeholders, for ``read_tensors_into`` to read straight into a
    model's parameters (``llamatrain.load_gguf``: the model is then held once, not twice).
    """
    if isinstance(source, GGUFContents):
        contents = load_tensor_data(source) if tensor_data else source
    else:
        contents = read_gguf(source, tensor_data=tensor_data)
    p = contents.path
    _check_architecture(contents.metadata, p)
    check_key_kinds(contents.metadata, p)
    tokenizer = tokenizer_from_metadata(contents.metadata, source=str(p))
    weights = {
        name: tensor
        for name, tensor in contents.tensors.items()
        if not name.startswith(CHECKPOINT_TENSOR_PREFIXES)
    }
    if not weights:
        raise GGUFError(
            f"{p} is a vocab-only GGUF (tokenizer keys, no weights); pass a model file, or use "
            "it as a tokenizer (read_tokenizer / tokenizer.path)"
        )
    cfg = model_config_from_metadata(contents)
    check_tensors(cfg, weights, p)
    return LlamaFile(cfg, weights, tokenizer, inherited_metadata(contents), contents)


def inherited_metadata(contents: GGUFContents) -> dict[str, Any]:
    """The keys of a model file that its finetunes keep: ``general.*`` (name, license, base
    models …) and the ``tokenizer.*`` keys (chat template, extra special ids …), typed as
    stored. llama.cpp's own finetune drops the chat template; a model that lost it no longer
    formats chats the way it was trained to."""
    return {
        key: typed_value(contents, key)
        for key in contents.metadata
        if key.startswith(("general.", "tokenizer.")) and key not in _NOT_INHERITED
    }


def _check_architecture(meta: Mapping[str, Any], p: Path) -> str:
    """The file's ``general.architecture``, one of ``ARCHS``; GGUFError naming them otherwise."""
    if "general.architecture" not in meta:
        raise GGUFError(f"{p} lacks the required key general.architecture; it is not a model")
    arch = meta["general.architecture"]
    if arch not in ARCHS:
        raise GGUFError(
            f"{p} is a {arch!r} model; llamatrain supports the architectures "
            f"{', '.join(repr(a) for a in ARCHS)}"
        )
    return arch


def read_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The vocabulary of any llama GGUF: a model, a checkpoint or a vocab-only file."""
    metadata = read_gguf_metadata(path)
    check_key_kinds(metadata, path)
    return tokenizer_from_metadata(metadata, source=str(path))
