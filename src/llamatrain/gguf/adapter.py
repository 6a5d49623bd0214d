"""llama.cpp's LoRA adapter GGUF (``llama-cli --lora``): write one from an adapted model, read
one back.

What llama.cpp's loader (``llama_adapter_lora_init`` in ``src/llama-adapter.cpp``) checks and
how it applies the file, which fixes the format:

* ``general.type = "adapter"``, ``adapter.type = "lora"`` and ``general.architecture`` equal to
  the base model's (a mismatch is refused);
* ``adapter.lora.alpha``, FLOAT32: the update is scaled by alpha / rank, rank being
  ``lora_b``'s ne[0]; a missing or zero alpha means scale 1;
* tensors ``<base tensor>.lora_a`` and ``<base tensor>.lora_b`` in pairs, named after a tensor
  the base has (``blk.0.attn_q.weight.lora_a``); anything else but ``*_norm.weight`` (skipped)
  is refused;
* shapes in ggml's order (fastest dimension first): the base's ne = [in, out], ``lora_a``'s
  [in, r] and ``lora_b``'s [r, out], i.e. (r, in) and (out, r) as row-major tensors — the
  shapes A and B have in our model and in PEFT, so they are written as they are;
* per token, the projection becomes ``W·x + scale·B·(A·x)`` (``llm_build_lora_mm``), with A
  and B in any type ``mul_mat`` takes (llama.cpp's converter writes f32, f16, bf16 or q8_0;
  we write f32, see ``write_lora_adapter``).

The model's adapter tensors are its state-dict entries ``<module>.lora_a`` / ``.lora_b``
(``llamatrain.lora``), the base name minus ``.weight``; this module adds and strips it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llamatrain.errors import ConfigError, GGUFError, shown
from llamatrain.gguf.file import GGUFContents, GGUFSource, load_tensor_data, read_gguf, typed_value
from llamatrain.gguf.llama import CHECKPOINT_TENSOR_PREFIXES, check_extras
from llamatrain.gguf.write import write_gguf
from llamatrain.model_config import PROJECTIONS

__all__ = [
    "ALL_TARGETS",
    "LORA_SUFFIXES",
    "LoraAdapter",
    "adapter_rank",
    "adapter_tensors",
    "check_alpha",
    "lora_settings_problem",
    "read_lora_adapter",
    "target_suffixes",
    "write_lora_adapter",
]

ALL_TARGETS = PROJECTIONS
"""The projections of a block LoRA can adapt (their llama.cpp names), all by default. Here,
below the config, so that ``[lora] targets`` is checked against the same names."""
LORA_SUFFIXES = (".lora_a", ".lora_b")
"""llama.cpp's adapter tensor suffixes, and our state-dict names' (``blk.0.attn_q.lora_a``)."""
_BASE_SUFFIX = ".weight"
_ALPHA_KEY = "adapter.lora.alpha"
_FILE_GENERAL_KEYS = {
    "general.architecture",
    "general.type",
    "general.file_type",
    "general.quantization_version",
    "general.alignment",
}
"""``general.*`` keys of a base model that describe its file, not the model: an adapter
keeps the others (name, license, …) and writes these itself or not at all."""


@dataclass
class LoraAdapter:
    """An adapter file read back. ``tensors`` use the model's names (``blk.0.attn_q.lora_a``),
    float32; ``alpha`` is llama.cpp's reading of the file (a missing or zero alpha is scale 1,
    so it is given as ``rank``); ``inherited``: the file's other ``general.*`` keys."""

    path: Path
    architecture: str
    alpha: float
    rank: int
    tensors: dict[str, torch.Tensor]
    inherited: dict[str, Any]
    contents: GGUFContents | None = None
    """The whole file: a LoRA checkpoint's ``training.*`` keys and state tensors are here."""

    @property
    def targets(self) -> tuple[str, ...]:
        """The adapted projections (``attn_q``, …), in file order."""
        return tuple(dict.fromkeys(name.rsplit(".", 2)[-2] for name in self.tensors))


# ------------------------------------------------------------------------------------ writing


def target_suffixes(targets: Sequence[str]) -> tuple[str, ...]:
    """The name endings of the weights LoRA ``targets`` adapt (``.attn_q.weight`` …)."""
    return tuple(f".{target}{_BASE_SUFFIX}" for target in targets)


