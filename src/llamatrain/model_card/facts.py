"""The facts an export's model card and ``general.*`` keys state, read from the files a run
leaves behind: the checkpoint's ``training.*`` keys (its config, counters and the base a LoRA
run recorded), ``metrics.jsonl`` beside it, and the base model's own keys (``inherited``).

Nothing is invented. The base's Hugging Face id is given only where a file says it: a
``huggingface.co/<org>/<name>`` URL among the base's ``general.*`` keys, an HF folder that is a
snapshot in the Hub's cache (``models--<org>--<name>/snapshots/…``), or an ``<org>/<name>``
``_name_or_path`` in its config.json (what llama.cpp's converter takes it from). A dataset's
id likewise comes only from a data path inside the Hub's cache (``datasets--<org>--<name>``).
What no file says is left out of the card, never guessed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from llamatrain.gguf.adapter import ALL_TARGETS
from llamatrain.gguf.file import read_gguf_metadata
from llamatrain.hf.config import read_json_object
from llamatrain.hf.folder import MODEL_CARD
from llamatrain.hf.inside import file_in_folder
from llamatrain.model_path import (
    BASE_PATH_KEY,
    BASE_SHA256_KEY,
    REFERENCE_PATH_KEY,
    REFERENCE_SHA256_KEY,
    is_hf_folder,
    model_file,
)
from llamatrain.plot import METRICS_FILE, finite_value, read_records

__all__ = [
    "BaseModel",
    "LoraFacts",
    "ModelCard",
    "Training",
    "conversion_card",
    "export_card",
    "hf_repo_url",
]

HF = "https://huggingface.co/"
_HUB_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_CACHE_PART = re.compile(rf"(models|datasets)--({_HUB_NAME}(?:--{_HUB_NAME})?)")
"""A folder of the Hub's cache: ``models--<org>--<name>`` (``<org>--`` absent for old ids)."""
_HUB_ID = rf"{_HUB_NAME}/{_HUB_NAME}"
_HF_URL = re.compile(rf"https?://huggingface\.co/({_HUB_ID})/?")
_HF_DATASET_URL = re.compile(rf"https?://huggingface\.co/datasets/({_HUB_ID})/?")
_CARD_LICENSE = re.compile(r"^license:\s*['\"]?([A-Za-z0-9][A-Za-z0-9.+_-]*)['\"]?\s*$")
_README_BYTES = 1 << 16
"""How much of a base folder's README.md is searched for its front matter's license."""
LLAMATRAIN_VERSION = version("llamatrain")
"""The version a card names: the installed distribution's (the package's own ``__version__``
sits above every layer, beside the lazily loaded API)."""
FINAL_METRICS = (
    ("loss", "train loss"),
    ("val_loss", "validation loss"),
    ("reward", "GRPO reward (train)"),
    ("val_reward", "GRPO reward (held-out prompts)"),
    ("reward_accuracy", "preference accuracy (train)"),
    ("val_reward_accuracy", "preference accuracy (validation)"),
)
"""The metrics a card reports the last logged value of, as metrics.jsonl names them."""


@dataclass(frozen=True)
class BaseModel:
    """A model an export derives from, as its file names it (llama.cpp's
    ``general.base_model.{i}.*`` fields)."""

    name: str | None = None
    organization: str | None = None
    version: str | None = None
    repo_url: str | None = None

    @property
    def hf_id(self) -> str | None:
        """``<org>/<name>`` when ``repo_url`` is a Hugging Face model page, else None."""
        match = _HF_URL.fullmatch(self.repo_url or "")
        return match.group(1) if match else None


@dataclass(frozen=True)
class LoraFacts:
    """The adapters a LoRA run trained: PEFT's words for them."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    quantized_base: bool
    """QLoRA: the frozen base was held in its GGUF's quantized blocks."""


