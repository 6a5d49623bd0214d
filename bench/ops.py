"""Forward+backward time and peak memory of the ggml-semantics ops against PyTorch's own.

Why: every op in ``llamatrain.ops`` is an ``autograd.Function`` with ggml's backward written
out by hand; this shows what that costs (or saves) against the native PyTorch path the
``ops="torch"`` model uses, per op and for one whole training step, and shows that the
recomputing flash attention keeps memory linear in the sequence where written-out attention
grows quadratically. It also measures the fused lm head + cross-entropy
(``llamatrain.ops.fused.linear_cross_entropy``) against the unfused pair.

Method:

* Time: the median of N repeats of forward + backward (``torch.autograd.grad`` with one
  fixed random upstream gradient), after warmup. The variants of a row (ggml, torch, ...)
  run *interleaved* in the same loop, so load changes on a shared machine hit them alike;
  compare the ratio ggml/torch rather than absolute times across runs.
* Memory ("MB" columns): the peak of *extra* bytes held by PyTorch's allocator during one
  forward + backward, above what was allocated before it started (inputs and parameters are
  not counted; outputs, saved activations, temporaries and the returned gradients are). On
  CUDA that is ``torch.cuda.max_memory_allocated`` minus the starting allocation. On CPU the
  allocator keeps no peak statistic, so the step runs once under ``torch.profiler`` with
  ``profile_memory=True`` and the peak is the maximum running sum of the recorded
  allocations and frees. (Peak RSS is no use for this on CPU: glibc keeps freed memory
  mapped, so RSS barely moves between repeated steps.)
* "saved MB" (JSON, and the attention table): bytes of the tensors autograd keeps from the
  forward for the backward, via ``torch.autograd.graph.saved_tensors_hooks``, counting each
  storage once and leaving out the inputs and parameters themselves.

Attention scaling: B=1, H=8, D=64, causal, T = 256 … 4096; ``flash_attn`` (ours, blockwise,
recomputing backward), ``naive`` (softmax(QKᵀ/√d + mask)·V written out with PyTorch ops,
autograd keeps the T×T matrices) and PyTorch's SDPA for reference.

``flash_attn`` is always our blockwise kernel, on CUDA too (PyTorch's SDPA is a separate
column here, and the model's ``attention="sdpa"`` choice). The process gets a training run's
settings (``llamatrain.device.configure_process``) once at start, as ``bench/train.py`` does.

Usage: ``python bench/ops.py [--quick] [--device cpu|cuda|auto] [--json PATH]``, or
``make bench-ops`` for the full run. How long runs take and measured results are in
``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import plain_step  # noqa: E402

from llamatrain import ops as G  # noqa: E402
from llamatrain.config import Config, OptimSection, validate  # noqa: E402
from llamatrain.device import configure_process  # noqa: E402
from llamatrain.model import Llama, ModelConfig  # noqa: E402
from llamatrain.ops.fused import linear_cross_entropy  # noqa: E402
from llamatrain.ops.sets import torch_rope  # noqa: E402
from llamatrain.optim import build_optimizer  # noqa: E402
from llamatrain.trainer import Trainer  # noqa: E402

MB = 1 << 20
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "ops.json"


# --------------------------------------------------------------------------- measurement


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    warmup: int = 2,
    budget_s: float = 6.0,
    min_repeats: int = 3,
    max_repeats: int = 25,
) -> dict[str, float]:
    """Median seconds per call of each function, the functions run in turn in one loop.

    The number of repeats is chosen after warmup so the measured loop takes about
    ``budget_s`` (within [min_repeats, max_repeats]).
    """
    samples: dict[str, list[float]] = {name: [] for name in fns}

    def one_round() -> float:
        total = 0.0
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            elapsed = time.perf_counter() - start
            samples[name].append(elapsed)
            total += elapsed
        return total

    per_round = max(one_round() for _ in range(max(1, warmup)))
    for name in samples:
        samples[name].clear()
    repeats = int(min(max_repeats, max(min_repeats, budget_s // max(per_round, 1e-6))))
    for _ in range(repeats):
        one_round()
    return {name: statistics.median(values) for name, values in samples.items()}


def _cpu_alloc_peak(prof: profile) -> int:
    """Peak running sum of the allocator events a memory-profiled CPU run recorded."""
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == torch._C._profiler._EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.alloc_size))
        stack.extend(node.children)
    events.sort()
    current = peak = 0
    for _, size in events:
        current += size
        peak = max(peak, current)
    return peak


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak extra allocator bytes while ``fn`` runs (see the module docstring)."""
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _cpu_alloc_peak(prof)


