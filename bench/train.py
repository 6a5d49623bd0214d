"""Training-step throughput, MFU and peak memory of llamatrain's trainer against plain PyTorch.

Why: the op micro-benchmarks (``bench/ops.py``) do not say what a user gets. This times real
optimizer steps on random tokens, and for llamatrain's model they are the trainer's own steps:
each row builds a ``Config`` as a run would (default ``[optim]``: AdamW from
``llamatrain.optim.build_optimizer``, the warmup/cosine schedule, gradient clipping at
``optim.grad_clip``), applies activation checkpointing with
``llamatrain.activation_checkpointing.apply`` and times ``Trainer.train_step`` - so what is
measured is what ``llamatrain fit`` runs, not a copy of it that could drift. After each step
``trainer.state.step`` advances as in ``Trainer.fit``, so the learning rate follows the
schedule; the rate does not change the cost of a step.

The rows (``ops`` and ``attn`` columns; ``step`` says which step runs):

* ``ggml`` (``ModelConfig(ops="ggml")``: our autograd ops with ggml's backward formulas, and
  the fused lm head + cross-entropy of ``llamatrain.ops.fused``, which never holds the full
  logits) and ``torch`` (``ops="torch"``: ``F.linear`` + ``F.cross_entropy``), step
  ``trainer``; with ``attention="flash"`` (ggml: our blockwise flash attention; torch: SDPA)
  and, on tiny32k, ``attention="softmax"`` (the 2023 graph without flash attention: the
  T×T scores are written out);
* ``ggml-unfused``: the ggml model with its loss taken from the full logits
  (``model(x, y)[1]``), which shows what the fused loss saves. The trainer has no such path,
  so this row runs ``bench/baseline.py``'s ``plain_step`` (zero grads, loss, backward, clip
  at 1.0, the same AdamW from ``build_optimizer``): a non-trainer variant, step ``plain``;
* ``baseline`` (``bench/baseline.py``: an independent, straightforward eager llama with
  ``torch.optim.AdamW`` of the same settings), step ``plain`` too;
* eager vs ``torch.compile`` (``--compile``: ``train.compile = true``, which compiles the
  loss with static shapes; a variant that fails to compile is reported with the error and
  skipped);
* activation checkpointing ``none`` / ``full`` (every block) / ``auto`` (the 2023 spacing
  rule, segment length from the block sizes measured on the model), the ``ckpt`` column
  showing the segment length chosen.

Columns:

* ``tok/s`` = batch·ctx / (median seconds per step). The rows of one config (all ops and
  modes) are built together and timed side by side: rounds of one step per row, in rotating
  order, at least 5 rounds and 3 s of steps per row (quick: 3 rounds, 1 s), after warmup.
  A load swing on a shared machine then hits every row of the comparison alike.
* ``MFU`` = achieved model FLOP/s ÷ peak FLOP/s. Model FLOPs per token =
  6·N + 12·L·H·Q·T, with N = the parameters of every matrix multiplication: the attention
  and feed-forward weights of all blocks *plus the lm head* (vocab × dim; for a small model
  with a 32k vocabulary it is the largest matmul), without the token embedding (a lookup,
  no FLOPs) or the norm weights (elementwise). L layers, H heads, Q head dim, T = ctx (the
  full, not causally halved, attention). Recomputation under checkpointing is not counted.
  The peak (``of GF/s``) is measured with the rows: a large matmul (float32 4096×4096 on
  CPU, bf16 8192×8192 on CUDA) timed once per round between the rows' steps, the best
  sample of the group kept.
* ``peak MB``: on CPU the process's peak RSS during two steps (``VmHWM``, reset via
  ``/proc/self/clear_refs``) minus its RSS before the model was built (after
  ``malloc_trim``), measured for each row right after it is built and warmed up, before
  the next row is built - parameters, gradients, optimizer state, activations and
  allocator slack. On CUDA ``torch.cuda.max_memory_allocated`` over two steps (absolute).
* ``step MB``: the peak of extra allocator bytes within one step above its start (CPU:
  from a ``torch.profiler`` memory trace; CUDA: allocator peak minus the allocation at the
  start): activations, gradients and temporaries - the part checkpointing and the fused
  loss change.

On CUDA (``--device cuda``) the trainer rows train under bf16 autocast with float32 master
weights (``train.dtype = "bfloat16"``); the GPU report at ~130M parameters is
``bench/gpu.py``'s, built from this file's rows and timing. The process-wide settings a
training run gets
(``llamatrain.device.configure_process``: glibc malloc retention on CPU, TF32 under bf16 on
CUDA) are applied once at start, for every row, the baseline included. The load average is
printed with every row.

Usage: ``python bench/train.py [--quick] [--scaling] [--compile] [--no-profile]
[--device cpu|cuda|auto] [--json PATH]``; ``make bench`` is the full default run. How long
runs take and the latest measured table are in ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import BaselineLlama, make_optimizer, plain_step  # noqa: E402
from ops import (  # noqa: E402
    MB,
    add_common_arguments,
    device_from_arguments,
    finish,
    load_average,
    machine_info,
    peak_bytes,
    sync,
)

from llamatrain import activation_checkpointing  # noqa: E402
from llamatrain.config import Config, OptimSection, validate  # noqa: E402
from llamatrain.device import configure_process  # noqa: E402
from llamatrain.model import Llama  # noqa: E402
from llamatrain.model_config import ARCHS, FAMILIES, ModelConfig  # noqa: E402
from llamatrain.optim import build_optimizer  # noqa: E402
from llamatrain.trainer import Trainer  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "train.json"


@dataclass(frozen=True)
class BenchConfig:
    name: str
    model: ModelConfig
    batch: int
    ctx: int


def _cfg(vocab, dim, layers, heads, kv_heads, ff, ctx) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_dim=ff,
        max_seq_len=ctx,
    )


CONFIGS = {
    # A tiny llama with llama's 32k vocabulary: the lm head and its loss dominate the step.
    # Peers measured on it (llama.cpp's llama-finetune, llama2.c): bench/README.md.
    "tiny32k": BenchConfig("tiny32k", _cfg(32000, 64, 2, 4, 2, 192, 256), batch=8, ctx=256),
    # train-text-from-scratch's 2023 defaults.
    "ggml-2023": BenchConfig("ggml-2023", _cfg(32000, 256, 16, 8, None, 768, 128), 8, 128),
    # nanoGPT's CPU shakespeare_char config (nanoGPT's README: 4 layers, 4 heads, 128 dim,
    # block 64, batch 12), as a llama; nanoGPT's own speed on it: bench/README.md.
    "nanogpt-cpu": BenchConfig("nanogpt-cpu", _cfg(65, 128, 4, 4, None, 512, 64), 12, 64),
    # One shape for every model family (--families): a small Qwen-like GQA model, a window
    # half the context for the sliding-window families.
    "family": BenchConfig("family", _cfg(32000, 256, 8, 8, 4, 768, 256), batch=4, ctx=256),
}

TRAINER_OPS = ("ggml", "torch")
"""Rows of these op sets run ``Trainer.train_step``; the others run ``plain_step``."""


@dataclass(frozen=True)
class Row:
    """What one row builds and how it runs it."""

    bc: BenchConfig
    ops: str  # "ggml" | "torch" (trainer) | "ggml-unfused" | "baseline" (plain step)
    attention: str = "flash"
    ckpt: str = "none"
    compile: bool = False

    @property
    def step_kind(self) -> str:
        return "trainer" if self.ops in TRAINER_OPS else "plain"

    @property
    def model_cfg(self) -> ModelConfig:
        """The row's ``[model]`` section (also what the FLOP count reads)."""
        bc = self.bc
        return replace(
            bc.model,
            ops="torch" if self.ops == "torch" else "ggml",
            attention=self.attention,
            max_seq_len=max(bc.model.max_seq_len, bc.ctx),
        )


