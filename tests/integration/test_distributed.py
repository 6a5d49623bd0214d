"""Training on two ranks (torchrun, gloo, one thread each) is the same optimisation as one process.

The reference is an ordinary single-process run of the tiny config with the same global batch
(``train.n_batch``): DDP and FSDP, with and without gradient accumulation, must give its loss
at every step and its final weights; checkpoints move between world sizes (saved on 2 ranks,
resumed on 1, and the other way) and continue its trajectory; a rank that dies ends the launch
with an error and leaves the last checkpoint loadable; Ctrl-C on the launcher saves once.

Tolerance: 1e-5 relative. Ranks sum the same products in another order (each rank's share of
the batch, then an all-reduce), so float32 results differ from one process's by rounding,
~1e-7 a step, which AdamW's normalisation can grow over 20 steps; a wrong share, a missed
gradient sync or a mis-weighted micro-batch moves the first loss already by far more.

This file is also the program each rank runs: ``python -m torch.distributed.run ...
test_distributed.py RUNS_JSON`` trains the runs listed, one after the other.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import llamatrain
import llamatrain.parallel
from llamatrain.checkpoint import load_checkpoint
from llamatrain.errors import ConfigError
from llamatrain.model_path import LATEST

STEPS = 20
SAVE_EVERY = 10
# 4 sequences of 64 tokens a step: 2 a rank; n_ubatch = 64 makes that 2 micro-steps a rank
BASE = {
    "train.steps": STEPS,
    "train.n_batch": 256,
    "train.save_every": SAVE_EVERY,
    "train.keep_checkpoints": 0,
    "train.eval_every": 0,
    "train.log_every": 1,
    "train.sample_tokens": 0,
    "train.device": '"cpu"',
    "output.export": "false",
}
RUNS = {
    "ddp": {"train.parallel": '"ddp"'},
    # activation checkpointing composes (applied before the wrapping, torchtitan's order)
    "ddp_accum": {"train.parallel": '"ddp"', "train.n_ubatch": 64, "train.checkpointing": '"auto"'},
    # the FSDP run also samples (every rank generates) and exports (gathered to rank 0)
    "fsdp": {"train.parallel": '"fsdp"', "train.sample_tokens": 8, "output.export": "true"},
    "fsdp_accum": {
        "train.parallel": '"fsdp"',
        "train.n_ubatch": 64,
        "train.checkpointing": '"full"',
    },
}
RTOL = 1e-5  # see the module docstring
TIMEOUT_S = 20  # train.dist_timeout_s of the failure tests: a dead rank's peers give up by then


def overrides(cache_dir: Path, out: Path, **values: object) -> list[str]:
    items = {**BASE, "data.cache_dir": f'"{cache_dir}"', "output.dir": f'"{out}"', **values}
    return [f"{key}={value}" for key, value in items.items()]


@contextlib.contextmanager
def torchrun(runs: list[dict], cwd: Path, **popen: object) -> Iterator[subprocess.Popen]:
    """Two ranks (gloo, one thread each) training ``runs`` with this file as their program;
    the launcher and its ranks are killed on leaving, should a test fail half-way."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        __file__, json.dumps(runs),
    ]  # fmt: skip
    launch = subprocess.Popen(command, cwd=cwd, env=env, text=True, start_new_session=True, **popen)
    try:
        yield launch
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)
        launch.communicate()


def losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if "loss" in record]


def weights(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / f"step-{step:07d}.gguf").weights


def assert_close_losses(ours: list[float], reference: list[float]) -> None:
    assert len(ours) == len(reference)
    for step, (a, b) in enumerate(zip(ours, reference, strict=True), 1):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: {a} vs {b}"


def assert_close_weights(ours: dict, reference: dict) -> None:
    assert ours.keys() == reference.keys()
    for name, weight in reference.items():
        error = torch.linalg.vector_norm(ours[name] - weight) / torch.linalg.vector_norm(weight)
        assert error <= RTOL, f"{name}: relative difference {error:.2e}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """The reference run (one process), the two-rank runs and the resumes across world sizes;
    the folder holding a run folder for each."""
    root = tmp_path_factory.mktemp("distributed")
    llamatrain.fit("tiny", overrides=overrides(cache_dir, root / "single"), progress=False)
    halfway = f"checkpoints/step-{SAVE_EVERY:07d}.gguf"
    two_ranks = [{"overrides": overrides(cache_dir, root / n, **v)} for n, v in RUNS.items()]
    one_to_two = overrides(cache_dir, root / "one_to_two", **RUNS["fsdp"])
    two_ranks.append({"overrides": one_to_two, "resume": str(root / "single" / halfway)})
    with torchrun(two_ranks, root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as launch:
        output, _ = launch.communicate(timeout=300)
    assert launch.returncode == 0, output[-4000:]
    llamatrain.fit(
        "tiny",
        overrides=overrides(cache_dir, root / "two_to_one"),
        resume=root / "fsdp" / halfway,
        progress=False,
    )
    return root


@pytest.mark.parametrize("name", RUNS)
def test_two_ranks_train_as_one_process(runs: Path, name: str) -> None:
    assert_close_losses(losses(runs / name), losses(runs / "single"))
    assert_close_weights(weights(runs / name), weights(runs / "single"))


def test_fsdp_exports_the_whole_model(runs: Path) -> None:
    """The FSDP run's export (gathered to rank 0) holds the weights its last checkpoint holds."""
    exported = llamatrain.load_gguf(runs / "fsdp" / "model-f32.gguf")[0].state_dict()
    for name, weight in weights(runs / "fsdp").items():
        assert torch.equal(exported[name], weight), name


