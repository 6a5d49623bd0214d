"""LoRA against full finetuning of the same model: step time, peak memory, trainable numbers.

Why: LoRA exists to make finetuning cheaper; this says how much cheaper a llamatrain run is,
measured the way a user runs it. Each row is a real ``llamatrain.api.fit`` on the same base
file, data and batch, in a fresh process (``--child``), so its peak RSS is that run's and
nothing else's:

* ``full``: every weight trained (model.init_from = the f32 base, lora.rank = 0);
* ``lora-f32`` / ``lora-bf16``: rank-16 adapters on all seven projections of every block, the
  frozen base kept in float32 / bfloat16 (``lora.base_dtype``);
* ``lora-q4_0`` / ``lora-q4_k``: the same adapters over the base stored as Q4_0 (llamatrain's
  writer) / Q4_K_M (llama.cpp's quantizer), kept in its blocks (QLoRA:
  ``lora.base_dtype = "quantized"``).

Models (random weights; only shapes matter for cost): ``ggml-2023`` (the 2023
train-text-from-scratch shape: dim 256, 16 layers, 8 heads, ffn 768, llama's 32000 vocab) and
``tinyllama`` (TinyLlama-1.1B: dim 2048, 22 layers, 32/4 heads, ffn 5632, vocab 32000; its full
finetuning needs ~18 GB plus activations, more than a 24 GB machine leaves) or ``tinyllama-11``
(the same width, 11 of its 22 blocks: the per-block ratios are TinyLlama's, the embeddings'
share of memory twice as large, so the ratios come out slightly worse than the whole model's), with
the synthetic 32000-piece SPM vocabulary of ``bench/import_memory.py``. The base files are
built once into ``bench/.cache/lora/`` (the quantized ones need llama-cpp-python, the
``quantize`` extra). Data: the packaged sonnets; n_ctx 128, one 128-token sequence per step on
the TinyLlama shapes, eight on ggml-2023; activation checkpointing off.

Columns: ``trainable`` parameters; ``s/step`` the median of the steps after the first two
(``metrics.jsonl``'s per-step tokens/s); ``tok/s``; ``peak MB`` the child's peak RSS
(``VmHWM``: weights, gradients, optimizer state, activations, Python and torch);
``x step`` / ``x peak``: the ratio to the ``full`` row of the same model. The issue's targets:
LoRA r=16 step <= 0.75x, peak <= 0.5x; with a Q4 base peak <= 0.35x.

Usage: ``python bench/lora.py [--models ggml-2023,tinyllama-11] [--steps N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_memory import MB, peak_rss_bytes, synthetic_vocabulary  # noqa: E402
from ops import finish, load_average, machine_info  # noqa: E402

from llamatrain.model_config import ModelConfig, tensor_shapes  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = HERE / ".cache" / "lora"
DEFAULT_JSON = HERE / "results" / "lora.json"
N_CTX = 128
MODELS = {
    "ggml-2023": (
        ModelConfig(vocab_size=32000, dim=256, n_layers=16, n_heads=8, ffn_dim=768,
                    max_seq_len=N_CTX),
        8,
    ),
    "tinyllama": (
        ModelConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                    ffn_dim=5632, max_seq_len=2048),
        1,
    ),
    "tinyllama-11": (
        ModelConfig(vocab_size=32000, dim=2048, n_layers=11, n_heads=32, n_kv_heads=4,
                    ffn_dim=5632, max_seq_len=2048),
        1,
    ),
}  # fmt: skip
"""Model shape and sequences per step."""
ROWS = {
    "full": ("f32", {"lora.rank": 0}),
    "lora-f32": ("f32", {"lora.rank": 16, "lora.base_dtype": "f32"}),
    "lora-bf16": ("f32", {"lora.rank": 16, "lora.base_dtype": "bf16"}),
    "lora-q4_0": ("q4_0", {"lora.rank": 16, "lora.base_dtype": "quantized"}),
    "lora-q4_k": ("q4_k_m", {"lora.rank": 16, "lora.base_dtype": "quantized"}),
}
"""Row name -> (base file type, the run's settings besides the shared ones)."""
HEADER = (
    f"{'model':<10} {'row':<10} {'trainable':>11} {'s/step':>7} {'tok/s':>7} {'peak MB':>8} "
    f"{'x step':>7} {'x peak':>7}"
)


def base_file(cache: Path, model: str, type_name: str) -> Path:
    """The model's random base stored as ``type_name``, built once (Q4_K_M by llama.cpp's
    quantizer, the others by llamatrain's writer)."""
    from llamatrain.gguf.export_types import QUANTIZER_TYPES
    from llamatrain.gguf.llama import write_model
    from llamatrain.gguf.quantize import write_quantized_model

    path = cache / f"{model}-{type_name}.gguf"
    if path.is_file():
        return path
    cfg, _ = MODELS[model]
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=generator) * (1.0 if len(shape) == 1 else 0.02)
        for name, shape in tensor_shapes(cfg).items()
    }
    cache.mkdir(parents=True, exist_ok=True)
    print(f"building {path.name} ...", flush=True)
    write = write_quantized_model if type_name in QUANTIZER_TYPES else write_model
    write(path, cfg, tensors, synthetic_vocabulary(cfg.vocab_size), type=type_name)
    return path


