"""The training loop: schedule, decay groups, micro-batching, exact resume, guard rails."""

import math
import os
from pathlib import Path

import pytest
import torch

from llamatrain import api
from llamatrain.checkpoint import CheckpointManager, load_checkpoint
from llamatrain.config import OptimSection
from llamatrain.errors import CheckpointError, TrainingError
from llamatrain.model import Llama, ModelConfig
from llamatrain.optim import build_optimizer, lr_at, parameter_groups
from llamatrain.trainer import Trainer, checkpoint_segment

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def test_schedule_warms_up_linearly_then_decays_by_cosine():
    cfg = OptimSection(lr=1.0, lr_min=0.1, warmup_steps=4, cos_decay_steps=10, cos_decay_restart=0)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == pytest.approx(1.0)
    assert lr_at(9, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # half way down the cosine
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(1000, cfg) == pytest.approx(0.1)


def test_schedule_restarts_with_growing_period():
    cfg = OptimSection(lr=1.0, lr_min=0.0, warmup_steps=0, cos_decay_steps=10, cos_decay_restart=2)
    assert lr_at(10, cfg) == pytest.approx(1.0)  # first restart after 10 steps
    assert lr_at(20, cfg) == pytest.approx(0.5)  # the second period is 20 long
    assert lr_at(30, cfg) == pytest.approx(1.0)  # second restart after 10 + 20


def test_weight_decay_only_on_matrices():
    model = Llama(ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2))
    decayed, plain = parameter_groups(model, 0.1, decay_min_ndim=2)
    assert all(p.dim() == 2 for p in decayed["params"]) and decayed["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in plain["params"]) and plain["weight_decay"] == 0.0
    optimizer = build_optimizer(model, OptimSection())
    assert isinstance(optimizer, torch.optim.AdamW)


def test_adamw_steps_follow_ggml_formula():
    """Three steps of the (fused) optimizer against ggml's AdamW written out in float64:
    m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², w ← w·(1 − lr·wd) − lr·m̂/(√v̂ + eps), with
    bias-corrected m̂, v̂ (t from 1) and wd only on matrices."""
    torch.manual_seed(0)
    model = Llama(ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2)).double()
    cfg = OptimSection(lr=1e-2, weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-6)
    optimizer = build_optimizer(model, cfg)
    params = list(model.parameters())
    w = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for t in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()
        for i, g in enumerate(grads):
            wd = cfg.weight_decay if w[i].dim() >= 2 else 0.0
            m[i] = cfg.beta1 * m[i] + (1 - cfg.beta1) * g
            v[i] = cfg.beta2 * v[i] + (1 - cfg.beta2) * g * g
            m_hat = m[i] / (1 - cfg.beta1**t)
            v_hat = v[i] / (1 - cfg.beta2**t)
            w[i] = w[i] * (1 - cfg.lr * wd) - cfg.lr * m_hat / (v_hat.sqrt() + cfg.eps)
    for p, expected in zip(params, w, strict=True):
        torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "policy, n, expected",
    [("none", 16, 0), ("full", 16, 1), ("every_n", 16, 3), ("every_n", 2, 2)],
)
def test_checkpoint_segment_policies(policy, n, expected):
    assert checkpoint_segment(policy, 3, n) == expected


def test_auto_checkpointing_follows_the_2023_rule():
    # 16 layers, each block saving 9x its input: keep sqrt(16·9) = 12 inputs -> 2 per segment.
    assert checkpoint_segment("auto", 0, 16, u=1, v=9) == 2
    # cheap blocks (v = u): keep sqrt(16) = 4 inputs, segments of 4
    assert checkpoint_segment("auto", 0, 16, u=1, v=1) == 4


def _trainer(tiny_overrides, **extra) -> Trainer:
    cfg = api.load_config(TINY, tiny_overrides(**extra))
    paths = api.resolve_inputs(cfg.data.path, cfg.data.cache_dir)
    model, tokenizer = api._start_model(cfg, paths)
    data = api.build_train_data(cfg, tokenizer, paths=paths, progress=False)
    return Trainer(model, tokenizer, data, cfg, progress=False)


