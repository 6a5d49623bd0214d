"""The rest of the 2023 trainer in real runs: convergence tests stop a run (and a resume keeps
counting), samples from seen tokens only, and the time and memory report."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from llamatrain import api
from llamatrain.build import build_tokenizer
from llamatrain.checkpoint import load_checkpoint
from llamatrain.config import load_config
from llamatrain.data import build_train_data, resolve_inputs
from llamatrain.errors import ConfigError
from llamatrain.generate import generate
from llamatrain.model import Llama
from llamatrain.trainer import Trainer


class ScriptedTrainer(Trainer):
    """A trainer whose steps report constructed losses (the model is not trained), so the
    convergence tests meet exactly the losses the test chose."""

    def __init__(self, *args, losses: list[float], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.losses = iter(losses)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return next(self.losses)


def scripted(tiny_overrides, losses: list[float], *extra: str) -> ScriptedTrainer:
    overrides = [*tiny_overrides(), "train.eval_every=0", "train.save_every=0", *extra]
    cfg = load_config("tiny", overrides)
    paths = resolve_inputs(cfg.data.path, cfg.data.cache_dir)
    tokenizer = build_tokenizer(cfg, paths)
    data = build_train_data(cfg, tokenizer, paths=paths, progress=False)
    model_cfg = dataclasses.replace(
        cfg.model, vocab_size=tokenizer.vocab_size, max_seq_len=cfg.data.n_ctx
    )
    model = Llama(model_cfg)
    return ScriptedTrainer(
        model, cfg, data=data, tokenizer=tokenizer, progress=False, losses=losses
    )


def metrics(trainer: Trainer) -> list[dict]:
    return [json.loads(line) for line in trainer.metrics_path.read_text().splitlines()]


def test_no_improvement_stops_saves_and_a_resume_keeps_counting(tiny_overrides):
    losses = [5.0, 4.0, 3.0, 3.5, 3.2, 3.1, 3.05, 3.01]
    trainer = scripted(tiny_overrides, losses, "optim.opt_max_no_improvement=3")
    history = trainer.fit()
    # best 3.0 at step 3; steps 4, 5, 6 bring nothing better: the run ends at step 6.
    assert [r["step"] for r in history.train] == [1, 2, 3, 4, 5, 6]
    assert "no new best training loss for 3 steps" in history.stopped
    records = metrics(trainer)
    assert {"step": 6, "stopped": history.stopped} in records
    assert records[-1]["step"] == 6 and "report" in records[-1]
    checkpoint = load_checkpoint(trainer.checkpoints.latest)
    assert checkpoint.state.step == 6
    assert checkpoint.state.convergence["best"] == 3.0
    assert checkpoint.state.convergence["best_step"] == 3

    resumed = scripted(tiny_overrides, [3.02, 2.0], "optim.opt_max_no_improvement=3")
    resumed.load_state(checkpoint)
    history = resumed.fit()
    # The counters came back: step 7 is the 4th step without a new best, so it stops at once
    # (restarted counters would have taken 3.02 as a new best and gone on).
    assert [r["step"] for r in history.train] == [7]
    assert "best 3 at step 3" in history.stopped


def test_validation_watch_stops_at_an_evaluation(tiny_overrides):
    trainer = scripted(
        tiny_overrides,
        [5.0] * 60,
        "train.eval_every=5",
        "optim.opt_max_no_improvement=5",
        "optim.opt_no_improvement_on=val",
        "train.sample_tokens=0",
    )
    history = trainer.fit()
    # The model never changes (the trainer is scripted), so the validation loss of step 5 is
    # never beaten: the evaluation at step 10 stops the run.
    assert history.train[-1]["step"] == 10
    assert [r["step"] for r in history.eval] == [5, 10]
    assert "no new best validation loss for 5 steps" in history.stopped


def test_a_tiny_gradient_norm_stops_a_real_run(tiny_overrides):
    result = api.fit(
        "tiny",
        overrides=tiny_overrides(),
        progress=False,
        train__steps=10,
        optim__adam_epsf=1e9,  # any real gradient is smaller
        output__export=False,
    )
    assert len(result.history.train) == 1
    assert result.history.train[0]["grad_norm"] < 1e9
    assert "gradient norm" in result.history.stopped
    assert load_checkpoint(result.run_dir / "checkpoints" / "latest.gguf").state.step == 1


def test_seen_tokens_are_stored_and_restrict_samples(tiny_overrides):
    result = api.fit(
        "tiny",
        overrides=tiny_overrides(),
        progress=False,
        train__steps=4,
        train__sample_seen_tokens_only=True,
        output__export=False,
    )
    seen = api.seen_tokens(result.run_dir)
    vocab = result.tokenizer.vocab_size
    assert seen.dtype == torch.bool and seen.shape == (vocab,)
    assert 0 < int(seen.sum()) < vocab  # e.g. most <0xNN> byte tokens never occur in text
    cfg = result.config
    data = build_train_data(cfg, result.tokenizer, progress=False)
    assert torch.equal(seen, data.seen_tokens(vocab))
    prompt = torch.tensor(result.tokenizer.encode("From fairest", bos=True))
    for seed in range(5):
        out = generate(result.model, prompt, 48, seed=seed, allowed=seen)
        assert bool(seen[out[len(prompt) :]].all())
    checkpoint_file = result.run_dir / "checkpoints" / "latest.gguf"
    assert (checkpoint_file.stat().st_size) > 0
    stored = load_checkpoint(checkpoint_file)
    assert stored.tensors["training.seen_tokens"].numel() == (vocab + 7) // 8  # a bitmap


def test_cli_generate_from_seen_tokens_and_the_fit_report(tiny_run):
    assert "trained 60 steps in" in tiny_run.stdout
    assert "peak memory" in tiny_run.stdout and "activation checkpointing: off" in tiny_run.stdout
    report = json.loads((tiny_run.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    parts = report["report"]
    assert parts["steps"] == 60 and parts["tokens"] == 60 * 512
    total = parts["weights_bytes"] + parts["gradients_bytes"] + parts["optimizer_bytes"]
    assert total + parts["rest_bytes"] == parts["peak_bytes"]
    command = [
        sys.executable, "-m", "llamatrain", "generate", str(tiny_run.run_dir),
        "--prompt", "From fairest", "--max-tokens", "24", "--seed", "3", "--seen-tokens-only",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    export = tiny_run.run_dir / "model-f32.gguf"
    command[4] = str(export)
    refused = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1
    assert "holds no seen-token set" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.parametrize(
    "bad, message",
    [
        (["optim.opt_no_improvement_on=test"], "must be one of 'train', 'val'"),
        (["optim.adam_epsf=-1"], "optim.adam_epsf in --set optim.adam_epsf=-1 must be >= 0"),
        (
            ["optim.opt_max_no_improvement=3", "optim.opt_no_improvement_on=val",
             "data.val_fraction=0"],
            "watches the validation loss, but data.val_fraction = 0 holds none out",
        ),
    ],
)  # fmt: skip
def test_bad_convergence_keys_are_reported(bad, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", bad)
