"""One DPO step against one SFT step on the same pairs: time and peak memory, LoRA and full.

Why: a preference objective scores two replies per pair, and DPO also needs its reference's
log-probs; this says what a step of it costs next to supervised finetuning on the chosen
replies of the same pairs, the way ``llamatrain fit`` runs both. Every row times
``Trainer.train_step`` built from a ``Config`` as a run builds it (``train.objective``,
``lora.rank``; AdamW, gradient clipping), one micro-batch a step:

* ``sft``: the pairs' prompt + chosen reply, chosen scored (a ``{"prompt", "completion"}``
  line), packed into rows (``llamatrain.data.examples.pack_rows``);
* ``dpo``: the same pairs as the data lays them (``llamatrain.data.preferences.pair_rows``,
  packed): a pair is one document whose prompt is computed once (the prompt but its last token,
  then a branch per reply from that token), so it costs prompt + chosen + rejected + 1 tokens
  (``mid``: 177 against SFT's 80), and both replies are scored: three times the scored tokens;
* ``full``: every weight trains. DPO's reference is then the run's cached table
  (``objectives.preference.reference.reference_table``, computed once before training, outside the
  timing, as a run does), read per step: no extra forward;
* ``lora``: rank-16 adapters on all seven projections (``lora.alpha`` 32). DPO's reference is
  the same model with its adapters off: one more forward a step, without gradients.

SFT's loss is the fused lm head + cross-entropy, which never holds the (rows, ctx, vocab)
logits; a preference objective takes every scored token's log-prob from the lm head the same
way, a chunk of rows at a time (``llamatrain.ops.logps``), so neither step holds them.

Models (random weights; only shapes matter for cost): ``tiny`` (the tiny config's model: dim
64, 2 layers, 4/2 heads, ffn 192, vocab 384, ctx 64; 8 pairs of prompt 8 + chosen 12 +
rejected 24 tokens) and ``mid`` (dim 256, 8 layers, 8 heads, ffn 768, llama's 32000 vocab,
ctx 256; 8 pairs of prompt 32 + chosen 48 + rejected 96). Pairs are random tokens.

Columns: ``pairs``; ``rows`` × ctx per step; ``tokens`` scored per step; ``trainable``
parameters; ``s/step`` the median over steps timed side by side with the group's other rows
(``bench/ops.py``'s ``time_interleaved``: one step of each row per round, after two warm-up
rounds); ``peak MB`` and ``step MB`` as in ``bench/train.py`` (CPU: peak RSS over two steps
minus RSS before the row was built, and the allocator's peak within one step from a
``torch.profiler`` memory trace; CUDA: ``max_memory_allocated``, absolute, and above the
step's start); ``x sft`` the DPO row's time / peak MB over the SFT row's of the same
model and finetune.

Usage: ``python bench/preference.py [--quick] [--models tiny,mid] [--device cpu|cuda|auto]
[--threads N] [--json PATH]``; ``--quick`` runs ``tiny`` only, with a shorter timing budget.
On a shared machine use ``--threads 1``: two threads on two busy cores mostly wait for each
other (``bench/README.md`` has both).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ops import (  # noqa: E402
    add_common_arguments,
    device_from_arguments,
    finish,
    load_average,
    machine_info,
    time_interleaved,
)
from train import _malloc_trim, _status_kb, step_peaks  # noqa: E402

from llamatrain.config import Config, validate  # noqa: E402
from llamatrain.data.examples import Example, ExampleRows, pack_rows  # noqa: E402
from llamatrain.data.preferences import Pair, pair_rows  # noqa: E402
from llamatrain.device import configure_process  # noqa: E402
from llamatrain.lora import trainable_parameter_count  # noqa: E402
from llamatrain.model import Llama  # noqa: E402
from llamatrain.model_config import ModelConfig  # noqa: E402
from llamatrain.objectives.preference.reference import reference_table
from llamatrain.trainer import Trainer  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "preference.json"
PAD = 0
LORA_RANK, LORA_ALPHA = 16, 32.0


@dataclass(frozen=True)
class Shape:
    """A model and the pairs one step trains on."""

    model: ModelConfig
    n_ctx: int
    pairs: int
    prompt: int
    chosen: int
    rejected: int


SHAPES = {
    "tiny": Shape(
        ModelConfig(vocab_size=384, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
                    max_seq_len=64),
        n_ctx=64, pairs=8, prompt=8, chosen=12, rejected=24,
    ),
    "mid": Shape(
        ModelConfig(vocab_size=32000, dim=256, n_layers=8, n_heads=8, ffn_dim=768,
                    max_seq_len=256),
        n_ctx=256, pairs=8, prompt=32, chosen=48, rejected=96,
    ),
}  # fmt: skip
ROWS = [("sft", "full"), ("dpo", "full"), ("sft", "lora"), ("dpo", "lora")]
"""(objective, finetune) of each model's rows, in the order they are built and printed."""
HEADER = (
    f"{'model':<6} {'objective':<9} {'finetune':<8} {'pairs':>5} {'rows':>8} {'tokens':>6} "
    f"{'trainable':>11} {'s/step':>8} {'x sft':>6} {'peak MB':>8} {'x sft':>6} {'step MB':>8}"
)


