"""``bench/decode.py --quick`` runs end to end at a tiny random shape: for each type, llama.cpp
and both of our compute dtypes measured over the same file, every figure finite and positive,
and the markdown table on stdout holding every row. Slow: three files written (Q4_K_M by
llama.cpp's quantizer) and nine worker processes started, about 30 s on two cores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from llama_cpp_files import vocab_dir as vocab_dir

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench" / "decode.py"
TYPES = ("q4_0", "q4_k_m", "q8_0")
SIDES = ("llama.cpp", "ours f32", "ours bf16")


def test_quick_run_puts_both_sides_beside_each_other(tmp_path: Path, vocab_dir: Path) -> None:
    results = tmp_path / "decode.json"
    command = [
        sys.executable, str(BENCH), "--quick", "--sizes", "tiny", "--types", ",".join(TYPES),
        "--threads", "1", "--cache", str(tmp_path / "files"), "--json", str(results),
    ]  # fmt: skip
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(results.read_text())["rows"]
    assert [(r["type"], r["side"]) for r in rows] == [(t, s) for t in TYPES for s in SIDES]
    for row in rows:
        figures = [*row["median"].values(), *row["x"].values()]
        assert all(math.isfinite(v) and v > 0 for v in figures), row
        if row["side"] == "llama.cpp":
            assert all(v == 1.0 for v in row["x"].values()), row
    table = [line for line in done.stdout.splitlines() if line.startswith("| tiny")]
    assert [line.split(" | ")[3] for line in table] == [s for _ in TYPES for s in SIDES]