# --------------------------------------------------------------------------- accounting


def matmul_params(cfg: ModelConfig) -> int:
    """N of the FLOP formula: every matmul weight, lm head included, embedding excluded."""
    hd = cfg.head_dim
    per_layer = (
        cfg.dim * cfg.n_heads * hd  # attn_q
        + 2 * cfg.dim * cfg.kv_heads * hd  # attn_k, attn_v
        + cfg.n_heads * hd * cfg.dim  # attn_output
        + 3 * cfg.dim * cfg.hidden_dim  # ffn_gate, ffn_up, ffn_down
    )
    return cfg.n_layers * per_layer + cfg.vocab_size * cfg.dim


FLOPS_FORMULA = "6*N + 12*L*H*Q*T, N = matmul weights incl. lm head, excl. embedding"
"""What :func:`flops_per_token` counts, as the JSON results record it."""


def flops_per_token(cfg: ModelConfig, ctx: int) -> int:
    """6·N + 12·L·H·Q·T (forward + backward; see the module docstring)."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * ctx


class PeakProbe:
    """The peak of MFU: best FLOP/s of one large matmul, sampled again and again.

    float32 4096² on CPU, bf16 8192² on CUDA. Each group samples it once per timing round,
    between the rows' steps, so the peak comes from the same minutes as the rows it divides;
    the best sample is kept (a conservative peak: the rows get their median step).
    """

    def __init__(self, device: torch.device) -> None:
        n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (4096, torch.float32)
        self.device, self.flops = device, 2 * n**3
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.b = torch.randn(n, n, device=device, dtype=dtype)
        torch.mm(self.a, self.b)
        self.best = 0.0

    def sample(self) -> float:
        sync(self.device)
        start = time.perf_counter()
        torch.mm(self.a, self.b)
        sync(self.device)
        self.best = max(self.best, self.flops / (time.perf_counter() - start))
        return self.best


# --------------------------------------------------------------------------- memory


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- one row


def trainer_config(row: Row, device: torch.device) -> Config:
    """The run config whose ``Trainer`` this row times (defaults but for the shape)."""
    cfg = Config(model=row.model_cfg)
    cfg.data.n_ctx = row.bc.ctx
    cfg.train.n_batch = cfg.train.n_ubatch = row.bc.batch * row.bc.ctx
    cfg.train.device = device.type
    cfg.train.dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg.train.compile = row.compile
    cfg.train.checkpointing = row.ckpt
    return validate(cfg)


def build(row: Row, device: torch.device) -> tuple[Callable[[], float], int | None]:
    """A function running one training step of ``row`` on a fresh random batch (returning
    its loss), and the checkpoint segment length (None where it does not apply)."""
    bc, cfg = row.bc, row.model_cfg
    bf16 = device.type == "cuda"
    gen = torch.Generator(device="cpu").manual_seed(1)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.randint(0, cfg.vocab_size, (bc.batch, bc.ctx + 1), generator=gen)
        data = data.to(device)
        return data[:, :-1], data[:, 1:]

    torch.manual_seed(0)
    if row.ops == "baseline":
        base = BaselineLlama(
            cfg.vocab_size,
            cfg.dim,
            cfg.n_layers,
            cfg.n_heads,
            cfg.kv_heads,
            cfg.hidden_dim,
            cfg.max_seq_len,
            cfg.norm_eps,
        ).to(device)
        o = OptimSection()
        opt = make_optimizer(base, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps)
        step = plain_step(
            base, opt, lambda x, y: base(x, y)[1], bf16=bf16, compile_loss=row.compile
        )
        return lambda: step(*batch()), None

    model = Llama(cfg).to(device)
    segment = None
    if row.ckpt != "none":
        segment = activation_checkpointing.apply(
            model,
            row.ckpt,
            n_seq=bc.batch,
            n_ctx=bc.ctx,
            autocast=torch.bfloat16 if bf16 else None,
        )
    if row.ops == "ggml-unfused":
        opt = build_optimizer(model, OptimSection())
        step = plain_step(
            model,
            opt,
            lambda x, y: model(x, y)[1],
            grad_clip=OptimSection().grad_clip,
            bf16=bf16,
            compile_loss=row.compile,
        )
        return lambda: step(*batch()), segment

    trainer = Trainer(model, trainer_config(row, device), progress=False)

    def trainer_step() -> float:
        loss = trainer.train_step(*batch())
        trainer.state.step += 1  # as Trainer.fit does: the schedule advances
        return loss

    return trainer_step, segment


@dataclass
class Variant:
    """One row: a built model with its step function, and the row's results so far."""

    bc: BenchConfig
    row: dict
    step: Callable[[], float]
    model_cfg: ModelConfig
    times: list[float] = field(default_factory=list)
    loss: float = math.nan


