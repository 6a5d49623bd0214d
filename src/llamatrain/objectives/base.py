"""What every objective is to the trainer: the :class:`Objective` interface, the
:class:`StepContext` it works in, and what a step hands back (:class:`StepResult`).

Why an interface: the trainer's loop (the update, clipping, the finite check, saves, resumes,
logging, trackers, the run plan) is one for every method, as nanoGPT keeps one loop; what
differs per method — what a step draws, how its loss is computed, what evaluation reports,
which file it scores against — is the objective's (TRL's one trainer per method, torchtune's
one recipe per method). The trainer asks "which objective?" nowhere: it calls the methods
below, and a notebook's own objective (``llamatrain.fit(cfg, objective=...)``) gets batching,
DDP, checkpoints, stop/resume and trackers the same way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch

from llamatrain.checkpoint import DIVERGED_FIX, Checkpoint
from llamatrain.config import Config, set_in
from llamatrain.errors import ConfigError
from llamatrain.model import Llama
from llamatrain.model_path import LoraBase, check_same_model
from llamatrain.ops.sets import IGNORE_INDEX
from llamatrain.parallel import Parallel

if TYPE_CHECKING:
    from llamatrain.data import Batch, TrainData
    from llamatrain.tokenizer import Tokenizer
    from llamatrain.trackers import Trackers

__all__ = [
    "Objective",
    "ObjectiveInputs",
    "autocast_for",
    "batch_result",
    "check_reference",
    "refuse_rewards",
    "ObjectiveBase",
    "StepContext",
    "StepResult",
    "scored_count",
]

Parts = tuple[torch.Tensor | None, ...]


@dataclass
class StepContext:
    """What an objective takes from the trainer: the prepared model and how to run it, the
    run's data and settings, and the trainer's update (``train_step``)."""

    cfg: Config
    model: Llama
    """Adapted and checkpointed, on its device (under FSDP its parameters are shards)."""
    loss_fn: Callable[..., torch.Tensor]
    """The next-token loss, through DDP/FSDP and compiled when the run asks."""
    logits_fn: Callable[..., torch.Tensor]
    """The model's forward (``logps_of=``: the targets' log-probs), wrapped alike."""
    device: torch.device
    parallel: Parallel
    train_step: Callable[..., float]
    """One optimizer step on a step's work: zeroes the gradients, calls the objective's
    :meth:`Objective.accumulate` on ``*work`` (more than once for L-BFGS), checks the loss,
    clips and updates; returns the loss."""
    data: TrainData | None = None
    progress: bool = False
    """Whether this rank shows progress bars (rank 0, when the run shows them)."""
    main: bool = True
    """Whether this rank writes files and logs."""
    run_dir: Path | None = None
    trackers: Trackers | None = None
    """The run's experiment trackers while ``fit`` runs (rank 0)."""

    @property
    def micro_batch(self) -> int:
        """Rows computed at once (``train.n_ubatch // data.n_ctx``)."""
        return self.cfg.seqs_per_ubatch

    def autocast(self) -> contextlib.AbstractContextManager:
        """The run's compute dtype for a forward (:func:`autocast_for`)."""
        return autocast_for(self.cfg, self.device)

    def micro_batches(self, *parts: torch.Tensor | None) -> Iterator[tuple[bool, Parts]]:
        """This rank's share of a batch's rows (``parts``: inputs, targets … cut alike, None
        passed on), in micro-batches of whole rows; each with whether it is the last, whose
        backward exchanges the gradients."""
        return self.split(*(None if p is None else self.parallel.rows(p) for p in parts))

    def split(self, *parts: torch.Tensor | None) -> Iterator[tuple[bool, Parts]]:
        """``parts`` (rows this rank holds) in micro-batches, as :meth:`micro_batches`."""
        n = math.ceil(len(parts[0]) / self.micro_batch)
        cut = [[None] * n if part is None else part.split(self.micro_batch) for part in parts]
        for i, micro_batch in enumerate(zip(*cut, strict=True)):
            yield i == n - 1, micro_batch


@dataclass
class ObjectiveInputs:
    """What building an objective may use, as a run has it after ``build.prepare``."""

    model: Llama
    device: torch.device
    ranks: int = 1
    data: TrainData | None = None
    tokenizer: Tokenizer | None = None
    rewards: Sequence[str | Callable[..., Any]] | None = None
    """GRPO's reward functions given in Python, in place of ``train.rewards``."""
    tools: Sequence[str | Callable[..., Any]] | None = None
    """GRPO's tools given in Python, in place of ``train.tools``."""
    checkpoint: Checkpoint | None = None
    """The checkpoint a resumed run continues (its reference record is checked)."""
    reference_from_file: bool = False
    """A full finetune's DPO/IPO table is ``model.init_from``'s (cached; resumable); False:
    computed from ``model`` as given (a Trainer built by hand), which cannot resume."""


class StepResult(NamedTuple):
    """One step done: its loss, the rows it trained on, the targets it scored (counted in
    ``state.tokens``), the tokens it processed (its throughput's) and its metrics beyond the
    loss (logged with it)."""

    loss: float
    rows: int
    scored: int
    processed: int
    metrics: dict[str, float]


