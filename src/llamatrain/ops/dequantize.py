"""GGUF block dequantization in torch, for a frozen quantized base weight (QLoRA).

A QLoRA matmul keeps the base weight in its GGUF blocks and turns a chunk of rows back into
floats inside every forward and backward. gguf-py's numpy dequantizers are exact but run on
the CPU only and allocate several float copies; these decoders are pure tensor ops, so they
run where the weight lives (CUDA too), vectorised over blocks with no Python loop. Each one
follows ggml's ``dequantize_row_*`` (ggml-quants.c) operation for operation in float32, so
the result is bit-for-bit what gguf-py and llama.cpp compute.

Speed matters as much as exactness: a QLoRA step decodes every base weight twice (forward
and backward), so on a CPU the decoders' time is most of what QLoRA costs over LoRA. Hence
bit fields are split eight bytes at a time (one shift and one mask of an int64 word serve
eight bytes, where a broadcast shift of single bytes is an order of magnitude slower), and
the float math runs in place on the one float32 buffer the quants were widened into.
"""

from collections.abc import Callable

import torch

QK_K = 256  # values per K-quant super-block

Decoder = Callable[[torch.Tensor, torch.Tensor], None]
"""Writes ``(n, type_size)`` uint8 blocks' values into ``out``, float32 ``(n, block_size)``."""

_BYTE_ONES = {torch.int64: 0x0101010101010101, torch.int32: 0x01010101, torch.int16: 0x0101}
"""An integer word with every byte 1: a byte mask times it masks every byte of the word."""


def _whole_words(field: torch.Tensor, size: int) -> bool:
    """Whether the bytes ``field`` can be viewed as ``size``-byte values: its row length,
    storage offset and outer strides (of size-1 dims too) whole words."""
    return all(
        n % size == 0 for n in (field.shape[-1], field.storage_offset(), *field.stride()[:-1])
    )


