"""Real training runs of the tiny config: exact resume, checkpoint contents, guard rails, L-BFGS.

Unit-level behaviour of one step (schedule, micro-batching, clipping) is in
tests/unit/test_trainer_step.py; the optimizer maths in tests/unit/test_optim.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from llamatrain import api
from llamatrain.build import build_tokenizer
from llamatrain.checkpoint import load_checkpoint
from llamatrain.config import Config, load_config
from llamatrain.data import build_train_data, resolve_inputs
from llamatrain.errors import CheckpointError, TrainingError
from llamatrain.model import Llama
from llamatrain.trainer import Trainer

# The straight run: 8 steps, a checkpoint every 2 (the last 3 kept), no export.
STRAIGHT = ["train.steps=8", "train.save_every=2", "train.keep_checkpoints=3", "train.eval_every=0"]
NO_EXPORT = "output.export=false"


def build_trainer(cfg: Config, trainer_class: type[Trainer] = Trainer) -> Trainer:
    """A trainer for ``cfg`` assembled from the public pieces, the way ``api.fit`` does it."""
    paths = resolve_inputs(cfg.data.path, cfg.data.cache_dir)
    tokenizer = build_tokenizer(cfg, paths)
    torch.manual_seed(cfg.train.seed)
    model_cfg = dataclasses.replace(
        cfg.model, vocab_size=tokenizer.vocab_size, max_seq_len=cfg.data.n_ctx
    )
    data = build_train_data(cfg, tokenizer, paths=paths, progress=False)
    return trainer_class(Llama(model_cfg), cfg, data=data, tokenizer=tokenizer, progress=False)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> api.FitResult:
    run = tmp_path_factory.mktemp("straight") / "run"
    overrides = [f'data.cache_dir="{cache_dir}"', f'output.dir="{run}"', *STRAIGHT, NO_EXPORT]
    return api.fit("tiny", overrides=overrides, progress=False)


def checkpoint(result: api.FitResult, step: int) -> Path:
    return result.run_dir / "checkpoints" / f"step-{step:07d}.gguf"


def assert_same_weights(a: Llama, b: Llama) -> None:
    b_weights = b.state_dict()
    for name, weight in a.state_dict().items():
        assert torch.equal(weight, b_weights[name]), name


def test_resume_latest_is_bit_identical(straight, tiny_overrides):
    """4 steps, then ``resume="latest"`` to 8, ends exactly where 8 straight steps end: the
    same losses, weights, validation loss and sample (weights, AdamW moments, RNG and data
    cursor are all restored)."""
    first = tiny_overrides(
        **{"train.save_every": 2, "train.eval_every": 0, "output.export": "false"}
    )
    api.fit("tiny", overrides=[*first, "train.steps=4"], progress=False)
    resumed = api.fit("tiny", overrides=[*first, "train.steps=8"], resume="latest", progress=False)
    straight_losses = [r["loss"] for r in straight.history.train]
    assert len(straight_losses) == 8
    assert [r["loss"] for r in resumed.history.train] == straight_losses[4:]
    assert_same_weights(straight.model, resumed.model)
    assert resumed.history.eval[-1]["val_loss"] == straight.history.eval[-1]["val_loss"]
    assert resumed.history.samples[-1] == straight.history.samples[-1]
    # metrics.jsonl keeps the first part's lines (steps <= 4, with that fit's own report) and
    # adds the resumed ones
    lines = [json.loads(s) for s in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [
        (r["step"], next(k for k in ("plan", "loss", "val_loss", "report") if k in r))
        for r in lines
    ]
    assert kinds == [
        (0, "plan"),  # each fit opens with what it is about to do
        (4, "loss"),
        (4, "val_loss"),
        (4, "report"),
        (4, "plan"),
        (8, "loss"),
        (8, "val_loss"),
        (8, "report"),
    ]
    assert lines[4]["plan"]["done"] == 4 and lines[4]["plan"]["steps"] == 8
    assert lines[5]["loss"] == straight_losses[-1]
    assert lines[-1]["report"]["steps"] == 4  # the resumed fit reports its own 4 steps


def test_a_finished_fit_holds_no_training_state(straight):
    """What only training needed (gradients; AdamW's moments live in the last checkpoint) is
    freed before export and plotting, so they do not add to the run's peak memory: the
    model ``fit`` returns has no gradients."""
    assert all(p.grad is None for p in straight.model.parameters())


def test_trainer_load_state_continues_a_run(straight, tiny_overrides):
    """The same through the Trainer API: a fresh trainer (its own, different init) restored
    from the straight run's step-4 checkpoint continues exactly as that run did."""
    cfg = load_config("tiny", tiny_overrides(**{"train.steps": 8, "train.eval_every": 0}))
    cfg.train.seed = 7  # a different init and data order: load_state must replace both
    trainer = build_trainer(cfg)
    trainer.load_state(load_checkpoint(checkpoint(straight, 4)))
    assert trainer.state.step == 4 and trainer.state.tokens == 4 * 512
    history = trainer.fit()
    assert [r["loss"] for r in history.train] == [r["loss"] for r in straight.history.train[4:]]
    assert_same_weights(straight.model, trainer.model)


def test_checkpoint_holds_weights_counters_and_optimizer_state(straight, tiny_overrides):
    ckpt = load_checkpoint(straight.run_dir / "checkpoints" / "latest.gguf")
    # 8 steps of 8 sequences of 64 tokens
    assert (ckpt.state.step, ckpt.state.samples, ckpt.state.tokens) == (8, 64, 64 * 64)
    assert ckpt.state.data_state["samples"] == 64
    assert ckpt.state.config["train"]["steps"] == 8  # the exact config travels with the file
    assert ckpt.metadata["optimizer.type"] == "adam"
    weights = {k: torch.as_tensor(v) for k, v in ckpt.weights.items()}
    for name, weight in straight.model.state_dict().items():
        assert torch.equal(weights[name], weight), name  # f32 checkpoints are lossless
    n = straight.model.num_params()
    first, second = (ckpt.tensors[f"optimizer.adam.{k}_moments"] for k in ("first", "second"))
    assert first.shape == second.shape == (n,)
    # squares of gradients: zero exactly where the first moment is, the embedding rows of
    # tokens no batch has contained yet
    assert torch.equal(second == 0, first == 0) and (second > 0).float().mean() > 0.8
    # load_state puts the flat moments back on the right parameters
    trainer = build_trainer(load_config("tiny", tiny_overrides()))
    trainer.load_state(ckpt)
    params = list(trainer.model.parameters())
    restored = torch.cat([trainer.optimizer.state[p]["exp_avg"].flatten() for p in params])
    assert torch.equal(restored, first)
    assert all(trainer.optimizer.state[p]["step"].item() == 8 for p in params)


def test_checkpoints_keep_the_last_k_and_latest_points_at_the_newest(straight):
    directory = straight.run_dir / "checkpoints"
    assert sorted(p.name for p in directory.glob("step-*.gguf")) == [
        "step-0000004.gguf",
        "step-0000006.gguf",
        "step-0000008.gguf",
    ]  # saved at 2, 4, 6, 8; keep_checkpoints = 3
    latest = directory / "latest.gguf"
    assert latest.is_symlink()
    assert str(latest.readlink()) == "step-0000008.gguf"  # relative: the folder can move
    assert load_checkpoint(checkpoint(straight, 6)).state.step == 6


class PoisonedTrainer(Trainer):
    """Turns the last micro-batch's logits of step ``poison_step`` to NaN, the way an overflow
    would: with accumulation (n_ubatch < n_batch) the micro-batches before it were finite."""

    poison_step = 4

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        if self.state.step + 1 != self.poison_step:
            return super().train_step(inputs, targets)
        n_micro, calls = len(inputs) // self.context.micro_batch, []

        def poison(module, args, output):
            calls.append(module)
            return output * math.nan if len(calls) == n_micro else output

        hook = self.model.output_norm.register_forward_hook(poison)
        try:
            return super().train_step(inputs, targets)
        finally:
            hook.remove()


@pytest.mark.parametrize(
    "setting",
    [{}, {"train.n_ubatch": 128}, {"train.dtype": '"bfloat16"'}],
    ids=["plain", "accumulating", "bf16-autocast"],
)
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_overrides, setting):
    overrides = {"train.steps": 6, "train.save_every": 2, "train.eval_every": 0, **setting}
    trainer = build_trainer(load_config("tiny", tiny_overrides(**overrides)), PoisonedTrainer)
    with pytest.raises(TrainingError, match="loss became nan at step 4") as err:
        trainer.fit()
    assert str(trainer.checkpoints.directory) in str(err.value)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())  # no update applied
    directory = trainer.checkpoints.directory
    assert [p.name for p in directory.glob("step-*.gguf")] == ["step-0000002.gguf"]
    good = load_checkpoint(directory / "latest.gguf")
    assert good.state.step == 2
    assert all(torch.isfinite(torch.as_tensor(t)).all() for t in good.weights.values())


