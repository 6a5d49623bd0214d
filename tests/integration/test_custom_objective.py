"""A notebook's own objective through ``llamatrain.fit``: the trainer's batching, checkpoints,
stop/resume and metrics serve it as they serve SFT, with no change to the trainer.

The objective is a token-weighted next-token loss (each target's loss weighted by a per-vocabulary
weight, normalised by the batch's total weight): what a user writes to upweight rare tokens. It
is one small class over ``ObjectiveBase``; with every weight 1 it must be SFT exactly.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from llamatrain import api, parallel
from llamatrain.objectives import ObjectiveBase, StepContext, StepResult
from llamatrain.ops.sets import IGNORE_INDEX

RUN = [
    "train.steps=4",
    "train.save_every=2",
    "train.eval_every=2",
    "train.log_every=1",
    "output.export=false",
]


class TokenWeighted(ObjectiveBase):
    """Cross-entropy weighted per target token: sum_t w[y_t] * nll_t / sum_t w[y_t] over the
    step's batch, accumulated over its micro-batches."""

    name = "token-weighted"

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights

    def step(self, ctx: StepContext, step: int) -> StepResult:
        batch = ctx.data.sampler.next_batch()
        loss = ctx.train_step(batch.inputs, batch.targets)
        scored = int((batch.targets != IGNORE_INDEX).sum())
        return StepResult(loss, len(batch.inputs), scored, ctx.cfg.train.n_batch, {})

    def accumulate(self, ctx: StepContext, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        total_weight = self.weights[targets.clamp(min=0)].sum()
        total = 0.0
        for last, (x, y) in ctx.micro_batches(inputs, targets):
            with ctx.parallel.gradient_sync(last), ctx.autocast():
                logits = ctx.logits_fn(x.to(ctx.device)).float()
                nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
                loss = (self.weights[y.flatten()] * nll).sum() / total_weight
                loss.backward()
            total += loss.item()
        return parallel.average(total)


def fit(overrides: list[str], objective: ObjectiveBase, **kwargs: object) -> api.FitResult:
    return api.fit("tiny", overrides=overrides, objective=objective, progress=False, **kwargs)


def test_a_custom_objective_trains_checkpoints_and_resumes_exactly(tiny_overrides, tmp_path):
    vocab = 384  # the tiny config's vocabulary
    weights = torch.linspace(0.5, 2.0, vocab)
    straight = fit(
        tiny_overrides(**{"output.dir": f'"{tmp_path / "a"}"'}) + RUN, TokenWeighted(weights)
    )
    losses = [r["loss"] for r in straight.history.train]
    assert len(losses) == 4 and all(loss > 0 for loss in losses)
    assert straight.history.eval[-1]["step"] == 4  # evaluated by ObjectiveBase's default: none
    checkpoints = sorted((straight.run_dir / "checkpoints").glob("step-*.gguf"))
    assert [p.name for p in checkpoints] == ["step-0000002.gguf", "step-0000004.gguf"]

    first = tiny_overrides(**{"output.dir": f'"{tmp_path / "b"}"'})
    fit([*first, *RUN[1:], "train.steps=2"], TokenWeighted(weights))
    resumed = fit([*first, *RUN], TokenWeighted(weights), resume="latest")
    assert [r["loss"] for r in resumed.history.train] == losses[2:]  # bit-exact
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, straight.model.state_dict()[name]), name
    logged = [json.loads(line) for line in (resumed.run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4]


def test_with_unit_weights_it_is_sft(tiny_overrides, tmp_path):
    """Every weight 1: the objective is the next-token loss, so its steps are SFT's (the
    built-in objective's loss through the model's own head; float32 sums in another order)."""
    short = [*RUN[1:], "train.steps=2", "train.sample_tokens=0"]
    sft = api.fit("tiny", overrides=tiny_overrides() + short, progress=False)
    unit = fit(
        tiny_overrides(**{"output.dir": f'"{tmp_path / "u"}"'}) + short,
        TokenWeighted(torch.ones(384)),
    )
    for ours, theirs in zip(unit.history.train, sft.history.train, strict=True):
        assert abs(ours["loss"] - theirs["loss"]) <= 1e-5 * theirs["loss"]
