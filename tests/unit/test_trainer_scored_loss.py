"""The loss of instruction data: the step loss is the mean over the batch's scored targets (not
-100), however the batch is split into micro-batches, even when micro-batches score unequal
counts; validation counts only scored targets, for its loss and its accuracy."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llamatrain.config import load_config
from llamatrain.evaluate import validation_metrics
from llamatrain.model import Llama
from llamatrain.ops.sets import IGNORE_INDEX
from llamatrain.trainer import Trainer

VOCAB, N_SEQ, N_CTX = 64, 8, 32


def make_trainer(tmp_path: Path, n_ubatch: int) -> Trainer:
    overrides = [f'output.dir="{tmp_path / "run"}"', "train.device=cpu", "data.n_ctx=32"]
    overrides += ["train.n_batch=256", f"train.n_ubatch={n_ubatch}", "optim.grad_clip=0"]
    cfg = load_config("tiny", overrides)
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(cfg.model, vocab_size=VOCAB, max_seq_len=N_CTX))
    return Trainer(model, cfg, progress=False)


def masked_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens whose rows score very different counts: row r scores its last 2 + 3r
    targets (2 of 32 up to 23 of 32)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (N_SEQ, N_CTX + 1), generator=g)
    targets = tokens[:, 1:].clone()
    for r in range(N_SEQ):
        targets[r, : N_CTX - (2 + 3 * r)] = IGNORE_INDEX
    return tokens[:, :-1], targets


def test_the_step_loss_is_the_mean_over_scored_tokens_whatever_the_split(tmp_path):
    """One micro-batch vs 4 of 2 rows (scoring 9, 21, 33 and 45 targets) vs 8 of 1 row: the
    same loss and gradients up to float32 rounding (sums in another order; 1e-5 of the largest
    gradient, as tests/unit/test_trainer_step.py allows), equal to cross-entropy over every
    scored token computed in float64 from the model's logits. Weighting micro-batches by rows
    instead would be off by far more (measured: the row-weighted loss differs by 4e-3)."""
    inputs, targets = masked_batch()
    whole, split, single = (make_trainer(tmp_path, n) for n in (256, 64, 32))
    with torch.no_grad():
        logits = whole.model(inputs).double()
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    losses = [t.objective.accumulate(t.context, inputs, targets) for t in (whole, split, single)]
    assert losses == pytest.approx([expected.item()] * 3, rel=1e-6)
    row_weighted = sum(
        F.cross_entropy(
            logits[2 * i : 2 * i + 2].flatten(0, 1), targets[2 * i : 2 * i + 2].flatten()
        ).item()
        / 4
        for i in range(4)
    )
    assert abs(row_weighted - expected.item()) > 1e-3  # the test can tell the two apart
    for other in (split, single):
        grads = dict(other.model.named_parameters())
        for name, p in whole.model.named_parameters():
            scale = p.grad.abs().max().item()
            assert (grads[name].grad - p.grad).abs().max().item() <= 1e-5 * scale, name


@pytest.mark.parametrize("chunk_bytes", [1 << 24, 7 * VOCAB * 4], ids=["one-chunk", "7-rows"])
def test_validation_counts_only_scored_targets(tmp_path, monkeypatch, chunk_bytes):
    """Two batches of 4 rows scoring 26 and 74 targets: loss and accuracy over the scored
    targets alone, computed in float64 from the model's logits (float32 sums: 1e-6). Every
    third target is made the model's own prediction, so the accuracy is far from 0 and
    counting unscored targets would lower it. Validation takes the lm head a chunk of rows at
    a time (never a whole batch's logits); with chunks of 7 rows most chunks straddle rows and
    several score nothing, and the figures are the same."""
    monkeypatch.setattr("llamatrain.evaluate.CHUNK_LOGITS", chunk_bytes)
    inputs, targets = masked_batch()
    model = make_trainer(tmp_path, 256).model
    with torch.no_grad():
        logits = model(inputs).double()
    scored = targets != IGNORE_INDEX
    targets[:, ::3] = torch.where(scored[:, ::3], logits.argmax(-1)[:, ::3], IGNORE_INDEX)
    loss = F.cross_entropy(logits[scored], targets[scored])
    accuracy = (logits.argmax(-1)[scored] == targets[scored]).double().mean()
    halves = [(inputs[:4], targets[:4]), (inputs[4:], targets[4:])]
    monkeypatch.setattr(Llama, "forward", _whole_logits_refused)
    metrics = validation_metrics(model, halves, torch.device("cpu"))
    assert metrics["val_loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert metrics["val_acc"] == pytest.approx(accuracy.item(), abs=1e-12)
    assert accuracy > 0.2


def _whole_logits_refused(*args, **kwargs):
    raise AssertionError("validation took a whole batch's logits (Llama.forward)")
