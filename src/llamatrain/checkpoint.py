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

Loading a checkpoint builds no model: it returns the weights and the state, and the trainer
restores them onto its own model and optimizer (``Trainer.load_state``). Today's llama.cpp
refuses a model file with extra tensors, so hand it ``llamatrain export``'s output;
``llamatrain.load`` reads checkpoints as models.
"""

from __future__ import annotations

import base64
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from llamatrain.errors import CheckpointError
from llamatrain.gguf.file import verify_gguf
from llamatrain.gguf.llama import read_model, write_model
from llamatrain.model import Llama, ModelConfig
from llamatrain.tokenizer import Tokenizer

FILE_VERSION = 1
LATEST = "latest.gguf"
DIVERGED_FIX = "Lower optim.lr, keep optim.grad_clip on, or check the data"
"""The advice for a run whose loss or weights stopped being finite."""


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


def _adam_tensors(model: Llama, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Flatten AdamW's moments into the 2023 layout (zeros before the first step)."""
    first, second = [], []
    for p in model.parameters():
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
    if first.numel() != sum(p.numel() for p in model.parameters()):
        raise CheckpointError("checkpoint optimizer state does not match the model's size")
    if step == 0:
        return
    offset = 0
    for p in model.parameters():
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
    """Write one resumable GGUF checkpoint atomically."""
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


@dataclass
class Checkpoint:
    """What a checkpoint file holds, read but not yet applied to a run."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    state: TrainingState
    metadata: dict
    tensors: dict[str, torch.Tensor]  # every tensor in the file, optimizer state included

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


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint (or a plain model GGUF: its counters are then zero)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    verify_gguf(path)
    model_file = read_model(path)
    meta = model_file.contents.metadata
    state = TrainingState(
        step=int(meta.get("training.iteration_count", 0)),
        samples=int(meta.get("training.sample_count", 0)),
        tokens=int(meta.get("training.token_count", 0)),
        epochs=int(meta.get("training.epoch_count", 0)),
        data_state=json.loads(meta.get("training.data_state", "{}")),
        config=json.loads(meta.get("training.config", "{}")),
        convergence=json.loads(meta.get("training.convergence", "{}")),
        seen_tokens=_seen_tokens(model_file.contents.tensors, model_file.config.vocab_size),
        inherited=model_file.inherited,
    )
    return Checkpoint(
        model_file.config,
        model_file.tensors,
        model_file.tokenizer,
        state,
        meta,
        model_file.contents.tensors,
    )


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
