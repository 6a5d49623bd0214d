"""Supervised finetuning (``train.objective = "sft"``): the next-token loss over the batch's
scored targets — every token of text data, the trained ones of instruction and chat data.

One optimizer step consumes ``n_batch`` tokens computed ``n_ubatch`` at a time (llama.cpp
finetune's semantics): each micro-batch's mean loss is weighted by its share of the batch's
scored targets and the gradients accumulated, so the step's loss is the mean over the batch's
scored tokens and the update equals the full batch's up to float rounding whatever
``n_ubatch`` is. A batch is ``(inputs, targets)``, or ``(inputs, targets, documents)`` for
packed examples (``documents`` None when each row holds one), all split alike by rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from llamatrain import parallel
from llamatrain.config import Config
from llamatrain.evaluate import validation_metrics
from llamatrain.objectives.base import (
    ObjectiveBase,
    ObjectiveInputs,
    StepContext,
    StepResult,
    batch_result,
    refuse_rewards,
    scored_count,
)

__all__ = ["DEFAULT_BETA", "SFTObjective", "build", "check"]

DEFAULT_BETA = 0.1
"""``train.beta`` unset (SFT has none; the config records the preference default)."""


class SFTObjective(ObjectiveBase):
    """The next-token loss on the sampler's batches of windows or example rows."""

    name = "sft"

    def step(self, ctx: StepContext, step: int) -> StepResult:
        batch = ctx.data.sampler.next_batch()
        packed = () if batch.documents is None else (batch.documents,)
        return batch_result(ctx, batch, ctx.train_step(batch.inputs, batch.targets, *packed))

    def accumulate(
        self,
        ctx: StepContext,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor | None = None,
    ) -> float:
        """Under torchrun this rank computes its equal share of the batch's rows; the ranks'
        gradients are averaged in the last micro-step's backward, as is the loss after it, so
        each rank weighs its micro-batches' scored shares of the whole batch ``ranks``-fold."""
        batch_scored, ranks = scored_count(targets), ctx.parallel.ranks
        total = 0.0
        for last, (x, y, d) in ctx.micro_batches(inputs, targets, documents):
            with ctx.parallel.gradient_sync(last):
                loss = _loss(ctx, x, y, d) * (scored_count(y) * ranks / batch_scored)
                loss.backward()
            total += loss.item()
        return parallel.average(total)

    def evaluate(self, ctx: StepContext, step: int) -> dict[str, float]:
        """Validation loss, perplexity and next-token accuracy over the held-out windows."""
        batches = ctx.data.val_batches(ctx.cfg.train.eval_batches)
        return validation_metrics(ctx.model, batches, ctx.device, ctx.autocast())

    def describe(self, record: dict[str, Any]) -> str:
        return (
            f"step {record['step']}: val_loss {record['val_loss']:.4f} "
            f"ppl {record['val_ppl']:.2f} acc {record['val_acc']:.3f}"
        )


def _loss(
    ctx: StepContext, inputs: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None
) -> torch.Tensor:
    """The micro-batch's mean loss over its scored targets, in float32."""
    packed = {} if documents is None else {"documents": documents.to(ctx.device)}
    with ctx.autocast():
        loss = ctx.loss_fn(inputs.to(ctx.device), targets.to(ctx.device), **packed)
    return loss.float()


def build(cfg: Config, inputs: ObjectiveInputs) -> SFTObjective:
    """SFT scores against nothing: nothing to build."""
    return SFTObjective()


def check(cfg: Config, rewards: Sequence[object] | None) -> None:
    """SFT samples nothing, so reward functions are a mistake (``objectives.check`` refuses
    them for every objective but GRPO)."""
    refuse_rewards(cfg, rewards)
