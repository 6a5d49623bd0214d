"""The C++ products over GGUF blocks (``ops.quantized_matmul``) against float64 references.

Forward ``y = x·Wᵀ``: the kernel quantizes x to int8 per 32 values (d = amax/127, q =
round-half-even(x·127/amax)) and sums integer products per block, scaled in float32. Two
references, each in float64 over W decoded by the eager decoders (ggml's values, bit for bit):

- ``x̂·Wᵀ`` with x̂ = d·q quantized here exactly as the kernel does: the same product but
  for float32 rounding of the per-block scale products and sums, so the error is bounded by
  a few float32 ulps of the sum of magnitudes: |err| ≤ 1e-5·Σ|w·x̂| (a row of 8192 terms has
  ~256 block terms summed in float32, ~2^-24·256 ≈ 1.5e-5 worst case, far less in practice).
- ``x·Wᵀ``, the exact product: the kernel is off by the activations' 8-bit rounding, at most
  half a step (amax/254) per value, so |err| ≤ Σ_blocks (amax_b/254)·Σ_block |w| — the bound
  is computed per row, not guessed.

Backward ``dx = G·W``: no quantization (W decoded in registers, G float32), so against float64
``G·W`` the error is float32 summation only: |err| ≤ 1e-5·Σ|g·w|.
"""

from __future__ import annotations

import ctypes
import warnings

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from llamatrain.errors import LlamatrainWarning
from llamatrain.ops.dequantize import dequantize
from llamatrain.ops.kernel_build import load_kernels
from llamatrain.ops.lora import lora_linear
from llamatrain.ops.quantized_matmul import (
    KERNEL_TYPES,
    blocks_matmul,
    blocks_matmul_t,
    kernel_rows,
    max_rows,
)

F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
"""Byte offsets of the K types' float16 scale fields (ggml-common.h), which gguf-py cannot
quantize: their blocks are random bytes with these fields set finite."""

ROWS = [1, 3, 8, 17, 65, 256]
"""Activation rows: single rows, part and whole tiles of the kernels' row tiles (4 or 8 rows
with AVX2 / AVX-512), and a training step's sizes."""


def stored(qtype: str, n_out: int, n_in: int, seed: int = 0) -> torch.Tensor:
    """Valid ``qtype`` blocks (n_out, row bytes): gguf's quantizer over normal floats where
    it has one, else random bytes with finite, varied float16 scales (every bit exercised)."""
    rng = np.random.default_rng(seed)
    ggml_type = GGMLQuantizationType[qtype]
    if qtype not in F16_FIELDS:
        values = rng.standard_normal((n_out, n_in)).astype(np.float32)
        return torch.from_numpy(gq.quantize(values, ggml_type).view(np.uint8).copy())
    block_values, block_bytes = GGML_QUANT_SIZES[ggml_type]
    n_blocks = n_out * n_in // block_values
    blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.standard_normal(n_blocks) * np.exp2(rng.integers(-8, 0, n_blocks))
        blocks[:, offset : offset + 2] = scales.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(n_out, -1))


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the kernel quantizes it, float64 x̂ = d·q, and each value's largest rounding
    error (half a step, d/2) — float32 arithmetic as the kernel's."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * scale)
    d = amax / 127
    exact = (q.double() * d.double()).reshape(x.shape)
    return exact, (d.double() / 2).expand_as(blocks).reshape(x.shape)


def shapes(qtype: str) -> list[int]:
    """Widths to test: several blocks, and for the 32-value types one that is not whole
    256-value blocks."""
    return [512] if qtype in F16_FIELDS else [96, 512]


