"""Preference tuning end to end: ``train.objective = "dpo"`` (LoRA) and ``"orpo"`` (full).

The base is a random tiny llama with the tiny config's vocabulary, exported f32; the pairs are
generated: the chosen reply to "What is <word>?" is short, the rejected one long. What a run
must show: at the start the policy is its reference (margins exactly 0, the loss ln 2); after
a few steps every training pair's chosen reply is preferred (reward accuracy 1) with a clear
margin; the metrics are logged; the adapter is written as for SFT; a resumed run reproduces
the uninterrupted run's losses and adapters bit for bit; a bad line stops the CLI naming
file:line in one line.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from llamatrain import api
from llamatrain.build import build_tokenizer
from llamatrain.cli import main
from llamatrain.config import load_config
from llamatrain.data import build_train_data, resolve_inputs
from llamatrain.gguf.adapter import read_lora_adapter
from llamatrain.lora import lora_state_dict
from llamatrain.model import Llama
from llamatrain.plot import read_records
from llamatrain.preference import PreferenceObjective

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
    cfg = load_config("tiny", [f'data.cache_dir="{cache_dir}"'])
    tokenizer = build_tokenizer(cfg, resolve_inputs(cfg.data.path, cfg.data.cache_dir))
    torch.manual_seed(0)
    model_cfg = dataclasses.replace(
        cfg.model, vocab_size=tokenizer.vocab_size, max_seq_len=cfg.data.n_ctx
    )
    base = api.export_gguf(Llama(model_cfg), tokenizer, folder / "base.gguf")
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
    return objective.evaluate(result.model, batches, torch.device("cpu"), autocast)


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
