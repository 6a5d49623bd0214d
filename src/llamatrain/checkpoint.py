"""Training checkpoints: one GGUF file that resumes everything.

As in llama.cpp's 2023 trainer, a checkpoint is the model GGUF (tensors, hyper-parameters,
tokenizer keys) plus ``training.*`` counters and ``optimizer.*`` state. AdamW moments are
stored as two flat F32 vectors over all parameters in ``state_dict`` order
(``optimizer.adam.first_moments`` / ``second_moments``), exactly the 2023 layout. What GGUF
has no tensor type for (RNG states, the data cursor, L-BFGS history) travels as JSON/base64
strings. Files are written through ``llamatrain.gguf`` atomically (temp file, fsync, rename),
so a crash never leaves a half-written checkpoint, and a full disk leaves the last good one and
``latest.gguf`` as they were. Each tensor's sha256 travels along (``training.tensor_sha256``)
and is checked when a run resumes, so a damaged file is refused by name, not trained on.

A LoRA run's checkpoint is its adapter GGUF (``llamatrain.gguf.adapter``) with the same
``training.*`` / ``optimizer.*`` keys and tensors (the moments over the adapters alone), plus
the frozen base's path and content hash (``training.lora.base`` / ``.base_sha256``): the base
is not copied into every checkpoint, and a run is never resumed or loaded over another base.

Loading a checkpoint builds no model: it returns the weights and the state, and the trainer
restores them onto its own model and optimizer (``Trainer.load_state``). Today's llama.cpp
refuses a model file with extra tensors, so hand it ``llamatrain export``'s output;
``llamatrain.load`` reads checkpoints as models (:func:`read_model_source`, which merges a
LoRA run's adapter into its base).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from llamatrain.errors import CheckpointError
from llamatrain.gguf.adapter import LoraAdapter, read_lora_adapter, write_lora_adapter
from llamatrain.gguf.file import read_gguf_metadata, read_tensors_into, verify_gguf
from llamatrain.gguf.llama import LlamaFile, read_model, write_model
from llamatrain.hf.folder import read_hf_folder
from llamatrain.hf.weights import weight_files
from llamatrain.lora import (
    apply_lora,
    load_lora_state_dict,
    lora_modules,
    lora_state_dict,
    merge_lora,
)
from llamatrain.model import Llama, ModelConfig
from llamatrain.tokenizer import Tokenizer

FILE_VERSION = 1
LATEST = "latest.gguf"
DIVERGED_FIX = "Lower optim.lr, keep optim.grad_clip on, or check the data"
"""The advice for a run whose loss or weights stopped being finite."""
BASE_PATH_KEY = "training.lora.base"
BASE_SHA256_KEY = "training.lora.base_sha256"


@dataclass(frozen=True)
class LoraBase:
    """The frozen model a LoRA run adapts: its absolute path and the sha256 of its content
    (:func:`base_sha256`), which a resume or load checks before using the adapter on it."""

    path: str
    sha256: str


@dataclass
class TrainingState:
    """Counters and cursors that, with the weights and optimizer, define a run's position."""

    step: int = 0
    samples: int = 0
    tokens: int = 0
    epochs: int = 0
    data_state: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    convergence: dict = field(default_factory=dict)
    seen_tokens: torch.Tensor | None = None
    """(vocab,) bool: the tokens of the training data, for seen-tokens-only sampling."""
    inherited: dict = field(default_factory=dict)
    """The base model's keys every checkpoint and export keep (``inherited_metadata``)."""
    lora_base: LoraBase | None = None
    """Set for a LoRA run: its checkpoints then hold the adapter, not the model."""


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as a bitmap (8 tokens a byte), stored as GGUF I8 bytes."""
    return torch.from_numpy(np.packbits(mask.cpu().numpy()).view(np.int8))


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(packed.numpy().view(np.uint8))[:n].astype(bool))


def _pack_bytes(obj: object) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _unpack_bytes(text: str) -> object:
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=False)


def _rng_states() -> dict:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _restore_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _trained(model: Llama) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: all of them, or a LoRA run's adapters."""
    return [p for p in model.parameters() if p.requires_grad]