def saved_bytes(forward: Callable[[], object], exclude: list[torch.Tensor]) -> int:
    """Bytes autograd saves for the backward during ``forward()``, inputs/params excluded."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(seen.values())


# --------------------------------------------------------------------------- op cases


def _randn(*shape: int, device: torch.device, grad: bool = True, scale: float = 1.0):
    return (torch.randn(*shape, device=device) * scale).requires_grad_(grad)


def fwd_bwd(forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor], upstream):
    """A closure running forward then the gradients wrt ``inputs`` for a fixed upstream."""

    def run():
        out = forward()
        return torch.autograd.grad(out, inputs, upstream)

    return run


def _causal_mask(t: int, device: torch.device) -> torch.Tensor:
    return torch.full((t, t), -math.inf, device=device).triu_(1)


def op_cases(device: torch.device, quick: bool) -> list[dict]:
    """Each case: name, shape, the differentiable inputs and one forward per variant."""
    b, t = (4, 128) if quick else (8, 256)
    tokens = b * t
    dev = {"device": device}
    cases = []

    table = _randn(32000, 64, **dev)
    ids = torch.randint(0, 32000, (b, t), device=device)
    cases.append(
        {
            "op": "get_rows",
            "shape": f"table 32000x64, ids {b}x{t}",
            "inputs": [table],
            "ggml": lambda: G.get_rows(table, ids),
            "torch": lambda: F.embedding(ids, table),
        }
    )

    x = _randn(b, t, 256, **dev)
    cases.append(
        {
            "op": "rms_norm",
            "shape": f"{b}x{t}x256",
            "inputs": [x],
            "ggml": lambda: G.rms_norm(x, 1e-5),
            "torch": lambda: F.rms_norm(x, (256,), eps=1e-5),
        }
    )

    xr = _randn(b, t, 8, 32, **dev)
    pos = torch.arange(t, device=device)
    cases.append(
        {
            "op": "rope (norm)",
            "shape": f"{b}x{t}x8x32",
            "inputs": [xr],
            "ggml": lambda: G.rope(xr, pos, theta=10000.0, mode="norm"),
            "torch": lambda: torch_rope(xr, pos, theta=10000.0),
        }
    )

    gate, up = _randn(b, t, 768, **dev), _randn(b, t, 768, **dev)
    cases.append(
        {
            "op": "swiglu",
            "shape": f"{b}x{t}x768",
            "inputs": [gate, up],
            "ggml": lambda: G.swiglu(gate, up),
            "torch": lambda: F.silu(gate) * up,
        }
    )

    scores = _randn(b, 8, t, t, **dev)
    mask = _causal_mask(t, device)
    scale = 1.0 / math.sqrt(32)
    cases.append(
        {
            "op": "soft_max (scale+mask)",
            "shape": f"{b}x8x{t}x{t}",
            "inputs": [scores],
            "ggml": lambda: G.soft_max(scores, mask, scale),
            "torch": lambda: torch.softmax(scores * scale + mask, dim=-1),
        }
    )

    rows = tokens // 2
    logits = _randn(rows, 32000, **dev)
    targets = torch.randint(0, 32000, (rows,), device=device)
    cases.append(
        {
            "op": "cross_entropy",
            "shape": f"{rows}x32000",
            "inputs": [logits],
            "ggml": lambda: G.cross_entropy(logits, targets),
            "torch": lambda: F.cross_entropy(logits, targets),
        }
    )

    xm, wm = _randn(b, t, 256, **dev), _randn(768, 256, **dev, scale=0.05)
    cases.append(
        {
            "op": "mul_mat",
            "shape": f"{b}x{t}x256 @ (768x256)T",
            "inputs": [xm, wm],
            "ggml": lambda: G.mul_mat(xm, wm),
            "torch": lambda: F.linear(xm, wm),
        }
    )

    q = _randn(b, 8, t, 32, **dev)
    k, v = _randn(b, 2, t, 32, **dev), _randn(b, 2, t, 32, **dev)
    cases.append(
        {
            "op": "flash_attn (causal, GQA 8/2)",
            "shape": f"q {b}x8x{t}x32, kv {b}x2x{t}x32",
            "inputs": [q, k, v],
            "ggml": lambda: G.flash_attn(q, k, v, causal=True),
            "torch": lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            ),
        }
    )
    return cases


def run_op_cases(device: torch.device, quick: bool, budget_s: float) -> list[dict]:
    rows = []
    for case in op_cases(device, quick):
        variants = {}
        for name in ("ggml", "torch"):
            out = case[name]()
            upstream = torch.randn_like(out) if out.dim() else None
            variants[name] = fwd_bwd(case[name], case["inputs"], upstream)
        times = time_interleaved(variants, device, budget_s=budget_s)
        mem = {name: peak_bytes(fn, device) for name, fn in variants.items()}
        saved = {name: saved_bytes(case[name], case["inputs"]) for name in variants}
        rows.append(_row(case["op"], case["shape"], times, mem, saved))
        print_row(rows[-1])
    return rows


def _row(op: str, shape: str, times: dict, mem: dict, saved: dict, ggml: str = "ggml") -> dict:
    return {
        "op": op,
        "shape": shape,
        "ggml_ms": 1e3 * times[ggml],
        "torch_ms": 1e3 * times["torch"],
        "ratio": times[ggml] / times["torch"],
        "ggml_peak_mb": mem[ggml] / MB,
        "torch_peak_mb": mem["torch"] / MB,
        "ggml_saved_mb": saved[ggml] / MB,
        "torch_saved_mb": saved["torch"] / MB,
    }


# --------------------------------------------------------------------------- fused loss


def run_fused_ce(device: torch.device, quick: bool, budget_s: float) -> list[dict]:
    """lm head + cross-entropy at 2048 tokens, vocab 32000: fused vs unfused (ours, torch)."""
    rows = []
    tokens, vocab = (1024 if quick else 2048), 32000
    for dim in (64, 256):
        h = _randn(tokens, dim, **{"device": device})
        w = _randn(vocab, dim, device=device, scale=0.05)
        targets = torch.randint(0, vocab, (tokens,), device=device)
        forwards = {
            "fused": lambda h=h, w=w, t=targets: linear_cross_entropy(h, w, t),
            "ggml": lambda h=h, w=w, t=targets: G.cross_entropy(G.mul_mat(h, w), t),
            "torch": lambda h=h, w=w, t=targets: F.cross_entropy(F.linear(h, w), t),
        }
        variants = {name: fwd_bwd(fn, [h, w], None) for name, fn in forwards.items()}
        times = time_interleaved(variants, device, budget_s=budget_s)
        mem = {name: peak_bytes(fn, device) for name, fn in variants.items()}
        saved = {name: saved_bytes(fn, [h, w]) for name, fn in forwards.items()}
        shape = f"{tokens}x{dim} @ ({vocab}x{dim})T"
        for name, label in (("ggml", "lm_head+CE unfused"), ("fused", "lm_head+CE fused")):
            rows.append(_row(label, shape, times, mem, saved, ggml=name))
            print_row(rows[-1])
    return rows


# --------------------------------------------------------------------------- train step


def run_train_step(device: torch.device, quick: bool, budget_s: float) -> list[dict]:
    """One training step of tiny32k: the trainer's, ggml vs torch ops, and the unfused loss.

    ``ggml`` and ``torch`` run ``Trainer.train_step`` (zero grads, ``Llama.loss`` - for
    ops="ggml" the fused lm head + cross-entropy -, backward, clip the global norm at
    ``optim.grad_clip``, AdamW from ``build_optimizer``) on one fixed batch. ``unfused``, in the
    same loop, takes the ggml model's loss from ``forward`` (full logits), a path the trainer
    does not have, so it runs ``bench/baseline.py``'s ``plain_step`` with the same optimizer.
    """
    batch, ctx = (4, 128) if quick else (8, 256)
    cfg = ModelConfig(
        vocab_size=32000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=ctx
    )
    torch.manual_seed(0)
    models = {"ggml": Llama(cfg).to(device)}
    models["unfused"] = Llama(cfg).to(device)
    models["torch"] = Llama(replace(cfg, ops="torch")).to(device)
    for name in ("unfused", "torch"):
        models[name].load_state_dict(models["ggml"].state_dict())
    losses = {
        "ggml": models["ggml"].loss,
        "unfused": lambda x, y: models["unfused"](x, y)[1],
        "torch": models["torch"].loss,
    }
    data = torch.randint(0, cfg.vocab_size, (batch, ctx + 1), device=device)
    x, y = data[:, :-1], data[:, 1:]
    bf16 = device.type == "cuda"

    def trainer_step(name: str) -> Callable[[], float]:
        run = Config(model=models[name].cfg)
        run.data.n_ctx = ctx
        run.train.n_batch = batch * ctx
        run.train.device = device.type
        run.train.dtype = "bfloat16" if bf16 else "float32"
        trainer = Trainer(models[name], validate(run), progress=False)

        def step() -> float:
            loss = trainer.train_step(x, y)
            trainer.state.step += 1
            return loss

        return step

    unfused = plain_step(
        models["unfused"],
        build_optimizer(models["unfused"], OptimSection()),
        losses["unfused"],
        grad_clip=OptimSection().grad_clip,
        bf16=bf16,
    )
    variants = {
        "ggml": trainer_step("ggml"),
        "unfused": lambda: unfused(x, y),
        "torch": trainer_step("torch"),
    }
    times = time_interleaved(variants, device, budget_s=budget_s)
    mem = {name: peak_bytes(fn, device) for name, fn in variants.items()}
    saved = {
        name: saved_bytes(lambda n=name: losses[n](x, y), list(models[name].parameters()))
        for name in models
    }
    shape = f"batch {batch}x{ctx}, 2L dim64 v32000"
    rows = []
    for name, label in (("ggml", "train step tiny32k"), ("unfused", "train step, unfused loss")):
        rows.append(_row(label, shape, times, mem, saved, ggml=name))
        print_row(rows[-1])
    return rows


# --------------------------------------------------------------------------- attention


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(QKᵀ/√d + causal mask)·V with plain PyTorch ops: the T×T matrices exist."""
    t = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores + _causal_mask(t, q.device)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def run_attention_scaling(device: torch.device, quick: bool, budget_s: float) -> list[dict]:
    rows = []
    lengths = (256, 512, 1024) if quick else (256, 512, 1024, 2048, 4096)
    b, h, d = 1, 8, 64
    print(
        f"\nattention fwd+bwd, B={b} H={h} D={d}, causal: peak extra allocator MB "
        "(saved-for-backward MB) and ms"
    )
    print(
        f"{'T':>6} {'flash ms':>9} {'naive ms':>9} {'sdpa ms':>8} | "
        f"{'flash MB':>15} {'naive MB':>17} {'sdpa MB':>15}"
    )
    for t in lengths:
        q, k, v = (_randn(b, h, t, d, device=device) for _ in range(3))
        forwards = {
            "flash": lambda q=q, k=k, v=v: G.flash_attn(q, k, v, causal=True),
            "naive": lambda q=q, k=k, v=v: naive_attention(q, k, v),
            "sdpa": lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }
        upstream = torch.randn_like(q)
        variants = {name: fwd_bwd(fn, [q, k, v], upstream) for name, fn in forwards.items()}
        times = time_interleaved(
            variants, device, warmup=1, budget_s=budget_s, min_repeats=2 if t >= 2048 else 3
        )
        mem = {name: peak_bytes(fn, device) for name, fn in variants.items()}
        saved = {name: saved_bytes(fn, [q, k, v]) for name, fn in forwards.items()}
        row = {"T": t, "B": b, "H": h, "D": d}
        for name in forwards:
            row[f"{name}_ms"] = 1e3 * times[name]
            row[f"{name}_peak_mb"] = mem[name] / MB
            row[f"{name}_saved_mb"] = saved[name] / MB
        rows.append(row)
        cells = [f"{row[f'{n}_peak_mb']:8.1f} ({row[f'{n}_saved_mb']:5.1f})" for n in forwards]
        print(
            f"{t:>6} {row['flash_ms']:>9.1f} {row['naive_ms']:>9.1f} {row['sdpa_ms']:>8.1f} | "
            f"{cells[0]:>15} {cells[1]:>17} {cells[2]:>15}"
        )
    for name in ("flash", "naive"):
        growth = [
            rows[i + 1][f"{name}_peak_mb"] / rows[i][f"{name}_peak_mb"]
            for i in range(len(rows) - 1)
            if rows[i][f"{name}_peak_mb"] > 0
        ]
        print(
            f"{name} peak memory growth per doubling of T: "
            + ", ".join(f"{g:.2f}x" for g in growth)
        )
    return rows


