"""GGUF blocks decoded in one compiled pass per chunk (``torch.compile``), for QLoRA at real sizes.

Why: the eager decoders (:mod:`llamatrain.ops.dequantize`) are several PyTorch ops over every
chunk of a frozen weight (bit fields split, widened, scaled, cast), each a pass through memory,
several times the cost of the bf16 product of a 64-token step. A QLoRA step decodes every base
weight twice (forward and backward), so decoding was over half of a 64-token step at
Llama-3.2-1B's shape. Inductor turns the per-value work into one loop that reads the bytes once
and writes the values once, in the compute dtype: a 2048 x 8192 Q4_0 matrix's chunks in 13 ms
of CPU where the eager decoders take 31 (float32; bf16 14 against 32; ``bench/dequantize.py``).

Same values, bit for bit: each kernel is its eager decoder's arithmetic, in ggml's order (the
integer quant, then ``d·q`` and ``+ m``, each rounded to float32), cast once at the end; the
blocks' fields (float16 scales, Q4_K's packed six-bit scales as int32 words) come in as
strided views of the blocks and are unpacked and widened inside, so a chunk is one pass over
its bytes. Q4_K and Q6_K (a Q4_K_M file's types) decode 3-4x faster than eagerly (2048 x 8192,
CPU ms: 12.9 against 37.1, 9.9 against 42.3; a first version that unpacked their sub-block
scales with eager ops first measured no faster than the eager decoders). Formats without a
kernel here (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, floats) decode eagerly.

When (:func:`compiled_decoding`, entered by ``api.fit`` from ``lora.decode``): "compiled"
always; "auto" on the CPU, for chunks of at least :data:`AUTO_MIN_VALUES` values — real sizes,
where a compile of a few seconds per format (cached on disk by inductor across runs) is repaid
within a step; "eager" never. A machine where inductor cannot build (no C++ compiler) decodes
eagerly after one warning.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch

from llamatrain.errors import LlamatrainWarning
from llamatrain.ops.dequantize import (
    FastDecoder,
    _format,
    _viewed_as,
    k_scale_words,
    set_fast_decoder,
)

__all__ = ["AUTO_MIN_VALUES", "DECODE_MODES", "KERNEL_TYPES", "compiled_decoding"]

DECODE_MODES = ("auto", "compiled", "eager")

AUTO_MIN_VALUES = 1 << 20
"""Values a chunk needs for ``"auto"`` to decode it compiled: a 1024-wide weight's 1024 rows.
Below that a model is small enough that its eager decoding is cheap next to a compile."""

Kernel = Callable[..., None]


# Each kernel writes its values into ``out``, of the kernel's own shape, in ``out``'s dtype:
# a caller decoding chunk after chunk (``ops.lora``) reuses one buffer, where a new tensor a
# chunk made a 7B's step churn through 16 MiB blocks (float32, 64 tokens: a peak of 8.3 GB
# and 4.4x llama.cpp's time, against 6.3 GB and 2.9x writing into the buffer).


def _q8_0(out: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> None:
    """``out`` (n, 32)."""
    out.copy_(q.to(torch.float32) * d.to(torch.float32))


def _fields(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The ``bits``-wide fields of every byte, field ``i`` (bits ``bits·i`` up) as index ``i``
    of a new dimension ``dim`` (negative), as int32.

    Written as a broadcast shift, not a stack of shifted copies: inductor then makes the
    decode one loop over the values, whose inner run is a row of bytes, vectorized (a stack
    is materialized first, and a flat index into repeated bytes defeats vectorization)."""
    shape = [1] * (packed.dim() + 1)
    shape[dim] = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device).view(shape)
    return (packed.to(torch.int32).unsqueeze(dim) >> shifts) & ((1 << bits) - 1)


