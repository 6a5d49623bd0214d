"""A model card's facts as GGUF ``general.*`` keys, spelled as llama.cpp's gguf-py defines them
(``gguf.constants.Keys.General``) and typed as its ``GGUFWriter`` writes them (counts UINT32,
the rest strings and string arrays): a GGUF export then says what its HF card says.

Only keys llama.cpp defines are written. A finetune's lineage replaces its base's: the base
becomes ``general.base_model.0``, the run's data its ``general.dataset.*`` (the base's own base
models, datasets and addresses describe the base, not the finetune), and its tags extend the
base's. The base's ``general.name`` stays, since llama.cpp reads it (a Phi-3 name changes how
its special tokens are tokenized). A conversion keeps its file's keys as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from llamatrain.model_card.facts import BaseModel, ModelCard, Training, hf_repo_url

__all__ = ["LINEAGE_PREFIXES", "general_keys", "with_general_keys"]

LINEAGE_PREFIXES = ("general.base_model.", "general.dataset.", "general.source.")
"""The base's keys about its own origin, which a finetune's replace."""
_REPLACED = (
    "general.tags",
    "general.description",
    "general.license",
    *("general.url", "general.repo_url", "general.doi", "general.uuid"),
)
"""The base's keys a finetune's replace or drop: the addresses that identify the base itself
are not the finetune's."""


def general_keys(card: ModelCard) -> dict[str, Any]:
    """The ``general.*`` keys an export of ``card``'s model carries, beyond the keys it keeps
    from its file: for a run, its lineage, license, tags and a one-line description of what
    it did; for a conversion, only a license its file did not hold (read from an HF folder's
    README.md)."""
    keys: dict[str, Any] = {}
    if card.license:
        keys["general.license"] = card.license
    if card.training is None:
        return keys
    keys.update(_base_model_keys(card.base_models))
    keys.update(_dataset_keys(card.datasets))
    keys["general.tags"] = list(card.tags)
    keys["general.description"] = description(card, card.training)
    return keys


def with_general_keys(kept: Mapping[str, Any], card: ModelCard) -> dict[str, Any]:
    """``kept`` (the keys an export keeps from its base or file) with ``card``'s
    :func:`general_keys`; a run's export first drops the base's lineage keys."""
    if card.training is None:
        return {**general_keys(card), **kept}
    own = {
        key: value
        for key, value in kept.items()
        if not key.startswith(LINEAGE_PREFIXES) and key not in _REPLACED
    }
    return {**own, **general_keys(card)}


def description(card: ModelCard, run: Training) -> str:
    """One line saying what ``run`` (``card.training``) did (``general.description``)."""
    base = card.base_models[0].name if card.base_models else None
    method = "" if run.lora is None else (" QLoRA" if run.lora.quantized_base else " LoRA")
    of = f" of {base}" if base else " from scratch"
    return (
        f"{run.objective}{method}{of} by llamatrain {card.version}: {run.steps} steps, "
        f"{run.tokens} tokens"
    )


def _base_model_keys(bases: tuple[BaseModel, ...]) -> dict[str, Any]:
    """Each base as llama.cpp's converter records one from a card's ``base_model``."""
    if not bases:
        return {}
    keys: dict[str, Any] = {"general.base_model.count": np.uint32(len(bases))}
    for i, base in enumerate(bases):
        for field in ("name", "organization", "version", "repo_url"):
            value = getattr(base, field)
            if value is not None:
                keys[f"general.base_model.{i}.{field}"] = value
    return keys


def _dataset_keys(ids: tuple[str, ...]) -> dict[str, Any]:
    """Each Hub dataset as llama.cpp's converter records one from a card's ``datasets``."""
    if not ids:
        return {}
    keys: dict[str, Any] = {"general.dataset.count": np.uint32(len(ids))}
    for i, hf_id in enumerate(ids):
        organization, name = hf_id.split("/") if "/" in hf_id else (None, hf_id)
        keys[f"general.dataset.{i}.name"] = name
        if organization:
            keys[f"general.dataset.{i}.organization"] = organization
        keys[f"general.dataset.{i}.repo_url"] = hf_repo_url(hf_id, "datasets")
    return keys
