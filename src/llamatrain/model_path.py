"""What a path names, when a user hands llamatrain a model: a GGUF model, a training
checkpoint, a LoRA run's checkpoint (an adapter that records its base), a run folder (its
latest checkpoint) or an HF checkpoint folder; and the models a run depends on without holding
them (a LoRA run's base, a DPO/IPO reference), recorded by path and content hash.

The answer is needed at several layers (the checkpoint reader records and reads those keys,
model cards cite them, ``fit --resume`` checks them), so it sits below all of them. This
module reads headers, never weights: the one exception is a model's sha256, which is what a
run records to refuse being resumed or applied over any other model. What a path *opens to* —
the models built from these files — is ``llamatrain.model_source``, floors above.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from llamatrain.errors import CheckpointError
from llamatrain.gguf.file import GGUFContents, read_gguf, read_gguf_metadata
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
    "checked_model",
    "checkpoint_dir",
    "describe_base",
    "existing_base",
    "is_hf_folder",
    "is_run_folder",
    "is_lora_checkpoint",
    "model_file",
    "read_header",
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


def read_header(path: str | Path) -> GGUFContents | None:
    """The GGUF ``path`` names (:func:`model_file`), its header parsed and its file kept open
    for what is read of it later; None for an HF folder, which is no one file."""
    if is_hf_folder(path):
        return None
    return read_gguf(model_file(path), tensor_data=False)


def is_lora_checkpoint(path: str | Path) -> bool:
    """Whether a GGUF is a LoRA run's checkpoint (an adapter that records its base)."""
    return records_a_base(read_gguf_metadata(path))


def records_a_base(metadata: Mapping[str, Any]) -> bool:
    """Whether a GGUF's keys are a LoRA run's checkpoint's: an adapter that records its base."""
    return metadata.get("general.type") == "adapter" and BASE_PATH_KEY in metadata


def base_sha256(path: str | Path, contents: GGUFContents | None = None) -> str:
    """sha256 of a model source's content: a GGUF file's bytes (a run folder's latest
    checkpoint's; read through ``contents``' open file when ``path``'s GGUF is parsed already,
    rather than opened again), or an HF folder's weight files' in order."""
    digest = hashlib.sha256()
    if contents is not None and contents.file is not None and not contents.file.closed:
        contents.file.seek(0)
        _hash_into(digest, contents.file)
        return digest.hexdigest()
    files = weight_files(path) if is_hf_folder(path) else [model_file(path).resolve()]
    for file in files:
        with file.open("rb") as f:
            _hash_into(digest, f)
    return digest.hexdigest()


def _hash_into(digest: Any, f: BinaryIO) -> None:
    """Feed the rest of ``f`` to ``digest``, a MiB at a time."""
    while chunk := f.read(1 << 20):
        digest.update(chunk)


def describe_base(
    path: str | Path, adapter: str | Path = "the LoRA run", contents: GGUFContents | None = None
) -> LoraBase:
    """The base ``adapter`` adapts, as its checkpoints record it (hashed through ``contents``
    when the file is open already: :func:`base_sha256`); CheckpointError if it is gone."""
    path = existing_base(path, adapter)
    return LoraBase(str(path.resolve()), base_sha256(path, contents))


def existing_base(path: str | Path, adapter: str | Path = "the LoRA run") -> Path:
    """``path``, the base of ``adapter``, if it exists; CheckpointError naming the fix if not."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"the base model {path} of {adapter} does not exist; put it back or point "
            "model.init_from at a copy of it"
        )
    return path


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


def checked_model(
    path: str | Path,
    recorded: LoraBase,
    role: str,
    checkpoint: str | Path | None,
    contents: GGUFContents | None = None,
) -> LoraBase:
    """The model at ``path`` (:func:`describe_base`, hashed through ``contents`` when given),
    refused unless it is the one ``checkpoint`` recorded as its ``role``
    (:func:`check_same_model`)."""
    used = describe_base(path, checkpoint or "the run", contents)
    check_same_model(used, recorded, role, checkpoint)
    return used