@pytest.fixture(scope="module", autouse=True)
def _library() -> None:
    if load_kernels() is None:
        pytest.fail("the kernel library did not build: a C++ compiler is part of the test setup")


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES))
@pytest.mark.parametrize("m", ROWS)
def test_forward_matches_the_product_with_quantized_activations(qtype: str, m: int) -> None:
    for n_in in shapes(qtype):
        w_blocks = stored(qtype, 43, n_in, seed=m)  # 43: a last panel of 3 of 8 rows
        w = dequantize(w_blocks, qtype, n_in).double()
        x = torch.randn(m, n_in, generator=torch.Generator().manual_seed(m))
        y = blocks_matmul(x, w_blocks, qtype).double()
        x_hat, half_step = quantized_activations(x)
        same = x_hat @ w.t()
        assert (y - same).abs().le(1e-5 * (x_hat.abs() @ w.abs().t()) + 1e-30).all()
        exact = x.double() @ w.t()
        assert (y - exact).abs().le(half_step @ w.abs().t() * 1.001 + 1e-5 * same.abs()).all()


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES))
@pytest.mark.parametrize("m", ROWS)
def test_backward_matches_the_float64_product(qtype: str, m: int) -> None:
    for n_in in shapes(qtype):
        w_blocks = stored(qtype, 300, n_in, seed=m + 1)  # 300 rows: more than one panel
        w = dequantize(w_blocks, qtype, n_in).double()
        g = torch.randn(m, 300, generator=torch.Generator().manual_seed(m))
        dx = blocks_matmul_t(g, w_blocks, qtype, n_in).double()
        bound = 1e-5 * (g.double().abs() @ w.abs())
        assert (dx - g.double() @ w).abs().le(bound).all()


def one_path(path: str, x: torch.Tensor, w_blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """``x·Wᵀ`` by one of lt_matmul's two paths, whatever the rows: ``rows`` (each weight
    row dotted straight from its blocks, rows_dot.h) or ``panels`` (the repacked GEMM)."""
    function = getattr(load_kernels(), f"lt_matmul_{path}")
    y = torch.empty(x.shape[0], w_blocks.shape[0])
    pointers = (w_blocks.data_ptr(), x.data_ptr(), y.data_ptr())
    status = function(
        ctypes.c_int(KERNEL_TYPES[qtype]),
        ctypes.c_void_p(pointers[0]),
        ctypes.c_int64(w_blocks.shape[0]),
        ctypes.c_int64(w_blocks.stride(0)),
        ctypes.c_void_p(pointers[1]),
        ctypes.c_int64(x.shape[0]),
        ctypes.c_int64(x.shape[1]),
        ctypes.c_void_p(pointers[2]),
        ctypes.c_int(1),
    )
    assert status == 0
    return y


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES))
def test_the_direct_rows_and_the_panels_agree(qtype: str) -> None:
    """lt_matmul takes the direct path up to 2-5 rows of x by type (a decoding step's) and
    the GEMM past them: the same integer sums and scale products, summed in another order, so
    the two agree to float32 rounding of Σ|x̂·w| on each side of the threshold (rows 1-5)."""
    n_in = 512
    w_blocks = stored(qtype, 43, n_in, seed=7)
    w = dequantize(w_blocks, qtype, n_in).double()
    x = torch.randn(5, n_in, generator=torch.Generator().manual_seed(7))
    for m in range(1, 6):
        rows, panels = (one_path(path, x[:m], w_blocks, qtype) for path in ("rows", "panels"))
        x_hat, _ = quantized_activations(x[:m])
        bound = 1e-6 * (x_hat.abs() @ w.abs().t())
        assert (rows.double() - panels.double()).abs().le(bound).all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q6_K"])
def test_threads_split_the_work_not_the_values(qtype: str) -> None:
    """Each output is summed by one thread in one order: 1 or 3 threads, the same bits."""
    w_blocks = stored(qtype, 70, 512)
    x, g = torch.randn(9, 512), torch.randn(9, 70)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            results.append(
                (blocks_matmul(x, w_blocks, qtype), blocks_matmul_t(g, w_blocks, qtype, 512))
            )
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_row_slices_of_a_larger_tensor() -> None:
    """A view of some rows (a chunk of a vocabulary table, a mapped file) is read in place."""
    w_blocks = stored("Q4_0", 64, 256)
    x = torch.randn(2, 256)
    part = w_blocks[10:30]
    assert torch.equal(blocks_matmul(x, part, "Q4_0"), blocks_matmul(x, part.clone(), "Q4_0"))