def _row_header(row: Row) -> dict:
    return {
        "config": row.bc.name,
        "ops": row.ops,
        "attention": row.attention,
        "step": row.step_kind,
        "compile": row.compile,
        "checkpointing": row.ckpt,
        "batch": row.bc.batch,
        "ctx": row.bc.ctx,
        "n_layers": row.bc.model.n_layers,
    }


def prepare(row: Row, device: torch.device, *, warmup: int) -> Variant | dict:
    """Build one variant, warm it up and measure its memory alone; a dict if it is skipped.

    Memory is measured here, before any other variant steps again: freed memory is
    released (``malloc_trim``) before the build, so the peak RSS above the RSS before the
    build is this variant's own.
    """
    out = _row_header(row)
    if row.ckpt != "none" and row.ops == "baseline":
        return out | {"skipped": "checkpointing applies to llamatrain's Llama only"}
    gc.collect()
    _malloc_trim()
    rss0 = _status_kb("VmRSS")
    step, segment = build(row, device)
    if segment is not None:
        out["checkpoint_segment"] = segment

    try:
        started = time.perf_counter()
        step()
        out["first_step_s"] = time.perf_counter() - started
        for _ in range(warmup - 1):
            step()
    except Exception as exc:  # report any compile failure and go on
        if not row.compile:
            raise
        traceback.print_exc(limit=2)
        return out | {"skipped": f"torch.compile failed: {type(exc).__name__}: {str(exc)[:200]}"}

    out |= step_peaks(step, device, rss0)
    return Variant(row.bc, out, step, row.model_cfg)


