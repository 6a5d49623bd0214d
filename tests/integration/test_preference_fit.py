"""Preference tuning end to end: ``train.objective = "dpo"`` (LoRA, QLoRA and full), ``"orpo"``
and ``"simpo"`` (full).

The base is a random tiny llama with the tiny config's vocabulary, exported f32; the pairs are
generated: the chosen reply to "What is <word>?" is short, the rejected one long. What a run
must show: at the start the policy is its reference (margins exactly 0, the loss ln 2); after
a few steps every training pair's chosen reply is preferred (reward accuracy 1) with a clear
margin; the metrics are logged; the adapter is written as for SFT; a resumed run reproduces
the uninterrupted run's losses and adapters bit for bit; a bad line stops the CLI naming
file:line in one line. A full finetune's DPO takes its reference from the cache, computed once
from the base file before training: it equals a live forward of the base, a resume reads it
(and recomputes it from the base when it is gone), bit-exact either way.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from random_models import tiny_llama
from user_errors import error_of

from llamatrain import api
from llamatrain.checkpoint import load_checkpoint
from llamatrain.cli import main
from llamatrain.data import build_train_data
from llamatrain.errors import CheckpointError, TrainingError
from llamatrain.gguf.adapter import read_lora_adapter
from llamatrain.lora import lora_state_dict
from llamatrain.model_path import base_sha256
from llamatrain.objectives import ObjectiveInputs, objective_for
from llamatrain.objectives.preference import reference
from llamatrain.objectives.preference.losses import pair_logps, token_logps
from llamatrain.objectives.preference.objective import PreferenceObjective
from llamatrain.plot import read_records
from llamatrain.trainer import Trainer

STEPS = 8
WORDS = ["love", "beauty", "time", "summer", "rose", "heart", "eye", "youth"]


def pairs() -> list[dict]:
    return [
        {
            "prompt": f"What is {w}?",
            "chosen": f" {w} is fair.",
            "rejected": f" {w} doth fade and die in winter.",
        }
        for w in WORDS * 3
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pref")
    model, tokenizer = tiny_llama(cache_dir)
    base = api.export_gguf(model, tokenizer, folder / "base.gguf")
    data = folder / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs()))
    return {"base": base, "pairs": data, "cache": cache_dir}


def overrides(files: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return [
        f'data.cache_dir="{files["cache"]}"',
        f'output.dir="{run_dir}"',
        f'model.init_from="{files["base"]}"',
        f'data.path="{files["pairs"]}"',
        'data.format="jsonl"',
        "data.val_fraction=0.125",
        'train.objective="dpo"',
        "lora.rank=4",
        "lora.alpha=8",
        f"train.steps={STEPS}",
        "train.n_batch=256",  # 4 rows a step ...
        "train.n_ubatch=128",  # ... in 2 micro-batches
        "train.save_every=2",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.log_every=1",
        "optim.lr=2e-2",
        "optim.warmup_steps=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory: pytest.TempPathFactory, files):
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    return api.fit("tiny", overrides=overrides(files, run_dir), progress=False)


def training_pair_metrics(result: api.FitResult) -> dict[str, float]:
    """The objective's metrics over every training pair, with the run's model as it is."""
    data = build_train_data(result.config, result.tokenizer)
    rows = data.train
    batches = [rows.batch(np.arange(len(rows)))]
    objective = PreferenceObjective("dpo", result.config.train.beta)
    autocast = torch.autocast("cpu", enabled=False)
    return objective.evaluate_batches(result.model, batches, torch.device("cpu"), autocast)


def test_dpo_starts_at_its_reference_and_learns_to_prefer_the_chosen_replies(dpo_run):
    first, last = dpo_run.history.train[0], dpo_run.history.train[-1]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference
    assert first["reward_margin"] == 0 and first["reward_accuracy"] == 0
    assert last["reward_accuracy"] == 1 and last["loss"] < first["loss"] - 0.1
    after = training_pair_metrics(dpo_run)
    assert after["reward_accuracy"] == 1.0 and after["reward_margin"] > 0.3, after
    assert dpo_run.history.eval[-1]["val_reward_accuracy"] == 1.0


def test_dpo_metrics_are_logged_and_the_adapter_is_written(dpo_run, files):
    records = [r for r in read_records(dpo_run.run_dir / "metrics.jsonl") if "loss" in r]
    assert len(records) == STEPS
    for key in ("reward_margin", "reward_accuracy", "logp_chosen", "logp_rejected"):
        assert all(math.isfinite(r[key]) for r in records), key
    assert all(r["logp_chosen"] > r["logp_rejected"] for r in records)  # shorter replies
    adapter = read_lora_adapter(dpo_run.adapter_path)
    assert set(adapter.tensors) == set(lora_state_dict(dpo_run.model))
    base_model, _ = api.load_gguf(files["base"])
    trained = dpo_run.model.state_dict()
    for name, weight in base_model.state_dict().items():
        assert torch.equal(trained[name], weight), name  # the base (the reference) is frozen


def test_dpo_resume_is_bit_exact(dpo_run, files, tmp_path):
    run_dir = tmp_path / "run"
    api.fit("tiny", overrides=overrides(files, run_dir, "train.steps=4"), progress=False)
    resumed = api.fit("tiny", overrides=overrides(files, run_dir), resume="latest", progress=False)
    straight = [r["loss"] for r in dpo_run.history.train]
    assert [r["loss"] for r in resumed.history.train] == straight[4:]
    reference = lora_state_dict(dpo_run.model)
    for name, tensor in lora_state_dict(resumed.model).items():
        assert torch.equal(tensor, reference[name]), name


def test_orpo_trains_a_whole_model_without_a_reference(files, tmp_path):
    items = overrides(files, tmp_path / "run", 'train.objective="orpo"', "lora.rank=0")
    result = api.fit("tiny", overrides=[*items, "train.steps=4", "optim.lr=3e-3"], progress=False)
    first, last = result.history.train[0], result.history.train[-1]
    assert last["nll"] < first["nll"] and last["loss"] < first["loss"]
    assert first["reward_chosen"] == pytest.approx(0.1 * first["logp_chosen"])


def test_a_huge_beta_that_overflows_the_loss_is_named_not_only_the_learning_rate(files, tmp_path):
    """Issue 37: SimPO with beta = 1e300 overflows its loss at the first step; the message
    blamed optim.lr alone."""
    items = overrides(files, tmp_path / "run", 'train.objective="simpo"', "train.beta=1e300")
    message = error_of(api.fit, "tiny", overrides=[*items, "train.steps=2"], progress=False)
    assert message.startswith("loss became") and "lower train.beta (= 1e+300)" in message
    assert "simpo loss scales with it" in message and "optim.lr" in message


def test_a_bad_pair_stops_the_cli_naming_file_and_line(files, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps(p) for p in pairs()[:3]] + ['{"prompt": "a", "chosen": "b"}']
    bad.write_text("\n".join(lines) + "\n")
    items = [*overrides(files, tmp_path / "run"), f'data.path="{bad}"']
    argv = ["fit", "--config", "tiny", *(arg for item in items for arg in ("--set", item))]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    line = next(x for x in err if f"{bad}:4: " in x)
    assert 'this line has no "rejected"' in line and "data.on_bad_line" in line


# ---- full finetuning: the cached reference -----------------------------------------------


def full_overrides(files: dict[str, Path], run_dir: Path, cache: Path, *extra: str) -> list[str]:
    """Full-finetune DPO with its own reference cache folder (``cache``), tokenizer shared."""
    items = overrides(files, run_dir, "lora.rank=0", "optim.lr=1e-3", "train.eval_every=4")
    return [*items, f'data.cache_dir="{cache}"', *extra]


@pytest.fixture(scope="module")
def full_cache(tmp_path_factory: pytest.TempPathFactory, files) -> Path:
    cache = tmp_path_factory.mktemp("full-cache")
    shutil.copytree(files["cache"], cache, dirs_exist_ok=True)  # the tokenizer: not retrained
    return cache


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, files, full_cache):
    run_dir = tmp_path_factory.mktemp("full") / "run"
    return api.fit("tiny", overrides=full_overrides(files, run_dir, full_cache), progress=False)


def cached_table(result: api.FitResult, files) -> tuple:
    """The run's cached reference table, read (computing it would fail), and its data."""
    data = build_train_data(result.config, result.tokenizer)
    base, _ = api.load_gguf(files["base"])
    inputs = ObjectiveInputs(base, torch.device("cpu"), data=data, reference_from_file=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "reference_table", _refuse)
        table = objective_for(result.config, inputs).table
    return table, data, base


