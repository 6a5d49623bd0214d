"""Training-step throughput, MFU and peak memory of llamatrain's model against plain PyTorch.

Why: the op micro-benchmarks (``bench/ops.py``) do not say what a user gets; this runs real
optimizer steps - forward, backward, gradient clipping at 1.0 and AdamW built exactly as the
trainer builds it (``llamatrain.optim.build_optimizer`` with the default ``OptimSection``:
lr 1e-3, betas 0.9/0.999, eps 1e-8, decay 0.1 on matrices) - on random tokens, for:

* ``ops``: ``ggml`` (``Llama(ops="ggml")`` trained as the trainer trains it, through
  ``Llama.loss``: our autograd ops and the fused lm head + cross-entropy of
  ``llamatrain.ops.fused``, which never holds the full logits), ``ggml-unfused`` (the same
  model, loss from ``forward(x, y)``: full logits, then ggml's ``cross_entropy``), ``torch``
  (``Llama(ops="torch")`` through ``Llama.loss``: ``F.linear`` + ``F.cross_entropy``) and
  ``baseline`` (``bench/baseline.py``: an independent, straightforward eager llama with
  ``torch.optim.AdamW`` of the same settings);
* eager vs ``torch.compile`` (``--compile``; a variant that fails to compile is reported
  with the error and skipped);
* activation checkpointing ``none`` / ``full`` (every block) / ``auto`` (the 2023 spacing
  rule, from ``llamatrain.trainer.checkpoint_segment`` with the block sizes measured by
  ``activation_bytes_per_block``), set through ``model.checkpoint_segment``.

Columns:

* ``tok/s`` = batch·ctx / (median seconds per step) over at least 5 steps and 3 s (quick: 3
  steps and 1 s), after warmup steps.
* ``MFU`` = achieved model FLOP/s ÷ peak FLOP/s. Model FLOPs per token =
  6·N + 12·L·H·Q·T, with N = the parameters of every matrix multiplication: the attention
  and feed-forward weights of all blocks *plus the lm head* (vocab × dim; for a small model
  with a 32k vocabulary it is the largest matmul), without the token embedding (a lookup,
  no FLOPs) or the norm weights (elementwise). L layers, H heads, Q head dim, T = ctx (the
  full, not causally halved, attention). Recomputation under checkpointing is not counted.
  The peak is measured in the same run: the best of repeated large matmuls, float32
  4096×4096 on CPU, bf16 8192×8192 on CUDA, taken before and after the rows.
* ``peak MB``: on CPU the process's peak RSS during the measured steps (``VmHWM``, reset
  via ``/proc/self/clear_refs``) minus its RSS before the model was built (after
  ``malloc_trim``) - parameters, gradients, optimizer state, activations and allocator
  slack. On CUDA ``torch.cuda.max_memory_allocated`` over the measured steps (absolute).
* ``step MB``: the peak of extra allocator bytes within one step above its start (CPU:
  from a ``torch.profiler`` memory trace; CUDA: allocator peak minus the allocation at the
  start): activations, gradients and temporaries - the part checkpointing and the fused
  loss change.

Rows run one after another (a model per row), so on a shared machine load swings show up in
tok/s; the load average is printed with every row. Usage:
``python bench/train.py [--quick] [--scaling] [--compile] [--device cpu|cuda|auto]
[--json PATH]``. The default run takes about 4-5 minutes on 2 CPU cores.
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
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import BaselineLlama, make_optimizer  # noqa: E402
from ops import finish, load_average, machine_info, peak_bytes, resolve, sync  # noqa: E402

from llamatrain.config import OptimSection  # noqa: E402
from llamatrain.model import Llama, ModelConfig  # noqa: E402
from llamatrain.optim import build_optimizer  # noqa: E402
from llamatrain.trainer import activation_bytes_per_block, checkpoint_segment  # noqa: E402

MB = 1 << 20
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
    # The tiny llama of NOTES §6 (llama.cpp finetune ≈ 1,060 tok/s, llama2.c ≈ 2,500-3,000).
    "tiny32k": BenchConfig("tiny32k", _cfg(32000, 64, 2, 4, 2, 192, 256), batch=8, ctx=256),
    # train-text-from-scratch's 2023 defaults.
    "ggml-2023": BenchConfig("ggml-2023", _cfg(32000, 256, 16, 8, None, 768, 128), 8, 128),
    # nanoGPT's CPU shakespeare_char config (≈ 12,300 tok/s on these machines).
    "nanogpt-cpu": BenchConfig("nanogpt-cpu", _cfg(65, 128, 4, 4, None, 512, 64), 12, 64),
}


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


def flops_per_token(cfg: ModelConfig, ctx: int) -> int:
    """6·N + 12·L·H·Q·T (forward + backward; see the module docstring)."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * ctx