def step_peaks(step: Callable[[], object], device: torch.device, rss0: int | None) -> dict:
    """The peak memory of two more steps: the device's (CUDA) or the process's RSS above
    ``rss0`` (the RSS before the model was built), and one step's own (``step_mb``)."""
    out: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_reset = _reset_peak_rss()
    for _ in range(2):
        step()
    if device.type == "cuda":
        out["peak_mb"] = torch.cuda.max_memory_allocated(device) / MB
        out["peak_kind"] = "cuda max_memory_allocated"
    elif rss_reset and rss0 is not None:
        out["peak_mb"] = (_status_kb("VmHWM") - rss0) / 1024
        out["peak_kind"] = "peak RSS - RSS before build"
    out["step_mb"] = peak_bytes(step, device) / MB
    return out


def time_interleaved(
    variants: list[Variant],
    device: torch.device,
    probe: PeakProbe,
    *,
    steps: int,
    min_seconds: float,
) -> None:
    """Time the variants' steps in rounds, one step of each per round, rotating the order.

    Interleaving puts every variant under the same machine conditions (load swings on a
    shared machine hit all of them alike), so the ratios between rows hold even when the
    absolute numbers wander. Runs at least ``steps`` rounds and, where steps are fast, more
    rounds until each variant has ``min_seconds`` of steps, as long as the group has run
    less than ``min_seconds`` per variant in all (a sweep mixing 0.1 s and 5 s steps stops
    there) and at most 100 rounds. Each round also samples the matmul peak.
    """
    budget = min_seconds * len(variants)
    started = time.perf_counter()
    rounds = 0
    while rounds < steps or (
        min(sum(v.times) for v in variants) < min_seconds
        and time.perf_counter() - started < budget
        and rounds < 100
    ):
        probe.sample()
        shift = rounds % len(variants)
        for v in variants[shift:] + variants[:shift]:
            sync(device)
            begun = time.perf_counter()
            v.loss = v.step()
            sync(device)
            v.times.append(time.perf_counter() - begun)
        rounds += 1


def finish_row(v: Variant, peak_flops: float) -> dict:
    """Throughput from the median step time, and MFU against the group's matmul peak."""
    bc, cfg = v.bc, v.model_cfg
    s_per_step = statistics.median(v.times)
    tokens = bc.batch * bc.ctx
    fpt = flops_per_token(cfg, bc.ctx)
    return v.row | {
        "loss": v.loss,
        "s_per_step": s_per_step,
        "tokens_per_s": tokens / s_per_step,
        "flops_per_token": fpt,
        "matmul_params": matmul_params(cfg),
        "mfu": fpt * tokens / s_per_step / peak_flops,
        "peak_flops": peak_flops,
        "steps": len(v.times),
        "load_avg": load_average(),
    }


