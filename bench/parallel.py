"""Data-parallel training on one CPU machine: 2 ranks x 1 thread against 1 process.

Why: ``train.parallel`` is only worth its processes if two ranks train faster than one process
with the same cores. Each row times the trainer's own optimizer steps (``Trainer.train_step``)
on the ggml-2023 config (16 layers, dim 256, n_batch 1024 = 8 x 128 tokens, checkpointing
``auto``) on random tokens, after two warm-up steps:

* ``1 process x 1 thread`` and ``1 process x 2 threads`` (``train.parallel = 'none'``);
* ``2 ranks x 1 thread`` under ``ddp`` and ``fsdp`` (torchrun, gloo), each rank computing half
  of every global batch.

Columns: ``tok/s`` = global tokens per second of step time (median step); ``vs 1x1`` its ratio
to one process on one thread (ideal 2.0 for two ranks); ``comm`` = the share of a rank's step
spent outside its own computation: 1 - (the median step of a single-process trainer on that
rank's half batch) / (the median distributed step) — gradient all-reduce or reduce-scatter,
FSDP's weight all-gathers and the waits for the slower rank; ``peak RSS`` = each rank's
``VmHWM`` after its timed steps (before the comparison trainer is built); ``optim MB`` = the
AdamW moments this rank holds.

Run: ``python bench/parallel.py [--steps N]`` (it starts the other processes itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from llamatrain import activation_checkpointing, parallel
from llamatrain.config import Config, load_config
from llamatrain.model import Llama
from llamatrain.trainer import Trainer

VOCAB = 2048  # the ggml-2023 config's tokenizer.vocab_size
RESULT = "RESULT "
SETUPS = [  # (label, train.parallel, processes, threads per process)
    ("1 process x 1 thread", "none", 1, 1),
    ("1 process x 2 threads", "none", 1, 2),
    ("2 ranks x 1 thread, ddp", "ddp", 2, 1),
    ("2 ranks x 1 thread, fsdp", "fsdp", 2, 1),
]


def run_config(mode: str, n_batch: int | None = None) -> Config:
    cfg = load_config("ggml-2023", [f'train.parallel="{mode}"', 'train.device="cpu"'])
    if n_batch is not None:
        cfg.train.n_batch = cfg.train.n_ubatch = n_batch
    return cfg


def build_trainer(cfg: Config) -> Trainer:
    """The trainer ``llamatrain fit`` would build for ``cfg``, on a seeded random model."""
    torch.manual_seed(cfg.train.seed)
    model = Llama(dataclasses.replace(cfg.model, vocab_size=VOCAB, max_seq_len=cfg.data.n_ctx))
    n_seq = (cfg.train.n_ubatch or cfg.train.n_batch) // cfg.data.n_ctx
    activation_checkpointing.apply(
        model, cfg.train.checkpointing, n_seq=n_seq, n_ctx=cfg.data.n_ctx
    )
    return Trainer(model, cfg, progress=False)


def median_step(trainer: Trainer, steps: int) -> float:
    """Median seconds of ``steps`` optimizer steps on random tokens (after two warm-ups)."""
    n_seq = trainer.cfg.train.n_batch // trainer.cfg.data.n_ctx
    tokens = torch.randint(0, VOCAB, (n_seq, trainer.cfg.data.n_ctx + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seconds = []
    for i in range(steps + 2):
        started = time.perf_counter()
        trainer.train_step(inputs, targets)
        trainer.state.step += 1
        if i >= 2:
            seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        line = next(s for s in f if s.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def optimizer_mb(trainer: Trainer) -> float:
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if v.dim() > 0]
    local = [parallel.local_tensor(t) for t in state]
    return sum(t.numel() * t.element_size() for t in local) / 2**20


def worker(mode: str, steps: int) -> None:
    """One process (or rank) of a setup: print its figures as one JSON line."""
    with parallel.process_group(mode, torch.device("cpu"), timeout_s=600):
        cfg = run_config(mode)
        trainer = build_trainer(cfg)
        step = median_step(trainer, steps)
        figures = {
            "rank": parallel.rank(),
            "tok_s": cfg.train.n_batch / step,
            "peak_rss_mb": peak_rss_mb(),
            "optim_mb": optimizer_mb(trainer),
        }
        if mode != "none":  # the same rank's half batch, computed alone
            local = build_trainer(run_config("none", cfg.train.n_batch // parallel.world_size()))
            figures["comm"] = 1 - median_step(local, steps) / step
        print(RESULT + json.dumps(figures), flush=True)


def launch(mode: str, processes: int, threads: int, steps: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("WORLD_SIZE", None)
    args = [__file__, "--worker", mode, "--steps", str(steps)]
    if processes > 1:
        runner = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        args = runner + args
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    lines = [s[len(RESULT) :] for s in done.stdout.splitlines() if s.startswith(RESULT)]
    return sorted((json.loads(s) for s in lines), key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per setup")
    parser.add_argument("--worker", metavar="MODE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    print(f"ggml-2023 config, {args.steps} timed steps, torch {torch.__version__}, CPU")
    header = (
        f"{'setup':<26} {'tok/s':>7} {'vs 1x1':>7} {'comm':>6} {'peak RSS MB':>16} {'optim MB':>9}"
    )
    print(header + "\n" + "-" * len(header))
    single = None
    for label, mode, processes, threads in SETUPS:
        ranks = launch(mode, processes, threads, args.steps)
        tok_s = ranks[0]["tok_s"]
        single = single or tok_s
        comm = f"{max(r['comm'] for r in ranks):.0%}" if "comm" in ranks[0] else "-"
        rss = " / ".join(f"{r['peak_rss_mb']:.0f}" for r in ranks)
        print(
            f"{label:<26} {tok_s:>7.0f} {tok_s / single:>6.2f}x {comm:>6} {rss:>16} "
            f"{ranks[0]['optim_mb']:>9.1f}"
        )


if __name__ == "__main__":
    main()
