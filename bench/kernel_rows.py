"""The quantized kernels against the decoded path, per number of rows M: where each one wins.

Why: ``ops.quantized_matmul.max_rows`` decides from these figures which products take the C++
kernels over the stored blocks and which decode chunks of W and run PyTorch's GEMM
(``ops.lora``, the decoders compiled as a QLoRA run has them). Both directions: the forward
``x·Wᵀ`` (the kernels' int8 GEMM) and the backward ``G·W`` (their decoded panels and float
micro-kernel), float32, or under bf16 autocast with ``--bf16``.

Method: median thread CPU time (``time.thread_time``) of each product over ``--rounds``
rounds, kernel and decoded in turns; one thread unless ``--threads``; W random blocks of
``--types`` at the two shapes of Llama-3.2-1B's MLP (2048 x 8192 and 8192 x 2048, out x in).
Prints kernel ms, decoded ms and their ratio per M. The AVX2 picture on a newer CPU:
``LLAMATRAIN_KERNEL_ARCH=-march=haswell MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``.

``--direct``: the forward alone by the kernels' two paths instead, ``rows`` (each weight row
dotted straight from its blocks, ``kernels/rows_dot.h``) and ``panels`` (the repacked GEMM),
at M=1..8 unless ``--rows``: rows ms, panels ms and their ratio, whence each type's
``direct_rows`` in ``kernels/quantized.cpp``.

Usage: ``python bench/kernel_rows.py [--types Q4_0,Q4_K] [--rows 1,8,16,32,64,256]
[--rounds 5] [--threads 1] [--bf16] [--direct]``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llamatrain.ops import lora, quantized_matmul
from llamatrain.ops.decode_kernels import compiled_decoding

SHAPES = [(2048, 8192), (8192, 2048)]

F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2)}
F16_FIELDS |= {"Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2)}
"""Byte offsets of each type's float16 scales, set finite in otherwise random blocks."""


def random_blocks(qtype: str, n_out: int, n_in: int) -> torch.Tensor:
    """``qtype`` blocks (n_out, row bytes) of random quants with finite float16 scales."""
    rng = np.random.default_rng(0)
    values, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    count = n_out * n_in // values
    blocks = rng.integers(0, 256, (count, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = (rng.standard_normal(count) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n_out, -1))


def thread_ms(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median thread CPU milliseconds of each function, in turns, after one warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(rounds + 1):
        for name, fn in fns.items():
            start = time.thread_time()
            fn()
            if round_:
                times[name].append((time.thread_time() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def products(qtype: str, blocks: torch.Tensor, n_in: int, m: int) -> dict[str, Callable]:
    """The four timed products of M rows: kernel and decoded, forward and backward."""
    x, g = torch.randn(m, n_in), torch.randn(m, blocks.shape[0])
    return {
        "fwd kernel": lambda: quantized_matmul.blocks_matmul(x, blocks, qtype),
        "fwd decoded": lambda: lora.base_forward(x, blocks, qtype, n_in, None),
        "bwd kernel": lambda: quantized_matmul.blocks_matmul_t(g, blocks, qtype, n_in),
        "bwd decoded": lambda: lora._base_backward(g, blocks, qtype, n_in, None),
    }


def direct_products(qtype: str, blocks: torch.Tensor, n_in: int, m: int) -> dict[str, Callable]:
    """The forward of M rows by each of the kernels' two paths, whatever M is."""
    x = torch.randn(m, n_in)
    return {
        path: functools.partial(quantized_matmul.blocks_matmul, x, blocks, qtype, path)
        for path in ("rows", "panels")
    }


def print_direct(types: list[str], rows: list[int], rounds: int) -> None:
    """Rows ms / panels ms (ratio) per type, shape and M."""
    print("type   shape       M   rows / panels ms (ratio)")
    for qtype in types:
        for n_out, n_in in SHAPES:
            blocks = random_blocks(qtype, n_out, n_in)
            for m in rows:
                ms = thread_ms(direct_products(qtype, blocks, n_in, m), rounds)
                ratio = ms["rows"] / ms["panels"]
                print(
                    f"{qtype:5}  {n_out}x{n_in:<5} {m:4}   "
                    f"{ms['rows']:7.2f} / {ms['panels']:7.2f} ({ratio:.2f})",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", default="Q4_0,Q4_K")
    parser.add_argument("--rows", help="M values (default 1,8,16,32,64,256; --direct 1..8)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bf16", action="store_true", help="under bf16 autocast")
    parser.add_argument("--direct", action="store_true", help="the forward's two paths")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load {os.getloadavg()[0]:.2f}, threads {args.threads}, bf16 {args.bf16}")
    types = args.types.split(",")
    if args.direct:
        print_direct(types, [*map(int, (args.rows or "1,2,3,4,5,6,7,8").split(","))], args.rounds)
        return
    rows = [*map(int, (args.rows or "1,8,16,32,64,256").split(","))]
    print("type   shape       M   fwd kernel/decoded ms (ratio)   bwd kernel/decoded ms (ratio)")
    autocast = torch.autocast("cpu", torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    # the decoded path's products: M past any kernel limit, so lora takes its chunks
    quantized_matmul.MAX_ROWS.update(forward=0, backward=0)
    quantized_matmul.AMX_BF16_MAX_ROWS.update(forward=0, backward=0)
    with compiled_decoding("compiled", "cpu"), autocast, torch.no_grad():
        for qtype in types:
            for n_out, n_in in SHAPES:
                blocks = random_blocks(qtype, n_out, n_in)
                for m in rows:
                    ms = thread_ms(products(qtype, blocks, n_in, m), args.rounds)
                    fwd = ms["fwd kernel"] / ms["fwd decoded"]
                    bwd = ms["bwd kernel"] / ms["bwd decoded"]
                    print(
                        f"{qtype:5}  {n_out}x{n_in:<5} {m:4}   "
                        f"{ms['fwd kernel']:7.1f} / {ms['fwd decoded']:7.1f} ({fwd:.2f})"
                        f"        {ms['bwd kernel']:7.1f} / {ms['bwd decoded']:7.1f} ({bwd:.2f})",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
