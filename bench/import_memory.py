"""Import memory and time: ``llamatrain.load_gguf`` of a TinyLlama-sized Q4_K_M file.

Why: a quantized file expands to float32 on import (a 0.67 GB Q4_K_M TinyLlama becomes a
4.4 GB model), so how many float copies the import holds at once decides whether a model fits
in memory. The claim checked here: peak RSS <= what the process held before (Python, torch,
llamatrain) + the model's own bytes + one tensor's working set.

Method. Once, cached in ``bench/.cache/import_memory/`` (``--cache``): a llama of
TinyLlama-1.1B's shape (dim 2048, 22 layers, 32 heads / 4 kv heads, ffn 5632, vocab 32000,
untied output) with random weights and a synthetic 32000-piece SPM vocabulary is written f32
and quantized to Q4_K_M by llama.cpp's quantizer, through ``llamatrain.gguf.quantize`` (the
``export --type q4_k_m`` path; needs llama-cpp-python). Then each row runs in a fresh process
(``--child``), so its peak RSS is that import's and nothing else's:

* ``load_gguf``: the library's import (header and checks, ``Llama(cfg)``, then each tensor
  dequantized straight into its parameter, a chunk of rows at a time);
* ``state_dict``: what ``load_gguf`` did before: every tensor dequantized into a dict first
  (``read_model``), then ``Llama(cfg).load_state_dict`` copies it (two float copies).

Columns: ``s`` import seconds; ``peak MB`` the child's peak RSS (``VmHWM``, see
``peak_rss_bytes``); ``base MB`` its peak after importing torch and llamatrain, before the
import; ``model MB`` the sum of parameter bytes; ``tensor MB`` the largest tensor as float32;
``over MB`` = peak - base - model, which the claim bounds by ``tensor MB``. Results: a table
and ``bench/results/import_memory.json``. Not part of the test suite: building the file
takes minutes and 5 GB of memory.

Usage: ``python bench/import_memory.py [--cache DIR] [--json PATH] [--rebuild]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ops import finish, load_average, machine_info  # noqa: E402
from train import _status_kb  # noqa: E402

from llamatrain.model_config import ModelConfig, tensor_shapes  # noqa: E402
from llamatrain.tokenizer import (  # noqa: E402
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    SpmTokenizer,
)

MB = 1 << 20
HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = HERE / ".cache" / "import_memory"
DEFAULT_JSON = HERE / "results" / "import_memory.json"
TINYLLAMA = ModelConfig(
    vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632,
    max_seq_len=2048,
)  # fmt: skip
MODES = ("load_gguf", "state_dict")
HEADER = f"{'mode':<11} {'s':>6} {'peak MB':>8} {'base MB':>8} {'model MB':>9} " + (
    f"{'tensor MB':>10} {'over MB':>8}  over <= tensor"
)


def synthetic_vocabulary(size: int) -> SpmTokenizer:
    """An SPM vocabulary of ``size`` pieces laid out as Llama 2's: <unk> <s> </s>, the 256
    byte pieces, then words. Only its size matters here; it spares a download."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL] + [TOKEN_TYPE_BYTE] * 256
    words = size - len(pieces)
    pieces += [f"\u2581w{i}" for i in range(words)]
    types += [TOKEN_TYPE_NORMAL] * words
    return SpmTokenizer(pieces, [0.0] * 259 + [-float(i) for i in range(words)], types)


def build(path: Path) -> None:
    """The random TinyLlama-shaped model, f32 to Q4_K_M through llama.cpp's quantizer."""
    from llamatrain.gguf.quantize import write_quantized_model

    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=generator) * (1.0 if len(shape) == 1 else 0.02)
        for name, shape in tensor_shapes(TINYLLAMA).items()
    }
    write_quantized_model(path, TINYLLAMA, tensors, synthetic_vocabulary(32000), type="q4_k_m")


def peak_rss_bytes() -> int:
    """This process's peak RSS so far: ``VmHWM``, the high-water mark of its own memory map.
    Not ``ru_maxrss``: Linux carries that over an exec from the parent's RSS at the fork, so a
    child started by a parent that built the 4 GB model would report the parent's peak."""
    kilobytes = _status_kb("VmHWM")
    if kilobytes is None:
        raise SystemExit("bench/import_memory.py needs /proc/self/status (Linux)")
    return kilobytes * 1024


def child(mode: str, path: Path) -> dict:
    """One import in this (fresh) process; prints and returns its figures."""
    from llamatrain import api
    from llamatrain.gguf.llama import read_model
    from llamatrain.model import Llama

    base = peak_rss_bytes()
    start = time.perf_counter()
    if mode == "load_gguf":
        model, _ = api.load_gguf(path)
    else:
        model_file = read_model(path)
        model = Llama(model_file.config)
        model.load_state_dict(model_file.tensors, strict=True)
        del model_file
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    result = {
        "mode": mode,
        "seconds": round(seconds, 2),
        "peak_bytes": peak,
        "base_bytes": base,
        "model_bytes": model_bytes,
        "largest_tensor_f32_bytes": largest,
        "over_bytes": peak - base - model_bytes,
        "within_claim": peak - base - model_bytes <= largest,
    }
    print(json.dumps(result))
    return result


def run_child(mode: str, path: Path) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def row_text(row: dict) -> str:
    megabytes = [
        row[key] / MB
        for key in ("peak_bytes", "base_bytes", "model_bytes", "largest_tensor_f32_bytes")
    ]
    peak, base, model, tensor = megabytes
    return (
        f"{row['mode']:<11} {row['seconds']:>6.1f} {peak:>8.0f} {base:>8.0f} {model:>9.0f} "
        f"{tensor:>10.0f} {row['over_bytes'] / MB:>8.0f}  {'yes' if row['within_claim'] else 'NO'}"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the file is kept")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--rebuild", action="store_true", help="make the model file again")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child[0], Path(args.child[1]))

    started = time.time()
    path = args.cache / "tinyllama-shape-q4_k_m.gguf"
    meta = machine_info(torch.device("cpu")) | {"load_avg_start": load_average()}
    if args.rebuild or not path.is_file():
        print(f"building {path} (random weights, f32 -> Q4_K_M by llama.cpp) ...", flush=True)
        build_start = time.time()
        build(path)
        meta["build_seconds"] = round(time.time() - build_start, 1)
    meta["file_bytes"] = path.stat().st_size
    print(f"bench/import_memory.py: {path.name}, {meta['file_bytes'] / MB:.0f} MB on disk")
    print(HEADER)
    rows = []
    for mode in MODES:
        rows.append(run_child(mode, path))
        print(row_text(rows[-1]), flush=True)
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
