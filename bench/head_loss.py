"""The lm head + cross-entropy of a training step: ours (fused) against PyTorch's own.

Why: at a 32k-128k vocabulary the logits of a small model's step are its largest tensor, and
PyTorch 2.13 ships ``F.linear_cross_entropy`` in core, with a chunked path
(``torch.nn.LinearCrossEntropyOptions``) that never materialises them either. Our
``llamatrain.ops.fused.linear_cross_entropy`` (what ``Llama.loss`` runs with the ggml op set)
must be at least as fast and use no more memory than that baseline. Rows, interleaved in one
loop per shape (``bench/ops.py``'s ``time_interleaved``), forward + backward with respect to
hidden states and head weight:

* ``llamatrain fused``: ours, row chunks of ``default_chunk_rows``;
* ``torch lce chunked``: ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())``
  (its "auto" chunking and accumulation policy);
* ``torch lce``: ``F.linear_cross_entropy`` with ``options=None`` (the reference path);
* ``torch unfused``: ``F.cross_entropy(F.linear(h, w), t)``.

Columns: ``ms`` median per call; ``x fused`` its ratio to ours; ``peak MB`` the allocator's
peak extra bytes during one call (``bench/ops.py``'s ``peak_bytes``: a profiler memory trace on
CPU); ``max |dloss|`` how far its loss is from the float64 reference.

Usage: ``python bench/head_loss.py [--quick] [--device cpu|cuda] [--threads N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ops import (  # noqa: E402
    MB,
    add_common_arguments,
    device_from_arguments,
    finish,
    fwd_bwd,
    load_average,
    machine_info,
    peak_bytes,
    time_interleaved,
)

from llamatrain.device import configure_process  # noqa: E402
from llamatrain.ops.fused import linear_cross_entropy  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "head_loss.json"
SHAPES = [(2048, 256, 32000), (2048, 64, 32000), (512, 256, 128256)]
"""(tokens, dim, vocab): llama 2's vocabulary at the ggml-2023 and tiny32k widths, and
llama 3's 128k vocabulary (fewer tokens: PyTorch's chunked path takes about a minute a call
there on 2 CPU cores)."""
QUICK_SHAPES = [(512, 256, 32000), (256, 256, 128256)]
HEADER = f"{'shape':<22} {'row':<18} {'ms':>8} {'x fused':>8} {'peak MB':>8} {'max |dloss|':>12}"


def variants(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> dict:
    chunked = torch.nn.LinearCrossEntropyOptions()
    return {
        "llamatrain fused": lambda: linear_cross_entropy(h, w, t),
        "torch lce chunked": lambda: F.linear_cross_entropy(h, w, t, options=chunked),
        "torch lce": lambda: F.linear_cross_entropy(h, w, t, options=None),
        "torch unfused": lambda: F.cross_entropy(F.linear(h, w), t),
    }


def run_shape(tokens: int, dim: int, vocab: int, device: torch.device, budget_s: float) -> list:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, dim, generator=gen).to(device).requires_grad_()
    w = (torch.randn(vocab, dim, generator=gen) * 0.05).to(device).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    exact = F.cross_entropy(F.linear(h.double(), w.double()), t).item()
    forwards = variants(h, w, t)
    runs = {name: fwd_bwd(fn, [h, w], None) for name, fn in forwards.items()}
    times = time_interleaved(runs, device, budget_s=budget_s, warmup=1)
    shape = f"{tokens}x{dim} V={vocab}"
    rows = []
    for name, fn in forwards.items():
        rows.append(
            {
                "shape": shape,
                "row": name,
                "ms": 1e3 * times[name],
                "vs_fused": times[name] / times["llamatrain fused"],
                "peak_mb": peak_bytes(runs[name], device) / MB,
                "loss_error": abs(fn().item() - exact),
            }
        )
        r = rows[-1]
        print(
            f"{shape:<22} {name:<18} {r['ms']:>8.1f} {r['vs_fused']:>8.2f} "
            f"{r['peak_mb']:>8.1f} {r['loss_error']:>12.2e}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    add_common_arguments(parser, DEFAULT_JSON)
    args = parser.parse_args(argv)
    device = device_from_arguments(args)
    configure_process(device, bf16=False)
    started = time.time()
    meta = machine_info(device) | {"load_avg_start": load_average(), "quick": args.quick}
    print(f"bench/head_loss.py on {device} ({meta['threads']} threads)\n{HEADER}")
    rows = []
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        rows += run_shape(*shape, device, budget_s=1.5 if args.quick else 5.0)
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
