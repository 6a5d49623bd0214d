"""GGUF block dequantization in torch (``ops.dequantize``) against gguf-py's numpy decoders.

gguf-py's dequantizers follow ggml's ``dequantize_row_*`` in float32, so ours must match them
bit for bit: every comparison is exact (``torch.equal``), no tolerance. Types gguf-py can
quantize get blocks quantized from random floats; for the K-quants (which it only decodes)
the blocks are random bytes with finite float16 scale fields, which exercises every bit of
every quant and scale field.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from llamatrain.ops.dequantize import DEQUANTIZABLE, _viewed_as, dequantize, row_bytes

QUANTIZED_BY_GGUF = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
# Byte offsets of each K-quant block's float16 scale fields (ggml-common.h block_q*_K).
K_QUANT_F16_FIELDS = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
SHAPES = [(1, 256), (7, 512), (33, 768)]


def random_f16_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` finite float16 values of varied sign and magnitude, as ``(n, 2)`` bytes."""
    values = rng.standard_normal(n) * np.exp2(rng.integers(-10, 6, n))
    return values.astype(np.float16).view(np.uint8).reshape(n, 2)


def stored_rows(qtype: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Valid stored bytes, ``(rows, row_bytes)`` uint8, of a ``shape`` tensor of ``qtype``."""
    rng = np.random.default_rng(seed)
    ggml_type = GGMLQuantizationType[qtype]
    if qtype in QUANTIZED_BY_GGUF:
        values = rng.standard_normal(shape).astype(np.float32)
        return gq.quantize(values, ggml_type).view(np.uint8).reshape(shape[0], -1)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_blocks = shape[0] * shape[1] // block_size
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in K_QUANT_F16_FIELDS[qtype]:
        blocks[:, offset : offset + 2] = random_f16_bytes(rng, n_blocks)
    return blocks.reshape(shape[0], -1)


def reference(stored: np.ndarray, qtype: str) -> torch.Tensor:
    out = gq.dequantize(stored, GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def test_every_required_type_is_supported() -> None:
    required = {"Q8_0", "Q4_0", "Q4_K", "Q6_K"}
    assert required <= DEQUANTIZABLE
    assert set(QUANTIZED_BY_GGUF) | set(K_QUANT_F16_FIELDS) == DEQUANTIZABLE


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("qtype", sorted(DEQUANTIZABLE))
def test_matches_gguf_py_bit_for_bit(qtype: str, shape: tuple[int, int]) -> None:
    stored = stored_rows(qtype, shape)
    ours = dequantize(torch.from_numpy(stored), qtype, shape[1])
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert torch.equal(ours, reference(stored, qtype))


@pytest.mark.parametrize("qtype", sorted(DEQUANTIZABLE))
def test_row_sliced_view(qtype: str) -> None:
    """A chunk of rows of a bigger matrix (a view with a storage offset) decodes alone."""
    stored = stored_rows(qtype, (16, 512), seed=1)
    chunk = torch.from_numpy(stored)[5:11]
    assert torch.equal(dequantize(chunk, qtype, 512), reference(stored[5:11], qtype))
    every_other = torch.from_numpy(stored)[::2]  # not contiguous: rows stride two rows
    assert torch.equal(dequantize(every_other, qtype, 512), reference(stored[::2], qtype))


@pytest.mark.parametrize("qtype", sorted(DEQUANTIZABLE - {"F32", "F16", "BF16"}))
def test_blocks_at_an_odd_byte_offset(qtype: str) -> None:
    """Blocks starting at an odd byte (no float16 view of their scales is possible) decode to
    the same values through a copy of the scales. (GGUF aligns its data, so only a caller's
    own bytes can be odd; a float table's rows are whole values.)"""
    stored = stored_rows(qtype, (4, 512), seed=3)
    shifted = torch.zeros(stored.size + 1, dtype=torch.uint8)
    shifted[1:] = torch.from_numpy(stored.reshape(-1))
    odd = shifted[1:].view(stored.shape)
    assert odd.storage_offset() == 1
    assert torch.equal(dequantize(odd, qtype, 512), reference(stored, qtype))


def test_float16_scales_are_read_in_place() -> None:
    """Blocks of an even size at an even offset (every GGUF row) give their float16 scales as
    a strided view of the bytes: copying them out was a strided byte copy as slow as the
    decode."""
    blocks = torch.from_numpy(stored_rows("Q4_0", (8, 512))).view(-1, 18)[3:]
    scales = _viewed_as(blocks[:, :2], torch.float16)
    assert scales.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr()
    assert torch.equal(scales, blocks[:, :2].contiguous().view(torch.float16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_half_output_is_the_float32_result_rounded(qtype: str, dtype: torch.dtype) -> None:
    stored = torch.from_numpy(stored_rows(qtype, (4, 512), seed=2))
    half = dequantize(stored, qtype, 512, dtype=dtype)
    assert half.dtype == dtype
    assert torch.equal(half, dequantize(stored, qtype, 512).to(dtype))


@pytest.mark.parametrize("qtype", sorted(DEQUANTIZABLE))
def test_row_bytes_matches_ggml_sizes(qtype: str) -> None:
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert row_bytes(qtype, 4 * 256) == 4 * 256 // block_size * type_size


def test_row_bytes_rejects_partial_blocks() -> None:
    with pytest.raises(ValueError, match="whole blocks of 256"):
        row_bytes("Q4_K", 300)


def test_unsupported_type_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="supported: .*Q4_K"):
        dequantize(torch.zeros(1, 66, dtype=torch.uint8), "IQ2_XXS", 256)


def test_wrong_byte_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"need uint8 \(rows, 144\)"):
        dequantize(torch.zeros(2, 143, dtype=torch.uint8), "Q4_K", 256)


@pytest.mark.parametrize("qtype", sorted(DEQUANTIZABLE))
def test_decoding_into_a_reused_buffer(qtype: str) -> None:
    """``out=``: the values land in the caller's buffer (returned as it is), and a second
    decode into the same buffer overwrites every value of the first."""
    first, second = (stored_rows(qtype, (4, 512), seed=seed) for seed in (3, 4))
    buffer = torch.full((4, 512), float("nan"))
    for stored in (first, second):
        got = dequantize(torch.from_numpy(stored), qtype, 512, out=buffer)
        assert got is buffer and torch.equal(buffer, reference(stored, qtype))


@pytest.mark.parametrize("n_blocks", [1, 3, 5])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_odd_block_counts_split_as_narrower_words(qtype: str, n_blocks: int) -> None:
    """A buffer of 1, 3 or 5 blocks of 18-24 bytes is no whole number of int64 words: the
    bit fields are then split as int32/int16/byte words, to the same values."""
    stored = stored_rows(qtype, (1, 32 * n_blocks), seed=n_blocks)
    assert torch.equal(
        dequantize(torch.from_numpy(stored), qtype, 32 * n_blocks), reference(stored, qtype)
    )


@pytest.mark.parametrize(
    "out",
    [
        torch.empty(4, 512, dtype=torch.float64),
        torch.empty(4, 256),
        torch.empty(512, 4).t(),
    ],
    ids=["float64", "wrong-shape", "not-contiguous"],
)
def test_an_unusable_out_buffer_is_refused(out: torch.Tensor) -> None:
    stored = torch.from_numpy(stored_rows("Q4_0", (4, 512)))
    with pytest.raises(ValueError, match=r"out must be a contiguous float32 \(4, 512\)"):
        dequantize(stored, "Q4_0", 512, out=out)
