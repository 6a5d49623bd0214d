"""Faults a long run meets: a stop signal, a full disk, a second run, a damaged checkpoint, a
torn metrics line. Each must end in one line that says what to do, with the last good
checkpoint (and ``latest.gguf``) intact and the run resumable.

The full disk is simulated with RLIMIT_FSIZE (the ``file_size_limit`` fixture: writes fail
with EFBIG, as they fail with ENOSPC on a full disk); the tests run as root, for whom a
read-only folder is writable.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader
from user_errors import error_of

from llamatrain import api
from llamatrain.checkpoint import load_checkpoint
from llamatrain.cli import main
from llamatrain.errors import GGUFError
from llamatrain.plot import read_metrics

QUICK = ["train.eval_every=0", "train.save_every=0", "output.export=false", "train.log_every=1"]


def checkpoint_files(run: Path) -> list[str]:
    """Every name in the checkpoint folder, hidden (temp) files included."""
    return sorted(os.listdir(run / "checkpoints"))


def losses(result: api.FitResult) -> list[float]:
    return [r["loss"] for r in result.history.train]


def start_fit(run: Path, cache_dir: Path, *sets: str) -> subprocess.Popen:
    """``llamatrain fit --config tiny`` in a new process, writing into ``run``."""
    command = [sys.executable, "-m", "llamatrain", "fit", "--config", "tiny",
               "--set", f"output.dir={run}", "--set", f"data.cache_dir={cache_dir}"]  # fmt: skip
    for item in [*QUICK, *sets]:
        command += ["--set", item]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_steps(process: subprocess.Popen, run: Path, n: int) -> None:
    """Until the process has logged ``n`` steps to metrics.jsonl (it logs every step)."""
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and metrics.read_text().count('"loss"') >= n:
            return
        time.sleep(0.02)
    process.kill()
    pytest.fail(f"no step {n} logged: {process.communicate()[1][-2000:]}")


@pytest.fixture
def process_reaper():
    """Processes a test starts; any still running at its end is killed (a failed test)."""
    started: list[subprocess.Popen] = []
    yield started.append
    for process in started:
        if process.poll() is None:
            process.kill()
        process.communicate()


def test_sigterm_saves_that_step_once_and_the_resume_is_exact(
    tmp_path, cache_dir, tiny_overrides, process_reaper
):
    run = tmp_path / "run"
    process = start_fit(run, cache_dir, "train.steps=400")
    process_reaper(process)
    wait_for_steps(process, run, random.Random(15).randint(2, 6))
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=10)
    assert time.monotonic() - sent < 10 and process.returncode == 1
    last = stderr.strip().splitlines()[-1]
    match = re.fullmatch(
        r"llamatrain: error: stopped by SIGTERM at step (\d+); saved (\S+)\. "
        r"Continue with --resume latest",
        last,
    )
    assert match, stderr[-2000:]
    step = int(match[1])
    assert step < 400 and Path(match[2]).name == f"step-{step:07d}.gguf"
    assert checkpoint_files(run) == ["latest.gguf", f"step-{step:07d}.gguf"]  # one save

    more = [*QUICK, f"train.steps={step + 3}"]
    resumed = api.fit("tiny", overrides=[*tiny_overrides(), *more], resume="latest", progress=False)
    straight_dir = f'output.dir="{tmp_path / "straight"}"'
    straight = api.fit("tiny", overrides=[*tiny_overrides(), *more, straight_dir], progress=False)
    assert losses(resumed) == losses(straight)[step:]


def test_a_full_disk_keeps_the_last_checkpoint_and_latest(
    tmp_path, tiny_overrides, file_size_limit, capsys
):
    sets = tiny_overrides(**{"train.save_every": 2, "train.eval_every": 0})
    api.fit("tiny", overrides=[*sets, "train.steps=2", "output.export=false"], progress=False)
    run = tmp_path / "run"
    before = (run / "checkpoints" / "step-0000002.gguf").read_bytes()
    argv = ["fit", "--config", "tiny", "--resume", "latest", "--set", "train.steps=4"]
    for item in sets:
        argv += ["--set", item]
    with file_size_limit(64 * 1024):  # metrics lines fit, a checkpoint (~1.4 MB) does not
        assert main(argv) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    # the limit hits in the tensor data, written by numpy, whose short write has no errno
    assert error.startswith(
        f"llamatrain: error: cannot write the step-4 checkpoint in {run / 'checkpoints'}: "
    )
    assert "written (the disk is full or a file size limit was reached); the last good" in error
    assert error.endswith("step-0000002.gguf is intact. Free space or choose another output.dir")
    assert checkpoint_files(run) == ["latest.gguf", "step-0000002.gguf"]  # no temp files
    assert (run / "checkpoints" / "latest.gguf").read_bytes() == before
    assert load_checkpoint(run / "checkpoints" / "latest.gguf").state.step == 2


@pytest.mark.parametrize(
    ("where", "error", "phase", "remedy"),
    [("prepare", MemoryError(), "while loading the model and data", "smaller or more quantized"),
     ("train_step", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"),
      "in a training step", "train.n_ubatch"),
     ("export_gguf", MemoryError(), "while exporting the trained model", "llamatrain export")],
)  # fmt: skip
def test_out_of_memory_in_any_phase_is_one_line_and_keeps_what_was_written(
    tmp_path, tiny_overrides, monkeypatch, where, error, phase, remedy
):
    """Issue 37, item 7: running out of memory while loading, in a step or in the export was a
    long traceback; now one line naming the phase, what the run needs (its memory plan) and
    what lowers it, the checkpoints already written intact."""
    from llamatrain.trainer import Trainer

    calls = []

    def out_of_memory(*args, **kwargs):
        calls.append(1)
        if where != "train_step" or len(calls) > 2:  # a step after the step-2 save
            raise error
        return original(*args, **kwargs)

    owner = Trainer if where == "train_step" else api
    original = getattr(owner, where)
    monkeypatch.setattr(owner, where, out_of_memory)
    sets = tiny_overrides(**{"train.save_every": 2, "train.eval_every": 0, "train.steps": 4})
    message = error_of(api.fit, "tiny", overrides=sets, progress=False)
    assert message.startswith(f"out of memory {phase}") and remedy in message, message
    if where != "prepare":
        assert "the run needs about" in message and "weights" in message
        latest = load_checkpoint(tmp_path / "run" / "checkpoints" / "latest.gguf")
        assert latest.state.step == (2 if where == "train_step" else 4)


def test_a_full_disk_at_the_start_names_the_file_it_could_not_write(
    tmp_path, tiny_overrides, file_size_limit, capsys
):
    """Issue 37: the first writes of a run (its token cache, config.toml) failing for a full
    disk said "cannot use: File too large" — no path to free space at."""
    argv = ["fit", "--config", "tiny", "--set", f'data.cache_dir="{tmp_path / "cache"}"']
    for item in tiny_overrides():
        if not item.startswith("data.cache_dir"):
            argv += ["--set", item]
    with file_size_limit(2048):
        assert main(argv) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.match(rf"llamatrain: error: cannot use {re.escape(str(tmp_path))}/\S+: ", error), (
        error
    )


def test_a_second_fit_into_the_same_folder_is_refused_until_the_first_dies(
    tmp_path, cache_dir, tiny_overrides, capsys, process_reaper
):
    run = tmp_path / "run"
    first = start_fit(run, cache_dir, "train.steps=100000")
    process_reaper(first)
    wait_for_steps(first, run, 1)
    argv = ["fit", "--config", "tiny"]
    for item in tiny_overrides():
        argv += ["--set", item]
    assert main(argv) == 1
    error = capsys.readouterr().err.strip()
    assert error == (
        f"llamatrain: error: {run} is in use by another llamatrain fit (PID {first.pid}, lock "
        f"{run / '.lock'}); wait for it to end or stop it, or choose another output.dir"
    )
    first.kill()  # SIGKILL: no handler runs, no lock is released by the process itself
    first.communicate(timeout=10)
    # the folder now holds the dead run's files: a new run there must say so (issue: a
    # forgotten --resume) and, told to, moves them aside
    overrides = [*tiny_overrides(), *QUICK, "train.steps=2"]
    with pytest.warns(UserWarning, match="moved the run"):
        result = api.fit("tiny", overrides=overrides, overwrite=True, progress=False)
    assert len(result.history.train) == 2
    assert (run / ".lock").read_text().strip() == str(os.getpid())


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A 2-step run with its checkpoint and f32 export (read-only for the tests below)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    sets = [f'data.cache_dir="{cache_dir}"', f'output.dir="{run}"', "train.steps=2",
            "train.save_every=2", "train.eval_every=0"]  # fmt: skip
    api.fit("tiny", overrides=sets, progress=False)
    return run


def test_a_flipped_byte_is_named_on_resume_and_by_info_verify(
    saved_run, tmp_path, tiny_overrides, capsys
):
    good = saved_run / "checkpoints" / "step-0000002.gguf"
    assert main(["info", "--verify", str(good)]) == 0
    n = len(GGUFReader(good).tensors)
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert said == (
        "verify: every value finite; the training.*/optimizer.* keys and all "
        f"{n} tensors match their sha256"
    )
    damaged = tmp_path / "damaged.gguf"
    data = bytearray(good.read_bytes())
    start = next(t.data_offset for t in GGUFReader(good).tensors if t.name == "blk.1.ffn_up.weight")
    data[start + 1001] ^= 0x01  # one bit of one weight
    damaged.write_bytes(bytes(data))
    named = r"damaged: tensor blk\.1\.ffn_up\.weight does not match the sha256"
    with pytest.raises(GGUFError, match=named):
        api.fit("tiny", overrides=tiny_overrides(), resume=damaged, progress=False)
    with pytest.raises(GGUFError, match=named):  # generate, eval and export load through it
        api.load(damaged)
    assert main(["info", "--verify", str(damaged)]) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and re.search(named, error)
    assert main(["export", str(damaged), "-o", str(tmp_path / "x.gguf")]) == 1
    assert re.search(named, capsys.readouterr().err)
    assert not (tmp_path / "x.gguf").exists()


def test_exports_carry_no_training_keys_and_load_in_llama_cpp(saved_run, tmp_path):
    import llama_cpp  # the test extra: real llama.cpp

    model, tokenizer = api.load(saved_run)
    path = api.export_gguf(model, tokenizer, tmp_path / "m.gguf")
    keys = [f.name for f in GGUFReader(path).fields.values()]
    assert not [k for k in keys if k.startswith(("training.", "optimizer."))]
    assert api.verify_gguf(path) == 0  # nothing recorded, nothing to check
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False)
    assert llm.n_vocab() == tokenizer.vocab_size


def test_a_torn_metrics_line_is_dropped_by_plot_and_resume(saved_run, tmp_path, tiny_overrides):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("metrics.jsonl", "checkpoints/step-0000002.gguf"):
        (run / name).write_bytes((saved_run / name).read_bytes())
    (run / "checkpoints" / "latest.gguf").symlink_to("step-0000002.gguf")
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "loss": 5.1, "l')  # a crash mid-line
    train, _ = read_metrics(run)
    assert [r["step"] for r in train] == [2]  # the torn line is skipped
    api.fit("tiny", overrides=[*tiny_overrides(), *QUICK, "train.steps=4"], resume="latest",
            progress=False)  # fmt: skip
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert all("step" in json.loads(line) for line in lines)  # the torn line is gone
    assert [r["step"] for r in read_metrics(run)[0]] == [2, 3, 4]
