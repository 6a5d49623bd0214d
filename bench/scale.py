"""llamatrain's QLoRA step beside llama.cpp's evaluation of the same tokens, over the same file,
at the shapes people finetune (issue 39): Llama-2-7B, Llama-3.2-1B, Qwen2.5-1.5B.

Why: the issue's target is a QLoRA step over a Q4 file within 3x the time llama.cpp takes to
evaluate the same tokens over the same file (a step is a forward and a backward to the inputs,
~3 forwards of arithmetic), and a peak RSS near the file's size; both only mean something at
real sizes, beside the peer on the same machine in the same run.

Method. For each shape and type, in turns (one command):

* the file: ``tests/real_shapes.py``'s random GGUF of the shape's exact tensors, keys and real
  vocabulary (Q4_0 / Q8_0 as random blocks in seconds; Q4_K_M through llama.cpp's quantizer
  from a random f16 file: minutes), written into ``--work`` and deleted after its rows
  (``--keep`` keeps it); ``write s`` is how long that took;
* ``llama.cpp``: a fresh process opens the file with llama-cpp-python (``n_ctx`` = ``n_batch``
  = ``--tokens``, ``--threads`` threads, memory-mapped as llama.cpp does by default) and
  evaluates the same ``--tokens`` random token ids twice from an empty cache; the second
  evaluation is timed (wall and the process's CPU time): the first pays the page faults.
  Then the same in a second context that keeps every token's logits (``cpp all s``), as
  ``llama-perplexity`` scores text: a training step's forward needs them all (its loss is
  over every token), where a prompt's evaluation multiplies the output matrix for the last
  token only: at a 128k vocabulary that matrix is a fifth of a 1B's weights;
* ``ours``: a fresh process runs ``llamatrain.api.fit`` as a user would: ``model.init_from`` =
  the file, one ``--tokens``-token sequence a step (the packaged sonnets), 2 steps, no
  evaluation, sample, checkpoints or export, trained as each of ``--modes`` says (``MODES``:
  ``qlora``, the default, is ``lora.rank = 8`` over the file's blocks with every other
  setting a user leaves alone: its compute dtype is ``train.dtype = "auto"``'s, bf16 on a CPU
  with AMX, float32 elsewhere (column ``dtype``); ``qlora-f32`` and ``qlora-bf16`` the same
  with the dtype set (bf16: the blocks decoded to bf16, the products on the CPU's bf16 matrix
  units where it has them); ``qlora-f32-eager`` and ``qlora-bf16-eager`` those two with the
  blocks decoded by PyTorch ops (``lora.decode = "eager"``) instead of the compiled kernels
  that ``"auto"`` takes at these sizes; ``lora-bf16`` and ``lora-f32`` the same adapters over
  a base widened to bf16 / float32 (float32 compute); ``full`` the whole model, float32 with
  AdamW); ``Trainer.train_step`` is wrapped to time each step (wall and
  process CPU) and the second step is reported (the first runs allocations and caches once);
  ``to step 1 s`` is the time from the call to the first step (reading the file, building the
  model); ``s/1k tok`` the step's wall time per 1,000 of its tokens. A mode the machine cannot
  hold is refused by llamatrain's own memory plan before it loads: its row gives the
  refusal and the planned peak instead of figures.

Each process's peak RSS is its own ``VmHWM``, so the peaks never mix; both include the pages
of the mapped file they touched. ``x`` columns are ours over llama.cpp's (wall, CPU; ``x
all``: wall over the every-logit evaluation), ``x file`` our peak over the file's size.
``--rounds N`` repeats every row, llama.cpp first in odd rounds and ours first in even ones,
and reports medians. Results: a table and
``bench/results/scale.json``.

Usage: ``python bench/scale.py [--shapes llama-3.2-1b,qwen2.5-1.5b,llama-2-7b]
[--types q4_0,q8_0,q4_k_m] [--modes qlora,qlora-f32,lora-bf16,lora-f32,full] [--tokens 64]
[--threads 2] [--rounds 1] [--work DIR] [--keep] [--json PATH]``. Needs llama-cpp-python and
llama.cpp's vocabulary files (``pytest tests/integration/test_llama_cpp_vocabs.py`` fetches
them once).
The 7B rows need ~8 GB of memory and, for Q4_K_M, ~17 GB of disk (its f16 source); the
``full`` and ``lora-f32`` modes of 1B-8B shapes up to 20 GB (or a refusal); not part of the
test suite.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from import_memory import peak_rss_bytes  # noqa: E402
from llama_cpp_files import CACHE as VOCABULARIES  # noqa: E402
from ops import finish, load_average, machine_info  # noqa: E402
from real_shapes import SHAPES, TYPES, shape_names, stored_bytes, write_real_shape  # noqa: E402

DEFAULT_JSON = HERE / "results" / "scale.json"
DEFAULT_WORK = HERE / ".cache" / "scale"
GB = 1e9
_QLORA = {"lora.rank": 8, "lora.base_dtype": "quantized"}
_F32, _BF16, _EAGER = (
    {"train.dtype": "float32"},
    {"train.dtype": "bfloat16"},
    {"lora.decode": "eager"},
)
MODES: dict[str, dict[str, object]] = {
    "qlora": _QLORA,
    "qlora-f32": _QLORA | _F32,
    "qlora-bf16": _QLORA | _BF16,
    "qlora-f32-eager": _QLORA | _F32 | _EAGER,
    "qlora-bf16-eager": _QLORA | _BF16 | _EAGER,
    "lora-bf16": {"lora.rank": 8, "lora.base_dtype": "bf16"},
    "lora-f32": {"lora.rank": 8, "lora.base_dtype": "f32"},
    "full": {"lora.rank": 0},
}
"""How ``ours`` trains: the settings each ``--modes`` name adds to the run."""
HEADER = (
    f"{'shape':<13} {'type':<6} {'mode':<16} {'dtype':<8} {'file GB':>7} {'write s':>7} "
    f"{'cpp s':>6} "
    f"{'cpp cpu':>7} {'cpp all s':>9} {'ours s':>7} {'ours cpu':>8} {'x wall':>6} {'x cpu':>6} "
    f"{'x all':>5} {'s/1k tok':>8} "
    f"{'peak GB':>7} {'x file':>6} {'cpp GB':>6} {'to step 1 s':>11} {'load':>5}"
)


# ------------------------------------------------------------------------ the child processes


def llama_cpp_eval(spec: dict) -> dict:
    """llama.cpp's evaluation of ``tokens`` random ids over the file, the second one timed:
    first as ``llama-cli`` reads a prompt (the last token's logits only), then, in a second
    context, with every token's logits as ``llama-perplexity`` scores text (and as a training
    step's forward needs them: its loss is over every token)."""
    import llama_cpp

    ids = None
    figures = {}
    for key, logits_all in (("", False), ("all_", True)):
        started = time.perf_counter()
        llm = llama_cpp.Llama(
            spec["path"], n_ctx=spec["tokens"], n_batch=spec["tokens"], n_ubatch=spec["tokens"],
            n_threads=spec["threads"], n_threads_batch=spec["threads"], logits_all=logits_all,
            verbose=False,
        )  # fmt: skip
        load_seconds = time.perf_counter() - started
        ids = ids or np.random.default_rng(0).integers(0, llm.n_vocab(), spec["tokens"]).tolist()
        times = []
        for _ in range(2):
            llm.reset()
            wall, cpu = time.perf_counter(), time.process_time()
            llm.eval(ids)
            times.append((time.perf_counter() - wall, time.process_time() - cpu))
        figures |= {f"{key}seconds": times[-1][0], f"{key}cpu_seconds": times[-1][1]}
        if not logits_all:  # the peak of the plain evaluation, before the logits' table
            figures |= {
                "first_seconds": times[0][0],
                "load_seconds": load_seconds,
                "peak_bytes": peak_rss_bytes(),
            }
        llm.close()
    return figures


def ours_step(spec: dict) -> dict:
    """A two-step ``fit`` over the file as ``spec["mode"]`` trains, each
    ``Trainer.train_step`` timed; the second. A run the memory plan refuses: the refusal."""
    from llamatrain import api
    from llamatrain.data import SONNETS_PATH
    from llamatrain.errors import MemoryBudgetError
    from llamatrain.trainer import Trainer

    steps: list[tuple[float, float, float]] = []  # (start, wall, cpu)
    original = Trainer.train_step

    def timed(self: Trainer, *args: object, **kwargs: object) -> float:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            steps.append((start, time.perf_counter() - start, time.process_time() - cpu))

    Trainer.train_step = timed  # type: ignore[method-assign]
    settings = {
        "model.init_from": spec["path"],
        "data.path": str(SONNETS_PATH),
        "data.n_ctx": spec["tokens"],
        "data.val_fraction": 0.0,
        **MODES[spec["mode"]],
        "train.n_batch": spec["tokens"],
        "train.steps": 2,
        "train.eval_every": 0,
        "train.save_every": 0,
        "train.sample_tokens": 0,
        "output.export": False,
        "output.dir": spec["dir"],
    }
    started = time.perf_counter()
    try:
        result = api.fit(
            None, overrides=[f"{k}={json.dumps(v)}" for k, v in settings.items()], progress=False
        )
    except MemoryBudgetError as e:
        return {"refused": str(e), "planned_peak_bytes": planned_bytes(str(e))}
    return {
        "dtype": result.config.train.dtype,
        "seconds": steps[-1][1],
        "cpu_seconds": steps[-1][2],
        "first_seconds": steps[0][1],
        "to_first_step_seconds": steps[0][0] - started,
        "run_seconds": time.perf_counter() - started,
        "peak_bytes": peak_rss_bytes(),
    }


def planned_bytes(refusal: str) -> float:
    """The peak a memory refusal says the run needs ("this run needs about 19.6 GB (...")."""
    amount, unit = re.search(r"needs about ([\d,.]+) (GB|MB)", refusal).groups()
    return float(amount.replace(",", "")) * (1 << (30 if unit == "GB" else 20))


CHILDREN = {"llama.cpp": llama_cpp_eval, "ours": ours_step}


def run_child(row: str, spec: dict) -> dict:
    """One row in a fresh process (its own peak RSS); its figures from the last stdout line."""
    command = [sys.executable, __file__, "--child", json.dumps(spec | {"row": row})]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode < 0:
        raise SystemExit(f"{row} was killed by signal {-done.returncode} (out of memory?)")
    if done.returncode != 0:
        raise SystemExit(f"{row} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------- the rows


def check_disk(work: Path, shape: str, type_name: str) -> None:
    """Refuse before writing when the file (and Q4_K_M's f16 source) cannot fit on the disk."""
    needed = stored_bytes(shape, type_name)
    if type_name == "q4_k_m":
        needed += stored_bytes(shape, "f16")
    free = shutil.disk_usage(work).free
    if free < needed + 2 * GB:
        raise SystemExit(
            f"{shape} {type_name} needs {needed / GB:.1f} GB; {work} has {free / GB:.1f}"
        )


def measure(shape: str, type_name: str, args: argparse.Namespace) -> list[dict]:
    """Write the file, run llama.cpp and each mode ``--rounds`` times in alternating order,
    delete it; a row per mode."""
    path = args.work / f"{shape}-{type_name}.gguf"
    written = 0.0
    if not path.is_file():
        check_disk(args.work, shape, type_name)
        started = time.perf_counter()
        write_real_shape(path, shape, type_name, VOCABULARIES)
        written = time.perf_counter() - started
    file_bytes = path.stat().st_size
    rows, rounds = ("llama.cpp", *args.modes), []
    try:
        for index in range(args.rounds):
            order = rows if index % 2 == 0 else rows[::-1]
            rounds.append({row: one_row(row, path, args) for row in order})
    finally:
        if not args.keep:
            path.unlink()
    cpp = medians([r["llama.cpp"] for r in rounds])
    load = load_average()
    return [
        summary(shape, type_name, mode, file_bytes, written, cpp, [r[mode] for r in rounds], args)
        | {"load": load}
        for mode in args.modes
    ]


def one_row(row: str, path: Path, args: argparse.Namespace) -> dict:
    spec = {"path": str(path), "tokens": args.tokens, "threads": args.threads, "mode": row}
    with tempfile.TemporaryDirectory(dir=args.work) as run_dir:
        child = "llama.cpp" if row == "llama.cpp" else "ours"
        return run_child(child, spec | {"dir": str(Path(run_dir) / "run")})


def medians(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds (a refusal, the dtype: the first round's, all
    alike)."""
    if "refused" in rounds[0]:
        return rounds[0]
    return {
        key: value if isinstance(value, str) else statistics.median(r[key] for r in rounds)
        for key, value in rounds[0].items()
    }


def summary(
    shape: str, type_name: str, mode: str, file_bytes: int, written: float, cpp: dict,
    rounds: list[dict], args: argparse.Namespace,
) -> dict:  # fmt: skip
    """A mode's medians over rounds; the ratios ours / llama.cpp and peak / file."""
    ours = medians(rounds)
    row = {
        "shape": shape, "type": type_name, "mode": mode, "tokens": args.tokens,
        "file_bytes": file_bytes, "write_seconds": written, "llama_cpp": cpp, "ours": ours,
        "rounds": rounds,
    }  # fmt: skip
    if "refused" in ours:
        return row
    return row | {
        "x_wall": ours["seconds"] / cpp["seconds"],
        "x_cpu": ours["cpu_seconds"] / cpp["cpu_seconds"],
        "x_wall_all_logits": ours["seconds"] / cpp["all_seconds"],
        "x_file": ours["peak_bytes"] / file_bytes,
        "seconds_per_1k_tokens": ours["seconds"] / args.tokens * 1000,
    }


def row_text(row: dict) -> str:
    cpp, ours = row["llama_cpp"], row["ours"]
    start = (
        f"{row['shape']:<13} {row['type']:<6} {row['mode']:<16} {ours.get('dtype', ''):<8} "
        f"{row['file_bytes'] / GB:>7.2f} "
        f"{row['write_seconds']:>7.1f} {cpp['seconds']:>6.2f} {cpp['cpu_seconds']:>7.2f} "
        f"{cpp['all_seconds']:>9.2f} "
    )
    if "refused" in ours:
        return start + f"refused: needs {ours['planned_peak_bytes'] / GB:.1f} GB"
    return start + (
        f"{ours['seconds']:>7.2f} {ours['cpu_seconds']:>8.2f} {row['x_wall']:>6.2f} "
        f"{row['x_cpu']:>6.2f} {row['x_wall_all_logits']:>5.2f} "
        f"{row['seconds_per_1k_tokens']:>8.1f} "
        f"{ours['peak_bytes'] / GB:>7.2f} {row['x_file']:>6.2f} "
        f"{cpp['peak_bytes'] / GB:>6.2f} {ours['to_first_step_seconds']:>11.1f} "
        f"{row['load'][0] if row['load'] else float('nan'):>5.2f}"
    )


def choices(text: str, known: tuple[str, ...] | list[str], what: str) -> list[str]:
    names = text.split(",")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(shape_names()), help="comma-separated")
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated")
    parser.add_argument("--modes", default="qlora", help="comma-separated, of MODES")
    parser.add_argument("--tokens", type=int, default=64, help="tokens evaluated / per step")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each row, alternating")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="where files are written")
    parser.add_argument("--keep", action="store_true", help="keep the model files")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        figures = CHILDREN[spec["row"]](spec)
        print(json.dumps(figures))
        return figures

    shapes = choices(args.shapes, list(SHAPES), "shape")
    types = choices(args.types, TYPES, "type")
    args.modes = choices(args.modes, list(MODES), "mode")
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    meta = machine_info(torch.device("cpu")) | {
        "load_avg_start": load_average(),
        "tokens": args.tokens,
        "llama_cpp_threads": args.threads,
    }
    print(HEADER)
    rows = []
    for shape in shapes:
        for type_name in types:
            for row in measure(shape, type_name, args):
                rows.append(row)
                print(row_text(row), flush=True)
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
