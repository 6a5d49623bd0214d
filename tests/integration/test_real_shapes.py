"""The random real-shape GGUFs of ``tests/real_shapes.py`` are what they stand in for.

Each shape and type is written, timed, read back by llamatrain (header: the real model's
architecture and stored types) and evaluated by llama.cpp; at the two small shapes llamatrain's
whole import (``load_gguf``) gives llama.cpp's logits. Every load runs in a child process
under an address-space cap (``RLIMIT_AS``) sized to what it should need, so a memory regression
fails the test instead of taking the shared machine down; the files are deleted as each test
ends. Slow: about 3 minutes with the 7B files (3.8 and 7.2 GB on disk, one at a time).
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from llama_cpp_files import vocab_dir as vocab_dir
from real_shapes import SHAPES, stored_bytes, write_real_shape

from llamatrain.gguf.llama import read_model
from llamatrain.model_config import tensor_shapes

pytestmark = pytest.mark.slow

GiB = 1 << 30
DIRECT = ("q4_0", "q8_0")
"""Types written as random blocks (fast); Q4_K_M goes through llama.cpp's quantizer."""
ISSUE_SHAPES = ("llama-3.2-1b", "qwen2.5-1.5b", "llama-2-7b")
"""The shapes issue 39 asks to be proven (the 3B and 8B ones are the bench's)."""
CASES = [(shape, type_name) for shape in ISSUE_SHAPES for type_name in DIRECT]
CASES.append(("llama-3.2-1b", "q4_k_m"))
SMALL = ("llama-3.2-1b", "qwen2.5-1.5b")
SECONDS_PER_GB = 15.0
"""Writing random blocks is bound by the disk: ~3-4 s a GB on the 2-core machine, shared."""
FIELDS = (
    "arch", "vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "hidden_dim", "max_seq_len",
    "rope_theta", "rope_freq_factors", "tie_embeddings", "qkv_bias",
)  # fmt: skip
"""The config fields the file must give back exactly (norm_eps is stored as float32)."""
TEXT = "The quick brown fox jumps over the lazy dog, again and again."

LLAMA_CPP = """
import json, sys, numpy as np, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=64, n_threads=1, logits_all=True, type_k=0, type_v=0,
                      flash_attn=False, verbose=False)
ids = llm.tokenize(sys.argv[2].encode())
llm.eval(ids)
np.save(sys.argv[3], np.array(llm.scores[: len(ids)], dtype=np.float64))
print(json.dumps(ids))
"""
"""llama.cpp's logits of the text's tokens, saved as .npy; prints the token ids."""
OURS = """
import json, sys, numpy as np, torch
from llamatrain.api import load_gguf
model, _ = load_gguf(sys.argv[1])
with torch.no_grad():
    logits = model(torch.tensor([json.loads(sys.argv[2])]))
np.save(sys.argv[3], logits[0].double().numpy())
"""
"""llamatrain's logits of the given token ids after ``load_gguf``, saved as .npy."""


def run_capped(script: str, args: list[str], cap_bytes: int) -> str:
    """Run ``script`` in a fresh Python whose address space is capped at ``cap_bytes``; its
    stdout, or the test fails with its stderr (a MemoryError past the cap among others)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))

    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, preexec_fn=cap
    )
    assert done.returncode == 0, f"cap {cap_bytes / GiB:.1f} GiB:\n{done.stderr[-3000:]}"
    return done.stdout


def written(tmp_path: Path, vocab_dir: Path, shape: str, type_name: str) -> Path:
    """The shape written as the type, timed against the disk-bound budget (direct types)."""
    started = time.perf_counter()
    path = write_real_shape(tmp_path / f"{shape}-{type_name}.gguf", shape, type_name, vocab_dir)
    seconds = time.perf_counter() - started
    if type_name in DIRECT:
        assert seconds < 10 + SECONDS_PER_GB * path.stat().st_size / 1e9, seconds
    return path


def llama_cpp_logits(path: Path, out: Path) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits of ``TEXT`` and its ids, capped at twice the file (it maps the file
    and may repack Q4_0 blocks into a copy of its own) plus 2 GiB."""
    cap = 2 * path.stat().st_size + 2 * GiB
    ids = json.loads(run_capped(LLAMA_CPP, [str(path), TEXT, str(out)], cap))
    return np.load(out), ids


@pytest.mark.parametrize(("shape", "type_name"), CASES)
def test_a_real_shape_reads_as_the_model_and_runs_in_llama_cpp(
    tmp_path: Path, vocab_dir: Path, shape: str, type_name: str
) -> None:
    path = written(tmp_path, vocab_dir, shape, type_name)
    expected = SHAPES[shape].config
    read = read_model(path, tensor_data=False)
    got = read.config
    assert {f: getattr(got, f) for f in FIELDS} == {f: getattr(expected, f) for f in FIELDS}
    assert got.norm_eps == pytest.approx(expected.norm_eps)
    matrices = {read.contents.tensor_types[n] for n, t in read.tensors.items() if t.dim() == 2}
    assert matrices == ({type_name.upper()} if type_name in DIRECT else {"Q4_K", "Q6_K"})
    if type_name in DIRECT:
        assert path.stat().st_size == pytest.approx(stored_bytes(shape, type_name), rel=0.02)
    logits, _ = llama_cpp_logits(path, tmp_path / "cpp.npy")
    assert np.isfinite(logits).all()
    assert 0.3 < logits.std() < 3.0  # the scales keep activations near unit size


@pytest.mark.parametrize("shape", SMALL)
def test_llamatrain_reads_the_weights_as_llama_cpp_does(
    tmp_path: Path, vocab_dir: Path, shape: str
) -> None:
    path = written(tmp_path, vocab_dir, shape, "q4_0")
    theirs, ids = llama_cpp_logits(path, tmp_path / "cpp.npy")
    n_params = sum(math.prod(dims) for dims in tensor_shapes(SHAPES[shape].config).values())
    cap = 4 * n_params + 4 * GiB  # the float32 model, Python, torch and its thread arenas
    run_capped(OURS, [str(path), json.dumps(ids), str(tmp_path / "ours.npy")], cap)
    ours = np.load(tmp_path / "ours.npy")
    # llama.cpp multiplies Q4_0 blocks by activations rounded to Q8_0: measured 0.15% of the
    # largest logit apart at both shapes (correlation 0.999996)
    assert np.abs(ours - theirs).max() < 0.01 * np.abs(theirs).max()
    assert np.corrcoef(ours.ravel(), theirs.ravel())[0, 1] > 0.9999
