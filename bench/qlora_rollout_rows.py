"""A QLoRA model's rollouts at few rows through the C++ decoding step and through the blocks,
beside llama.cpp's batched decode of the base file.

Why: at GRPO's usual 32 rows a decoding step is mostly its products and the C++ step
(``fused_decode``, the LoRA update inside it) changes little; at 1 and 8 rows the blocks' small
PyTorch ops are a large share, which is where the step pays (bench/README.md, grpo_speed).

Method: the model a GRPO QLoRA run builds (``bench/grpo_speed.py``'s ``qlora_model``, float32,
rank 8; B drawn nonzero, as after training), ``--rows`` rows of a ``--prompt-tokens``-token
random prompt each, ``--tokens`` sampled tokens at temperature 1 through
``sample_completions`` (prompt evaluation included), once with the step and once with
``rollout.fused_decoding`` off; llama.cpp: ``LlamaCppBatched`` over the base without an adapter.
Thread CPU seconds (``time.thread_time``, one thread a side), best of ``--rounds``.

Usage: ``python bench/qlora_rollout_rows.py [--model PATH] [--rows 1,8] [--tokens 64]``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from grpo_speed import ours, qlora_model, random_prompts  # noqa: E402
from llama_cpp_batched import LlamaCppBatched  # noqa: E402
from lora import smollm2_file  # noqa: E402

from llamatrain.objectives.grpo import rollout  # noqa: E402


@contextlib.contextmanager
def blocks_only() -> Iterator[None]:
    """Rollouts run the blocks (the C++ step's swap turned into a no-op) within it."""
    fused = rollout.fused_decoding
    rollout.fused_decoding = lambda _model: contextlib.nullcontext()
    try:
        yield
    finally:
        rollout.fused_decoding = fused


def cpu_seconds(call: Callable[[], object]) -> float:
    """This thread's CPU seconds in ``call()``."""
    start = time.thread_time()
    call()
    return time.thread_time() - start


def speeds(model: torch.nn.Module, path: Path, rows: int, args: argparse.Namespace) -> dict:
    """Each side's best tokens/s over ``rows`` rows (module docstring)."""
    cpp = LlamaCppBatched(path, rows, args.prompt_tokens + args.tokens, args.prompt_tokens, 1)
    prompts = random_prompts(rows, args.prompt_tokens, cpp.vocab_size())

    def blocks() -> None:
        with blocks_only():
            ours(model, prompts, 1, args.tokens)

    sides: dict[str, Callable[[int], object]] = {
        "llama.cpp (base)": lambda r: cpp.rollout(prompts, 1, args.tokens, r),
        "ours qlora, C++ step": lambda _: ours(model, prompts, 1, args.tokens),
        "ours qlora, blocks": lambda _: blocks(),
    }
    best = dict.fromkeys(sides, float("inf"))
    for r in range(args.rounds):  # in turns
        for name, side in sides.items():
            best[name] = min(best[name], cpu_seconds(lambda s=side, r=r: s(r)))
    cpp.close()
    return {name: rows * args.tokens / seconds for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = args.model or smollm2_file(HERE / ".cache")
    with tempfile.TemporaryDirectory() as work:
        model = qlora_model(path, Path(work), "float32")
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("lora_b"):
                    parameter.normal_(std=0.01)
        for rows in map(int, args.rows.split(",")):
            for name, speed in speeds(model, path, rows, args).items():
                print(f"b{rows} {name:<22}{speed:8.1f} tok/s (thread CPU)", flush=True)


if __name__ == "__main__":
    main()
