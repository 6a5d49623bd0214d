"""GPU training throughput and MFU at two ~130M-parameter shapes: the path ``train.device =
"auto"`` picks on CUDA against the ggml-semantics path, eager and compiled.

Why: on CUDA ``auto`` trains with PyTorch's ops, SDPA and bf16 autocast
(``llamatrain.device.resolve_run_settings``); ``model.ops = "ggml"`` keeps ggml's semantics
and our blockwise flash attention. This says what each costs on a GPU, and how much of the
difference is the attention kernel. The rows are ``bench/train.py``'s trainer rows, built and
timed by its machinery (``Trainer.train_step`` from a run's ``Config``, rounds of one step per
row in rotating order, the bf16 matmul peak sampled in the same rounds, the same FLOP formula
and memory peaks), so the two benchmarks cannot drift apart.

Groups (each timed side by side):

* ``llama-124m``: a GPT-2-small-sized llama (dim 768, 12 layers, 12 heads, ffn 2048, vocab
  32000, ctx 1024, batch 8; ~134M parameters, 85M of them in the blocks).
* ``smollm2-135m``: SmolLM2-135M's shape (30 layers, dim 576, 9 query / 3 kv heads of 64,
  ffn 1536, vocab 49152 tied to the embeddings, ctx 2048, batch 4).

Rows (``ops`` / ``attn`` columns):

* ``ggml`` / ``flash``: ggml's ops and our blockwise flash attention (``model.ops = "ggml"``);
* ``ggml`` / ``sdpa``: ggml's ops with PyTorch's fused attention: the attention kernel's share;
* ``torch`` / ``sdpa``: PyTorch's ops and fused attention, what ``auto`` picks on CUDA;
* ``baseline``: ``bench/baseline.py``'s independent plain PyTorch llama (SDPA) and step, where
  an ordinary implementation stands (its lm head is a weight of its own: untied on
  SmolLM2's shape, the same matmul).

The torch op set's ``flash`` is SDPA itself, so a ``torch`` / ``flash`` row would repeat the
``torch`` / ``sdpa`` one. Every row runs eager and compiled (``train.compile = true``;
``--no-compile`` skips the compiled ones), all under bf16 autocast with float32 master weights
on CUDA, so the rows differ in their kernels alone (``auto`` gives the ggml path float32: bf16
is chosen with PyTorch's ops only). On the CPU (``--device cpu``, a check that the script
runs) they train in float32 and ``MFU`` divides by the float32 matmul peak.

Columns: ``bench/train.py``'s (its docstring; ``bench/README.md``): ``tok/s``, ``MFU`` =
model FLOP/s / the best bf16 8192² matmul of the same run, ``peak MB`` =
``torch.cuda.max_memory_allocated`` over two steps (CPU: peak RSS above the RSS before the
row was built).

Usage: ``python bench/gpu.py --device cuda`` on a CUDA machine; ``python bench/gpu.py
--device cpu --quick`` trains tiny versions of both shapes (dim 64, 2 layers, ctx 64) on the
CPU, a check that the script works: about 15 s with ``--no-compile``, 2-3 minutes with the
compiled rows on 2 cores. Results: ``bench/results/gpu.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ops import add_common_arguments, device_from_arguments, finish, load_average, machine_info  # noqa: E402
from train import FLOPS_FORMULA, BenchConfig, Row, run_plan  # noqa: E402

from llamatrain.device import configure_process  # noqa: E402
from llamatrain.model_config import ModelConfig  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "gpu.json"

CONFIGS = (
    BenchConfig(
        "llama-124m",
        ModelConfig(
            vocab_size=32000, dim=768, n_layers=12, n_heads=12, ffn_dim=2048, max_seq_len=1024
        ),
        batch=8,
        ctx=1024,
    ),
    BenchConfig(
        "smollm2-135m",
        ModelConfig(
            vocab_size=49152,
            dim=576,
            n_layers=30,
            n_heads=9,
            n_kv_heads=3,
            ffn_dim=1536,
            tie_embeddings=True,
            rope_theta=100000.0,
            max_seq_len=2048,
        ),
        batch=4,
        ctx=2048,
    ),
)
ROWS = (("ggml", "flash"), ("ggml", "sdpa"), ("torch", "sdpa"), ("baseline", "flash"))
"""The rows' (ops, attention): the ggml path, its attention swapped, ``auto`` on CUDA, and
``bench/train.py``'s baseline (whose attention is always SDPA; ``flash`` names no change)."""


def quick(bc: BenchConfig) -> BenchConfig:
    """``bc`` at a tiny size (dim 64, 2 layers, ctx 64) keeping its kind: tied head, GQA."""
    kv_heads = None if bc.model.n_kv_heads is None else 2
    model = replace(
        bc.model,
        vocab_size=512,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=kv_heads,
        ffn_dim=128,
        max_seq_len=64,
    )
    family = bc.name.split("-")[0]
    return BenchConfig(f"{family}-tiny", model, batch=2, ctx=64)


def plan(args: argparse.Namespace) -> list[list[Row]]:
    """One group per shape: every row of :data:`ROWS`, eager, then compiled unless told."""
    modes = (False,) if args.no_compile else (False, True)
    shapes = [quick(bc) for bc in CONFIGS] if args.quick else list(CONFIGS)
    return [
        [Row(bc, ops, attention=attn, compile=mode) for mode in modes for ops, attn in ROWS]
        for bc in shapes
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, fewer steps")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled rows")
    parser.add_argument("--steps", type=int, default=None, help="least measured steps per row")
    add_common_arguments(parser, DEFAULT_JSON)
    args = parser.parse_args(argv)
    device = device_from_arguments(args)
    bf16 = device.type == "cuda"  # bench/train.py's trainer rows autocast to bf16 on CUDA
    configure_process(device, bf16=bf16)
    steps = args.steps or (3 if args.quick else 10)

    started = time.time()
    meta = machine_info(device) | {
        "load_avg_start": load_average(),
        "quick": args.quick,
        "dtype": "bf16 autocast, float32 weights" if bf16 else "float32",
        "flops_formula": FLOPS_FORMULA,
    }
    print(f"bench/gpu.py on {meta.get('gpu', device)} ({meta['dtype']}), torch {meta['torch']}")
    rows = run_plan(plan(args), device, steps=steps, min_seconds=0.5 if args.quick else 3.0)
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