@pytest.mark.parametrize("name", ["one_to_two", "two_to_one"])
def test_a_checkpoint_resumes_at_another_world_size(runs: Path, name: str) -> None:
    """Saved at step 10 on 1 rank (2 ranks), resumed on 2 ranks (1): steps 11-20 are the
    uninterrupted run's."""
    reference = losses(runs / "single")
    assert_close_losses(losses(runs / name)[-SAVE_EVERY:], reference[SAVE_EVERY:])
    assert_close_weights(weights(runs / name), weights(runs / "single"))


@pytest.mark.slow
def test_a_lora_run_under_ddp_trains_as_one_process(tmp_path: Path, cache_dir: Path) -> None:
    """The adapters of a LoRA run are trained alike on two DDP ranks and in one process."""
    base = overrides(cache_dir, tmp_path / "base", **{"train.steps": 4, "output.export": "true"})
    llamatrain.fit("tiny", overrides=base, progress=False)
    lora = {"model.init_from": f'"{tmp_path / "base" / "model-f32.gguf"}"', "lora.rank": 4}
    llamatrain.fit(
        "tiny", overrides=overrides(cache_dir, tmp_path / "single", **lora), progress=False
    )
    two_ranks = [{"overrides": overrides(cache_dir, tmp_path / "ddp", **lora, **RUNS["ddp"])}]
    with torchrun(two_ranks, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as launch:
        output, _ = launch.communicate(timeout=300)
    assert launch.returncode == 0, output[-4000:]
    assert_close_losses(losses(tmp_path / "ddp"), losses(tmp_path / "single"))
    assert_close_weights(weights(tmp_path / "ddp"), weights(tmp_path / "single"))


def test_a_gemma3_run_under_fsdp_trains_as_one_process(tmp_path: Path, cache_dir: Path) -> None:
    """The family furthest from llama (sandwich norms, GEGLU, windows on 5 of 6 layers, scaled
    embeddings) shards and checkpoints like llama: the parallel code never looks inside."""
    gemma3 = {"model.arch": '"gemma3"', "model.n_layers": 6, "model.sliding_window": 16}
    gemma3 |= {"train.steps": 6, "train.save_every": 6}
    llamatrain.fit(
        "tiny", overrides=overrides(cache_dir, tmp_path / "single", **gemma3), progress=False
    )
    sharded = overrides(cache_dir, tmp_path / "fsdp", **gemma3, **RUNS["fsdp_accum"])
    with torchrun(
        [{"overrides": sharded}], tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as launch:
        output, _ = launch.communicate(timeout=300)
    assert launch.returncode == 0, output[-4000:]
    assert_close_losses(losses(tmp_path / "fsdp"), losses(tmp_path / "single"))
    assert_close_weights(weights(tmp_path / "fsdp", 6), weights(tmp_path / "single", 6))


def test_each_rank_takes_its_own_equal_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank r of n computes rows [r·B/n, (r+1)·B/n) of every global batch; a batch n ranks
    cannot share equally is refused with the fix."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    rows = llamatrain.parallel.Parallel("ddp", loss=lambda *_: None).rows
    batch = torch.arange(4 * 3).view(4, 3)
    assert torch.equal(rows(batch), batch[2:])
    with pytest.raises(ConfigError, match="multiple of 2 x data.n_ctx = 6"):
        rows(batch[:3])


def test_a_launch_and_train_parallel_must_agree(
    monkeypatch: pytest.MonkeyPatch, tiny_overrides
) -> None:
    with pytest.raises(ConfigError, match="launch with `torchrun"):
        llamatrain.fit("tiny", overrides=tiny_overrides(**{"train.parallel": '"ddp"'}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="set train.parallel = 'ddp' or 'fsdp'"):
        llamatrain.fit("tiny", overrides=tiny_overrides())
    with pytest.raises(ConfigError, match="AdamW only"):
        llamatrain.fit(
            "tiny",
            overrides=tiny_overrides(**{"train.parallel": '"fsdp"', "optim.name": '"lbfgs"'}),
        )


LAUNCH = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}


@pytest.mark.parametrize(
    ("changed", "named"),
    [({"RANK": "abc"}, "RANK"), ({"RANK": "2"}, "RANK"), ({"RANK": "-1"}, "RANK"),
     ({"WORLD_SIZE": "two"}, "WORLD_SIZE"), ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
     ({"WORLD_SIZE": "9" * 5000}, "WORLD_SIZE"), ({"MASTER_ADDR": None}, "MASTER_ADDR"),
     ({"MASTER_PORT": None}, "MASTER_PORT"), ({"MASTER_PORT": "70000"}, "MASTER_PORT"),
     ({"MASTER_PORT": "²"}, "MASTER_PORT")],
)  # fmt: skip
def test_torchrun_variables_set_by_hand_are_one_line(monkeypatch, tiny_overrides, changed, named):
    """Issue 37, item 1: a launch's variables without torchrun (RANK=abc, no MASTER_ADDR) ended
    in int()'s or torch's rendezvous traceback; each is refused naming it, before any wait."""
    for name, value in {**LAUNCH, "MASTER_PORT": "29500", **changed}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    started = time.monotonic()
    overrides = tiny_overrides(**{"train.parallel": '"ddp"', "train.device": '"cpu"'})
    message = _error_of(llamatrain.fit, "tiny", overrides=overrides)
    assert f"environment variable {named}" in message and "torchrun" in message, message
    assert time.monotonic() - started < 30


def test_a_peer_that_never_joins_ends_in_one_line_after_the_timeout(monkeypatch, tiny_overrides):
    with socket.socket() as s:  # a free port: nobody else joins there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {**LAUNCH, "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    values = {"train.parallel": '"ddp"', "train.device": '"cpu"', "train.dist_timeout_s": 2}
    message = _error_of(llamatrain.fit, "tiny", overrides=tiny_overrides(**values))
    assert f"rank 0 of 2 could not meet the others at 127.0.0.1:{port}" in message
    assert "train.dist_timeout_s = 2 s" in message and "torchrun" in message


def wait_for(path: Path, launch: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert launch.poll() is None, "the launch ended before its first checkpoint"
        assert time.monotonic() < deadline, f"no {path} after {seconds} s"
        time.sleep(0.1)


def rank_pid(launcher: int, rank: int) -> int:
    """The PID of the worker torchrun started as ``rank`` (its environment says RANK=...)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        parent = next(int(s.split()[1]) for s in status.splitlines() if s.startswith("PPid:"))
        if parent == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} among the children of {launcher}")


def long_run(cache_dir: Path, out: Path) -> list[dict]:
    """An FSDP run far longer than a test waits for, saving every 5 steps."""
    values = {
        **RUNS["fsdp"],
        "train.steps": 100_000,
        "train.save_every": 5,
        "train.dist_timeout_s": TIMEOUT_S,
    }
    return [{"overrides": overrides(cache_dir, out, **values)}]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks in /proc")
def test_a_dead_rank_ends_the_launch_and_latest_loads(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "run"
    with torchrun(long_run(cache_dir, out), tmp_path, stderr=subprocess.PIPE) as launch:
        wait_for(out / "checkpoints" / LATEST, launch, 120)
        os.kill(rank_pid(launch.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = launch.communicate(timeout=TIMEOUT_S + 40)
    assert launch.returncode != 0
    assert time.monotonic() - killed < TIMEOUT_S + 40
    assert "local_rank: 1" in stderr  # torchrun's failure summary names the rank
    assert load_checkpoint(out / "checkpoints" / LATEST).state.step % 5 == 0


def test_ctrl_c_on_the_launcher_saves_once_and_stops(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "run"
    with torchrun(long_run(cache_dir, out), tmp_path, stderr=subprocess.PIPE) as launch:
        wait_for(out / "checkpoints" / LATEST, launch, 120)
        launch.send_signal(signal.SIGINT)
        _, stderr = launch.communicate(timeout=TIMEOUT_S + 40)
    assert launch.returncode != 0
    saved = load_checkpoint(out / "checkpoints" / LATEST).state.step
    stops = [line for line in stderr.splitlines() if "llamatrain: error: stopped by" in line]
    assert stops, stderr[-4000:]
    assert all(f"at step {saved}; saved" in line for line in stops), stops  # one step, one save


def main(runs: list[dict]) -> int:
    """One rank of a launch above: ``llamatrain fit`` for each run it was given, in order,
    after running the Python file a run names as its ``setup`` (a test's stand-ins, such as
    ``tool_runs``' scripted draws, in the rank's own process).

    The ranks join once for all the runs, as a notebook would (``fit`` then uses that group):
    a group destroyed and created again in one process can meet the old one's rendezvous keys.
    """
    import torch.distributed as dist

    from llamatrain.cli import main as llamatrain_main
    from llamatrain.parallel import leave_together

    dist.init_process_group("gloo")
    try:
        for run in runs:
            if "setup" in run:
                runpy.run_path(run["setup"])
            args = ["fit", "--config", "tiny", *(f"--set={item}" for item in run["overrides"])]
            if "resume" in run:
                args += ["--resume", run["resume"]]
            if code := llamatrain_main(args):
                return code
        leave_together()
        return 0
    finally:
        dist.destroy_process_group()


def _error_of(fn, *args, **kwargs) -> str:
    """``user_errors.error_of``, imported when a test calls it: this file is also each rank's
    program, run by torchrun where the tests' folder is not on ``sys.path``."""
    from user_errors import error_of

    return error_of(fn, *args, **kwargs)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