def _refuse(*_args, **_kwargs):
    raise AssertionError("the reference was computed again instead of read from the cache")


def test_full_finetune_dpo_learns_against_its_cached_reference(full_run, files):
    first, last = full_run.history.train[0], full_run.history.train[-1]
    # policy = reference at step 1, up to float32 rounding (cache: 2 rows a forward; the
    # step: its own rows): measured on CPU margin 0.0 exactly, loss - ln 2 = 1.9e-9 (float32
    # log-sigmoid(0) vs the float64 ln 2)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(first["reward_margin"]) < 1e-5
    assert last["reward_accuracy"] == 1 and last["loss"] < first["loss"] - 0.1
    table, data, _ = cached_table(full_run, files)
    objective = PreferenceObjective("dpo", full_run.config.train.beta)
    rows = np.arange(len(data.train))
    after = objective.evaluate_batches(
        full_run.model, [data.train.batch(rows)], torch.device("cpu"),
        torch.autocast("cpu", enabled=False), [table.rows(rows)],
    )  # fmt: skip
    assert after["reward_accuracy"] == 1.0 and after["reward_margin"] > 0.3, after
    assert full_run.history.eval[-1]["val_reward_accuracy"] == 1.0
    base, _ = api.load_gguf(files["base"])
    moved = [
        name for name, w in base.state_dict().items()
        if not torch.equal(full_run.model.state_dict()[name], w)
    ]  # fmt: skip
    assert len(moved) > 10  # every weight trains: no frozen copy serves as the reference


