"""Reward code cannot end or move a GRPO run (docs/guides/safety.md), as a user meets it:
``llamatrain fit`` in a process of its own over a small random llama, with a reward file that
exits, or changes the working directory and its arguments on every call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from random_models import tiny_llama

from llamatrain import api
from llamatrain.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow

REWARDS = """
import os, sys


def quits(prompts, completions, completion_ids, trainer_state, **columns):
    if trainer_state.global_step == 2:  # in step 3, after the step-2 checkpoint
        sys.exit(0)
    return [float(len(c)) for c in completions]


def wanders(prompts, completions, completion_ids, **columns):
    os.chdir(os.environ["ELSEWHERE"])
    for ids in completion_ids:
        ids.extend([0] * 1000)  # the logged lengths are the run's, not these
    completion_ids.clear()
    return [float(len(c)) for c in completions]
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("reward_code")
    model, tokenizer = tiny_llama(cache_dir)
    base = api.export_gguf(model, tokenizer, folder / "base.gguf")
    prompts = folder / "prompts.jsonl"
    rows = [{"prompt": f"Say {w}."} for w in ("love", "time", "rose", "youth") * 4]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "my_rewards.py").write_text(REWARDS)
    (folder / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    return {"base": base, "prompts": prompts, "folder": folder, "cache": cache_dir}


def fit(files: dict[str, Path], reward: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``llamatrain fit`` of 4 GRPO steps (a checkpoint every 2) into ``cwd/run``: the run
    folder named relative to the working directory, as the docs' commands name it."""
    settings = [
        f"data.cache_dir={files['cache']}", "output.dir=run", f"model.init_from={files['base']}",
        f"data.path={files['prompts']}", "data.format=jsonl", "data.val_fraction=0",
        "train.objective=grpo", f'train.rewards=["{files["folder"] / reward}"]',
        "train.num_generations=4", "train.max_completion_length=8", "lora.rank=4",
        "train.steps=4", "train.n_batch=512", "train.save_every=2", "train.eval_every=0",
        "train.sample_tokens=0", "train.log_every=1",
    ]  # fmt: skip
    command = [sys.executable, "-m", "llamatrain", "fit", "--config", "tiny"]
    command += [arg for s in settings for arg in ("--set", s)]
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )  # fmt: skip


def last_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr.strip().splitlines()[-1].split("\r")[-1]


def test_a_reward_that_exits_mid_run_is_one_line_and_keeps_the_checkpoint(files, tmp_path):
    """``sys.exit(0)`` in step 3: before, exit 0 with nothing said (a script saw success)."""
    done = fit(files, "my_rewards.py:quits", tmp_path)
    assert done.returncode == 1
    assert last_line(done) == (
        f"llamatrain: error: reward function '{files['folder'] / 'my_rewards.py'}:quits' raised "
        "SystemExit(0) (sys.exit), which would end the run; user code must return (raise an "
        "Exception to report a problem)"
    )
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "latest.gguf").state.step == 2


def test_a_reward_module_that_exits_at_import_is_one_line(files, tmp_path):
    done = fit(files, "exits_at_import.py:f", tmp_path)
    assert done.returncode == 1
    assert "running" in last_line(done) and "raised SystemExit(0) (sys.exit)" in last_line(done)


def test_a_reward_that_changes_directory_cannot_move_the_run(files, tmp_path):
    """Every call moves to another folder and rewrites its ``completion_ids``: the run still
    writes everything into ``output.dir`` as named at the start, logs its own lengths, and
    the other folder stays empty."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    done = fit(files, "my_rewards.py:wanders", work, ELSEWHERE=str(elsewhere))
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(elsewhere.iterdir()) == []
    run = work / "run"
    for name in ("config.toml", "metrics.jsonl", "completions.jsonl", "adapter-f32.gguf"):
        assert (run / name).is_file(), name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest.gguf", "step-0000002.gguf", "step-0000004.gguf"
    ]  # fmt: skip
    assert f"run folder: {run}" in done.stdout
    steps = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    lengths = [r["completions/mean_length"] for r in steps if "completions/mean_length" in r]
    assert len(lengths) == 4 and all(0 < n <= 8 for n in lengths)