class DivergedTrainer(Trainer):
    """Its weights turn NaN right after step 4 while that step's loss was finite (a NaN
    gradient applied by the optimizer), just before the step-4 save."""

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = super().train_step(inputs, targets)
        if self.state.step + 1 == 4:
            with torch.no_grad():
                self.model.output_norm.weight[0] = math.nan
        return loss


def test_non_finite_weights_are_never_saved(tiny_overrides):
    overrides = {"train.steps": 6, "train.save_every": 2, "train.eval_every": 0}
    trainer = build_trainer(load_config("tiny", tiny_overrides(**overrides)), DivergedTrainer)
    with pytest.raises(CheckpointError, match="weight output_norm.weight is not finite at step 4"):
        trainer.fit()
    assert load_checkpoint(trainer.checkpoints.directory / "latest.gguf").state.step == 2


def test_resume_refuses_a_different_model(straight, tiny_overrides):
    with pytest.raises(CheckpointError, match="dim: checkpoint 64 vs config 32"):
        api.fit(
            "tiny",
            overrides=tiny_overrides(**{"train.steps": 10, "model.dim": 32}),
            resume=checkpoint(straight, 8),
            progress=False,
        )


def test_resume_refuses_a_different_tokenizer(straight, tiny_overrides):
    with pytest.raises(CheckpointError, match="tokenizer differs"):
        api.fit(
            "tiny",
            overrides=tiny_overrides(**{"train.steps": 10, "tokenizer.vocab_size": 400}),
            resume=checkpoint(straight, 8),
            progress=False,
        )