def run_group(
    group: list[Row], device: torch.device, *, steps: int, min_seconds: float
) -> list[dict]:
    """Prepare every row of a group, then time them side by side (``time_interleaved``)."""
    if any(row.compile for row in group):
        torch._dynamo.reset()
    prepared = [prepare(row, device, warmup=2) for row in group]
    variants = [v for v in prepared if isinstance(v, Variant)]
    probe = PeakProbe(device)
    if variants:
        time_interleaved(variants, device, probe, steps=steps, min_seconds=min_seconds)
    del probe.a, probe.b
    return [finish_row(v, probe.best) if isinstance(v, Variant) else v for v in prepared]


# --------------------------------------------------------------------------- profile


def profile_step(row: Row, device: torch.device, top: int = 8) -> list[dict]:
    """Top ops by self CPU time over two steps (after two warmup steps) of ``row``'s step."""
    step, _ = build(row, device)
    for _ in range(2):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    rows = [
        {
            "name": e.key,
            "self_cpu_ms_per_step": e.self_cpu_time_total / 2e3,
            "share": e.self_cpu_time_total / total,
            "calls_per_step": e.count / 2,
        }
        for e in events[:top]
    ]
    print(f"\nprofile {row.bc.name} ops={row.ops}: top {top} by self CPU time (per step)")
    for r in rows:
        print(
            f"  {r['name']:<44} {r['self_cpu_ms_per_step']:>8.1f} ms {100 * r['share']:>5.1f}% "
            f"{r['calls_per_step']:>6.0f} calls"
        )
    return rows


# --------------------------------------------------------------------------- output


HEADER = (
    f"{'config':<14} {'ops':<12} {'attn':<7} {'step':<7} {'mode':<7} {'ckpt':<9} {'batch':>8} "
    f"{'tok/s':>8} {'s/step':>7} {'MFU':>6} {'of GF/s':>7} {'peak MB':>8} {'step MB':>8}  load"
)


def run_plan(
    groups: list[list[Row]], device: torch.device, *, steps: int, min_seconds: float
) -> list[dict]:
    """Every group timed (``run_group``), its rows printed under the table's header as they
    finish."""
    print(HEADER)
    print("-" * len(HEADER))
    rows: list[dict] = []
    for group in groups:
        group_rows = run_group(group, device, steps=steps, min_seconds=min_seconds)
        for row in group_rows:
            print_row(row)
        rows += group_rows
    return rows


def print_row(row: dict) -> None:
    mode = "compile" if row["compile"] else "eager"
    ckpt = row["checkpointing"]
    if "checkpoint_segment" in row:
        ckpt = f"{ckpt}/{row['checkpoint_segment']}"
    shape = f"{row['batch']}x{row['ctx']}"
    head = (
        f"{row['config']:<14} {row['ops']:<12} {row['attention']:<7} {row['step']:<7} "
        f"{mode:<7} {ckpt:<9} {shape:>8}"
    )
    if "skipped" in row:
        print(f"{head} skipped: {row['skipped']}", flush=True)
        return
    load = row["load_avg"][0] if row["load_avg"] else float("nan")
    print(
        f"{head} {row['tokens_per_s']:>8.0f} {row['s_per_step']:>7.3f} "
        f"{100 * row['mfu']:>5.1f}% {row['peak_flops'] / 1e9:>7.0f} "
        f"{row.get('peak_mb', math.nan):>8.0f} "
        f"{row['step_mb']:>8.0f}  {load:.2f}",
        flush=True,
    )


