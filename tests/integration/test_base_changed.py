"""A base changed under a running run (docs/guides/safety.md, "A mapped base").

A QLoRA run maps its base GGUF (``gguf.file.map_stored``): truncated while it trains, a read
past the new end would be SIGBUS (exit 135, nothing saved); rewritten in place, the run would go
on over other weights. Each run here is ``llamatrain fit`` in a process of its own, its base a
small random llama exported Q4_0, changed at a chosen point: it must stop in one line naming
the file, exit 1 with no traceback, and leave its last checkpoint whole (the adapters and the
optimizer's moments as they were saved), from which the run continues once the file is back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from random_models import tiny_llama, unit_scaled

from llamatrain import api
from llamatrain.checkpoint import load_checkpoint
from llamatrain.gguf.file import read_gguf

pytestmark = pytest.mark.slow

DRIVER = """
import os, shutil, sys
from pathlib import Path
from llamatrain import run_checkpoints
from llamatrain.cli import main

base, change = Path(os.environ["BASE"]), os.environ["CHANGE"]
save = run_checkpoints.CheckpointManager.save


def save_then_change(self, *args, **kwargs):
    path = save(self, *args, **kwargs)
    if not self.directory.joinpath("first.gguf").exists():  # the run's first checkpoint
        shutil.copy(path, self.directory / "first.gguf")
        if change == "truncate":
            os.truncate(base, 4096)
        elif change == "rewrite":
            with open(base, "r+b") as f:
                f.seek(base.stat().st_size // 2)
                f.write(bytes(4096))
    return path


run_checkpoints.CheckpointManager.save = save_then_change
sys.exit(main(sys.argv[1:]))
"""
"""``llamatrain fit`` whose first checkpoint, once written, is copied to ``first.gguf``, and
then the base changed as ``$CHANGE`` says: truncated to a page, rewritten in place at its size,
or (``keep``) left as it is."""

BREAKS_BASE = """
import os


def breaks_base(prompts, completions, completion_ids, trainer_state, **columns):
    if trainer_state.global_step == 2:  # inside step 3: after its rollout, before its update
        os.truncate(os.environ["BASE"], 4096)
    return [float(len(c)) for c in completions]
"""


@pytest.fixture(scope="module")
def q4_0_base(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A random llama with the tiny config's vocabulary and rows of 256 values, as Q4_0."""
    model, tokenizer = tiny_llama(
        cache_dir, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512
    )
    unit_scaled(model)
    folder = tmp_path_factory.mktemp("base")
    return api.export_gguf(model, tokenizer, folder / "q4_0.gguf", type="q4_0")


def qlora_fit(base: Path, run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """``fit`` arguments: rank-4 adapters over ``base`` kept as its blocks, a checkpoint every
    2 of 6 steps, in float32."""
    settings = [
        f"data.cache_dir={cache_dir}", f"output.dir={run_dir}", f"model.init_from={base}",
        "lora.rank=4", 'lora.base_dtype="quantized"', "train.dtype=float32", "train.steps=6",
        "train.n_batch=128", "train.save_every=2", "train.eval_every=0", "train.sample_tokens=0",
        "output.export=false", *extra,
    ]  # fmt: skip
    return ["fit", "--config", "tiny", *(arg for s in settings for arg in ("--set", s))]


def run(args: list[str], base: Path, change: str = "keep") -> subprocess.CompletedProcess:
    env = {**os.environ, "BASE": str(base), "CHANGE": change}
    return subprocess.run(
        [sys.executable, "-c", DRIVER, *args], capture_output=True, text=True, timeout=600, env=env
    )  # fmt: skip


def assert_stopped_in_one_line(done: subprocess.CompletedProcess, base: Path, how: str) -> Path:
    """The run ended with exit 1 and one error line naming ``base`` and ``how`` it changed;
    returns the checkpoint it says it saved."""
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "llamatrain: error" in line]
    assert len(errors) == 1 and done.stderr.strip().endswith(errors[0]), done.stderr[-3000:]
    match = re.fullmatch(
        rf"llamatrain: error: {re.escape(str(base))}, which this run maps, changed \({how}\); "
        r"the step that read it was not applied, and the run saved what it had trained before "
        r"it to (\S+); put the file back as it was \(the run's checkpoints record its sha256\) "
        r"and continue with --resume latest",
        errors[0].split("\r")[-1],
    )
    assert match, errors[0]
    return Path(match[1])


def assert_same_training_state(saved: Path, first: Path) -> None:
    """``saved`` loads as a checkpoint and holds the adapters and optimizer moments ``first``
    (the checkpoint written before the base changed) holds."""
    assert load_checkpoint(saved).state.step == load_checkpoint(first).state.step == 2
    ours, theirs = read_gguf(saved).tensors, read_gguf(first).tensors
    assert sorted(ours) == sorted(theirs) and any(".lora_a" in n for n in ours)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize(
    "change, how",
    [("truncate", r"it is 4,096 bytes, [\d,]+ when the run mapped it"),
     ("rewrite", "it was rewritten in place")],
)  # fmt: skip
def test_a_base_changed_between_steps_stops_the_run_in_one_line_keeping_its_checkpoint(
    q4_0_base, cache_dir, tmp_path, change, how
):
    """Changed right after the step-2 checkpoint: step 3 reads the changed file (truncated:
    past its end, a SIGBUS answered with zeros), its update is not applied, and the state after
    step 2 is saved. Once the file is back, the run continues from there to its end."""
    base, run_dir = tmp_path / "base.gguf", tmp_path / "run"
    shutil.copy(q4_0_base, base)
    done = run(qlora_fit(base, run_dir, cache_dir), base, change)
    saved = assert_stopped_in_one_line(done, base, how)
    assert saved == run_dir / "checkpoints" / "step-0000002.gguf"
    assert_same_training_state(saved, run_dir / "checkpoints" / "first.gguf")
    shutil.copy(q4_0_base, base)
    resumed = run([*qlora_fit(base, run_dir, cache_dir), "--resume", "latest"], base)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()]
    assert max(steps) == 6


def test_a_base_truncated_inside_a_grpo_step_stops_the_run_in_one_line(
    q4_0_base, cache_dir, tmp_path
):
    """A reward function truncates the base in the middle of step 3 (after its rollout): the
    KL reference and the update then read past the file's end. Without the fault handler this
    run dies of SIGBUS; with it, one line, and the step-2 checkpoint as it was written."""
    base, run_dir = tmp_path / "base.gguf", tmp_path / "run"
    shutil.copy(q4_0_base, base)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"Say {w}."} for w in ("love", "time", "rose", "youth") * 4]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "breaks.py").write_text(BREAKS_BASE)
    grpo = [
        f"data.path={prompts}", "data.format=jsonl", "data.val_fraction=0",
        "train.objective=grpo", f'train.rewards=["{tmp_path / "breaks.py"}:breaks_base"]',
        "train.num_generations=4", "train.max_completion_length=8", "train.n_batch=512",
        "train.beta=0.04",
    ]  # fmt: skip
    done = run(qlora_fit(base, run_dir, cache_dir, *grpo), base)
    truncated = r"it is 4,096 bytes, [\d,]+ when the run mapped it"
    saved = assert_stopped_in_one_line(done, base, truncated)
    assert_same_training_state(saved, run_dir / "checkpoints" / "first.gguf")