def write_lora_adapter(
    path: str | os.PathLike[str],
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    alpha: float,
    base_architecture: str | None = None,
    inherited: Mapping[str, Any] | None = None,
    extra_kv: Mapping[str, Any] | None = None,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    checksums: bool = False,
) -> Path:
    """Write ``model``'s LoRA tensors as llama.cpp's adapter GGUF, atomically (``model``: an
    adapted model, or its ``lora_state_dict``, as a checkpoint holds it).

    ``alpha`` must be the one the adapters were applied with (the scale is alpha / rank);
    ``base_architecture``: the base's ``general.architecture``, which llama.cpp requires the
    adapter to repeat (unset: ``model.cfg.arch`` for a model, else ``"llama"``);
    ``inherited``: the base model's keys, of which the ``general.*`` ones (name, license …)
    are kept. ``extra_kv`` / ``extra_tensors`` / ``checksums`` make it a LoRA run's
    checkpoint, as ``write_model``'s do for a full one: keys of its own, state tensors under
    ``CHECKPOINT_TENSOR_PREFIXES`` (which readers never take for adapter tensors) and each
    tensor's sha256. A and B are stored F32: exact, and small beside the base (r·(in + out) per
    projection). A lower type would cost more than its rounding: llama.cpp then also rounds
    the activations it multiplies with them (measured with f16: 5e-4 on logits of 0.6).
    """
    state = model if isinstance(model, Mapping) else model.state_dict()
    adapter = adapter_tensors(state, path)
    adapter_rank(adapter, str(path))
    check_alpha(alpha, path)
    kept = {key: value for key, value in (inherited or {}).items() if _kept(key)}
    metadata = {
        "general.name": "llamatrain-lora",
        **kept,
        "general.type": "adapter",
        "adapter.type": "lora",
        _ALPHA_KEY: np.float32(alpha),
    }
    extra_kv, extra_tensors = dict(extra_kv or {}), dict(extra_tensors or {})
    check_extras(metadata, extra_kv, extra_tensors, "the adapter", "an adapter tensor")
    tensors = {_file_name(name): (tensor, "f32") for name, tensor in adapter.items()}
    tensors.update({name: (tensor, "f32") for name, tensor in extra_tensors.items()})
    metadata.update(extra_kv)
    if base_architecture is None:
        cfg = getattr(model, "cfg", None)
        base_architecture = getattr(cfg, "arch", "llama")
    return write_gguf(path, base_architecture, metadata, tensors, checksums=checksums)


def adapter_tensors(
    state: Mapping[str, torch.Tensor], destination: str | os.PathLike[str]
) -> dict[str, torch.Tensor]:
    """The LoRA entries of a model's state dict; ConfigError when it has none."""
    adapter = {name: t.detach() for name, t in state.items() if name.endswith(LORA_SUFFIXES)}
    if not adapter:
        raise ConfigError(
            f"{destination}: the model has no LoRA adapters to write; apply_lora "
            "(llamatrain.lora) first, or export the model itself"
        )
    return adapter


def lora_settings_problem(
    rank: object = 1, alpha: object = 1.0, dropout: object = 0.0, targets: object = ALL_TARGETS
) -> str | None:
    """What is wrong with LoRA settings, worded as their ``[lora]`` keys (None: nothing).

    The one home of these rules: the config's validation, ``apply_lora`` and the adapter
    writers all ask here, so a value is refused in the same words wherever it comes from.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        return f"lora.rank = {rank!r} must be a positive integer (e.g. 8 or 16)"
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        return f"lora.alpha = {alpha!r} must be a number"
    if not math.isfinite(alpha) or alpha <= 0:
        return (
            f"lora.alpha = {alpha!r} must be positive and finite (the update is scaled by "
            "alpha / rank; llama.cpp reads alpha 0 as scale 1)"
        )
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        return f"lora.dropout = {dropout!r} must be in [0, 1) (0 = none)"
    names = list(targets) if isinstance(targets, list | tuple) else [targets]
    unknown = [t for t in names if t not in ALL_TARGETS]
    if unknown:
        return f"lora.targets names unknown projection {unknown[0]!r}; choose among " + ", ".join(
            ALL_TARGETS
        )
    if not names or len(set(names)) != len(names):
        return (
            f"lora.targets = {names} must name each projection once and at least one; choose "
            "among " + ", ".join(ALL_TARGETS)
        )
    return None


def check_alpha(alpha: float, destination: str | os.PathLike[str]) -> None:
    """An adapter file's alpha must give the scale the model uses: alpha / rank, alpha > 0."""
    problem = lora_settings_problem(alpha=alpha)
    if problem:
        raise ConfigError(
            f"{destination}: {problem}; pass the alpha the adapters were applied with"
        )


