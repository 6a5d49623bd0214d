"""A run's checkpoints folder: ``<run>/checkpoints/step-<n>.gguf``, the last K kept,
``latest.gguf`` the stable name of the newest (a symlink swapped atomically), and which one a
resume means. One checkpoint file's contents are ``llamatrain.checkpoint``'s.

A save refuses weights that are not finite (the update after a NaN gradient can leave them
while the step's loss was still finite), and a folder it cannot write leaves the previous
checkpoints and ``latest.gguf`` as they were: what a failed run keeps is said in every error.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llamatrain.checkpoint import DIVERGED_FIX, TrainingState, save_checkpoint
from llamatrain.errors import CheckpointError
from llamatrain.files import point_link_at
from llamatrain.model import Llama
from llamatrain.model_path import LATEST
from llamatrain.parallel import any_rank, is_main, local_tensor

__all__ = ["CheckpointManager"]


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
            if not is_main():
                return path  # rank 0 writes, points latest.gguf and prunes
            self._point_latest_at(path)
        except OSError as err:
            raise CheckpointError(
                f"cannot write the step-{state.step} checkpoint in {self.directory}: "
                f"{_write_failure(err)}; {self.kept()}. Free space or choose another output.dir"
            ) from err
        self._prune(state.step)
        return path

    def _point_latest_at(self, path: Path) -> None:
        """Swap the ``latest.gguf`` symlink atomically (``files.point_link_at``)."""
        point_link_at(self.latest, path.name)

    def numbered(self) -> dict[int, Path]:
        """The folder's checkpoints by the step their name says (``step-<n>.gguf``, read as a
        number: names stop sorting by step once a step has more digits than the padding)."""
        found = {}
        for path in self.directory.glob("step-*.gguf"):
            digits = path.name.removeprefix("step-").removesuffix(".gguf")
            if digits.isascii() and digits.isdigit() and path.is_file():
                found[int(digits)] = path
        return found

    def _prune(self, step: int) -> None:
        """Keep step ``step``'s checkpoint (``latest.gguf``'s) and the ``keep - 1`` newest before
        it. Checkpoints of later steps belong to a trajectory a resume from an earlier one
        abandoned, so they go first."""
        if self.keep == 0:
            return
        found = self.numbered()
        current = self.path_for(step)
        others = sorted((s for s, p in found.items() if p != current), key=lambda s: (s < step, s))
        for old in others[: max(0, len(others) - (self.keep - 1))]:  # abandoned, then oldest
            found[old].unlink(missing_ok=True)

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


def _write_failure(err: OSError) -> str:
    """The errno text; numpy's short tensor writes carry none, only the byte counts."""
    if err.strerror:
        return err.strerror
    return f"{err} (the disk is full or a file size limit was reached)"


def _check_finite_weights(model: Llama, step: int, kept: str) -> None:
    """Refuse to save a diverged model: the update after a NaN gradient can leave NaN weights
    while the loss that step reported was still finite. Every rank checks its shard and all
    refuse together, so none waits for a save that is not coming."""
    bad = next((n for n, w in model.named_parameters() if not _all_finite(local_tensor(w))), None)
    if any_rank(bad is not None):
        raise CheckpointError(
            f"weight {bad or 'on another rank'} is not finite at step {step}, so it is not "
            f"saved; {kept}. " + DIVERGED_FIX
        )


_FINITE_CHUNK = 1 << 20
"""Elements checked at a time by :func:`_all_finite`."""


def _all_finite(weight: torch.Tensor) -> bool:
    """Whether every element is finite, checked a million elements at a time (one device
    sync): ``isfinite(w).all()`` on a whole weight makes weight-sized temporaries (its
    absolute values and masks), which a training process keeps for reuse: +148 MB at a QLoRA
    run's checkpoint, for its float32 tied embedding."""
    parts = weight.reshape(-1).split(_FINITE_CHUNK)
    return bool(torch.stack([torch.isfinite(part).all() for part in parts]).all())