@dataclass(frozen=True)
class Training:
    """What a llamatrain run did, up to the checkpoint exported."""

    objective: str
    steps: int
    tokens: int
    """Tokens the loss scored (``training.token_count``)."""
    final: dict[str, tuple[int, float]]
    """The last logged value of each of :data:`FINAL_METRICS` present: {name: (step, value)}."""
    lora: LoraFacts | None
    base_file: str | None
    """The file the run started from (``model.init_from``), as the run recorded it."""
    base_sha256: str | None
    """Its sha256, where the run recorded one (a LoRA base, a DPO/IPO reference)."""


@dataclass(frozen=True)
class ModelCard:
    """Everything an export says about its origin. ``training`` is None for a conversion (a
    GGUF or HF model exported as it is): the card then repeats the file's own lineage."""

    name: str | None
    base_models: tuple[BaseModel, ...]
    license: str | None
    license_name: str | None
    license_link: str | None
    tags: tuple[str, ...]
    datasets: tuple[str, ...]
    """Hugging Face dataset ids."""
    training: Training | None
    version: str = LLAMATRAIN_VERSION

    @property
    def hf_base_ids(self) -> tuple[str, ...]:
        """The Hub ids of the base models that have one (the card's ``base_model``)."""
        return tuple(b.hf_id for b in self.base_models if b.hf_id is not None)


def hf_repo_url(hf_id: str, kind: str = "models") -> str:
    """The Hub page of a model (``kind="models"``) or dataset id."""
    return HF + ("datasets/" if kind == "datasets" else "") + hf_id


# ------------------------------------------------------------------------------- reading


def export_card(source: str | Path, inherited: Mapping[str, Any]) -> ModelCard:
    """The facts of what ``export`` writes from ``source`` (a run folder, a checkpoint, a GGUF
    model or an HF folder) whose kept keys are ``inherited`` (the base's ``general.*`` keys for
    a run, the file's own for a conversion)."""
    if is_hf_folder(source):
        return conversion_card(inherited, _hf_folder_license(Path(source)))
    checkpoint = model_file(source)
    metadata = read_gguf_metadata(checkpoint)
    config = _json_object(metadata.get("training.config"))
    if not config:  # a model file, not a run's checkpoint
        return conversion_card(inherited)
    return _run_card(config, metadata, inherited, _run_folder(checkpoint))


def conversion_card(inherited: Mapping[str, Any], folder_license: str | None = None) -> ModelCard:
    """A model exported as it is (no run of ours behind it): its name, license and lineage as
    its keys ``inherited`` state them (``folder_license``: an HF folder's README's)."""
    return ModelCard(
        name=_text(inherited, "general.name"),
        base_models=_listed_base_models(inherited),
        license=_text(inherited, "general.license") or folder_license,
        license_name=_text(inherited, "general.license.name"),
        license_link=_text(inherited, "general.license.link"),
        tags=_dedup([*_tags(inherited), "llamatrain"]),
        datasets=_listed_datasets(inherited),
        training=None,
    )


def _run_card(
    config: Mapping[str, Any],
    metadata: Mapping[str, Any],
    inherited: Mapping[str, Any],
    run_dir: Path | None,
) -> ModelCard:
    """A run's export: a finetune of its base, whose keys ``inherited`` holds (a run from
    scratch has no base, and the keys its checkpoint holds are llamatrain's own)."""
    training = _training(config, metadata, run_dir)
    base_path = training.base_file
    base_keys = inherited if base_path else {}
    hf_base = Path(base_path) if base_path and is_hf_folder(base_path) else None
    lora = training.lora
    method = () if lora is None else ("lora", "qlora") if lora.quantized_base else ("lora",)
    return ModelCard(
        name=_text(base_keys, "general.name"),
        base_models=(_base_model(base_keys, hf_base),) if base_path else (),
        license=_text(base_keys, "general.license") or _hf_folder_license(hf_base),
        license_name=_text(base_keys, "general.license.name"),
        license_link=_text(base_keys, "general.license.link"),
        tags=_dedup([*_tags(base_keys), "llamatrain", training.objective, *method]),
        datasets=_hub_cache_ids(_section(config, "data").get("path"), "datasets"),
        training=training,
    )