def _file_name(name: str) -> str:
    """``blk.0.attn_q.lora_a`` -> ``blk.0.attn_q.weight.lora_a``."""
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}{_BASE_SUFFIX}.{suffix}"


def adapter_rank(tensors: Mapping[str, torch.Tensor], source: str) -> int:
    """The one rank of complete, consistently shaped A/B pairs; GGUFError otherwise."""
    ranks: set[int] = set()
    for stem in dict.fromkeys(name.rsplit(".", 1)[0] for name in tensors):
        a, b = tensors.get(f"{stem}.lora_a"), tensors.get(f"{stem}.lora_b")
        if a is None or b is None:
            lacking = "lora_a" if a is None else "lora_b"
            raise GGUFError(
                f"{source}: LoRA pair {shown(stem)} has no {lacking}; the adapter is damaged"
            )
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise GGUFError(
                f"{source}: LoRA pair {shown(stem)} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                "they must be A (r, in) and B (out, r) — the adapter is damaged"
            )
        ranks.add(a.shape[0])
    if len(ranks) != 1:
        raise GGUFError(
            f"{source}: the LoRA pairs have ranks {sorted(ranks)}; llamatrain applies one rank "
            "to every adapted projection"
        )
    return ranks.pop()


def _kept(key: str) -> bool:
    """Whether an adapter keeps a base model's key (see ``_FILE_GENERAL_KEYS``)."""
    return key.startswith("general.") and key not in _FILE_GENERAL_KEYS


# ------------------------------------------------------------------------------------ reading


def read_lora_adapter(source: GGUFSource) -> LoraAdapter:
    """Read a LoRA adapter GGUF (ours or llama.cpp's converter's) back; GGUFError for a file
    that is not one, holds tensors other than A/B pairs, or pairs that do not fit. A LoRA
    checkpoint's state tensors (``CHECKPOINT_TENSOR_PREFIXES``) stay in ``contents``, unread
    when ``source`` is a parsed header (the checkpoint reads what it needs of them)."""
    if isinstance(source, GGUFContents):
        contents = load_tensor_data(source, skip=CHECKPOINT_TENSOR_PREFIXES)
    else:
        contents = read_gguf(source)
    meta, p = contents.metadata, contents.path
    kind = (meta.get("general.type"), meta.get("adapter.type"))
    if kind != ("adapter", "lora"):
        raise GGUFError(
            f"{p} is not a LoRA adapter (general.type = {kind[0]!r}, adapter.type = "
            f"{kind[1]!r}); pass an adapter GGUF (llamatrain's or convert_lora_to_gguf.py's)"
        )
    tensors = {
        _model_name(name, p): tensor
        for name, tensor in contents.tensors.items()
        if not name.startswith(CHECKPOINT_TENSOR_PREFIXES)
    }
    rank = adapter_rank(tensors, str(p))
    alpha = _alpha(meta.get(_ALPHA_KEY, 0), rank, p)
    inherited = {key: typed_value(contents, key) for key in meta if _kept(key)}
    architecture = str(meta.get("general.architecture", ""))
    return LoraAdapter(p, architecture, alpha, rank, tensors, inherited, contents)


def _alpha(value: object, rank: int, p: Path) -> float:
    """The adapter's alpha as llama.cpp reads it (absent or 0: the scale is 1, alpha = rank);
    GGUFError for a value no scale can come from (text, NaN, negative...)."""
    if type(value) in (int, float) and value == 0:
        return float(rank)
    if lora_settings_problem(alpha=value) is not None:
        raise GGUFError(
            f"{p}: {_ALPHA_KEY} = {shown(repr(value))} is not a positive finite number; the "
            "adapter was edited or damaged — re-export it"
        )
    return float(value)


def _model_name(name: str, p: Path) -> str:
    """``blk.0.attn_q.weight.lora_a`` -> ``blk.0.attn_q.lora_a``."""
    stem, _, suffix = name.rpartition(".")
    if f".{suffix}" not in LORA_SUFFIXES or not stem.endswith(_BASE_SUFFIX):
        raise GGUFError(
            f"{p}: tensor {shown(name)} is not a LoRA A/B tensor (<base>.weight.lora_a / .lora_b); "
            "llamatrain applies adapters made of those only"
        )
    return f"{stem.removesuffix(_BASE_SUFFIX)}.{suffix}"
