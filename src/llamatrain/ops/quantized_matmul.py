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
  llama.cpp's own. A GEMM, as llama.cpp's prompt processing: W's rows repacked eight at a time
  so that one integer instruction gives eight rows' partial sums, a tile of 4 (AVX2) or 8
  (AVX-512) rows of x sharing each load. Up to 2-5 rows of x (decoding; by type) each weight
  row is dotted straight from its blocks instead (``kernels/rows_dot.h``): the repack costs
  more than it saves with few x rows to share it.
- :func:`blocks_matmul_t`, ``dx = G·W``: W decoded a panel at a time (ggml's float
  arithmetic), G kept float32, a register-tiled float micro-kernel over each panel: the exact
  product up to float32 summation order (QLoRA's backward).

Types: :data:`KERNEL_TYPES` (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K: the types of Q4_K_M,
Q5_K_M and Q8_0 files; Q5_0 and Q5_1, which llama.cpp's quantizer puts in a Q4_K_M/Q5_K_M
file where rows are no multiple of 256, as SmolLM2-135M's 576); others return None and keep
the caller's decode-then-matmul path, as does everything when the library cannot be built
(one warning, :mod:`kernel_build`).

When a product takes the kernels (:func:`kernel_rows`): while its rows M (tokens) are at most
:func:`max_rows`, which depends on the dtype. Measured single-thread CPU times
(``bench/kernel_rows.py``: ``time.thread_time``, 2048 x 8192 and 8192 x 2048 matrices, Q4_0
and Q4_K; the decoded path with the compiled decoders, ``ops.decode_kernels``, as QLoRA runs
it) on a shared Sapphire Rapids core (AVX-512, VNNI, AMX; load 5.7-7.2 on 2 cores), kernel
time / decoded time, float32::

                M=1        M=8        M=16       M=32       M=64       M=128      M=256
    forward     0.12-0.19  0.12-0.20  0.18-0.25  0.21-0.28  0.30-0.35  0.39-0.44  0.53-0.59
    backward    0.43-0.53  0.33-0.40  0.36-0.45  0.46-0.54  0.58-0.64  0.64-0.70  0.94-1.03

the AVX2 build (maddubs, no VNNI) against AVX2 GEMMs (this CPU limited to them:
``LLAMATRAIN_KERNEL_ARCH=-march=haswell``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``,
``ONEDNN_MAX_CPU_ISA=AVX2``)::

    forward     0.10-0.19  0.16-0.21  0.21-0.26  0.28-0.32  0.38-0.41  0.47-0.52  0.58-0.63
    backward    0.46-0.67  0.37-0.53  0.41-0.54  0.53-0.68  0.64-0.81  0.84-0.95  1.04-1.11
    (aligned)                                               0.64-0.82  0.77-0.88  0.92-1.04

(the last row, Q4_0 and Q6_K at load 1.1: after the kernels' buffers were aligned to cache
lines, ``kernels/aligned.h``, which halved the backward's panel decode; the figures above it
predate that). The AVX2 build again, after the panel was decoded block by block down its
rows, the next panel's rows prefetched (``kernels/quantized.cpp``'s ``decode_blocks``), and
the AVX2 forward's int16 sums kept in registers (they had been spilled to the stack), Q4_0,
Q4_K and Q6_K, both shapes, load ~0.9, PyTorch's own kernels held to AVX2 too
(``ATEN_CPU_CAPABILITY=avx2``)::

                M=1        M=8        M=16       M=32       M=64       M=128      M=256
    forward     0.07-0.12  0.17-0.26  0.22-0.30  0.28-0.31  0.33-0.37  0.38-0.46  0.41-0.55
    backward    0.29-0.50  0.32-0.53  0.34-0.58  0.44-0.64  0.60-0.72  0.71-0.77  0.88-0.93

(the forward row after Q6_K's panels lost their sign instructions, load 0.2; before it, Q6_K
gave the upper ends: 0.54 at 64 rows, 0.84 at 256)

and the backward at 256 and 512 rows in both builds (Q4_0, Q4_K, Q6_K, Q8_0)::

                M=256      M=512
    AVX2        0.88-0.97  1.01-1.11
    AVX-512     0.84-0.99  1.03-1.21

and under bf16 autocast, where the decoded path's GEMM runs on AMX tiles (M=8..64)::

    forward     0.25-0.41  0.31-0.53  0.44-0.62  0.66-0.88
    backward    0.61-0.70  0.75-0.83  0.94-0.98  1.18-1.37

The decoded times at small M swing most with the machine's load (a Q4_0 forward at M=1: 10-21
ms decoded, 2.4-4.4 ms in the kernel; an earlier, less loaded run gave M=1 0.18-0.30). So the
float32 forward takes the kernels at any M (a 256-token step's forward ~1.7x faster than
decoding, and no float32 copy of W at all), the float32 backward up to M=256 (past that
PyTorch's GEMM over decoded chunks is faster: its decode paid once per 16 MiB chunk, its GEMM
tuned), and bf16 on AMX the forward up to 64 and the backward up to 16
(:data:`AMX_BF16_MAX_ROWS`). Where bf16 is emulated (no AMX) its GEMM is slower than the
kernels at every M (AVX2: a Q4_0 backward of 64 rows 4.8 s decoded in bf16, 0.17 s in the
kernel), so there bf16 takes the kernels at any M.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from llamatrain.ops.dtypes import autocast_dtype
from llamatrain.ops.kernel_build import load_kernels

__all__ = [
    "KERNEL_TYPES",
    "max_rows",
    "blocks_matmul",
    "blocks_matmul_t",
    "kernel_backward",
    "kernel_forward",
    "kernel_rows",
]