def _training(
    config: Mapping[str, Any], metadata: Mapping[str, Any], run_dir: Path | None
) -> Training:
    """The run's objective, counters, adapters, base file and last metrics."""
    steps = _count(metadata.get("training.iteration_count"))
    recorded = _recorded_base(metadata)
    base_file = recorded[0] if recorded else _section(config, "model").get("init_from")
    return Training(
        objective=str(_section(config, "train").get("objective", "sft")),
        steps=steps,
        tokens=_count(metadata.get("training.token_count")),
        final=_final_metrics(run_dir, steps),
        lora=_lora(_section(config, "lora")),
        base_file=base_file if isinstance(base_file, str) and base_file else None,
        base_sha256=recorded[1] if recorded else None,
    )


def _recorded_base(metadata: Mapping[str, Any]) -> tuple[str, str] | None:
    """The base (a LoRA run's) or reference (a full DPO/IPO run's: the ``model.init_from``
    it started from) the checkpoint records by path and sha256."""
    for path_key, sha256_key in _RECORDED_MODELS:
        path, sha256 = metadata.get(path_key), metadata.get(sha256_key)
        if isinstance(path, str) and isinstance(sha256, str):
            return path, sha256
    return None


_RECORDED_MODELS = ((BASE_PATH_KEY, BASE_SHA256_KEY), (REFERENCE_PATH_KEY, REFERENCE_SHA256_KEY))


def _lora(section: Mapping[str, Any]) -> LoraFacts | None:
    rank = section.get("rank", 0)
    if not isinstance(rank, int) or rank <= 0:
        return None
    targets = section.get("targets") or ALL_TARGETS
    return LoraFacts(
        rank=rank,
        alpha=float(section.get("alpha", 0.0)),
        targets=tuple(str(t) for t in targets),
        quantized_base=section.get("base_dtype") == "quantized",
    )


def _run_folder(checkpoint: Path) -> Path | None:
    """The run folder of a checkpoint in its ``checkpoints/`` folder (None elsewhere)."""
    folder = checkpoint.parent
    return folder.parent if folder.name == "checkpoints" else None


def _final_metrics(run_dir: Path | None, steps: int) -> dict[str, tuple[int, float]]:
    """The last value of each reported metric logged up to ``steps`` (the checkpoint's step:
    a later checkpoint's metrics are not this export's)."""
    path = None if run_dir is None else run_dir / METRICS_FILE
    if path is None or not path.is_file():
        return {}
    final: dict[str, tuple[int, float]] = {}
    for record in read_records(path):  # a damaged line costs the card that line alone
        if record["step"] > steps:
            continue
        for key, _ in FINAL_METRICS:
            value = finite_value(record, key)
            if value is not None:
                final[key] = (record["step"], value)
    return final


def _base_model(keys: Mapping[str, Any], hf_folder: Path | None) -> BaseModel:
    """The run's base as its keys name it, with its repository where a file states one: its
    own repository keys, a Hub page among its URL keys, or the Hub id its HF folder states."""
    urls = [_text(keys, "general.repo_url"), _text(keys, "general.source.repo_url")]
    urls += [_text(keys, "general.url"), _text(keys, "general.source.url")]
    urls = [u for i, u in enumerate(urls) if u and (i < 2 or _HF_URL.fullmatch(u))]
    if hf_folder is not None:
        urls += [hf_repo_url(i) for i in _hf_folder_ids(hf_folder)]
    return BaseModel(
        name=_text(keys, "general.name"),
        organization=_text(keys, "general.organization"),
        version=_text(keys, "general.version"),
        repo_url=urls[0] if urls else None,
    )


