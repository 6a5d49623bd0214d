"""The preference objectives (DPO, IPO, ORPO, SimPO) as the trainer drives them: each step's
micro-batches of whole pairs, their losses weighted for the whole batch (the formulas:
:mod:`.losses`), the step's reward metrics over every rank's pairs, and evaluation.

The reference of DPO/IPO over a LoRA run is the model with its adapters switched off
(``llamatrain.lora.adapters_disabled``), computed without gradients on the same rows just
before the policy's forward: no second copy of the weights, and no cache (the base's forward
is as cheap as the policy's, a cache would only add a file and a check). A full finetune's is
a :class:`~.reference.ReferenceTable`, looked up by the rows the sampler draws and cut among
the ranks as the rows are.

A step's loss is the mean over its pairs (ORPO's NLL: over its chosen tokens) however the
step is cut into micro-batches: :meth:`PreferenceObjective.loss` divides each micro-batch's
sums by the whole batch's counts (:meth:`PreferenceObjective.batch_counts`), so the
accumulated gradient equals the whole batch's; every rank counts the whole batch's, which it
holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from llamatrain import parallel
from llamatrain.checkpoint import DIVERGED_FIX, Checkpoint
from llamatrain.data.preferences import CHOSEN
from llamatrain.errors import TrainingError
from llamatrain.lora import adapters_disabled, lora_modules
from llamatrain.model import Llama
from llamatrain.model_path import REFERENCE_ROLE
from llamatrain.objectives.base import ObjectiveBase, StepContext, StepResult, batch_result
from llamatrain.objectives.preference.losses import (
    OBJECTIVES,
    PairLogps,
    dpo_losses,
    ipo_losses,
    orpo_losses,
    pair_count,
    pair_logps,
    simpo_losses,
    token_logps,
)
from llamatrain.objectives.preference.reference import ReferenceTable, checked_slots
from llamatrain.ops.sets import IGNORE_INDEX

__all__ = ["PreferenceObjective"]


@dataclass
class _Sums:
    """Per-pair quantities summed over a step's micro-batches."""

    values: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor) -> None:
        self.values[name] = self.values.get(name, 0.0) + float(value.detach().double().sum())