def child(spec: dict) -> dict:
    """One run in this (fresh) process; prints and returns its figures."""
    from llamatrain import api
    from llamatrain.data import SONNETS_PATH
    from llamatrain.lora import trainable_parameter_count

    settings = {
        "model.init_from": spec["base"],
        "data.path": str(SONNETS_PATH),
        "data.n_ctx": N_CTX,
        "data.val_fraction": 0.0,
        "train.n_batch": N_CTX * spec["n_seq"],
        "train.steps": spec["steps"],
        "train.log_every": 1,
        "train.eval_every": 0,
        "train.save_every": 0,
        "train.sample_tokens": 0,
        "train.checkpointing": "none",
        "output.export": False,
        "output.dir": spec["dir"],
        **spec["settings"],
    }
    overrides = [f"{key}={json.dumps(value)}" for key, value in settings.items()]
    result = api.fit(None, overrides=overrides, progress=False)
    steps = [json.loads(line) for line in (Path(spec["dir"]) / "metrics.jsonl").open()]
    per_step = [N_CTX * spec["n_seq"] / r["tokens_per_s"] for r in steps if "tokens_per_s" in r]
    seconds = statistics.median(per_step[2:])
    figures = {
        "trainable": trainable_parameter_count(result.model),
        "s_per_step": seconds,
        "tokens_per_s": N_CTX * spec["n_seq"] / seconds,
        "peak_bytes": peak_rss_bytes(),
    }
    print(json.dumps(figures))
    return figures


def run_row(model: str, row: str, base: Path, steps: int, run_dir: Path) -> dict:
    _, settings = ROWS[row]
    spec = {
        "base": str(base),
        "n_seq": MODELS[model][1],
        "steps": steps,
        "dir": str(run_dir),
        "settings": settings,
    }
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True
    )
    if done.returncode < 0:
        raise SystemExit(f"{model} {row} was killed by signal {-done.returncode} (out of memory?)")
    if done.returncode != 0:
        raise SystemExit(f"{model} {row} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return {"model": model, "row": row} | json.loads(done.stdout.strip().splitlines()[-1])


def row_text(row: dict, full: dict) -> str:
    return (
        f"{row['model']:<10} {row['row']:<10} {row['trainable']:>11,} "
        f"{row['s_per_step']:>7.3f} {row['tokens_per_s']:>7.0f} {row['peak_bytes'] / MB:>8.0f} "
        f"{row['s_per_step'] / full['s_per_step']:>7.2f} "
        f"{row['peak_bytes'] / full['peak_bytes']:>7.2f}"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="ggml-2023,tinyllama-11", help="comma-separated")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (first 2 untimed)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where bases are kept")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))

    started = time.time()
    meta = machine_info(torch.device("cpu")) | {"load_avg_start": load_average()}
    rows: list[dict] = []
    print(HEADER)
    for model in args.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
        full = None
        for row in ["full"] + [r for r in args.rows.split(",") if r != "full"]:
            base = base_file(args.cache, model, ROWS[row][0])
            with tempfile.TemporaryDirectory() as run_dir:
                rows.append(run_row(model, row, base, args.steps, Path(run_dir)))
            full = full or rows[-1]
            print(row_text(rows[-1], full), flush=True)
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
