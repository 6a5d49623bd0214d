"""Reward functions from the Python API: ``api.fit(cfg, rewards=[f])`` with no train.rewards.

The run is test_grpo_fit's (its random tiny base and "Say <word>." prompts, LoRA, 2 steps of 2
prompts x 4 completions) with its rewards taken out of the config and a plain function of this
module passed instead: it is called with TRL's arguments and the rows' columns, its metrics
carry its ``__name__``, and every completion's logged reward is what it returns for that
completion.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from test_grpo_fit import files as files  # the random tiny base and the prompts
from test_grpo_fit import overrides

from llamatrain import api
from llamatrain.plot import read_records

CALLS: list[dict] = []


def vowel_share(prompts, completions, completion_ids, answer, trainer_state, **columns):
    """The share of a completion's characters that are vowels (0 for an empty one)."""
    CALLS.append(
        {"n": len(completions), "answers": list(answer), "step": trainer_state.global_step}
    )
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def test_a_python_function_scores_a_run_whose_config_names_none(files, tmp_path: Path):
    cut = ("train.rewards=", "train.reward_args=")
    items = overrides(files, tmp_path / "run", "train.steps=2", "train.save_every=0")
    items = [o for o in items if not o.startswith(cut)]
    CALLS.clear()
    run = api.fit("tiny", overrides=items, rewards=[vowel_share], progress=False)
    records = read_records(run.run_dir / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert {"rewards/vowel_share/mean", "rewards/vowel_share/std"} <= set(train[-1])
    rollouts = [call for call in CALLS if call["n"] == 8]  # 2 prompts x 4 a step
    assert [call["step"] for call in rollouts] == [0, 1]
    words = {"love", "beauty", "time", "summer", "rose", "heart", "eye", "youth"}
    assert all(set(call["answers"]) <= words for call in rollouts)
    table = read_records(run.run_dir / "completions.jsonl")
    assert len(table) == 16
    for row in table:
        text = row["completion"]
        expected = sum(ch in "aeiou" for ch in text) / max(len(text), 1)
        assert row["rewards"] == {"vowel_share": expected} and row["reward"] == expected
    assert any("val_rewards/vowel_share/mean" in r for r in records)
    recorded = tomllib.loads((run.run_dir / "config.toml").read_text())["train"]
    assert "rewards" not in recorded  # a Python object has no name a config could hold