class PreferenceObjective(ObjectiveBase):
    """``train.objective`` (dpo, ipo, orpo, simpo) on a model: micro-batch losses weighted
    for the whole batch, and the step's reward metrics. ``gamma``: SimPO's target margin.
    ``table``: the reference of DPO/IPO over a full finetune (:mod:`.reference`); without it
    the reference is the model with its LoRA adapters off."""

    reference_role = REFERENCE_ROLE

    def __init__(
        self,
        objective: str,
        beta: float,
        label_smoothing: float = 0.0,
        gamma: float = 0.0,
        table: ReferenceTable | None = None,
    ) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown preference objective {objective!r}; one of {OBJECTIVES}")
        self.name = self.objective = objective
        self.beta, self.label_smoothing, self.gamma = beta, label_smoothing, gamma
        self.needs_reference = objective in ("dpo", "ipo")
        self.table = table
        self.reference = None if table is None else table.model
        self._sums = _Sums()
        self._pairs = 0

    @staticmethod
    def batch_counts(targets: torch.Tensor, documents: torch.Tensor) -> tuple[int, int]:
        """A batch's pairs and its chosen replies' scored tokens (ORPO's NLL divisor)."""
        scored = targets != IGNORE_INDEX
        chosen_tokens = int((scored & (documents[..., 1] == CHOSEN)).sum())
        return pair_count(targets, documents), chosen_tokens

    def start_step(self) -> None:
        """Forget the last step's metrics."""
        self._sums, self._pairs = _Sums(), 0

    def reference_logps(
        self,
        model: Llama,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor,
        autocast: contextlib.AbstractContextManager,
        cached: torch.Tensor | None = None,
    ) -> PairLogps | None:
        """The reference's pair log-probs: these rows' ``cached`` slots (a
        :class:`ReferenceTable`'s, checked to be these rows' pairs) or, without them, the
        model's forward with its adapters off (no gradients); None for a reference-free
        objective."""
        if not self.needs_reference:
            return None
        if cached is not None:
            return checked_slots(cached.to(inputs.device), targets, documents)
        with torch.no_grad(), adapters_disabled(model), autocast:
            logps = model(inputs, documents=documents, logps_of=targets)
        return pair_logps(logps, targets, documents)

    def loss(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor,
        reference: PairLogps | None,
        counts: tuple[int, int],
    ) -> torch.Tensor:
        """:meth:`loss_from_logps` on full ``logits`` (B, T, V): the plain path, for checks."""
        logps = token_logps(logits, targets)
        return self.loss_from_logps(logps, targets, documents, reference, counts)

    def loss_from_logps(
        self,
        logps: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor,
        reference: PairLogps | None,
        counts: tuple[int, int],
    ) -> torch.Tensor:
        """This micro-batch's share of the step's loss from its targets' log-probs ``logps``
        (B, T): its per-pair losses summed over the step's pair count (ORPO's NLL: its chosen
        tokens' over the step's); metrics summed."""
        n_pairs, n_chosen_tokens = counts
        policy = pair_logps(logps, targets, documents)
        if self.objective == "dpo":
            assert reference is not None
            chosen, rejected = policy.chosen, policy.rejected
            ref = reference.chosen, reference.rejected
            losses, r_c, r_r = dpo_losses(chosen, rejected, *ref, self.beta, self.label_smoothing)
        elif self.objective == "ipo":
            assert reference is not None
            chosen, rejected = policy.means()
            losses, r_c, r_r = ipo_losses(chosen, rejected, *reference.means(), self.beta)
        elif self.objective == "simpo":
            chosen, rejected = policy.means()
            losses, r_c, r_r = simpo_losses(
                chosen, rejected, self.beta, self.gamma, self.label_smoothing
            )
        else:
            chosen, rejected = policy.means()
            losses, r_c, r_r = orpo_losses(chosen, rejected, self.beta)
        loss = losses.sum() / n_pairs
        if self.objective == "orpo":  # + the NLL of the chosen replies, mean over their tokens
            nll = -policy.chosen.sum()
            loss = loss + nll / n_chosen_tokens
            self._sums.add("nll_sum", nll)
            self._sums.add("nll_tokens", policy.chosen_tokens)
            self._sums.add("odds_ratio_loss", losses)
        self._record(losses, chosen, rejected, r_c, r_r)
        return loss

    def _record(
        self,
        losses: torch.Tensor,
        chosen: torch.Tensor,
        rejected: torch.Tensor,
        r_c: torch.Tensor,
        r_r: torch.Tensor,
    ) -> None:
        s = self._sums
        margin = r_c - r_r
        s.add("reward_margin", margin)
        s.add("reward_accuracy", (margin > 0).double())
        s.add("reward_chosen", r_c)
        s.add("reward_rejected", r_r)
        s.add("logp_chosen", chosen)
        s.add("logp_rejected", rejected)
        self._pairs += len(losses)

    def metrics(self) -> dict[str, float]:
        """The step's per-pair means (since :meth:`start_step`); ORPO's also its ``nll``."""
        sums, n = dict(self._sums.values), max(self._pairs, 1)
        nll, tokens = sums.pop("nll_sum", None), sums.pop("nll_tokens", None)
        out = {name: value / n for name, value in sums.items()}
        if nll is not None and tokens:
            out["nll"] = nll / tokens
        return out

    def evaluate_batches(
        self,
        model: Llama,
        batches: Iterable[tuple[torch.Tensor, ...]],
        device: torch.device,
        autocast: contextlib.AbstractContextManager,
        references: Iterable[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """The objective's loss (per pair) and reward metrics over ``batches``;
        ``references``: each batch's cached reference slots (:meth:`ReferenceTable.batches`),
        None for the adapters-off reference."""
        was_training = model.training
        model.eval()
        self.start_step()
        weighted, pairs = 0.0, 0
        cached = iter(references) if references is not None else None
        try:
            for batch in batches:
                inputs, targets, documents = (t.to(device) for t in batch[:3])
                counts = self.batch_counts(targets, documents)
                slots = next(cached) if cached is not None else None
                reference = self.reference_logps(model, inputs, targets, documents, autocast, slots)
                with torch.no_grad(), autocast:
                    logps = model(inputs, documents=documents, logps_of=targets)
                    loss = self.loss_from_logps(logps, targets, documents, reference, counts)
                weighted += float(loss) * counts[0]  # the batch's mean, weighted by its pairs
                pairs += counts[0]
        finally:
            model.train(was_training)
        return {"loss": weighted / max(pairs, 1), **self.metrics()}

    # ---- as the trainer drives it ----------------------------------------------------------

    def step(self, ctx: StepContext, step: int) -> StepResult:
        """A step on the sampler's next rows (with their cached reference slots, for a
        full finetune's DPO/IPO)."""
        cached = {}
        if self.table is None:
            batch = ctx.data.sampler.next_batch()
        else:
            indices = ctx.data.sampler.next_indices()  # next_batch(), with the rows' indices
            batch = ctx.data.train.batch(indices)
            cached = {"reference": self.table.rows(indices)}
        loss = ctx.train_step(batch.inputs, batch.targets, batch.documents, **cached)
        return batch_result(
            ctx, batch, loss, self.step_metrics(ctx, batch.targets, batch.documents)
        )

    def accumulate(
        self,
        ctx: StepContext,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor | None = None,
        reference: torch.Tensor | None = None,
    ) -> float:
        """Micro-batches of whole pairs (a pair lies in one row), each micro-batch's loss its
        share of the step's mean over the batch's pairs (``ranks``-fold, as SFT's).
        ``reference``: the rows' cached reference slots (a full finetune's DPO/IPO), cut
        alike. The policy's log-probs of the targets (the model's forward with ``logps_of``,
        which never holds the full logits) come through the wrapper (``logits_fn``: DDP,
        FSDP, compile); a LoRA run's reference is the plain model with its adapters off,
        without gradients, so no wrapper is needed for it."""
        if documents is None:
            raise TrainingError(
                f"train.objective = {self.objective!r} trains on rows of preference pairs "
                "(llamatrain.data.preferences), which carry documents; this batch has none"
            )
        if reference is None and self.needs_reference and not _has_adapters(ctx.model):
            raise TrainingError(
                f"train.objective = {self.objective!r} over a full finetune needs the batch's "
                "cached reference log-probs (train_step's reference=); this batch has none"
            )
        self.start_step()
        counts = self.batch_counts(targets, documents)  # the whole batch's, on every rank
        total = 0.0
        for last, (x, y, d, r) in ctx.micro_batches(inputs, targets, documents, reference):
            x, y, d = x.to(ctx.device), y.to(ctx.device), d.to(ctx.device)
            with ctx.parallel.gradient_sync(last):
                ref = self.reference_logps(ctx.model, x, y, d, ctx.autocast(), r)
                with ctx.autocast():
                    logps = ctx.logits_fn(x, documents=d, logps_of=y)
                loss = self.loss_from_logps(logps, y, d, ref, counts) * ctx.parallel.ranks
                loss.backward()
            total += loss.item()
        return parallel.average(total)

    def step_metrics(
        self, ctx: StepContext, targets: torch.Tensor, documents: torch.Tensor
    ) -> dict[str, float]:
        """The step's metrics over the whole batch: each rank's means (over its pairs; ORPO's
        nll over its chosen tokens) weighted by its counts, summed over the ranks, divided by
        the batch's counts. Every rank holds whole rows, each with a pair, so every rank
        reports the same names."""
        metrics = self.metrics()
        if ctx.parallel.ranks == 1:
            return metrics
        counts = self.batch_counts(targets, documents)
        rows = ctx.parallel.rows
        mine = self.batch_counts(rows(targets), rows(documents))
        names = sorted(metrics)
        per = [int(name == "nll") for name in names]  # the count it is a mean over
        sums = parallel.summed([metrics[n] * mine[i] for n, i in zip(names, per, strict=True)])
        return {n: s / counts[i] for n, s, i in zip(names, sums, per, strict=True)}

    def evaluate(self, ctx: StepContext, step: int) -> dict[str, float]:
        """The loss and reward metrics over the held-out pairs, named ``val_…``."""
        n_seq, limit = ctx.data.n_seq, ctx.cfg.train.eval_batches
        references = None if self.table is None else self.table.batches(n_seq, limit)
        batches = ctx.data.val_batches(limit)
        metrics = self.evaluate_batches(ctx.model, batches, ctx.device, ctx.autocast(), references)
        return {f"val_{k}": v for k, v in metrics.items()}

    def describe(self, record: dict[str, Any]) -> str:
        return (
            f"step {record['step']}: val_loss {record['val_loss']:.4f} "
            f"reward margin {record['val_reward_margin']:.4f} "
            f"accuracy {record['val_reward_accuracy']:.3f}"
        )

    def postfix(self, record: dict[str, Any]) -> dict[str, str]:
        return {
            "margin": f"{record['reward_margin']:.3f}",
            "acc": f"{record['reward_accuracy']:.2f}",
        }

    def diverged_fix(self) -> str:
        """DIVERGED_FIX, with beta named beside the learning rate: the loss scales with it,
        so a huge one overflows whatever the rate."""
        return (
            f"{DIVERGED_FIX}; or lower train.beta (= {self.beta:g}): the {self.objective} loss "
            "scales with it, so a huge one overflows whatever the learning rate"
        )

    def check_resume(self, checkpoint: Checkpoint) -> None:
        """A table computed from a model in memory cannot follow a restore of other weights;
        one from a file checks that file is the one the checkpoint's run scored against."""
        if self.table is not None and self.table.model is None:
            raise TrainingError(
                "this trainer computed its DPO/IPO reference from the model it was given, so "
                "it cannot continue a checkpoint; pass the initial model's reference "
                "(objectives.objective_for with the run's model file) or resume through "
                "llamatrain.api.fit"
            )
        super().check_resume(checkpoint)


def _has_adapters(model: Llama) -> bool:
    """Whether ``model`` has LoRA adapters to switch off for DPO/IPO's reference; a full
    finetune has none, so its reference must be the cached table's rows."""
    return any(True for _ in lora_modules(model))