CACHED_VS_LIVE_ATOL = 2e-5
"""|cached - live| of a reply's summed log-prob: the same float32 computation by the same
weights, over other rows in a forward (the cache: 2 rows; here: all 11 rows at once), so at
most the matmuls' float32 rounding may differ. Measured on CPU: 0.0 (bit-equal) on sums up to
|137|; the bound, ~2 float32 ulp of such a sum, leaves room for a BLAS or GPU whose kernels
round differently with the batch size."""


def test_the_cached_reference_is_a_live_reference_forward(full_run, files):
    table, data, base = cached_table(full_run, files)
    batch = data.train.batch(np.arange(len(data.train)))
    with torch.no_grad():
        logits = base(batch.inputs, documents=batch.documents)
    live = pair_logps(token_logps(logits, batch.targets), batch.targets, batch.documents)
    slots = table.rows(np.arange(len(data.train)))
    real = (slots[..., 2] > 0) & (slots[..., 3] > 0)
    cached = slots[real]
    assert len(cached) == len(live.chosen) == 21  # every training pair
    assert torch.equal(cached[:, 2], live.chosen_tokens)
    assert torch.equal(cached[:, 3], live.rejected_tokens)
    assert float((cached[:, 0] - live.chosen).abs().max()) <= CACHED_VS_LIVE_ATOL
    assert float((cached[:, 1] - live.rejected).abs().max()) <= CACHED_VS_LIVE_ATOL


def test_a_trainer_built_by_hand_takes_its_reference_from_the_model_it_is_given(full_run, files):
    table, data, base = cached_table(full_run, files)
    trainer = Trainer(base, full_run.config, data=data, tokenizer=full_run.tokenizer)
    assert np.array_equal(trainer.objective.table.train, table.train)  # the same computation
    assert np.array_equal(trainer.objective.table.val, table.val)
    with pytest.raises(TrainingError, match="cannot continue a checkpoint"):
        trainer.load_state(None)  # its model is not the initial one after a restore