def random_pairs(shape: Shape) -> list[Pair]:
    """``shape.pairs`` pairs of random tokens: a prompt (first token 1, as a BOS) and two
    replies, only the replies scored."""
    generator = np.random.default_rng(0)

    def example(prompt: np.ndarray, reply: int) -> Example:
        ids = np.concatenate([prompt, generator.integers(3, shape.model.vocab_size, reply)])
        return Example(ids.astype(np.int64), np.arange(len(ids)) >= len(prompt))

    pairs = []
    for _ in range(shape.pairs):
        rest = generator.integers(3, shape.model.vocab_size, shape.prompt - 1)
        prompt = np.concatenate([[1], rest])
        pairs.append(Pair(example(prompt, shape.chosen), example(prompt, shape.rejected)))
    return pairs


def rows_of(shape: Shape, objective: str) -> ExampleRows:
    """The step's rows: SFT the chosen examples packed, DPO the pairs as the data lays them."""
    pairs = random_pairs(shape)
    if objective == "sft":
        return pack_rows([pair.chosen for pair in pairs], shape.n_ctx + 1, PAD)
    return pair_rows(pairs, shape.n_ctx + 1, PAD, packing=True)


def run_config(shape: Shape, objective: str, finetune: str, n_rows: int, device) -> Config:
    """The run config a ``llamatrain fit`` of this row would have: one micro-batch a step.

    ``model.init_from`` names no file: validation asks for one (a LoRA run and a full
    finetune's DPO take their base from it), but the row builds its random model itself.
    """
    cfg = Config(model=shape.model)
    cfg.model.init_from = "random-base"
    cfg.data.n_ctx = shape.n_ctx
    cfg.data.format = "jsonl"
    cfg.train.objective = objective
    cfg.train.n_batch = cfg.train.n_ubatch = n_rows * shape.n_ctx
    cfg.train.device = device.type
    cfg.train.dtype = "bfloat16" if device.type == "cuda" else "float32"
    if finetune == "lora":
        cfg.lora.rank, cfg.lora.alpha = LORA_RANK, LORA_ALPHA
    return validate(cfg)


