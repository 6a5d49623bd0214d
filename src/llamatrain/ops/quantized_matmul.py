"""x·Wᵀ and G·W over a weight's GGUF blocks as stored, on the CPU: no float copy of W.

Why: decoding W's rows to float32 and running a float GEMM (``ops.lora``'s chunks) reads 4
bytes a weight per pass where the blocks are 0.56 (Q4_0) to 1.06 (Q8_0); at batch 1 a decode
step is memory bound, so llama.cpp's integer products over the blocks run several times
faster. These are the same scheme (``ops/kernels/quantized.cpp``, built on first use by
:mod:`llamatrain.ops.kernel_build`):

- :func:`blocks_matmul`, ``y = x·Wᵀ``: x quantized to int8 per 32 values with one float
  scale (llama.cpp's Q8_0 activations; the K types also take 32-value activation blocks,
  finer than llama.cpp's 256-value Q8_K), integer dot products against each block, scaled in
  float. Not the exact product of x with the decoded W: off by x's rounding to 8 bits, as
  llama.cpp's own.
- :func:`blocks_matmul_t`, ``dx = G·W``: W decoded in registers (ggml's float arithmetic),
  G kept float32: the exact product up to float32 summation order (QLoRA's backward).

Types: :data:`KERNEL_TYPES` (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K: the types of Q4_K_M,
Q5_K_M and Q8_0 files); others return None and keep the caller's decode-then-matmul path, as
does everything when the library cannot be built (one warning, :mod:`kernel_build`).

When a product takes the kernels (:func:`kernel_rows`): float32 products at any number of
rows M. Under bf16/f16 autocast, only while M is at most :data:`LOW_PRECISION_MAX_ROWS`:
where the CPU has AMX, PyTorch's bf16 GEMM over decoded chunks overtakes the integer kernel
for larger M (prompt evaluation, training steps); see that constant for the figures.
"""

from __future__ import annotations

import ctypes

import torch

from llamatrain.ops.dtypes import autocast_dtype
from llamatrain.ops.kernel_build import load_kernels

__all__ = [
    "KERNEL_TYPES",
    "LOW_PRECISION_MAX_ROWS",
    "blocks_matmul",
    "blocks_matmul_t",
    "kernel_backward",
    "kernel_forward",
    "kernel_rows",
]

KERNEL_TYPES: dict[str, int] = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5}
"""ggml type -> its id in the C++ library's format table."""

_BLOCK_VALUES = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}

LOW_PRECISION_MAX_ROWS = 16
"""Rows M up to which a bf16/f16 (autocast) product still takes the integer kernel."""


def _functions() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    """The library's two products with their C signatures, or None without the library."""
    library = load_kernels()
    if library is None:
        return None
    signature = [
        ctypes.c_int,  # type id
        ctypes.c_void_p,  # W's blocks
        ctypes.c_int64,  # n: W's rows
        ctypes.c_int64,  # bytes from one row of blocks to the next
        ctypes.c_void_p,  # x (m, k), or gt (n, m)
        ctypes.c_int64,  # m
        ctypes.c_int64,  # k
        ctypes.c_void_p,  # y (m, n), or dx (m, k)
        ctypes.c_int,  # threads
    ]
    products = (library.lt_matmul, library.lt_matmul_t)
    for function in products:
        function.argtypes, function.restype = signature, ctypes.c_int
    return products


_OPERAND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Operands the kernels take (as float32): float64 products (gradchecks) keep the exact path."""


def kernel_rows(
    blocks: torch.Tensor,
    qtype: str | None,
    n_in: int,
    rows: int,
    dtype: torch.dtype = torch.float32,
) -> bool:
    """Whether a product of ``rows`` activation rows of ``dtype`` with these blocks takes the
    kernels: a CPU weight of a kernel type whose rows are whole blocks, inside the row limit
    of the autocast dtype in force, the library loaded."""
    if qtype not in KERNEL_TYPES or blocks.device.type != "cpu" or n_in % _BLOCK_VALUES[qtype]:
        return False
    if dtype not in _OPERAND_DTYPES:
        return False
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.stride(-1) != 1:
        return False
    low = torch.is_autocast_enabled("cpu")
    return (not low or rows <= LOW_PRECISION_MAX_ROWS) and _functions() is not None


def _call(which: int, blocks: torch.Tensor, qtype: str, operand, m: int, k: int, out) -> None:
    functions = _functions()
    assert functions is not None  # kernel_rows said the library is there
    status = functions[which](
        KERNEL_TYPES[qtype],
        blocks.data_ptr(),
        blocks.shape[0],
        blocks.stride(0),
        operand.data_ptr(),
        m,
        k,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status:
        raise ValueError(f"{qtype} kernel: rows of {k} values are not whole blocks")


def blocks_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """``x·Wᵀ`` as float32 (M, out) for x (M, in) and W's ``qtype`` blocks (out, row bytes),
    x quantized to 8 bits per 32 values (module docstring). Call where :func:`kernel_rows`
    says yes."""
    x = x.detach().to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    _call(0, blocks, qtype, x, x.shape[0], x.shape[1], y)
    return y


def blocks_matmul_t(g: torch.Tensor, blocks: torch.Tensor, qtype: str, n_in: int) -> torch.Tensor:
    """``G·W`` as float32 (M, in) for G (M, out) and W's ``qtype`` blocks (out, row bytes),
    W decoded in registers, G unrounded. Call where :func:`kernel_rows` says yes."""
    gt = g.detach().to(torch.float32).t().contiguous()
    dx = torch.zeros(g.shape[0], n_in, dtype=torch.float32)
    _call(1, blocks, qtype, gt, g.shape[0], n_in, dx)
    return dx


def kernel_forward(
    rows: torch.Tensor, blocks: torch.Tensor, qtype: str | None, n_in: int
) -> torch.Tensor | None:
    """``rows·Wᵀ`` by :func:`blocks_matmul` in the dtype the decoded path would give (autocast's
    if on, else the rows'), or None
    where that path is to be taken: no kernel for this product (:func:`kernel_rows`), or an
    input autograd must differentiate (the kernel's result carries no graph)."""
    if torch.is_grad_enabled() and rows.requires_grad:
        return None
    if not kernel_rows(blocks, qtype, n_in, rows.shape[0], rows.dtype):
        return None
    return blocks_matmul(rows, blocks, qtype).to(autocast_dtype("cpu") or rows.dtype)


def kernel_backward(
    g: torch.Tensor, blocks: torch.Tensor, qtype: str | None, n_in: int
) -> torch.Tensor | None:
    """``G·W`` by :func:`blocks_matmul_t` (float32, as the decoded path sums it), or None
    where :func:`kernel_rows` says no."""
    if not kernel_rows(blocks, qtype, n_in, g.shape[0], g.dtype):
        return None
    return blocks_matmul_t(g, blocks, qtype, n_in)