def _hf_folder_ids(folder: Path) -> tuple[str, ...]:
    """The Hub id an HF folder states: the Hub cache's folder name, or config.json's
    ``_name_or_path`` when it is an ``<org>/<name>`` id (llama.cpp's converter's rule)."""
    ids = _hub_cache_ids(str(folder.resolve()), "models")
    name = read_json_object(file_in_folder(folder, "config.json")).get("_name_or_path")
    if isinstance(name, str) and re.fullmatch(_HUB_ID, name):
        ids += (name,)
    return ids


def _hf_folder_license(folder: Path | None) -> str | None:
    """The ``license:`` of an HF folder's README.md front matter (one Hub license id)."""
    if folder is None:
        return None
    readme = file_in_folder(folder, MODEL_CARD)
    if not readme.is_file():
        return None
    with readme.open("rb") as f:
        head = f.read(_README_BYTES).decode("utf-8", errors="replace")
    lines = head.splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    for line in lines[1:]:
        if line.strip() == "---":
            break
        if match := _CARD_LICENSE.match(line):
            return match.group(1)
    return None


def _hub_cache_ids(paths: object, kind: str) -> tuple[str, ...]:
    """The Hub ids of ``kind`` (models, datasets) whose cache folder
    (``<kind>--<org>--<name>``) holds any of ``paths`` (a path or a list of them)."""
    items = [paths] if isinstance(paths, str) else paths if isinstance(paths, list) else []
    ids = []
    for item in items:
        for part in Path(str(item)).parts:
            match = _CACHE_PART.fullmatch(part)
            if match and match.group(1) == kind:
                ids.append(match.group(2).replace("--", "/"))
    return _dedup(ids)


def _listed_base_models(keys: Mapping[str, Any]) -> tuple[BaseModel, ...]:
    """A file's own ``general.base_model.{i}.*`` entries."""
    return tuple(
        BaseModel(**{f: _text(keys, f"general.base_model.{i}.{f}") for f in _BASE_FIELDS})
        for i in _listed(keys, "general.base_model")
    )


def _listed_datasets(keys: Mapping[str, Any]) -> tuple[str, ...]:
    """The Hub ids of a file's own ``general.dataset.{i}.repo_url`` entries."""
    urls = [
        _text(keys, f"general.dataset.{i}.repo_url") or "" for i in _listed(keys, "general.dataset")
    ]
    matches = (_HF_DATASET_URL.fullmatch(url) for url in urls)
    return _dedup(m.group(1) for m in matches if m)


_BASE_FIELDS = ("name", "organization", "version", "repo_url")


def _listed(keys: Mapping[str, Any], prefix: str) -> list[int]:
    """The entries ``i`` of a ``<prefix>.{i}.*`` list that a file holds below its
    ``<prefix>.count``, in order. Read from the keys present, never counted up to the count:
    a 0.6 MB file may claim 10^12 entries, which a loop over ``range(count)`` would build."""
    count, head = _count(keys.get(f"{prefix}.count")), f"{prefix}."
    parts = (key[len(head) :].partition(".") for key in keys if key.startswith(head))
    present = {int(i) for i, dot, _ in parts if dot and i.isdecimal() and str(int(i)) == i}
    return sorted(i for i in present if i < count)


# ------------------------------------------------------------------------------- values


def _text(keys: Mapping[str, Any], key: str) -> str | None:
    """A key's value when it is a nonempty string (a file may hold anything under a key)."""
    value = keys.get(key)
    return value if isinstance(value, str) and value else None


def _tags(keys: Mapping[str, Any]) -> list[str]:
    value = keys.get("general.tags")
    return [t for t in value if isinstance(t, str) and t] if isinstance(value, list) else []


def _count(value: object) -> int:
    """A counter key's value (numpy's integers included); 0 when absent or not a count."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0:
        return int(value)
    return 0


def _json_object(value: object) -> dict[str, Any]:
    """A JSON-object key's value ({} when absent or not one)."""
    if not isinstance(value, str):
        return {}
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section = config.get(name)
    return section if isinstance(section, dict) else {}


def _dedup(items: Sequence[str] | Any) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))