def test_full_finetune_dpo_resume_reads_the_cache_and_is_bit_exact(full_run, files, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(files["cache"], cache)  # a cache with no reference yet
    run_dir = tmp_path / "run"
    api.fit("tiny", overrides=full_overrides(files, run_dir, cache, "train.steps=4"),
            progress=False)  # fmt: skip
    shutil.copytree(run_dir, tmp_path / "copy", symlinks=True)  # to resume a second time
    entries = sorted((cache / "reference").iterdir())
    assert [p.suffix for p in entries] == [".bin", ".json"]
    stamp = [p.stat().st_mtime_ns for p in entries]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a recomputation would warn
        resumed = api.fit(
            "tiny", overrides=full_overrides(files, run_dir, cache), resume="latest",
            progress=False,
        )  # fmt: skip
    assert [p.stat().st_mtime_ns for p in entries] == stamp  # read, not rewritten
    straight = [r["loss"] for r in full_run.history.train]
    assert [r["loss"] for r in resumed.history.train] == straight[4:]
    reference = full_run.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name

    shutil.rmtree(cache / "reference")  # gone: recomputed from the base file, same bits
    with pytest.warns(UserWarning, match="computing them again"):
        items = full_overrides(files, tmp_path / "copy", cache)
        again = api.fit("tiny", overrides=items, resume="latest", progress=False)
    assert [r["loss"] for r in again.history.train] == straight[4:]


def test_full_finetune_dpo_resume_refuses_a_reference_model_replaced_since(files, tmp_path):
    """The checkpoint records the reference file's sha256; a file of other content under the
    same name is refused as a LoRA base is, not silently scored against (a recomputed table)."""
    base = tmp_path / "base.gguf"
    shutil.copy(files["base"], base)
    cache = tmp_path / "cache"
    shutil.copytree(files["cache"], cache)
    items = [*full_overrides(files, tmp_path / "run", cache), f'model.init_from="{base}"']
    api.fit("tiny", overrides=[*items, "train.steps=2"], progress=False)
    checkpoint = load_checkpoint(tmp_path / "run" / "checkpoints" / "latest.gguf")
    assert checkpoint.state.reference_model.sha256 == base_sha256(base)
    model, tokenizer = api.load_gguf(base)
    with torch.no_grad():
        model.token_embd.weight.add_(0.5)  # same shape and vocabulary, other log-probs
    api.export_gguf(model, tokenizer, base)
    with pytest.raises(CheckpointError, match="is not the DPO/IPO reference model") as info:
        api.fit("tiny", overrides=items, resume="latest", progress=False)
    assert "\n" not in str(info.value) and "model.init_from" in str(info.value)


def test_simpo_trains_a_whole_model_without_a_reference(files, tmp_path):
    items = overrides(files, tmp_path / "run", 'train.objective="simpo"', "lora.rank=0")
    extra = ["train.steps=4", "optim.lr=1e-3", "train.beta=2.0", "train.simpo_gamma=0.5"]
    result = api.fit("tiny", overrides=[*items, *extra], progress=False)
    first, last = result.history.train[0], result.history.train[-1]
    assert last["loss"] < first["loss"] and last["reward_margin"] > first["reward_margin"]
    assert first["reward_chosen"] == pytest.approx(2.0 * first["logp_chosen"])
    inputs = ObjectiveInputs(result.model, torch.device("cpu"), reference_from_file=True)
    assert objective_for(result.config, inputs).table is None


def test_qlora_dpo_over_a_q8_0_base(files, tmp_path):
    model, tokenizer = api.load_gguf(files["base"])
    q8 = api.export_gguf(model, tokenizer, tmp_path / "base-q8_0.gguf", type="q8_0")
    items = overrides(files, tmp_path / "run", f'model.init_from="{q8}"')
    extra = ['lora.base_dtype="quantized"', "train.steps=3", "train.save_every=0"]
    result = api.fit("tiny", overrides=[*items, *extra], progress=False)
    first, last = result.history.train[0], result.history.train[-1]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)  # adapters off = the base
    assert last["reward_margin"] > 0 and last["loss"] < first["loss"]
    stored = {buf.dtype for name, buf in result.model.named_buffers() if "blk." in name}
    assert torch.uint8 in stored  # the adapted projections kept as Q8_0 blocks