def test_resume_latest_without_a_checkpoint_is_reported(tiny_overrides):
    with pytest.raises(CheckpointError, match="no checkpoint to resume"):
        api.fit("tiny", overrides=tiny_overrides(), resume="latest", progress=False)


@pytest.fixture(scope="module")
def lbfgs_and_adamw(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict:
    """4 steps from the same init on the same batches: L-BFGS (10 iterations per step, lr 1,
    its line search sets the length) and AdamW at the tiny config's peak lr from step 0."""
    common = [f'data.cache_dir="{cache_dir}"', "train.steps=4", "train.eval_every=0",
              "train.eval_batches=0", "optim.warmup_steps=0", NO_EXPORT]  # fmt: skip
    lbfgs = ['optim.name="lbfgs"', "optim.lr=1", "optim.lr_min=1", "optim.lbfgs_max_iter=10"]
    results = {}
    for name, extra in (("lbfgs", lbfgs), ("adamw", [])):
        run = tmp_path_factory.mktemp(name) / "run"
        overrides = [*common, *extra, f'output.dir="{run}"']
        results[name] = api.fit("tiny", overrides=overrides, progress=False)
    return results


def test_lbfgs_lowers_the_validation_loss_more_than_adamw(lbfgs_and_adamw):
    """Measured on the whole validation split: L-BFGS 5.96 -> ~4.6 nats, AdamW ~5.3. Each L-BFGS
    step minimises its batch with up to 10 line-searched iterations, so after the same 4
    steps it must be far ahead on held-out text, not merely lower on its own batch."""
    lbfgs = lbfgs_and_adamw["lbfgs"].history.eval[-1]["val_loss"]
    adamw = lbfgs_and_adamw["adamw"].history.eval[-1]["val_loss"]
    uniform = math.log(384)  # a fresh model predicts nearly uniformly: ~5.96 measured
    assert lbfgs < uniform - 1.0
    assert lbfgs < adamw - 0.4
    losses = [r["loss"] for r in lbfgs_and_adamw["lbfgs"].history.train]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))


def test_lbfgs_checkpoint_resumes_only_with_lbfgs(lbfgs_and_adamw, tiny_overrides):
    run = lbfgs_and_adamw["lbfgs"].run_dir
    ckpt = load_checkpoint(run / "checkpoints" / "latest.gguf")
    assert ckpt.metadata["optimizer.type"] == "lbfgs" and ckpt.state.step == 4
    assert not any(name.startswith("optimizer.adam") for name in ckpt.tensors)
    with pytest.raises(CheckpointError, match="'lbfgs' optimizer state"):
        api.fit(
            "tiny",
            overrides=tiny_overrides(),
            resume=run / "checkpoints" / "latest.gguf",
            progress=False,
        )