def measure_peak_flops(device: torch.device) -> float:
    """Best FLOP/s of a large matmul: float32 4096² on CPU, bf16 8192² on CUDA."""
    if device.type == "cuda":
        n, dtype, reps = 8192, torch.bfloat16, 10
    else:
        n, dtype, reps = 4096, torch.float32, 3
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    best = math.inf
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


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


def build(kind: str, cfg: ModelConfig, device: torch.device):
    """Model, optimizer and a loss function ``loss(x, y)`` for one variant."""
    torch.manual_seed(0)
    optim_cfg = OptimSection()
    if kind == "baseline":
        model = BaselineLlama(
            cfg.vocab_size,
            cfg.dim,
            cfg.n_layers,
            cfg.n_heads,
            cfg.kv_heads,
            cfg.hidden_dim,
            cfg.max_seq_len,
            cfg.norm_eps,
        ).to(device)
        opt = make_optimizer(
            model,
            optim_cfg.lr,
            optim_cfg.weight_decay,
            (optim_cfg.beta1, optim_cfg.beta2),
            optim_cfg.eps,
        )
        return model, opt, lambda x, y: model(x, y)[1]
    model = Llama(cfg, ops="torch" if kind == "torch" else "ggml").to(device)
    opt = build_optimizer(model, optim_cfg)
    if kind == "ggml-unfused":
        return model, opt, lambda x, y: model(x, y)[1]
    return model, opt, model.loss