@runtime_checkable
class Objective(Protocol):
    """A training objective as the trainer drives it (:class:`ObjectiveBase` gives the
    defaults; SFT, preference and GRPO in this package, or a notebook's own)."""

    name: str
    """What the run trains (``train.objective``'s value for the built-in ones)."""
    watches: str | None
    """The evaluation metric the convergence test watches (``val_loss``), or None."""
    reference: LoraBase | None
    """The model file the objective scores against, which checkpoints record."""

    def step(self, ctx: StepContext, step: int) -> StepResult:
        """Draw step ``step``'s work (0-based) and train on it through ``ctx.train_step``."""

    def accumulate(self, ctx: StepContext, *work: Any, **extra: Any) -> float:
        """Forward/backward over ``work`` (gradients zeroed before); returns its loss."""

    def evaluate(self, ctx: StepContext, step: int) -> dict[str, float]:
        """The held-out metrics after ``step`` steps (the trainer prefixes ``val_``)."""

    def describe(self, record: dict[str, Any]) -> str:
        """An evaluation record in one line, for the console."""

    def postfix(self, record: dict[str, Any]) -> dict[str, str]:
        """A training record's extra fields for the progress bar."""

    def diverged_fix(self) -> str:
        """What to change when the loss stops being finite."""

    def check_resume(self, checkpoint: Checkpoint) -> None:
        """Refuse a checkpoint that was trained against another reference."""

    def start(self, ctx: StepContext, step: int) -> None:
        """``fit`` begins at ``step`` (a resume's): keep what the run's files hold to it."""

    def logged(self, ctx: StepContext, step: int) -> None:
        """The trainer logged step ``step``'s record (to the trackers too)."""


class ObjectiveBase:
    """Defaults for an :class:`Objective`: no reference, nothing kept between steps, the
    validation loss watched, the loss printed."""

    name = "custom"
    watches: str | None = "val_loss"
    reference: LoraBase | None = None
    reference_role = "reference model"
    """How a refusal of a changed :attr:`reference` names it."""
    held: Llama | None = None
    """A frozen model the objective holds beside the trained one (GRPO's base reference over
    a full finetune), which the run's memory plan counts."""

    def evaluate(self, ctx: StepContext, step: int) -> dict[str, float]:
        """Nothing held out to report unless the objective says what."""
        return {}

    def describe(self, record: dict[str, Any]) -> str:
        shown = [f"{k} {v:.4f}" for k, v in record.items() if isinstance(v, float)]
        return f"step {record['step']}: " + (" ".join(shown) or "no held-out metrics")

    def postfix(self, record: dict[str, Any]) -> dict[str, str]:
        return {}

    def diverged_fix(self) -> str:
        return DIVERGED_FIX

    def check_resume(self, checkpoint: Checkpoint) -> None:
        check_reference(self.reference, checkpoint, self.reference_role)

    def start(self, ctx: StepContext, step: int) -> None:
        return None

    def logged(self, ctx: StepContext, step: int) -> None:
        return None


def check_reference(used: LoraBase | None, checkpoint: Checkpoint | None, role: str) -> None:
    """The one check of a recorded reference: the file an objective scores against (``used``)
    has the content the checkpoint's run scored against; ``role`` names it in a refusal."""
    recorded = None if checkpoint is None else checkpoint.state.reference_model
    if recorded is not None and used is not None:
        check_same_model(used, recorded, role, checkpoint.path)


def refuse_rewards(cfg: Config, rewards: Sequence[object] | None) -> None:
    """Reward functions score GRPO's completions, tools and environments answer its turns; an
    objective that samples none refuses them, from the config (``train.rewards``,
    ``train.tools``, ``train.environment``) or from Python (``rewards=``)."""
    objective = cfg.train.objective
    if cfg.train.rewards is not None:
        raise ConfigError(
            f"train.rewards {set_in(cfg, 'train.rewards', 'train.objective')} score GRPO's "
            f"completions; train.objective = {objective!r} samples none: set train.objective = "
            "'grpo' or remove train.rewards"
        )
    if rewards is not None:
        raise ConfigError(
            f"rewards= score GRPO's completions; train.objective = {objective!r} "
            f"{set_in(cfg, 'train.objective')} samples none: set train.objective = 'grpo' "
            "or pass no rewards"
        )
    for key in ("tools", "environment"):
        if getattr(cfg.train, key):
            raise ConfigError(
                f"train.{key} {set_in(cfg, f'train.{key}', 'train.objective')} answers turns "
                f"of GRPO's rollouts; train.objective = {objective!r} samples none: set "
                f"train.objective = 'grpo' or remove train.{key}"
            )


def autocast_for(cfg: Config, device: torch.device) -> contextlib.AbstractContextManager:
    """The run's compute dtype for a forward: bf16 autocast (``train.dtype``) or nothing —
    the one place a run's autocast is made."""
    if cfg.train.dtype == "bfloat16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batch_result(
    ctx: StepContext, batch: Batch, loss: float, metrics: dict[str, float] | None = None
) -> StepResult:
    """A step on a sampler's ``batch`` counted: its rows, its scored targets and the
    ``n_batch`` tokens it processed."""
    rows, scored = batch.inputs.shape[0], scored_count(batch.targets)
    return StepResult(loss, rows, scored, ctx.cfg.train.n_batch, metrics or {})


def scored_count(targets: torch.Tensor) -> int:
    """Targets the loss scores (not -100): every one of text data, the trained ones of
    instruction and chat data."""
    return int((targets != IGNORE_INDEX).sum())