def _viewed_as(field: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``(n, k·size)`` bytes of every block as ``(n, k)`` ``dtype`` values: a strided view
    of the blocks where their offsets are whole values (every GGUF row of blocks whose size is
    a multiple of ``size``), else a copy. Why a view: copying a few bytes of every block into
    a contiguous tensor was a strided byte copy as slow as the decode around it."""
    aligned = field.stride(-1) == 1 and _whole_words(field, dtype.itemsize)
    return (field if aligned else field.clone(memory_format=torch.contiguous_format)).view(dtype)


def _f16(field: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 fields of every block (``(n, 2k)`` bytes) as float32 ``(n, k)``."""
    return _viewed_as(field, torch.float16).to(torch.float32)


def _word_dtype(packed: torch.Tensor) -> torch.dtype:
    """The widest integer type whose words the (contiguous) bytes ``packed`` can be viewed as."""
    return next((d for d in _BYTE_ONES if _whole_words(packed, d.itemsize)), torch.uint8)


def _split_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpack ``bits``-wide fields: ``(..., k, L)`` bytes -> ``(..., k, 8 // bits, L)``.

    Field ``i`` of a byte is ``(byte >> bits * i) & mask``; ggml packs the ``i``-th field of
    ``L`` consecutive bytes as ``L`` consecutive values, which this layout keeps in order.
    The bytes are shifted as whole words: a word's bits that cross into a neighbouring byte
    (or the sign bits of an arithmetic shift) land above ``bits`` and are masked off.
    """
    packed = packed.contiguous()
    fields = torch.empty(
        *packed.shape[:-1], 8 // bits, packed.shape[-1], dtype=torch.uint8, device=packed.device
    )
    word = _word_dtype(packed)
    words, out = packed.view(word), fields.view(word)
    mask = ((1 << bits) - 1) * _BYTE_ONES.get(word, 1)
    for i, shift in enumerate(range(0, 8, bits)):
        field = out.select(-2, i)
        if shift:
            torch.bitwise_right_shift(words, shift, out=field).bitwise_and_(mask)
        else:
            torch.bitwise_and(words, mask, out=field)
    return fields


def _words(data: torch.Tensor) -> torch.Tensor:
    """Contiguous bytes ``data`` as one run of the widest words they fill (a view), for byte-wise
    operations that cannot carry across bytes (masks, flips, shifts of values kept in range)."""
    flat = data.view(1, -1)
    return flat.view(_word_dtype(flat)).view(-1)


def _low_bits(packed: torch.Tensor) -> torch.Tensor:
    """Bit ``i`` of a little-endian bit field of ``(n, nbytes)`` bytes as value ``i``: bit
    ``k`` of byte ``j`` is value ``8j + k`` (split as the bytes' words, then transposed)."""
    return _split_bits(packed.unsqueeze(1), 1).squeeze(1).transpose(1, 2).flatten(1)


def _block_fields(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """Every ``bits``-wide field of every byte of ``(n, size)`` contiguous blocks, scale bytes
    included: ``(8 // bits, n, size)``. The whole buffer is split as one run of words, where
    splitting only the quant bytes would first copy them out of the blocks: a strided copy of
    16-byte runs (Q4_0's) costs more than the split itself."""
    return _split_bits(blocks.reshape(1, -1), bits).view(8 // bits, *blocks.shape)


def _in_block_order(fields: torch.Tensor, start: int) -> torch.Tensor:
    """A 32-value block's ``(2, n, size)`` nibble fields (:func:`_block_fields`) -> ``(n, 2,
    16)``: the low nibbles of its 16 bytes from ``start`` (values 0-15), then the high ones
    (16-31). A view."""
    return fields[:, :, start:].transpose(0, 1)


def _centred(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-wide quants ``q`` (contiguous uint8) as int8 ``2**(8 - bits) * (q -
    2**(bits - 1))``, in place: ``q``'s top bit flipped makes it the signed ``bits``-wide
    ``q - 2**(bits - 1)``, and shifting it to the top of its byte sign-extends it.

    Why: ggml subtracts the offset from the integer quant before the float product. Done
    here on bytes (two word operations), the caller's only float pass is the product with
    the scale divided by ``2**(8 - bits)``, which is exact (a power of two), so the value is
    the one rounding of ``d * (q - offset)`` that ggml computes, bit for bit.
    """
    words = _words(fields)
    flip = (1 << (bits - 1)) * _BYTE_ONES.get(words.dtype, 1)
    words.bitwise_xor_(flip).bitwise_left_shift_(8 - bits)
    return fields.view(torch.int8)


def _widen_halves(q: torch.Tensor, out: torch.Tensor) -> None:
    """``(n, 2, 16)`` quants (:func:`_in_block_order`) into ``out`` as float32, a half at a
    time: one copy from the transposed view runs ~20% slower than these two."""
    halves = out.view_as(q)
    for half in range(2):
        halves[:, half].copy_(q[:, half])


# The decoders widen the quants into ``out`` (float32, ``(blocks, values per block)``) and
# finish in place on it, in ggml's order: d·q (+ m), one rounding per operation. Widening
# into the caller's buffer rather than a new tensor is the point: a caller decoding chunk
# after chunk (``ops.lora``) reuses one buffer already paged in, where a new 16 MiB tensor
# is fresh pages to fault in and zero: Q8_0's chunks (same arithmetic) decode 1.6-2.6x faster.


def _decode_q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks[:, 2:].view(torch.int8)).mul_(_f16(blocks[:, :2]))


def _decode_q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _widen_halves(_in_block_order(_centred(_block_fields(blocks, 4), 4), 2), out)  # 16(q-8)
    out.mul_(_f16(blocks[:, :2]).div_(16))


def _scale_min(blocks: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_1/Q5_1: ``d * q + m`` with d and m the block's two leading float16 fields, q
    ``(n, 2, 16)``."""
    d_m = _f16(blocks[:, :4])
    _widen_halves(q, out)
    out.mul_(d_m[:, :1]).add_(d_m[:, 1:])


def _decode_q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scale_min(blocks, _in_block_order(_block_fields(blocks, 4), 4), out)


def _five_bit(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0/Q5_1's ``(2, n, size)`` nibble fields (:func:`_block_fields`), each block's fifth bits
    (the 32-bit ``qh`` before byte ``start``) set in place as bit 4 of its 32 values."""
    fields = _block_fields(blocks, 4)
    high = _low_bits(blocks[:, start - 4 : start]).view(-1, 2, 16).bitwise_left_shift_(4)
    _in_block_order(fields, start).bitwise_or_(high)
    return fields


def _decode_q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _widen_halves(_in_block_order(_centred(_five_bit(blocks, 6), 5), 6), out)  # 8(q-16)
    out.mul_(_f16(blocks[:, :2]).div_(8))


def _decode_q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scale_min(blocks, _in_block_order(_five_bit(blocks, 8), 8), out)


def k_scale_words(words: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 8 six-bit scales and 8 six-bit mins, packed in a block's bytes 4-15 (given
    as three int32 words, ``(n, 3)``), as four words ``(n, 4)`` of one value a byte: scales
    0-3, scales 4-7, mins 0-3, mins 4-7 (little-endian).

    Bytes 4-7 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 8-11 the
    same for the mins; bytes 12-15 the low nibbles of scales 4-7 and (high nibble) mins 4-7.
    Masked and shifted a word at a time: a dozen byte-wide operations on 4-byte runs cost a
    third of the whole eager decode. (The compiled Q4_K kernel unpacks them the same way.)
    """
    d, m, low = words.unbind(1)
    six, top, nibble = 0x3F3F3F3F, 0x30303030, 0x0F0F0F0F
    return torch.stack(
        [
            d & six,
            (low & nibble) | ((d >> 2) & top),
            m & six,
            ((low >> 4) & nibble) | ((m >> 2) & top),
        ],
        dim=1,
    )


def _k_scales_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 8 scales and 8 mins (:func:`k_scale_words`) as float32 ``(n, 8)`` each."""
    words = k_scale_words(_viewed_as(blocks[:, 4:16], torch.int32))
    values = words.view(torch.uint8).to(torch.float32)  # (n, 16): 8 scales, then 8 mins
    return values[:, :8], values[:, 8:]


def _affine_k(blocks: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_K/Q5_K: ``d * scale * q - dmin * min`` per 32-value sub-block."""
    scales, mins = _k_scales_mins(blocks)
    d = (_f16(blocks[:, :2]) * scales).unsqueeze(-1)
    dm = (_f16(blocks[:, 2:4]) * mins).unsqueeze(-1)
    out.view(-1, 8, 32).copy_(q.reshape(-1, 8, 32)).mul_(d).sub_(dm)


def _decode_q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _affine_k(blocks, _split_bits(blocks[:, 16:].reshape(-1, 4, 32), 4), out)


def _decode_q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    low = _split_bits(blocks[:, 48:].reshape(-1, 4, 32), 4).reshape(-1, 8, 32)
    high = _split_bits(blocks[:, 16:48].unsqueeze(1), 1).reshape(-1, 8, 32)
    _affine_k(blocks, low.bitwise_or_(high.bitwise_left_shift_(4)), out)


_Q6_K_BITS = (slice(0, 128), slice(128, 192))
"""Q6_K's ``ql`` bytes (four low bits of each quant) and ``qh`` bytes (its two high bits)."""


def _q6_k_quants(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K's 256 six-bit quants per block as int8 ``4 * (q - 32)``, ``(n, 2, 4, 32)``: two
    halves of four 32-value quarters, each value's six bits written straight to the top of
    its byte (no unsigned ``q`` to combine and offset afterwards: ~13% of the decode).

    Of each half's 64 ``ql`` bytes, the low nibbles are quarters 0-1 and the high ones
    quarters 2-3 (bits 2-5 of the result); crumb ``i`` of its 32 ``qh`` bytes is quarter
    ``i``'s top two bits (6-7), its own top bit flipped first: that flip is ``q - 32``
    (:func:`_centred`'s trick), the shift to the top of the byte the factor 4.
    """
    n = blocks.shape[0]
    ones = _BYTE_ONES[torch.int64]
    # copies (a 1-block slice counts as contiguous, at any offset): whole int64 words
    low, high = (
        blocks[:, span].clone(memory_format=torch.contiguous_format) for span in _Q6_K_BITS
    )
    low, high = low.view(torch.int64).view(n, 2, 8), high.view(torch.int64).view(n, 2, 4)
    quants = torch.empty(n, 2, 4, 32, dtype=torch.uint8, device=blocks.device)
    words = quants.view(torch.int64)  # (n, 2, 4, 4)
    nibbles = words.view(n, 2, 2, 8)
    torch.bitwise_and(low, 0x0F * ones, out=nibbles[:, :, 0]).bitwise_left_shift_(2)
    torch.bitwise_right_shift(low, 2, out=nibbles[:, :, 1]).bitwise_and_(0x3C * ones)
    high.bitwise_xor_(0xAA * ones)
    for i in range(4):
        words[:, :, i].bitwise_or_((high << (6 - 2 * i)).bitwise_and_(0xC0 * ones))
    return quants.view(torch.int8)


def _decode_q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    scales = blocks[:, 192:208].view(torch.int8).to(torch.float32)
    d = (_f16(blocks[:, 208:]) * scales).div_(4).unsqueeze(-1)
    out.view(-1, 16, 16).copy_(_q6_k_quants(blocks).view(-1, 16, 16)).mul_(d)


def _decode_q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    packed = blocks[:, :16]
    dl = (_f16(blocks[:, 80:82]) * (packed & 0x0F).to(torch.float32)).unsqueeze(-1)
    ml = (_f16(blocks[:, 82:]) * (packed >> 4).to(torch.float32)).unsqueeze(-1)
    q = _split_bits(blocks[:, 16:80].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)
    out.view(-1, 16, 16).copy_(q).mul_(dl).sub_(ml)


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K's 16 six-bit signed scales from 12 bytes: low nibbles in bytes 0-7, top 2 bits
    in bytes 8-11 (scale ``4 * s + k`` in bits ``2s`` of byte ``8 + k``)."""
    low = _split_bits(packed[:, :8].unsqueeze(1), 4).flatten(1)
    high = _split_bits(packed[:, 8:].unsqueeze(1), 2).flatten(1)
    return ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)


def _decode_q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    dl = (_f16(blocks[:, 108:]) * _q3_k_scales(blocks[:, 96:108])).unsqueeze(-1)
    low = _split_bits(blocks[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, 16, 16)
    # ggml subtracts 4 where the hmask bit is *clear*.
    high = _split_bits(blocks[:, :32].unsqueeze(1), 1).reshape(-1, 16, 16) ^ 1
    q = low.to(torch.int8) - (high << 2).to(torch.int8)
    out.view(-1, 16, 16).copy_(q).mul_(dl)


def _reinterpret(dtype: torch.dtype) -> Decoder:
    """Decoder of an unquantized type: the bytes viewed as ``dtype``, widened to float32."""

    def decode(blocks: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(blocks.contiguous().view(dtype))

    return decode


# name -> (values per block, bytes per block, decoder); sizes as ggml's type_traits.
_FORMATS: dict[str, tuple[int, int, Decoder]] = {
    "F32": (1, 4, _reinterpret(torch.float32)),
    "F16": (1, 2, _reinterpret(torch.float16)),
    "BF16": (1, 2, _reinterpret(torch.bfloat16)),
    "Q8_0": (32, 34, _decode_q8_0),
    "Q4_0": (32, 18, _decode_q4_0),
    "Q4_1": (32, 20, _decode_q4_1),
    "Q5_0": (32, 22, _decode_q5_0),
    "Q5_1": (32, 24, _decode_q5_1),
    "Q2_K": (QK_K, 84, _decode_q2_k),
    "Q3_K": (QK_K, 110, _decode_q3_k),
    "Q4_K": (QK_K, 144, _decode_q4_k),
    "Q5_K": (QK_K, 176, _decode_q5_k),
    "Q6_K": (QK_K, 210, _decode_q6_k),
}

DEQUANTIZABLE: frozenset[str] = frozenset(_FORMATS)

FastDecoder = Callable[
    [torch.Tensor, str, torch.dtype, "torch.Tensor | None"], "torch.Tensor | None"
]
"""Decodes ``(n, type_size)`` blocks of a type straight to ``(n, block values)`` of a dtype (in
the memory of a float32 buffer, if one is given), or returns None to leave them to the
decoders here: ``ops.decode_kernels``' compiled ones."""

_fast_decoder: FastDecoder | None = None


def set_fast_decoder(decoder: FastDecoder | None) -> FastDecoder | None:
    """Install ``decoder`` (None: none) to be tried first by :func:`dequantize`; returns the
    one it replaces, for the caller to put back (``ops.decode_kernels.compiled_decoding``)."""
    global _fast_decoder
    before, _fast_decoder = _fast_decoder, decoder
    return before


def _format(qtype: str) -> tuple[int, int, Decoder]:
    if qtype not in _FORMATS:
        supported = ", ".join(sorted(DEQUANTIZABLE))
        raise ValueError(f"cannot dequantize ggml type {qtype!r}; supported: {supported}")
    return _FORMATS[qtype]


def row_bytes(qtype: str, n_cols: int) -> int:
    """Stored bytes of one row of ``n_cols`` values of ``qtype``."""
    block_size, type_size, _ = _format(qtype)
    if n_cols % block_size:
        raise ValueError(f"{qtype} rows hold whole blocks of {block_size} values, got {n_cols}")
    return n_cols // block_size * type_size


def dequantize(
    blocks: torch.Tensor,
    qtype: str,
    n_cols: int,
    *,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of ``qtype`` blocks (uint8 ``(rows, row_bytes)``) as ``(rows, n_cols)`` ``dtype``.

    Computed in float32 exactly as ggml does and cast last, so a half-precision result is
    the float32 one rounded once. ``out``: a contiguous float32 ``(rows, n_cols)`` tensor to
    decode into (and return, cast to ``dtype``), for a caller that decodes chunk after chunk
    into one buffer; None decodes into a new tensor. An installed fast decoder
    (:func:`set_fast_decoder`) that takes the blocks returns the same values, ``dtype`` in
    ``out``'s memory (its first bytes).
    """
    block_size, type_size, decode = _format(qtype)
    expected = row_bytes(qtype, n_cols)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != expected:
        raise ValueError(
            f"{qtype} rows of {n_cols} values need uint8 (rows, {expected}) bytes, "
            f"got {blocks.dtype} {tuple(blocks.shape)}"
        )
    shape = (blocks.shape[0], n_cols)
    if out is not None and (
        out.dtype != torch.float32 or out.shape != shape or not out.is_contiguous()
    ):
        raise ValueError(
            f"dequantize: out must be a contiguous float32 {shape} tensor, "
            f"got {out.dtype} {tuple(out.shape)}"
        )
    if _fast_decoder is not None:
        values = _fast_decoder(blocks.reshape(-1, type_size), qtype, dtype, out)
        if values is not None:
            return values.view(shape)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=blocks.device)
    decode(blocks.reshape(-1, type_size), out.view(-1, block_size))
    return out.to(dtype)