# --------------------------------------------------------------------------- output


HEADER = (
    f"{'op':<30} {'shape':<34} {'ggml ms':>9} {'torch ms':>9} {'ratio':>6} "
    f"{'ggml MB':>9} {'torch MB':>9}"
)


def print_row(row: dict) -> None:
    print(
        f"{row['op']:<30} {row['shape']:<34} {row['ggml_ms']:>9.2f} {row['torch_ms']:>9.2f} "
        f"{row['ratio']:>6.2f} {row['ggml_peak_mb']:>9.1f} {row['torch_peak_mb']:>9.1f}",
        flush=True,
    )


def resolve(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device available")
    return torch.device(name)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device) -> dict:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def finish(results: dict, meta: dict, started: float, path: Path) -> dict:
    """Stamp the end-of-run load and duration into ``meta`` and write ``results`` as JSON."""
    meta["load_avg_end"] = load_average()
    meta["seconds"] = round(time.time() - started, 1)
    print(f"\nload {meta['load_avg_end']}, {meta['seconds']} s")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    return results


def add_common_arguments(parser: argparse.ArgumentParser, default_json: Path) -> None:
    """``--device``, ``--threads`` and ``--json``, shared by the bench scripts."""
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: PyTorch's choice)"
    )
    parser.add_argument("--json", type=Path, default=default_json, help="where to write results")


def device_from_arguments(args: argparse.Namespace) -> torch.device:
    """The device of ``--device``, with ``--threads`` applied."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return resolve(args.device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    add_common_arguments(parser, DEFAULT_JSON)
    args = parser.parse_args(argv)
    device = device_from_arguments(args)
    configure_process(device, bf16=device.type == "cuda")
    budget = 1.5 if args.quick else 4.0
    torch.manual_seed(0)

    started = time.time()
    meta = machine_info(device) | {"load_avg_start": load_average(), "quick": args.quick}
    print(f"bench/ops.py on {device} ({meta['threads']} threads), load {meta['load_avg_start']}")
    print("fwd+bwd; ms = median of interleaved repeats; MB = peak extra allocator memory\n")
    print(HEADER)
    print("-" * len(HEADER))
    results = {"meta": meta}
    results["ops"] = run_op_cases(device, args.quick, budget)
    results["ops"] += run_fused_ce(device, args.quick, budget)
    results["ops"] += run_train_step(device, args.quick, 2 * budget)
    results["attention_scaling"] = run_attention_scaling(device, args.quick, budget)
    return finish(results, meta, started, args.json)


if __name__ == "__main__":
    main()
