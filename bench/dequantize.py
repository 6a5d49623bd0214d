"""The QLoRA matmul's decode, alone and inside the matmul: this tree against a git revision.

Why: a QLoRA step decodes every frozen projection's GGUF blocks to float32 twice (forward and
backward); on a CPU the decode was most of the step (issue 39, item 3). This times it where
it runs, on one matrix of a real model's size (default 2048 x 8192, Llama-3.2-1B's
``ffn_down``), for each type:

* ``decode``: ``dequantize`` of the whole matrix into a new tensor;
* ``decode chunks``: the matrix in ``ops.lora``'s row chunks (``CHUNK_BYTES`` of float32),
  as a QLoRA matmul decodes it (no autograd graph: each chunk into one reused buffer);
  ``bf16 chunks`` the same decoded to bf16 (a step under bf16 autocast);
* ``compiled …``: the rows above with the compiled kernels (``ops.decode_kernels``) for the
  types that have one, checked to decode the same values;
* ``x.W^T`` / ``G.W``: the base product of the forward and of the backward (``--tokens``
  rows of x / G), chunk decode included;
* ``f32 x.W^T`` / ``f32 G.W``: the same products over the matrix already in float32: the
  floor a decode-then-multiply design cannot go below.

With ``--against REV`` (say ``HEAD~1``) the same rows run on that revision's
``ops/dequantize.py`` and ``ops/lora.py`` too, loaded from git into this process, in turns
with this tree's (each round runs every row once), so both see the same machine load; the
decoded values are checked to be equal, bit for bit. Times are process CPU milliseconds (the
median over ``--rounds``; wall time drifts with other processes' load, CPU time far less),
on ``--threads`` threads (default 1: on a shared machine a second thread waits spinning).

Usage: ``python bench/dequantize.py [--types Q4_0,Q8_0,Q4_K,Q6_K] [--shape 2048x8192]
[--tokens 64] [--rounds 7] [--threads 1] [--against REV] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from llamatrain.ops.decode_kernels import KERNEL_TYPES, compiled_decoding

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "unit"))
from ops import finish, load_average, machine_info  # noqa: E402
from test_dequantize import stored_rows  # noqa: E402

# by module name: ``llamatrain.ops``'s attribute ``dequantize`` is the function
tree_dequantize = importlib.import_module("llamatrain.ops.dequantize")
tree_lora = importlib.import_module("llamatrain.ops.lora")

DEFAULT_JSON = HERE / "results" / "dequantize.json"
TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K")


def load_revision(rev: str, workdir: Path) -> tuple[ModuleType, ModuleType]:
    """``rev``'s ``ops/dequantize.py`` and ``ops/lora.py`` as modules of their own, the second
    importing the first (every other import is this tree's)."""
    modules = []
    for name in ("dequantize", "lora"):
        source = subprocess.run(
            ["git", "show", f"{rev}:src/llamatrain/ops/{name}.py"],
            cwd=HERE.parent, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        source = source.replace(
            "from llamatrain.ops.dequantize import", "from rev_dequantize import"
        )
        path = workdir / f"rev_{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"rev_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"rev_{name}"] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[0], modules[1]


def cases(
    label: str, dequantize: ModuleType, lora: ModuleType, blocks: torch.Tensor, qtype: str,
    x: torch.Tensor, g: torch.Tensor,
) -> dict[str, Callable[[], object]]:  # fmt: skip
    """The timed rows of one implementation: decode, decode in chunks, and both products."""
    n_in = x.shape[1]

    def chunks() -> None:
        for _ in lora.row_chunks(blocks, qtype, n_in, torch.float32, None):
            pass

    def bf16_chunks() -> None:
        for _ in lora.row_chunks(blocks, qtype, n_in, torch.bfloat16, None):
            pass

    return {
        f"{label} decode": lambda: dequantize.dequantize(blocks, qtype, n_in),
        f"{label} decode chunks": chunks,
        f"{label} bf16 chunks": bf16_chunks,
        f"{label} x.W^T": lambda: lora.base_forward(x, blocks, qtype, n_in, None),
        f"{label} G.W": lambda: lora._base_backward(g, blocks, qtype, n_in, None),
    }


def compiled(fns: dict[str, Callable[[], object]]) -> dict[str, Callable[[], object]]:
    """The same rows with the blocks decoded by the compiled kernels (``lora.decode =
    "compiled"``, ``ops.decode_kernels``)."""

    def within(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with compiled_decoding("compiled", "cpu"):
                return fn()

        return run

    return {name.replace("tree", "compiled", 1): within(fn) for name, fn in fns.items()}


def cpu_medians(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median process CPU milliseconds of each function, run in turns (one warm-up round),
    each round starting one row later: no row always runs first (after the others' memory
    traffic) or last."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(rounds + 1):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            start = time.process_time()
            fns[name]()
            if round_:
                times[name].append((time.process_time() - start) * 1e3)
    return {name: round(statistics.median(times[name]), 2) for name in names}


def measure(qtype: str, shape: tuple[int, int], args: argparse.Namespace, revision) -> dict:
    """One type's rows (and the revision's, if any), after checking both decode alike."""
    blocks = torch.from_numpy(stored_rows(qtype, shape))
    x, g = torch.randn(args.tokens, shape[1]), torch.randn(args.tokens, shape[0])
    dense = tree_dequantize.dequantize(blocks, qtype, shape[1])
    fns = cases("tree", tree_dequantize, tree_lora, blocks, qtype, x, g)
    if qtype in KERNEL_TYPES:
        with compiled_decoding("compiled", "cpu"):
            if not torch.equal(tree_dequantize.dequantize(blocks, qtype, shape[1]), dense):
                raise SystemExit(f"{qtype}: the compiled kernel decodes other values")
        fns |= compiled(fns)
    if revision is not None:
        if not torch.equal(revision[0].dequantize(blocks, qtype, shape[1]), dense):
            raise SystemExit(f"{qtype}: this tree decodes other values than {args.against}")
        fns |= cases(args.against, *revision, blocks, qtype, x, g)
    fns["f32 x.W^T"] = lambda: torch.mm(x, dense.t())
    fns["f32 G.W"] = lambda: torch.mm(g, dense)
    with torch.no_grad():
        return {"type": qtype, "load": load_average()} | cpu_medians(fns, args.rounds)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated")
    parser.add_argument("--shape", default="2048x8192", help="rows x columns of the matrix")
    parser.add_argument("--tokens", type=int, default=64, help="rows of x and G")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--against", help="a git revision to time beside this tree")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = tuple(int(n) for n in args.shape.split("x"))
    started = time.time()
    meta = machine_info(torch.device("cpu")) | {"load_avg_start": load_average(), "shape": shape}
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        revision = load_revision(args.against, Path(workdir)) if args.against else None
        for qtype in args.types.split(","):
            row = measure(qtype, shape, args, revision)
            rows.append(row)
            print(f"{qtype} {shape[0]}x{shape[1]}, {args.tokens} tokens, load {row['load']}")
            for name, ms in row.items():
                if name not in ("type", "load"):
                    print(f"  {name:<24} {ms:9.2f} cpu ms")
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