def run_row(
    bc: BenchConfig,
    kind: str,
    device: torch.device,
    *,
    ckpt: str = "none",
    compile_: bool = False,
    steps: int = 5,
    min_seconds: float = 3.0,
    warmup: int = 2,
    peak_flops: float,
) -> dict:
    row = {
        "config": bc.name,
        "ops": kind,
        "compile": compile_,
        "checkpointing": ckpt,
        "batch": bc.batch,
        "ctx": bc.ctx,
        "n_layers": bc.model.n_layers,
    }
    cfg = replace(bc.model, max_seq_len=max(bc.model.max_seq_len, bc.ctx))
    gc.collect()
    _malloc_trim()
    rss0 = _status_kb("VmRSS")
    model, opt, loss_fn = build(kind, cfg, device)
    if ckpt != "none":
        if kind == "baseline":
            return row | {"skipped": "checkpointing applies to llamatrain's Llama only"}
        u = v = 1
        if ckpt == "auto":
            u, v = activation_bytes_per_block(model, bc.batch, bc.ctx)
        model.checkpoint_segment = checkpoint_segment(ckpt, 1, cfg.n_layers, u, v)
        row["checkpoint_segment"] = model.checkpoint_segment
    if compile_:
        # A fresh compile per row: otherwise a later row's new shapes make dynamo recompile
        # with dynamic shapes, which measures something else (and can fail, see the report).
        torch._dynamo.reset()
        loss_fn = torch.compile(loss_fn)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else contextlib.nullcontext()
    )
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator(device="cpu").manual_seed(1)

    def step() -> float:
        data = torch.randint(0, cfg.vocab_size, (bc.batch, bc.ctx + 1), generator=gen)
        data = data.to(device)
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(data[:, :-1], data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return loss.item()

    try:
        started = time.perf_counter()
        step()
        row["first_step_s"] = time.perf_counter() - started
        for _ in range(warmup - 1):
            step()
    except Exception as exc:  # report any compile failure and go on
        if not compile_:
            raise
        row["skipped"] = f"torch.compile failed: {type(exc).__name__}: {str(exc)[:200]}"
        traceback.print_exc(limit=2)
        return row

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rss_reset = _reset_peak_rss()
    times: list[float] = []
    loss = math.nan
    # At least ``steps`` steps and at least ``min_seconds`` of them (fast configs get more).
    while len(times) < steps or (sum(times) < min_seconds and len(times) < 100):
        sync(device)
        started = time.perf_counter()
        loss = step()
        sync(device)
        times.append(time.perf_counter() - started)
    if device.type == "cuda":
        row["peak_mb"] = torch.cuda.max_memory_allocated(device) / MB
        row["peak_kind"] = "cuda max_memory_allocated"
    elif rss_reset and rss0 is not None:
        row["peak_mb"] = (_status_kb("VmHWM") - rss0) / 1024
        row["peak_kind"] = "peak RSS - RSS before build"
    row["step_mb"] = peak_bytes(step, device) / MB

    s_per_step = statistics.median(times)
    tokens = bc.batch * bc.ctx
    fpt = flops_per_token(cfg, bc.ctx)
    row |= {
        "loss": loss,
        "s_per_step": s_per_step,
        "tokens_per_s": tokens / s_per_step,
        "flops_per_token": fpt,
        "matmul_params": matmul_params(cfg),
        "mfu": fpt * tokens / s_per_step / peak_flops,
        "steps": len(times),
        "load_avg": load_average(),
    }
    return row


# --------------------------------------------------------------------------- profile


def profile_step(bc: BenchConfig, kind: str, device: torch.device, top: int = 8) -> list[dict]:
    """Top ops by self CPU time over two steps (after two warmup steps)."""
    model, opt, loss_fn = build(kind, bc.model, device)
    gen = torch.Generator(device="cpu").manual_seed(1)

    def step() -> None:
        data = torch.randint(0, bc.model.vocab_size, (bc.batch, bc.ctx + 1), generator=gen)
        data = data.to(device)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(data[:, :-1], data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

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
    print(f"\nprofile {bc.name} ops={kind}: top {top} by self CPU time (per step)")
    for r in rows:
        print(
            f"  {r['name']:<44} {r['self_cpu_ms_per_step']:>8.1f} ms {100 * r['share']:>5.1f}% "
            f"{r['calls_per_step']:>6.0f} calls"
        )
    return rows


# --------------------------------------------------------------------------- output


HEADER = (
    f"{'config':<14} {'ops':<12} {'mode':<7} {'ckpt':<9} {'batch':>8} {'tok/s':>8} "
    f"{'s/step':>7} {'MFU':>6} {'peak MB':>8} {'step MB':>8}  load"
)


def print_row(row: dict) -> None:
    mode = "compile" if row["compile"] else "eager"
    ckpt = row["checkpointing"]
    if "checkpoint_segment" in row:
        ckpt = f"{ckpt}/{row['checkpoint_segment']}"
    shape = f"{row['batch']}x{row['ctx']}"
    head = f"{row['config']:<14} {row['ops']:<12} {mode:<7} {ckpt:<9} {shape:>8}"
    if "skipped" in row:
        print(f"{head} skipped: {row['skipped']}", flush=True)
        return
    load = row["load_avg"][0] if row["load_avg"] else float("nan")
    print(
        f"{head} {row['tokens_per_s']:>8.0f} {row['s_per_step']:>7.3f} "
        f"{100 * row['mfu']:>5.1f}% {row.get('peak_mb', math.nan):>8.0f} "
        f"{row['step_mb']:>8.0f}  {load:.2f}",
        flush=True,
    )


def plan(args: argparse.Namespace) -> list[tuple[BenchConfig, str, str, bool]]:
    """(config, ops, checkpointing, compile) for every row of this run."""
    rows: list[tuple[BenchConfig, str, str, bool]] = []
    kinds = ["ggml", "ggml-unfused", "torch", "baseline"]
    if args.quick:
        for name in ("tiny32k", "nanogpt-cpu"):
            for kind in kinds:
                rows.append((CONFIGS[name], kind, "none", False))
    else:
        for kind in kinds:
            rows.append((CONFIGS["tiny32k"], kind, "none", False))
        for kind in kinds:
            rows.append((CONFIGS["ggml-2023"], kind, "none", False))
        for ckpt in ("full", "auto"):
            rows.append((CONFIGS["ggml-2023"], "ggml", ckpt, False))
        for kind in ("ggml", "torch", "baseline"):
            rows.append((CONFIGS["nanogpt-cpu"], kind, "none", False))
    if args.compile:
        for bc, kind in (
            (CONFIGS["tiny32k"], "ggml"),
            (CONFIGS["tiny32k"], "ggml-unfused"),
            (CONFIGS["tiny32k"], "torch"),
            (CONFIGS["tiny32k"], "baseline"),
            (CONFIGS["nanogpt-cpu"], "ggml"),
            (CONFIGS["nanogpt-cpu"], "torch"),
            (CONFIGS["nanogpt-cpu"], "baseline"),
        ):
            rows.append((bc, kind, "none", True))
    if args.scaling:
        tiny = CONFIGS["tiny32k"]
        for ctx in (256, 512, 1024, 2048, 4096):
            bc = BenchConfig(f"tiny32k-T{ctx}", replace(tiny.model, max_seq_len=ctx), 1, ctx)
            for kind in ("ggml", "ggml-unfused"):  # without and with the full logits
                for ckpt in ("none", "auto"):
                    rows.append((bc, kind, ckpt, False))
        g = CONFIGS["ggml-2023"]
        for layers in (2, 4, 8, 16):
            for ckpt in ("none", "auto"):
                bc = BenchConfig(f"ggml-2023-L{layers}", replace(g.model, n_layers=layers), 8, 128)
                rows.append((bc, "ggml", ckpt, False))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small configs, fewer steps")
    parser.add_argument("--scaling", action="store_true", help="add ctx and n_layers sweeps")
    parser.add_argument("--compile", action="store_true", help="add torch.compile rows")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler table")
    parser.add_argument("--steps", type=int, default=None, help="least measured steps per row")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: PyTorch's choice)"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    device = resolve(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or (3 if args.quick else 5)

    started = time.time()
    meta = machine_info(device) | {
        "load_avg_start": load_average(),
        "quick": args.quick,
        "flops_formula": "6*N + 12*L*H*Q*T, N = matmul weights incl. lm head, excl. embedding",
    }
    peak_before = measure_peak_flops(device)
    print(
        f"bench/train.py on {device} ({meta['threads']} threads), load {meta['load_avg_start']}, "
        f"matmul peak {peak_before / 1e9:.0f} GFLOP/s"
    )
    print(HEADER)
    print("-" * len(HEADER))
    rows = []
    for bc, kind, ckpt, compile_ in plan(args):
        row = run_row(
            bc,
            kind,
            device,
            ckpt=ckpt,
            compile_=compile_,
            steps=steps,
            min_seconds=1.0 if args.quick else 3.0,
            peak_flops=peak_before,
        )
        rows.append(row)
        print_row(row)
    peak_after = measure_peak_flops(device)
    peak = max(peak_before, peak_after)
    for row in rows:  # MFU against the better of the two peak measurements
        if "mfu" in row:
            row["mfu"] = row["flops_per_token"] * row["tokens_per_s"] / peak
    meta |= {
        "peak_flops_before": peak_before,
        "peak_flops_after": peak_after,
        "peak_flops": peak,
    }
    print(
        f"\nmatmul peak {peak_before / 1e9:.0f} GFLOP/s before the rows, "
        f"{peak_after / 1e9:.0f} after; summary with MFU against {peak / 1e9:.0f} GFLOP/s:"
    )
    print(HEADER)
    print("-" * len(HEADER))
    for row in rows:
        print_row(row)
    results: dict = {"meta": meta, "rows": rows}
    if not args.no_profile:
        results["profile"] = {
            kind: profile_step(CONFIGS["tiny32k"], kind, device)
            for kind in ("ggml", "ggml-unfused")
        }
    return finish(results, meta, started, args.json)


if __name__ == "__main__":
    main()
