"""What a path names, when a user hands llamatrain a model: a GGUF model, a training
checkpoint, a LoRA run's checkpoint (an adapter that records its base), a run folder (its
latest checkpoint) or an HF checkpoint folder.

The answer is needed at several layers (``fit --resume``, ``model.init_from``, ``generate``,
``export``), so it has one home here, below the checkpoint reader and the model builder that
act on it. This module reads headers, never weights: the one exception is the base's sha256,
which is what a LoRA run records to refuse being applied over any other base.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llamatrain.errors import CheckpointError
from llamatrain.gguf.file import read_gguf_metadata
from llamatrain.hf.weights import weight_files
from llamatrain.plot import METRICS_FILE

__all__ = [
    "BASE_PATH_KEY",
    "BASE_ROLE",
    "BASE_SHA256_KEY",
    "LATEST",
    "LoraBase",
    "REFERENCE_PATH_KEY",
    "REFERENCE_ROLE",
    "REFERENCE_SHA256_KEY",
    "base_sha256",
    "check_same_model",
    "checkpoint_dir",
    "describe_base",
    "is_hf_folder",
    "is_lora_checkpoint",
    "model_file",
    "records_a_base",
]

LATEST = "latest.gguf"
"""The stable name of a run's newest checkpoint (a symlink in ``checkpoints/``)."""
BASE_PATH_KEY = "training.lora.base"
BASE_SHA256_KEY = "training.lora.base_sha256"
"""The keys a LoRA run's checkpoint records its frozen base under: its path and content hash."""
REFERENCE_PATH_KEY = "training.reference.model"
REFERENCE_SHA256_KEY = "training.reference.model_sha256"
"""The keys a full finetune's DPO/IPO checkpoint records its reference model under (the file
``model.init_from`` named, whose log-probs it scores against): its path and content hash."""
BASE_ROLE, REFERENCE_ROLE = "base model", "DPO/IPO reference model"
"""What a recorded model is to its run, as :func:`check_same_model` names it."""


@dataclass(frozen=True)
class LoraBase:
    """A model file a run depends on but does not hold — the frozen base a LoRA run adapts,
    or the reference a full finetune's DPO/IPO scores against: its absolute path and the sha256
    of its content (:func:`base_sha256`), which a resume or load checks before using the run
    with it (:func:`check_same_model`)."""

    path: str
    sha256: str


def checkpoint_dir(run_dir: str | Path) -> Path:
    """Where a run folder keeps its checkpoints."""
    return Path(run_dir) / "checkpoints"


def is_run_folder(path: str | Path) -> bool:
    """A folder a run writes: ``checkpoints/``, or before its first checkpoint the
    ``metrics.jsonl`` every fit starts with."""
    path = Path(path)
    return checkpoint_dir(path).is_dir() or (path / METRICS_FILE).is_file()


def is_hf_folder(path: str | Path) -> bool:
    """A folder that is not a run folder (:func:`is_run_folder`) is read as an HF checkpoint
    folder."""
    path = Path(path)
    return path.is_dir() and not is_run_folder(path)


def model_file(path: str | Path) -> Path:
    """A run folder means its latest checkpoint; anything else names a file."""
    path = Path(path)
    if path.is_dir() and not (checkpoint_dir(path) / LATEST).exists():
        raise CheckpointError(
            f"{path} is a run folder with no checkpoint yet (a run saves one every "
            "train.save_every steps and when it ends); wait for one, or pass a checkpoint or a "
            "GGUF"
        )
    if path.is_dir():
        path = checkpoint_dir(path) / LATEST
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a checkpoint, a GGUF or a run folder")
    return path


def is_lora_checkpoint(path: str | Path) -> bool:
    """Whether a GGUF is a LoRA run's checkpoint (an adapter that records its base)."""
    return records_a_base(read_gguf_metadata(path))


def records_a_base(metadata: Mapping[str, Any]) -> bool:
    """Whether a GGUF's keys are a LoRA run's checkpoint's: an adapter that records its base."""
    return metadata.get("general.type") == "adapter" and BASE_PATH_KEY in metadata


def base_sha256(path: str | Path) -> str:
    """sha256 of a model source's content: a GGUF file's bytes (a run folder's latest
    checkpoint's), or an HF folder's weight files' in order."""
    files = weight_files(path) if is_hf_folder(path) else [model_file(path).resolve()]
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def describe_base(path: str | Path, adapter: str | Path = "the LoRA run") -> LoraBase:
    """The base ``adapter`` adapts, as its checkpoints record it; CheckpointError if it is
    gone."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"the base model {path} of {adapter} does not exist; put it back or point "
            "model.init_from at a copy of it"
        )
    return LoraBase(str(path.resolve()), base_sha256(path))


def check_same_model(
    used: LoraBase, recorded: LoraBase, role: str, checkpoint: str | Path | None
) -> None:
    """Refuse (CheckpointError) to go on with ``checkpoint`` when the model it depends on as
    ``role`` (its LoRA base, its DPO/IPO reference) has other content now than when it was
    recorded: a resumed run then continues over, or against, exactly what it started with."""
    if used.sha256 != recorded.sha256:
        raise CheckpointError(
            f"{used.path} is not the {role} of checkpoint {checkpoint}: its content changed "
            f"(sha256 {used.sha256[:12]}… vs {recorded.sha256[:12]}… recorded); point "
            f"model.init_from at that model, unchanged ({recorded.path})"
        )
