"""One optimizer step of the Trainer: what ``train_step`` does without data, tokenizer or files.

``Trainer.train_step`` is what the benchmarks drive and what ``fit`` repeats, so its contract is
tested on its own here: the schedule's learning rate, gradient accumulation over micro-batches,
gradient clipping, the non-finite-loss guard, and that building a trainer writes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from llamatrain.config import load_config
from llamatrain.errors import TrainingError
from llamatrain.model import Llama
from llamatrain.optim import lr_at
from llamatrain.trainer import Trainer

VOCAB = 64


def make_trainer(tmp_path: Path, *overrides: str) -> Trainer:
    """The tiny config's model and optimizer (vocabulary VOCAB), seeded, on the CPU."""
    cfg = load_config("tiny", [f'output.dir="{tmp_path / "run"}"', "train.device=cpu", *overrides])
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(cfg.model, vocab_size=VOCAB, max_seq_len=cfg.data.n_ctx))
    return Trainer(model, cfg, progress=False)


def random_batch(n_seq: int = 8, n_ctx: int = 32, seed: int = 0):
    tokens = torch.randint(
        0, VOCAB, (n_seq, n_ctx + 1), generator=torch.Generator().manual_seed(seed)
    )
    return tokens[:, :-1], tokens[:, 1:]


def grad_norm(grads: dict[str, torch.Tensor]) -> float:
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()


def grads_at_update(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Filled, at every optimizer update, with the gradients that update reads (the step frees
    them right after it)."""
    seen: dict[str, torch.Tensor] = {}
    update = trainer.optimizer.step

    def spy(*args, **kwargs):
        seen.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return update(*args, **kwargs)

    trainer.optimizer.step = spy
    return seen


def test_building_and_stepping_writes_nothing(tmp_path):
    """Files appear only when fit() or save() run: a trainer made to time steps leaves no
    run folder behind."""
    trainer = make_trainer(tmp_path)
    trainer.train_step(*random_batch())
    assert not (tmp_path / "run").exists()
    assert list(tmp_path.iterdir()) == []


def test_each_step_uses_the_schedules_learning_rate(tmp_path):
    trainer = make_trainer(tmp_path)
    for step in range(12):  # through the 10 warmup steps into the cosine
        trainer.state.step = step
        trainer.train_step(*random_batch(n_seq=1, seed=step))
        lrs = {g["lr"] for g in trainer.optimizer.param_groups}
        assert lrs == {lr_at(step, trainer.cfg.optim)}


def test_micro_batching_does_not_change_loss_or_update(tmp_path):
    """n_ubatch only changes how many sequences are computed at once: 8 sequences in one go vs
    4 micro-batches of 2 must give the same loss and gradients up to float32 rounding (sums
    taken in another order: measured 5e-7 of the largest gradient). The gradient check is the
    sharp one: AdamW's update hardly changes if every gradient is scaled by the same factor
    (a wrong micro-batch weight), the gradients and the loss do."""
    whole = make_trainer(tmp_path, "train.n_ubatch=512")
    split = make_trainer(tmp_path, "train.n_ubatch=128")
    assert (whole.context.micro_batch, split.context.micro_batch) == (8, 2)
    whole_grads, split_grads = grads_at_update(whole), grads_at_update(split)
    for step in range(3):
        batch = random_batch(n_ctx=64, seed=step)
        whole.state.step = split.state.step = step
        assert split.train_step(*batch) == pytest.approx(whole.train_step(*batch), rel=1e-6)
        if step == 0:  # same weights so far: the gradients of the update must agree
            for name, grad in whole_grads.items():
                scale = grad.abs().max().item()
                diff = (split_grads[name] - grad).abs().max().item()
                assert diff <= 1e-5 * scale, name
    # After three AdamW steps the weights still agree closely, though less tightly: AdamW
    # divides by sqrt(v), so where a gradient is as small as its rounding noise the update's
    # sign is noise too (up to lr, 3e-4 at step 1; measured 4e-7 at most here).
    split_weights = split.model.state_dict()
    for name, weight in whole.model.state_dict().items():
        torch.testing.assert_close(split_weights[name], weight, rtol=1e-5, atol=1e-5, msg=name)
    # and the steps really changed the weights (the comparison above is not of two inits)
    untrained = make_trainer(tmp_path).model.state_dict()
    assert not torch.equal(untrained["blk.0.attn_q.weight"], split_weights["blk.0.attn_q.weight"])


def test_gradients_are_clipped_to_grad_clip(tmp_path):
    """The step clips the global gradient norm before the update: at init this batch's norm is
    ~0.8, so a clip of 0.1 must act. After the update the gradients are freed (evaluation,
    sampling and saves between steps run without them)."""
    free = make_trainer(tmp_path, "optim.grad_clip=0")
    free_grads = grads_at_update(free)
    free.train_step(*random_batch())
    assert grad_norm(free_grads) > 0.3
    clipped = make_trainer(tmp_path, "optim.grad_clip=0.1")
    clipped_grads = grads_at_update(clipped)
    clipped.train_step(*random_batch())
    assert grad_norm(clipped_grads) == pytest.approx(0.1, rel=1e-5)
    assert all(p.grad is None for p in clipped.model.parameters())


def test_a_nan_weight_stops_the_step_before_the_update(tmp_path):
    """A non-finite loss raises before the optimizer steps, so NaN never spreads from the
    loss into the other weights (or into a checkpoint written afterwards)."""
    trainer = make_trainer(tmp_path)
    trainer.train_step(*random_batch())
    trainer.state.step = 1
    with torch.no_grad():
        trainer.model.output_norm.weight[0] = math.nan
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(TrainingError, match="loss became nan at step 2") as err:
        trainer.train_step(*random_batch(seed=1))
    assert "optim.lr" in str(err.value)  # says what to change
    after = trainer.model.state_dict()
    for name, weight in before.items():
        torch.testing.assert_close(after[name], weight, rtol=0, atol=0, equal_nan=True, msg=name)


def test_a_diverging_learning_rate_is_caught(tmp_path):
    """lr = 1e30 without clipping: AdamW's first updates (~lr each) overflow float32 within
    a few steps; the guard must name the step instead of training on NaN."""
    trainer = make_trainer(tmp_path, "optim.lr=1e30", "optim.grad_clip=0")
    with pytest.raises(TrainingError, match=r"loss became (nan|inf|-inf) at step \d"):
        for step in range(5):
            trainer.state.step = step
            trainer.train_step(*random_batch(seed=step))


def test_a_short_batch_is_weighted_by_its_own_size(tmp_path):
    """A batch of fewer sequences than n_batch (a bench's, a last partial one) still gives its
    mean loss: each micro-batch counts by its share of the batch actually passed."""
    trainer = make_trainer(tmp_path, "train.n_ubatch=64")  # one sequence per micro-batch
    inputs, targets = random_batch(n_seq=3, n_ctx=64)
    expected = trainer.model.loss(inputs, targets).item()
    assert trainer.train_step(inputs, targets) == pytest.approx(expected, rel=1e-6)


def test_a_hand_built_config_is_validated(tmp_path):
    """A notebook may pass Config() straight in: the trainer fills what validate() fills."""
    from llamatrain.config import Config

    cfg = Config()
    cfg.output.dir = str(tmp_path / "run")
    model = Llama(dataclasses.replace(cfg.model, vocab_size=VOCAB, max_seq_len=cfg.data.n_ctx))
    trainer = Trainer(model, cfg, progress=False)
    assert trainer.cfg.train.n_ubatch == cfg.train.n_batch
    assert trainer.context.micro_batch == cfg.train.n_batch // cfg.data.n_ctx
