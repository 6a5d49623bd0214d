"""GRPO end to end: ``train.objective = "grpo"`` from a prompt file and a reward function.

The base is a random tiny llama with the tiny config's vocabulary, exported f32; the prompts are
"Say <word>." rows with an ``answer`` column. A LoRA run of a few steps must log TRL's metric
names, keep its completions table, and end as every LoRA run does, with the GGUF adapter and the
merged export; a reward function from a file (TRL's signature) receives the columns; a resumed
run reproduces the uninterrupted one's rewards and adapters (the rollouts' sampler is seeded by
the step, so nothing of it needs storing).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from random_models import tiny_llama

from llamatrain import api
from llamatrain.gguf.adapter import read_lora_adapter
from llamatrain.plot import metrics_figure, read_metrics, read_records

WORDS = ["love", "beauty", "time", "summer", "rose", "heart", "eye", "youth"]

REWARD_FILE = """
def mentions_answer(prompts, completions, completion_ids, answer, **columns):
    assert len(prompts) == len(completions) == len(completion_ids) == len(answer)
    return [float(a in c) if a != "skip" else None for c, a in zip(completions, answer)]
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("grpo")
    model, tokenizer = tiny_llama(cache_dir)
    base = api.export_gguf(model, tokenizer, folder / "base.gguf")
    prompts = folder / "prompts.jsonl"
    rows = [{"prompt": f"Say {w}.", "answer": w} for w in WORDS * 2]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewards = folder / "my_rewards.py"
    rewards.write_text(REWARD_FILE)
    return {"base": base, "prompts": prompts, "rewards": rewards, "cache": cache_dir}


def overrides(files: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return [
        f'data.cache_dir="{files["cache"]}"',
        f'output.dir="{run_dir}"',
        f'model.init_from="{files["base"]}"',
        f'data.path="{files["prompts"]}"',
        'data.format="jsonl"',
        "data.val_fraction=0.125",
        'train.objective="grpo"',
        f'train.rewards=["{files["rewards"]}:mentions_answer", "builtin:length"]',
        "train.reward_args={length={target=4}}",
        "train.num_generations=4",
        "train.max_completion_length=8",
        "lora.rank=4",
        "lora.alpha=8",
        "train.steps=4",
        "train.n_batch=512",  # 8 completions a step: 2 prompts x 4 ...
        "train.n_ubatch=256",  # ... in 2 micro-batches
        "train.save_every=2",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.log_every=1",
        "optim.lr=2e-2",
        "optim.warmup_steps=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory: pytest.TempPathFactory, files):
    run_dir = tmp_path_factory.mktemp("grpo_run") / "run"
    extra = ("train.beta=0.04", "train.num_iterations=2", "train.epsilon_high=0.28")
    return api.fit("tiny", overrides=overrides(files, run_dir, *extra), progress=False)


def test_a_grpo_run_logs_trl_metrics_and_ends_with_the_adapter_and_the_export(grpo_run):
    records = [r for r in read_records(grpo_run.run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    names = {
        "reward",
        "reward_std",
        "rewards/mentions_answer/mean",
        "rewards/mentions_answer/std",
        "rewards/length/mean",
        "rewards/length/std",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "kl",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "entropy",
    }
    for record in records:
        assert names <= set(record), names - set(record)
        assert 1 <= record["completions/mean_length"] <= 8
        assert 0 < record["entropy"] < math.log(grpo_run.model.cfg.vocab_size)  # nats
    # mu = 2: the second step of a rollout trains on the first's rewards again
    assert records[0]["reward"] == records[1]["reward"]
    assert records[0]["kl"] == 0.0  # the first step's policy is the base
    table = read_records(grpo_run.run_dir / "completions.jsonl")
    assert {r["step"] for r in table} == {1, 2, 3, 4}
    assert len(table) == 4 * 8
    row = table[-1]
    assert set(row) >= {"prompt", "completion", "rewards", "reward", "advantage"}
    assert set(row["rewards"]) == {"mentions_answer", "length"}
    assert grpo_run.adapter_path.is_file() and grpo_run.export_path.is_file()
    adapter = read_lora_adapter(grpo_run.adapter_path)
    assert adapter.tensors  # the trained adapters, as llama.cpp's --lora reads them
    evals = [r for r in read_records(grpo_run.run_dir / "metrics.jsonl") if "val_reward" in r]
    assert evals and "val_rewards/length/mean" in evals[-1]


def test_the_runs_curves_draw_its_rewards_lengths_and_entropy_as_logged(grpo_run):
    """``llamatrain plot`` on the metrics.jsonl a GRPO run wrote (fit drew curves.png from it):
    every GRPO panel has the run's 4 steps, and the held-out reward its final evaluation."""
    assert grpo_run.curves_path is not None and grpo_run.curves_path.is_file()
    train, evals = read_metrics(grpo_run.run_dir)
    panels = {ax.get_title(): ax for ax in metrics_figure(train, evals, "run").axes}
    drawn = {
        (title, line.get_label()): list(line.get_xdata())
        for title in ("Reward", "Reward per function", "Completion length", "Entropy and KL")
        for line in panels[title].lines
    }
    for key in [
        ("Reward", "train reward (mean)"),
        ("Reward per function", "train mentions_answer"),
        ("Reward per function", "train length"),
        ("Completion length", "train mean length"),
        ("Completion length", "train max length"),
        ("Entropy and KL", "entropy"),
    ]:
        assert drawn[key] == [1, 2, 3, 4], key
    assert drawn["Reward", "held-out reward (greedy)"] == [evals[-1]["step"]]
    assert panels["Reward"].collections  # the ± std band


def test_a_resumed_grpo_run_reproduces_the_uninterrupted_run(files, tmp_path):
    whole = api.fit("tiny", overrides=overrides(files, tmp_path / "a"), progress=False)
    cut = overrides(files, tmp_path / "b", "train.steps=2")
    api.fit("tiny", overrides=cut, progress=False)
    resumed = api.fit(
        "tiny", overrides=overrides(files, tmp_path / "b"), resume="latest", progress=False
    )
    rewards = [[r["reward"] for r in run.history.train] for run in (whole, resumed)]
    assert rewards[0][2:] == rewards[1]
    a, b = (read_lora_adapter(run.adapter_path).tensors for run in (whole, resumed))
    for name in a:
        assert torch.equal(torch.as_tensor(a[name]), torch.as_tensor(b[name])), name