def _q4_0(out: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> None:
    """``out`` (n, 2, 16): the low nibbles are values 0-15."""
    out.copy_((_fields(qs, 4, -2) - 8).to(torch.float32) * d.to(torch.float32).unsqueeze(-1))


def _q4_1(out: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
    """``out`` (n, 2, 16), as Q4_0's."""
    q = _fields(qs, 4, -2).to(torch.float32)
    d, m = d.to(torch.float32), m.to(torch.float32)
    out.copy_(q * d.unsqueeze(-1) + m.unsqueeze(-1))


def _q4_k(
    out: torch.Tensor, qs: torch.Tensor, words: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor
) -> None:
    """``out`` (n, 4, 2, 32): of each 32 ``qs`` bytes, the low nibbles are sub-block ``2j``
    and the high ones ``2j + 1``; sub-block ``i``'s values are ``d·scale_i·q − dmin·min_i``
    (ggml's ``d1 = d·sc``, ``m1 = min·m``, each rounded to float32, then ``d1·q − m1``).
    ``words``: the block's bytes 4-15 as three int32, its six-bit scales and mins, unpacked by
    the eager decoder's :func:`llamatrain.ops.dequantize.k_scale_words`."""
    packed = k_scale_words(words)  # (n, 4) words: scales 0-3, 4-7, mins 0-3, 4-7, a byte each
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=words.device)
    fields = ((packed.unsqueeze(-1) >> shifts) & 0xFF).reshape(-1, 2, 4, 2).to(torch.float32)
    scale = (d.to(torch.float32).view(-1, 1, 1) * fields[:, 0]).unsqueeze(-1)
    low_end = (dmin.to(torch.float32).view(-1, 1, 1) * fields[:, 1]).unsqueeze(-1)
    out.copy_(_fields(qs, 4, -2).to(torch.float32) * scale - low_end)


def _q6_k(
    out: torch.Tensor, ql: torch.Tensor, qh: torch.Tensor, scales: torch.Tensor, d: torch.Tensor
) -> None:
    """``out`` (n, 2, 4, 2, 16): two halves of four 32-value quarters, each quarter two runs
    of 16 with a scale each. Quarter ``k`` of a half: the low nibbles (``k`` < 2) or high ones
    of its ``ql`` bytes ``32·(k mod 2)`` on, with crumb ``k`` of its 32 ``qh`` bytes as bits
    4-5; ``(d·scale)·(q − 32)`` as ggml orders it."""
    low = _fields(ql, 4, -3).reshape(-1, 2, 4, 32)  # (n, half, nibble, k mod 2, 32) as k
    q = ((low | (_fields(qh, 2, -2) << 4)) - 32).to(torch.float32).view(-1, 2, 4, 2, 16)
    out.copy_((d.to(torch.float32).view(-1, 1, 1, 1) * scales.to(torch.float32)).unsqueeze(-1) * q)


def _f16_scale(blocks: torch.Tensor, start: int = 0) -> torch.Tensor:
    """The float16 scale at byte ``start`` of every block, ``(n, 1)``, a view of the blocks
    (widened to float32 inside the kernel, exactly)."""
    return _viewed_as(blocks[:, start : start + 2], torch.float16)


def _args_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return blocks[:, 2:].view(torch.int8), _f16_scale(blocks)


def _args_q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return blocks[:, 2:], _f16_scale(blocks)


def _args_q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return blocks[:, 4:], _f16_scale(blocks), _f16_scale(blocks, 2)


def _args_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    words = _viewed_as(blocks[:, 4:16], torch.int32)
    return blocks[:, 16:].view(-1, 4, 32), words, _f16_scale(blocks), _f16_scale(blocks, 2)


def _args_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scales = blocks[:, 192:208].view(torch.int8).view(-1, 2, 4, 2)
    ql, qh = blocks[:, :128].view(-1, 2, 2, 32), blocks[:, 128:192].view(-1, 2, 32)
    return ql, qh, scales, _f16_scale(blocks, 208)


_KERNELS: dict[
    str, tuple[Callable[[torch.Tensor], tuple[torch.Tensor, ...]], Kernel, tuple[int, ...]]
] = {
    "Q8_0": (_args_q8_0, _q8_0, (32,)),
    "Q4_0": (_args_q4_0, _q4_0, (2, 16)),
    "Q4_1": (_args_q4_1, _q4_1, (2, 16)),
    "Q4_K": (_args_q4_k, _q4_k, (4, 2, 32)),
    "Q6_K": (_args_q6_k, _q6_k, (2, 4, 2, 16)),
}
"""ggml type -> (its blocks' arguments for the kernel, views of the blocks; the kernel; the
shape its ``out`` gives a block's values)."""

KERNEL_TYPES: frozenset[str] = frozenset(_KERNELS)


_compiled: dict[str, Kernel] = {}
"""The kernels compiled so far in this process (by ggml type), shared by every run in it."""

_failed: list[str] = []
"""Why compiling failed, once it has: the kernels stay off for the rest of the process."""


def _compiled_kernel(qtype: str) -> Kernel:
    if qtype not in _compiled:
        _compiled[qtype] = torch.compile(_KERNELS[qtype][1], dynamic=True)
    return _compiled[qtype]


def _decoder(min_values: int) -> FastDecoder:
    """The fast decoder :func:`compiled_decoding` installs: the compiled kernels for chunks of
    at least ``min_values`` values."""

    def decode(
        blocks: torch.Tensor, qtype: str, dtype: torch.dtype, out: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``(n, type_size)`` blocks as ``(n, block values)`` ``dtype`` (in ``out``'s memory,
        if given), or None where this chunk is left to the eager decoder (no kernel, too
        small, or no compiler)."""
        block_size, _, _ = _format(qtype)
        n_values = blocks.shape[0] * block_size
        if _failed or qtype not in _KERNELS or n_values < min_values:
            return None
        arguments, _, block_shape = _KERNELS[qtype]
        values = _buffer(out, n_values, dtype, blocks.device)
        # autocast off: it changes nothing here, but dynamo compiles a kernel once for each
        # autocast state it is called under (a bf16 run's projections and its lm head)
        try:
            with torch.autocast(blocks.device.type, enabled=False):
                _compiled_kernel(qtype)(values.view(-1, *block_shape), *arguments(blocks))
        except Exception as e:  # inductor's errors have no common base: a missing compiler,
            _failed.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            warnings.warn(  # a failed build, a backend error
                f"the compiled GGUF decoders are unavailable here ({_failed[0]}); decoding "
                'with PyTorch ops, slower; lora.decode = "eager" skips the attempt',
                LlamatrainWarning,
                stacklevel=3,
            )
            return None
        return values.view(blocks.shape[0], block_size)

    return decode


def _buffer(
    out: torch.Tensor | None, n_values: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``n_values`` of ``dtype``: the first bytes of ``out`` (contiguous float32), or a new
    tensor where there is no ``out`` or it is too small (float64)."""
    if out is None or dtype.itemsize > out.element_size():
        return torch.empty(n_values, dtype=dtype, device=device)
    return out.view(-1).view(torch.uint8)[: n_values * dtype.itemsize].view(dtype)


@contextlib.contextmanager
def compiled_decoding(mode: str, device: torch.device | str) -> Iterator[None]:
    """Within it, :func:`llamatrain.ops.dequantize.dequantize` decodes the formats of
    :data:`KERNEL_TYPES` with the compiled kernels as ``mode`` says (see the module
    docstring); the decoders in place before are put back after."""
    if mode not in DECODE_MODES:
        raise ValueError(f"decode mode must be one of {DECODE_MODES}, got {mode!r}")
    on_cpu = torch.device(device).type == "cpu"
    if mode == "eager" or (mode == "auto" and not on_cpu):
        yield
        return
    before = set_fast_decoder(_decoder(0 if mode == "compiled" else AUTO_MIN_VALUES))
    try:
        yield
    finally:
        set_fast_decoder(before)