def _adam_tensors(model: Llama, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Flatten AdamW's moments into the 2023 layout (zeros before the first step)."""
    first, second = [], []
    for p in _trained(model):
        state = optimizer.state.get(p, {})
        first.append(state.get("exp_avg", torch.zeros_like(p)).detach().float().flatten().cpu())
        second.append(state.get("exp_avg_sq", torch.zeros_like(p)).detach().float().flatten().cpu())
    return {
        "optimizer.adam.first_moments": torch.cat(first),
        "optimizer.adam.second_moments": torch.cat(second),
    }


def _restore_adam(model: Llama, optimizer: torch.optim.Optimizer, tensors: dict, step: int) -> None:
    """Rebuild AdamW's per-parameter state from the flat moment vectors."""
    first = tensors["optimizer.adam.first_moments"]
    second = tensors["optimizer.adam.second_moments"]
    if first.numel() != sum(p.numel() for p in _trained(model)):
        raise CheckpointError("checkpoint optimizer state does not match the model's size")
    if step == 0:
        return
    offset = 0
    for p in _trained(model):
        n = p.numel()
        step_device = p.device if getattr(optimizer, "defaults", {}).get("fused") else "cpu"
        optimizer.state[p] = {
            "step": torch.tensor(float(step), dtype=torch.float32, device=step_device),
            "exp_avg": first[offset : offset + n].view_as(p).to(p.device, p.dtype).clone(),
            "exp_avg_sq": second[offset : offset + n].view_as(p).to(p.device, p.dtype).clone(),
        }
        offset += n


def save_checkpoint(
    path: str | Path,
    model: Llama,
    tokenizer: Tokenizer,
    optimizer: torch.optim.Optimizer,
    state: TrainingState,
) -> Path:
    """Write one resumable GGUF checkpoint atomically: the model, or for a LoRA run
    (``state.lora_base``) the adapter, with the training state."""
    extra_kv, extra_tensors = _training_extras(model, optimizer, state)
    if state.lora_base is not None:
        return _save_lora_checkpoint(path, model, state, extra_kv, extra_tensors)
    tensors = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    return write_model(
        path,
        model.cfg,
        tensors,
        tokenizer,
        type="f32",
        inherited=state.inherited,
        extra_kv=extra_kv,
        extra_tensors=extra_tensors,
        checksums=True,
    )


def _save_lora_checkpoint(
    path: str | Path,
    model: Llama,
    state: TrainingState,
    extra_kv: dict[str, object],
    extra_tensors: dict[str, torch.Tensor],
) -> Path:
    """The adapter GGUF plus the training state and the base it adapts."""
    extra_kv[BASE_PATH_KEY] = state.lora_base.path
    extra_kv[BASE_SHA256_KEY] = state.lora_base.sha256
    _, first = next(lora_modules(model))
    return write_lora_adapter(
        path,
        lora_state_dict(model),
        alpha=first.alpha,
        inherited=state.inherited,
        extra_kv=extra_kv,
        extra_tensors=extra_tensors,
        checksums=True,
    )


def _training_extras(
    model: Llama, optimizer: torch.optim.Optimizer, state: TrainingState
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """A checkpoint's ``training.*`` / ``optimizer.*`` keys and tensors (any kind of run)."""
    is_adam = isinstance(optimizer, torch.optim.AdamW)
    extra_kv: dict[str, object] = {
        "training.file_version": FILE_VERSION,
        "training.iteration_count": state.step,
        "training.sample_count": state.samples,
        "training.token_count": state.tokens,
        "training.epoch_count": state.epochs,
        "training.config": json.dumps(state.config),
        "training.convergence": json.dumps(state.convergence),
        "training.data_state": json.dumps(state.data_state),
        "training.rng_state": _pack_bytes(_rng_states()),
        "optimizer.type": "adam" if is_adam else "lbfgs",
        "optimizer.lr_schedule.step": state.step,
    }
    extra_tensors: dict[str, torch.Tensor] = {}
    if state.seen_tokens is not None:
        extra_tensors["training.seen_tokens"] = _pack_bits(state.seen_tokens)
    if is_adam:
        extra_kv["optimizer.adam.iteration_count"] = state.step
        extra_tensors.update(_adam_tensors(model, optimizer))
    else:
        extra_kv["optimizer.lbfgs.state"] = _pack_bytes(optimizer.state_dict())
    return extra_kv, extra_tensors


@dataclass
class Checkpoint:
    """What a checkpoint file holds, read but not yet applied to a run."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    state: TrainingState
    metadata: dict
    tensors: dict[str, torch.Tensor]  # every tensor in the file, optimizer state included
    adapter: LoraAdapter | None = None  # a LoRA run's: ``weights`` are then its tensors
    base: LlamaFile | None = None
    """A LoRA run's base as read to check it (a GGUF's header only), so that building the
    model does not read it a second time (an HF base's weights would be)."""

    def restore_weights(self, model: Llama) -> None:
        """Load the weights into ``model``: all of them, or a LoRA run's adapters (``model``
        is then the base, adapted as the run was)."""
        if self.adapter is None:
            model.load_state_dict(self.weights)
        else:
            load_lora_state_dict(model, self.weights)

    def restore_optimizer(self, model: Llama, optimizer: torch.optim.Optimizer) -> None:
        """Load the optimizer state into ``optimizer``, whose parameters are ``model``'s."""
        kind = self.metadata.get("optimizer.type")
        if kind == "adam" and isinstance(optimizer, torch.optim.AdamW):
            _restore_adam(model, optimizer, self.tensors, self.state.step)
        elif kind == "lbfgs" and isinstance(optimizer, torch.optim.LBFGS):
            optimizer.load_state_dict(_unpack_bytes(self.metadata["optimizer.lbfgs.state"]))
        else:
            wanted = "adamw" if isinstance(optimizer, torch.optim.AdamW) else "lbfgs"
            raise CheckpointError(
                f"checkpoint holds {kind!r} optimizer state but the config asks for "
                f"optim.name = {wanted!r}; resume with the optimizer it was trained with"
            )

    def restore_rng(self) -> None:
        if "training.rng_state" in self.metadata:
            _restore_rng_states(_unpack_bytes(self.metadata["training.rng_state"]))


def _seen_tokens(tensors: dict[str, torch.Tensor], vocab_size: int) -> torch.Tensor | None:
    packed = tensors.get("training.seen_tokens")
    return None if packed is None else _unpack_bits(packed, vocab_size)


def load_checkpoint(path: str | Path, base: str | Path | None = None) -> Checkpoint:
    """Read a checkpoint (or a plain model GGUF: its counters are then zero).

    A LoRA run's checkpoint is read with its base's config, tokenizer and keys, from ``base``
    (default: the path it records), which must have the content it was trained on.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    verify_gguf(path)
    if is_lora_checkpoint(path):
        return _load_lora_checkpoint(path, base)
    model_file = read_model(path)
    meta, tensors = model_file.contents.metadata, model_file.contents.tensors
    state = _training_state(meta, tensors, model_file.config.vocab_size, model_file.inherited)
    return Checkpoint(
        model_file.config, model_file.tensors, model_file.tokenizer, state, meta, tensors
    )


def is_lora_checkpoint(path: str | Path) -> bool:
    """Whether a GGUF is a LoRA run's checkpoint (an adapter that records its base)."""
    meta = read_gguf_metadata(path)
    return meta.get("general.type") == "adapter" and BASE_PATH_KEY in meta


def _load_lora_checkpoint(path: Path, base: str | Path | None) -> Checkpoint:
    adapter = read_lora_adapter(path)
    meta, tensors = adapter.contents.metadata, adapter.contents.tensors
    recorded = LoraBase(str(meta[BASE_PATH_KEY]), str(meta[BASE_SHA256_KEY]))
    used = describe_base(base or recorded.path, path)
    if used.sha256 != recorded.sha256:
        raise CheckpointError(
            f"{used.path} is not the base model LoRA checkpoint {path} was trained on (sha256 "
            f"{used.sha256[:12]}… vs {recorded.sha256[:12]}…); point model.init_from at that "
            f"base, unchanged ({recorded.path})"
        )
    base_file = read_model_source(used.path)
    state = _training_state(meta, tensors, base_file.config.vocab_size, base_file.inherited)
    state.lora_base = used
    return Checkpoint(
        base_file.config, adapter.tensors, base_file.tokenizer, state, meta, tensors, adapter,
        base_file,
    )  # fmt: skip


def _training_state(
    meta: dict, tensors: dict[str, torch.Tensor], vocab_size: int, inherited: dict
) -> TrainingState:
    """The ``training.*`` counters, cursors and seen tokens of a checkpoint's file."""
    return TrainingState(
        step=int(meta.get("training.iteration_count", 0)),
        samples=int(meta.get("training.sample_count", 0)),
        tokens=int(meta.get("training.token_count", 0)),
        epochs=int(meta.get("training.epoch_count", 0)),
        data_state=json.loads(meta.get("training.data_state", "{}")),
        config=json.loads(meta.get("training.config", "{}")),
        convergence=json.loads(meta.get("training.convergence", "{}")),
        seen_tokens=_seen_tokens(tensors, vocab_size),
        inherited=inherited,
    )


# ---- the models a run starts from or is loaded as -----------------------------------------


def base_sha256(path: str | Path) -> str:
    """sha256 of a model source's content: a GGUF file's bytes (a run folder's latest
    checkpoint's), or an HF folder's weight files' in order."""
    path = Path(path)
    if path.is_dir() and not checkpoint_dir(path).is_dir():
        files = weight_files(path)
    else:
        files = [model_file(path).resolve()]
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


def model_file(path: str | Path) -> Path:
    """A run folder means its latest checkpoint; anything else names a file."""
    path = Path(path)
    if path.is_dir():
        path = checkpoint_dir(path) / LATEST
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a checkpoint, a GGUF or a run folder")
    return path


def read_model_source(path: str | Path) -> LlamaFile:
    """A run folder (its latest checkpoint), a checkpoint, a llama GGUF, or an HF checkpoint
    folder (any other folder: one without ``checkpoints/``). A checkpoint's tensors are checked
    against the sha256 recorded when it was written (``verify_gguf``), so nothing built from
    it uses silently damaged weights; a LoRA run's is its base with the adapter merged in."""
    path = Path(path)
    if path.is_dir() and not checkpoint_dir(path).is_dir():
        return read_hf_folder(path)
    path = model_file(path)
    if is_lora_checkpoint(path):
        return _merged_lora_run(load_checkpoint(path))
    verify_gguf(path)
    return read_model(path, tensor_data=False)


def _merged_lora_run(checkpoint: Checkpoint) -> LlamaFile:
    """A LoRA checkpoint as the plain model it stands for: base W + s·B·A."""
    adapter = checkpoint.adapter
    model = build_model(checkpoint.base)
    apply_lora(model, adapter.rank, adapter.alpha, targets=adapter.targets)
    checkpoint.restore_weights(model)
    merged = merge_lora(model)
    state = {name: t.detach() for name, t in merged.state_dict().items()}
    return LlamaFile(merged.cfg, state, checkpoint.tokenizer, checkpoint.state.inherited)


def build_model(source: LlamaFile, **changes: object) -> Llama:
    """The model a file describes, with its weights; ``changes`` to its config (run choices).

    A file read without its tensor data (``read_model(path, tensor_data=False)``) is read
    straight into the model's parameters, a tensor at a time: the import then holds the model
    once, where loading a state dict holds a float copy of every weight beside it.
    """
    model = Llama(dataclasses.replace(source.config, **changes))
    header_only = any(tensor.is_meta for tensor in source.tensors.values())
    if header_only and source.contents is not None:
        read_tensors_into(source.contents.path, model.state_dict())
    else:
        model.load_state_dict(source.tensors, strict=True)
    return model


def check_compatible(checkpoint: Checkpoint, model_cfg: ModelConfig, tokenizer: Tokenizer) -> None:
    """Refuse to resume a checkpoint into a run whose model or tokenizer differ."""
    if checkpoint.tokenizer.fingerprint() != tokenizer.fingerprint():
        raise CheckpointError(
            "checkpoint tokenizer differs from the one the config gives (tokenizer.* or the "
            "corpus changed); resume with the config it was trained with"
        )
    ours, theirs = model_cfg.architecture(), checkpoint.config.architecture()
    ours.pop("max_seq_len"), theirs.pop("max_seq_len")
    diffs = [
        f"{k}: checkpoint {theirs[k]!r} vs config {ours[k]!r}" for k in ours if ours[k] != theirs[k]
    ]
    if diffs:
        raise CheckpointError(
            "checkpoint model does not match the config (" + "; ".join(diffs) + "); "
            "resume with the config it was trained with or start a new output.dir"
        )


def checkpoint_dir(run_dir: str | Path) -> Path:
    """Where a run folder keeps its checkpoints."""
    return Path(run_dir) / "checkpoints"


def _write_failure(err: OSError) -> str:
    """The errno text; numpy's short tensor writes carry none, only the byte counts."""
    if err.strerror:
        return err.strerror
    return f"{err} (the disk is full or a file size limit was reached)"


def _check_finite_weights(model: Llama, step: int, kept: str) -> None:
    """Refuse to save a diverged model: the update after a NaN gradient can leave NaN weights
    while the loss that step reported was still finite."""
    for name, weight in model.named_parameters():
        if not torch.isfinite(weight).all():
            raise CheckpointError(
                f"weight {name} is not finite at step {step}, so it is not saved; {kept}. "
                + DIVERGED_FIX
            )


class CheckpointManager:
    """Numbered checkpoints in ``<run>/checkpoints``, the last K kept (0 = all), ``latest.gguf``
    a stable name for the newest."""

    def __init__(self, directory: str | Path, keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:07d}.gguf"

    @property
    def latest(self) -> Path:
        return self.directory / LATEST

    def kept(self) -> str:
        """What survives a failed run: the checkpoint ``latest.gguf`` points at, if any."""
        if self.latest.exists():
            return f"the last good checkpoint {self.latest.resolve()} is intact"
        return "no checkpoint was written yet"

    def save(self, model, tokenizer, optimizer, state: TrainingState) -> Path:
        """Write step ``state.step``'s checkpoint, point ``latest.gguf`` at it, prune old ones.

        Raises CheckpointError, leaving the previous checkpoints and ``latest.gguf`` as they
        were, when the weights are not finite or the folder cannot be written (full, read-only).
        """
        _check_finite_weights(model, state.step, self.kept())
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = save_checkpoint(self.path_for(state.step), model, tokenizer, optimizer, state)
            self._point_latest_at(path)
        except OSError as err:
            raise CheckpointError(
                f"cannot write the step-{state.step} checkpoint in {self.directory}: "
                f"{_write_failure(err)}; {self.kept()}. Free space or choose another output.dir"
            ) from err
        self._prune()
        return path

    def _point_latest_at(self, path: Path) -> None:
        """Swap the ``latest.gguf`` symlink atomically (symlink to a temp name, rename)."""
        tmp = self.directory / f".{LATEST}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.symlink(path.name, tmp)
            os.replace(tmp, self.latest)
        finally:
            tmp.unlink(missing_ok=True)  # gone after the rename; left over if it failed

    def _prune(self) -> None:
        if self.keep == 0:
            return
        numbered = sorted(self.directory.glob("step-*.gguf"))
        for old in numbered[: -self.keep]:
            old.unlink()

    def resolve(self, spec: str | Path) -> Path:
        """``latest`` means this run's newest checkpoint; anything else is a path."""
        if str(spec) == "latest":
            if not self.latest.exists():
                raise CheckpointError(
                    f"no checkpoint to resume in {self.directory}; run without --resume first "
                    "or check output.dir"
                )
            return self.latest.resolve()
        return Path(spec)