KERNEL_TYPES: dict[str, int] = {
    "Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q5_K": 4, "Q6_K": 5, "Q5_0": 6, "Q5_1": 7,
}  # fmt: skip
"""ggml type -> its id in the C++ library's format table."""

_BLOCK_VALUES = {qtype: 256 if qtype.endswith("_K") else 32 for qtype in KERNEL_TYPES}

MAX_ROWS: dict[str, int | None] = {"forward": None, "backward": 256}
"""Rows M up to which a float32 product takes the kernels, None: any (the module docstring's
figures)."""
AMX_BF16_MAX_ROWS: dict[str, int | None] = {"forward": 64, "backward": 16}
"""The same under bf16/f16 autocast on a CPU whose bf16 GEMM runs on AMX tiles."""


def max_rows(direction: str) -> int | None:
    """The most rows M for which a ``"forward"`` (x·Wᵀ) or ``"backward"`` (G·W) product takes
    the kernels under the autocast state in force; None: any M (bf16 emulated, no AMX)."""
    if not torch.is_autocast_enabled("cpu"):
        return MAX_ROWS[direction]
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return AMX_BF16_MAX_ROWS[direction] if amx and amx() else None


_PRODUCTS = ("lt_matmul", "lt_matmul_t", "lt_matmul_rows", "lt_matmul_panels")
"""The library's products: x·Wᵀ, G·W, and x·Wᵀ by each of lt_matmul's two paths."""


@functools.cache
def _signed(library: ctypes.CDLL) -> dict[str, ctypes._CFuncPtr]:
    """The library's products with their C signatures (set once per library loaded)."""
    signature = [
        ctypes.c_int,  # type id
        ctypes.c_void_p,  # W's blocks
        ctypes.c_int64,  # n: W's rows
        ctypes.c_int64,  # bytes from one row of blocks to the next
        ctypes.c_void_p,  # x (m, k), or G (m, n)
        ctypes.c_int64,  # m
        ctypes.c_int64,  # k
        ctypes.c_void_p,  # y (m, n), or dx (m, k)
        ctypes.c_int,  # threads
    ]
    products = {name: getattr(library, name) for name in _PRODUCTS}
    for function in products.values():
        function.argtypes, function.restype = signature, ctypes.c_int
    return products


def _functions() -> dict[str, ctypes._CFuncPtr] | None:
    """The library's products by name, or None without the library."""
    library = load_kernels()
    return None if library is None else _signed(library)


_OPERAND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Operands the kernels take (as float32): float64 products (gradchecks) keep the exact path."""


def kernel_rows(
    blocks: torch.Tensor,
    qtype: str | None,
    n_in: int,
    rows: int,
    dtype: torch.dtype = torch.float32,
    direction: str = "forward",
) -> bool:
    """Whether a ``direction`` product of ``rows`` activation rows of ``dtype`` with these
    blocks takes the kernels: a CPU weight of a kernel type whose rows are whole blocks,
    ``rows`` within :func:`max_rows`, the library loaded."""
    if qtype not in KERNEL_TYPES or blocks.device.type != "cpu" or n_in % _BLOCK_VALUES[qtype]:
        return False
    if dtype not in _OPERAND_DTYPES:
        return False
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.stride(-1) != 1:
        return False
    limit = max_rows(direction)
    return (limit is None or rows <= limit) and _functions() is not None


def _call(which: str, blocks: torch.Tensor, qtype: str, operand, m: int, k: int, out) -> None:
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


def blocks_matmul(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, path: str = "auto"
) -> torch.Tensor:
    """``x·Wᵀ`` as float32 (M, out) for x (M, in) and W's ``qtype`` blocks (out, row bytes),
    x quantized to 8 bits per 32 values (module docstring). Call where :func:`kernel_rows`
    says yes. ``path``: ``"auto"`` the faster for M and the type; ``"rows"`` (each weight row
    dotted straight from its blocks) or ``"panels"`` (the repacked GEMM) whatever M is, for
    benches (``bench/kernel_rows.py --direct``) that set the threshold between them."""
    x = x.detach().to(torch.float32).contiguous()
    y = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    which = "lt_matmul" if path == "auto" else f"lt_matmul_{path}"
    _call(which, blocks, qtype, x, x.shape[0], x.shape[1], y)
    return y


def blocks_matmul_t(g: torch.Tensor, blocks: torch.Tensor, qtype: str, n_in: int) -> torch.Tensor:
    """``G·W`` as float32 (M, in) for G (M, out) and W's ``qtype`` blocks (out, row bytes),
    W decoded a panel at a time, G unrounded. Call where :func:`kernel_rows` says yes."""
    g = g.detach().to(torch.float32).contiguous()
    dx = torch.empty(g.shape[0], n_in, dtype=torch.float32)
    _call("lt_matmul_t", blocks, qtype, g, g.shape[0], n_in, dx)
    return dx


def kernel_forward(
    rows: torch.Tensor, blocks: torch.Tensor, qtype: str | None, n_in: int
) -> torch.Tensor | None:
    """``rows·Wᵀ`` by :func:`blocks_matmul` in the dtype the decoded path would give (autocast's
    if on, else the rows'), or None where that path is to be taken: no kernel for this product
    (:func:`kernel_rows`), or an input autograd must differentiate (the kernel's result carries
    no graph)."""
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
    if not kernel_rows(blocks, qtype, n_in, g.shape[0], g.dtype, "backward"):
        return None
    return blocks_matmul_t(g, blocks, qtype, n_in)