def test_lora_linear_gradients_match_the_decoded_path() -> None:
    """lora_linear over Q4_K blocks, kernel on and off: dx (the kernel's exact backward)
    agrees to float32 rounding; y differs by the activations' 8-bit rounding only."""
    n_in, n_out, rank = 512, 96, 4
    w_blocks = stored("Q4_K", n_out, n_in)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, n_in, generator=gen)
    a, b = torch.randn(rank, n_in, generator=gen) * 0.1, torch.randn(n_out, rank, generator=gen)
    grad = torch.randn(5, n_out, generator=gen)
    results = []
    for chunk_rows in (None, 32):  # None: the kernel; explicit chunks: decode-then-matmul
        xi, ai, bi = (t.clone().requires_grad_() for t in (x, a, b))
        y = lora_linear(xi, w_blocks, ai, bi, 0.5, qtype="Q4_K", chunk_rows=chunk_rows)
        y.backward(grad)
        results.append((y.detach(), xi.grad, ai.grad, bi.grad))
    (y_kernel, *grads_kernel), (y_decoded, *grads_decoded) = results
    assert kernel_rows(w_blocks, "Q4_K", n_in, 5)
    for ours, theirs in zip(grads_kernel[:2], grads_decoded[:2], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * theirs.abs().max())
    scale = y_decoded.abs().max()
    assert (y_kernel - y_decoded).abs().max() < 0.02 * scale


def test_without_a_compiler_one_warning_then_the_decoded_path(monkeypatch, tmp_path) -> None:
    """CXX pointing nowhere and a fresh cache: one warning, and products computed as before."""
    w_blocks = stored("Q8_0", 16, 64)
    x, a, b = torch.randn(3, 64), torch.zeros(2, 64), torch.zeros(16, 2)
    expected = x @ dequantize(w_blocks, "Q8_0", 64).t()
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    load_kernels.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = lora_linear(x, w_blocks, a, b, 1.0, qtype="Q8_0")
            second = lora_linear(x, w_blocks, a, b, 1.0, qtype="Q8_0")
        messages = [w for w in caught if issubclass(w.category, LlamatrainWarning)]
        assert len(messages) == 1 and "C++ compiler" in str(messages[0].message)
        torch.testing.assert_close(first, expected, rtol=1e-6, atol=1e-5)
        assert torch.equal(first, second)
    finally:
        load_kernels.cache_clear()


def test_long_products_keep_the_decoded_path_only_backward() -> None:
    """The float32 forward (an int8 GEMM over repacked blocks) beats decode-then-GEMM at every
    M measured, so it takes any M; the backward's float micro-kernel stops at its limit, past
    which PyTorch's GEMM over decoded chunks is as fast (the module docstring's figures)."""
    w_blocks = stored("Q4_0", 4, 64)
    assert max_rows("forward") is None
    assert kernel_rows(w_blocks, "Q4_0", 64, 1 << 16)
    limit = max_rows("backward")
    assert kernel_rows(w_blocks, "Q4_0", 64, limit, direction="backward")
    assert not kernel_rows(w_blocks, "Q4_0", 64, limit + 1, direction="backward")
    assert not kernel_rows(w_blocks, "Q4_0", 64, 1, torch.float64)  # gradchecks stay exact


def test_switched_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("LLAMATRAIN_KERNELS", "0")
    load_kernels.cache_clear()
    try:
        assert not kernel_rows(stored("Q4_0", 4, 32), "Q4_0", 32, 1)
    finally:
        load_kernels.cache_clear()