def test_micro_batching_does_not_change_loss_or_update(tiny_overrides):
    # n_ubatch only changes how many sequences are computed at once: 8 sequences of 64 in one
    # go vs 4 micro-batches of 2 must give the same loss and weights up to float32 rounding.
    whole = _trainer(tiny_overrides, **{"train.n_ubatch": 512})
    split = _trainer(tiny_overrides, **{"train.n_ubatch": 128})
    assert split.n_micro == 4 and whole.n_micro == 1
    for _ in range(3):
        inputs, targets = whole.data.sampler.next_batch()
        split.data.sampler.next_batch()
        loss_whole = whole.train_step(inputs, targets)
        loss_split = split.train_step(inputs, targets)
        whole.state.step += 1
        split.state.step += 1
        assert loss_split == pytest.approx(loss_whole, rel=1e-6)
    for (name, a), b in zip(
        whole.model.state_dict().items(), split.model.state_dict().values(), strict=False
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_resume_is_bit_identical(tiny_overrides, tmp_path):
    common = {"train.steps": 8, "train.eval_every": 0, "output.export": "false"}
    straight = api.fit(TINY, overrides=tiny_overrides(**common), progress=False)
    first = tiny_overrides(**common, **{"output.dir": f'"{tmp_path / "resumed"}"'})
    api.fit(TINY, overrides=[*first, "train.steps=4"], progress=False)
    resumed = api.fit(TINY, overrides=first, resume="latest", progress=False)
    straight_losses = [r["loss"] for r in straight.history.train]
    assert [r["loss"] for r in resumed.history.train] == straight_losses[4:]
    for (name, a), b in zip(
        straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=False
    ):
        assert torch.equal(a, b), name


def test_checkpoint_holds_counters_and_optimizer_state(tiny_overrides, tmp_path):
    result = api.fit(
        TINY,
        overrides=tiny_overrides(**{"train.steps": 3, "train.eval_every": 0}),
        progress=False,
    )
    ckpt = load_checkpoint(result.run_dir / "checkpoints" / "latest.gguf")
    assert ckpt.state.step == 3 and ckpt.state.samples == 24 and ckpt.state.tokens == 24 * 64
    assert ckpt.metadata["optimizer.type"] == "adam"
    n = result.model.num_params()
    assert ckpt.tensors["optimizer.adam.first_moments"].shape == (n,)
    assert ckpt.tensors["optimizer.adam.second_moments"].abs().sum() > 0
    assert ckpt.state.data_state["samples"] == 24


def test_checkpoint_manager_keeps_last_k_and_points_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        path = manager.path_for(step)
        path.write_bytes(b"x")
        manager._point_latest_at(path)
        manager._prune()
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [
        "step-0000002.gguf",
        "step-0000003.gguf",
    ]
    assert os.readlink(manager.latest) == "step-0000003.gguf"


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_overrides, monkeypatch):
    trainer = _trainer(tiny_overrides, **{"train.steps": 6, "train.save_every": 2})
    real_loss = Trainer._loss
    calls = {"n": 0}

    def poisoned(self, inputs, targets):
        calls["n"] += 1
        loss = real_loss(self, inputs, targets)
        return loss * math.nan if calls["n"] == 4 else loss

    monkeypatch.setattr(Trainer, "_loss", poisoned)
    with pytest.raises(TrainingError, match="loss became nan at step 4"):
        trainer.fit()
    good = load_checkpoint(trainer.checkpoints.latest)
    assert good.state.step == 2
    assert all(torch.isfinite(t).all() for t in good.model.state_dict().values())


def test_resume_refuses_a_different_model(tiny_overrides):
    api.fit(TINY, overrides=tiny_overrides(**{"train.steps": 2}), progress=False)
    with pytest.raises(CheckpointError, match="dim: checkpoint 64 vs config 32"):
        api.fit(
            TINY,
            overrides=tiny_overrides(**{"train.steps": 4, "model.dim": 32}),
            resume="latest",
            progress=False,
        )


def test_lbfgs_trains(tiny_overrides):
    trainer = _trainer(
        tiny_overrides, **{"optim.name": '"lbfgs"', "optim.lr": 1.0, "optim.lbfgs_max_iter": 4}
    )
    inputs, targets = trainer.data.sampler.next_batch()
    first = trainer.train_step(inputs, targets)
    trainer.state.step += 1
    second = trainer.train_step(inputs, targets)
    assert second < first


def test_resume_refuses_a_different_tokenizer(tiny_overrides):
    api.fit(TINY, overrides=tiny_overrides(**{"train.steps": 2}), progress=False)
    with pytest.raises(CheckpointError, match="tokenizer differs"):
        api.fit(
            TINY,
            overrides=tiny_overrides(**{"train.steps": 4, "tokenizer.vocab_size": 400}),
            resume="latest",
            progress=False,
        )