def plan(args: argparse.Namespace) -> list[list[Row]]:
    """The rows of this run in groups; the rows of a group are timed side by side."""
    kinds = ("ggml", "ggml-unfused", "torch", "baseline")
    nano_kinds = ("ggml", "torch", "baseline")
    tiny, g2023, nano = CONFIGS["tiny32k"], CONFIGS["ggml-2023"], CONFIGS["nanogpt-cpu"]
    groups: list[list[Row]] = [
        [Row(tiny, kind) for kind in kinds]
        + [Row(tiny, kind, attention="softmax") for kind in TRAINER_OPS],
        [Row(nano, kind) for kind in nano_kinds],
    ]
    if not args.quick:
        groups.insert(
            1,
            [Row(g2023, kind) for kind in kinds]
            + [Row(g2023, "ggml", ckpt=ckpt) for ckpt in ("full", "auto")],
        )
    if args.compile:
        groups[0] += [Row(tiny, kind, compile=True) for kind in kinds]
        groups[-1] += [Row(nano, kind, compile=True) for kind in nano_kinds]
    if args.families:
        groups.append([Row(family_config(arch), "ggml") for arch in ARCHS])
    if args.scaling:
        sweep = []
        for ctx in (256, 512, 1024, 2048, 4096):
            bc = BenchConfig(f"tiny32k-T{ctx}", replace(tiny.model, max_seq_len=ctx), 1, ctx)
            for kind in ("ggml", "ggml-unfused"):  # without and with the full logits
                sweep += [Row(bc, kind, ckpt=ckpt) for ckpt in ("none", "auto")]
        groups.append(sweep)
        sweep = []
        for layers in (2, 4, 8, 16):
            bc = BenchConfig(f"ggml-2023-L{layers}", replace(g2023.model, n_layers=layers), 8, 128)
            sweep += [Row(bc, "ggml", ckpt=ckpt) for ckpt in ("none", "auto")]
        groups.append(sweep)
        # ggml-2023 stops at 16 layers, where a block saves far more than its input and the
        # rule checkpoints every block; a narrow model 4 -> 256 layers deep shows the
        # sqrt(n) regime.
        sweep = []
        for layers in (4, 16, 64, 256):
            bc = BenchConfig(f"deep-L{layers}", _cfg(512, 64, layers, 4, 2, 192, 256), 4, 256)
            sweep += [Row(bc, "ggml", ckpt=ckpt) for ckpt in ("none", "auto")]
        groups.append(sweep)
    return groups


def family_config(arch: str) -> BenchConfig:
    """The ``family`` shape as ``arch``: the same widths, each family's own switches (a
    sliding window of half the context where the family has one)."""
    base = CONFIGS["family"]
    changes: dict = {"arch": arch}
    if FAMILIES[arch].swa_every:
        changes["sliding_window"] = base.ctx // 2
    return replace(base, name=f"family-{arch}", model=replace(base.model, **changes))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small configs, fewer steps")
    parser.add_argument("--scaling", action="store_true", help="add ctx and n_layers sweeps")
    parser.add_argument("--compile", action="store_true", help="add torch.compile rows")
    parser.add_argument(
        "--families", action="store_true", help="add one row per model family at one shape"
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler table")
    parser.add_argument("--steps", type=int, default=None, help="least measured steps per row")
    add_common_arguments(parser, DEFAULT_JSON)
    args = parser.parse_args(argv)
    device = device_from_arguments(args)
    # A training run's process-wide settings, once, for every row (baseline included); CUDA
    # rows train under bf16 autocast.
    configure_process(device, bf16=device.type == "cuda")
    steps = args.steps or (3 if args.quick else 5)

    started = time.time()
    meta = machine_info(device) | {
        "load_avg_start": load_average(),
        "quick": args.quick,
        "flops_formula": FLOPS_FORMULA,
    }
    print(f"bench/train.py on {device} ({meta['threads']} threads), load {meta['load_avg_start']}")
    rows = run_plan(plan(args), device, steps=steps, min_seconds=1.0 if args.quick else 3.0)
    results: dict = {"meta": meta, "rows": rows}
    if not args.no_profile:
        results["profile"] = {
            f"{name} {kind}": profile_step(Row(CONFIGS[name], kind), device)
            for name, kind in (
                ("tiny32k", "ggml"),
                ("tiny32k", "ggml-unfused"),
                ("ggml-2023", "ggml"),
            )
        }
    return finish(results, meta, started, args.json)


if __name__ == "__main__":
    main()