def build_step(
    shape: Shape, objective: str, finetune: str, device: torch.device
) -> tuple[Callable[[], float], dict]:
    """A function running one optimizer step of the row, and the row's fixed figures."""
    rows = rows_of(shape, objective)
    batch = rows.batch(np.arange(len(rows)))
    torch.manual_seed(0)
    cfg = run_config(shape, objective, finetune, len(rows), device)
    trainer = Trainer(Llama(shape.model), cfg, progress=False)
    extra = {}
    if objective == "dpo" and finetune == "full":  # the cached table's rows, read per step
        bf16 = cfg.train.dtype == "bfloat16"
        autocast = torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()
        table = reference_table(trainer.model, rows, None, len(rows), trainer.device, autocast)
        extra["reference"] = table.rows(np.arange(len(rows)))

    def step() -> float:
        loss = trainer.train_step(batch.inputs, batch.targets, batch.documents, **extra)
        trainer.state.step += 1  # as Trainer.fit does: the schedule advances
        return loss

    figures = {
        "rows": len(rows),
        "ctx": shape.n_ctx,
        "scored_tokens": int((batch.targets != -100).sum()),
        "trainable": trainable_parameter_count(trainer.model),
    }
    return step, figures


def prepare(name: str, objective: str, finetune: str, device: torch.device) -> tuple:
    """Build one row, warm it up and measure its memory alone (before the next row is built),
    as ``bench/train.py``'s ``prepare`` does."""
    row = {"model": name, "objective": objective, "finetune": finetune}
    row["pairs"] = SHAPES[name].pairs
    gc.collect()
    _malloc_trim()
    rss0 = _status_kb("VmRSS")
    step, figures = build_step(SHAPES[name], objective, finetune, device)
    row |= figures
    for _ in range(2):
        step()
    row |= step_peaks(step, device, rss0)
    return row, step


def run_model(name: str, device: torch.device, budget_s: float, min_repeats: int) -> list[dict]:
    """The model's rows, built one by one, then timed side by side; DPO's ratios to SFT."""
    built = [prepare(name, objective, finetune, device) for objective, finetune in ROWS]
    steps = {f"{r['objective']}-{r['finetune']}": step for r, step in built}
    seconds = time_interleaved(steps, device, budget_s=budget_s, min_repeats=min_repeats)
    rows = [row | {"s_per_step": seconds[key]} for (row, _), key in zip(built, steps, strict=True)]
    for row in rows:
        sft = next(r for r in rows if r["objective"] == "sft" and r["finetune"] == row["finetune"])
        row["x_sft_time"] = row["s_per_step"] / sft["s_per_step"]
        if "peak_mb" in row:
            row["x_sft_peak"] = row["peak_mb"] / sft["peak_mb"]
        row["load_avg"] = load_average()
    return rows


def row_text(row: dict) -> str:
    peak = row.get("peak_mb", float("nan"))
    return (
        f"{row['model']:<6} {row['objective']:<9} {row['finetune']:<8} {row['pairs']:>5} "
        f"{str(row['rows']) + 'x' + str(row['ctx']):>8} {row['scored_tokens']:>6} "
        f"{row['trainable']:>11,} {row['s_per_step']:>8.4f} {row['x_sft_time']:>6.2f} "
        f"{peak:>8.1f} {row.get('x_sft_peak', float('nan')):>6.2f} {row['step_mb']:>8.1f}"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny only, shorter timing")
    parser.add_argument("--models", default=None, help="comma-separated (default tiny,mid)")
    add_common_arguments(parser, DEFAULT_JSON)
    args = parser.parse_args(argv)
    device = device_from_arguments(args)
    configure_process(device, bf16=device.type == "cuda")  # as bench/train.py: a run's settings
    names = (args.models or ("tiny" if args.quick else "tiny,mid")).split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown model {unknown[0]!r}; choose from {', '.join(SHAPES)}")

    started = time.time()
    meta = machine_info(device) | {"load_avg_start": load_average(), "quick": args.quick}
    print(f"bench/preference.py on {device} ({meta['threads']} threads), load "
          f"{meta['load_avg_start']}")  # fmt: skip
    print(HEADER)
    print("-" * len(HEADER))
    prepare("tiny", "dpo", "lora", device)  # one-off costs of a process's first Trainer/step
    rows: list[dict] = []
    budget_s, min_repeats = (3.0, 3) if args.quick else (10.0, 5)
    for name in names:
        model_rows = run_model(name, device, budget_s, min_repeats)
        for row in model_rows:
            print(row_text(row), flush=True)
        rows += model_rows
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
