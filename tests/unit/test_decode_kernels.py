"""The compiled GGUF decoders (``llamatrain.ops.decode_kernels``).

* each kernel (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; float32 and bf16 out) gives the eager decoder's
  values bit for bit — and so gguf-py's, which ``test_dequantize`` holds the eager ones to — on
  real blocks (gguf-py's quantization of random rows, where it has a quantizer) and on blocks
  of every byte value with scales of both signs, tiny and large (for the K-quants, their
  packed six-bit and int8 sub-block scales random bytes too);
* ``"auto"`` compiles only chunks of real size and only on the CPU; ``"eager"`` never;
* a machine where inductor cannot build decodes eagerly after one warning, the same values,
  for the rest of the process;
* the scope puts back what was installed before.

Each kernel compiles in seconds the first time (inductor caches it on disk for later runs).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from llamatrain.errors import LlamatrainWarning
from llamatrain.ops import decode_kernels
from llamatrain.ops.decode_kernels import KERNEL_TYPES, compiled_decoding
from llamatrain.ops.dequantize import _format, dequantize, set_fast_decoder

ROWS, COLS = 48, 256
SCALE_BYTES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}
"""Where each type's float16 fields lie in its block."""


def real_blocks(qtype: str) -> torch.Tensor:
    """gguf-py's quantization of random rows, (ROWS, row bytes) uint8 (Q8_0, Q4_0, Q4_1: it
    has no K-quant quantizer)."""
    values = np.random.default_rng(0).normal(0, 0.02, (ROWS, COLS)).astype(np.float32)
    blocks = gguf_quants.quantize(values, GGMLQuantizationType[qtype])
    return torch.from_numpy(blocks)


def every_byte_blocks(qtype: str) -> torch.Tensor:
    """Blocks of random bytes (every quant value) whose float16 fields are finite, of both
    signs, from subnormal (2^-24) to 2^14."""
    block_size, type_size, _ = _format(qtype)
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (ROWS, COLS // block_size, type_size), generator=generator)
    blocks = blocks.to(torch.uint8)
    for offset in SCALE_BYTES[qtype]:
        exponent_and_sign = torch.randint(0, 0x78, blocks.shape[:2], generator=generator)
        blocks[:, :, offset + 1] = exponent_and_sign.to(torch.uint8) | (blocks[:, :, 0] & 0x80)
    return blocks.reshape(ROWS, -1)


class Calls:
    """Counts the compiled kernels' calls (each wrapped before it is compiled)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        monkeypatch.setattr(decode_kernels, "_compiled", {})  # compiled again, counted
        for qtype, (arguments, kernel, shape) in list(decode_kernels._KERNELS.items()):
            counted = (arguments, self._counted(kernel), shape)
            monkeypatch.setitem(decode_kernels._KERNELS, qtype, counted)

    def _counted(self, kernel):
        def counted(*args):
            self.count += 1  # runs while dynamo traces, and again on each call
            return kernel(*args)

        return counted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES))
def test_a_compiled_decode_is_the_eager_one_bit_for_bit(qtype: str, dtype: torch.dtype) -> None:
    """Into a new tensor, and into the memory of a caller's float32 buffer (chunk after chunk
    into one buffer, as ``ops.lora`` decodes)."""
    kinds = (every_byte_blocks,) if qtype.endswith("_K") else (real_blocks, every_byte_blocks)
    for blocks in (kind(qtype) for kind in kinds):
        want = dequantize(blocks, qtype, COLS, dtype=dtype)
        buffer = torch.empty(ROWS, COLS)
        with warnings.catch_warnings():
            warnings.simplefilter("error", LlamatrainWarning)  # no fallback to eager
            with compiled_decoding("compiled", "cpu"):
                new = dequantize(blocks, qtype, COLS, dtype=dtype)
                into = dequantize(blocks, qtype, COLS, dtype=dtype, out=buffer)
        for got in (new, into):
            assert got.dtype == dtype and got.shape == (ROWS, COLS)
            assert torch.equal(got, want)
        assert into.data_ptr() == buffer.data_ptr()


@pytest.mark.parametrize("qtype", sorted(KERNEL_TYPES))
def test_blocks_at_an_odd_byte_offset_decode_the_same(qtype: str) -> None:
    """The scales are views of the blocks where their offsets allow (every GGUF row); blocks
    starting at an odd byte take copies of them instead, to the same values."""
    blocks = every_byte_blocks(qtype)
    shifted = torch.zeros(blocks.numel() + 1, dtype=torch.uint8)
    shifted[1:] = blocks.reshape(-1)
    odd = shifted[1:].view(blocks.shape)
    want = dequantize(blocks, qtype, COLS)
    with warnings.catch_warnings(), compiled_decoding("compiled", "cpu"):
        warnings.simplefilter("error", LlamatrainWarning)  # no fallback to eager
        assert torch.equal(dequantize(odd, qtype, COLS), want)


def test_auto_compiles_real_sizes_on_the_cpu_only(monkeypatch) -> None:
    calls = Calls(monkeypatch)
    blocks = real_blocks("Q8_0")
    want = dequantize(blocks, "Q8_0", COLS)
    for mode, device in (("auto", "cpu"), ("eager", "cpu"), ("auto", "cuda")):
        with compiled_decoding(mode, device):
            assert torch.equal(dequantize(blocks, "Q8_0", COLS), want)
    assert calls.count == 0  # 12,288 values: below AUTO_MIN_VALUES
    monkeypatch.setattr(decode_kernels, "AUTO_MIN_VALUES", ROWS * COLS)
    with compiled_decoding("auto", "cpu"):
        assert torch.equal(dequantize(blocks, "Q8_0", COLS), want)
        assert torch.equal(dequantize(blocks[:4], "Q8_0", COLS), want[:4])  # too small again
    assert calls.count >= 1
    with compiled_decoding("eager", "cpu"):
        before = calls.count
        dequantize(blocks, "Q8_0", COLS)
        assert calls.count == before


def test_without_a_compiler_it_decodes_eagerly_after_one_warning(monkeypatch) -> None:
    def no_compiler(function, **_):
        def fails(*args):
            raise RuntimeError("Compiler: cc is not found.\nmore detail")

        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(decode_kernels, "_compiled", {})
    monkeypatch.setattr(decode_kernels, "_failed", [])  # this process's state, put back after
    blocks = real_blocks("Q4_0")
    want = dequantize(blocks, "Q4_0", COLS, dtype=torch.bfloat16)
    with compiled_decoding("compiled", "cpu"):
        said = r"unavailable here \(RuntimeError: Compiler: cc is not found\.\); decoding with"
        with pytest.warns(LlamatrainWarning, match=said):
            assert torch.equal(dequantize(blocks, "Q4_0", COLS, dtype=torch.bfloat16), want)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the kernels stay off
            assert torch.equal(dequantize(blocks, "Q4_0", COLS, dtype=torch.bfloat16), want)
    with compiled_decoding("compiled", "cpu"), warnings.catch_warnings():
        warnings.simplefilter("error")  # and off for the next run in this process
        assert torch.equal(dequantize(blocks, "Q4_0", COLS, dtype=torch.bfloat16), want)


def installed():
    decoder = set_fast_decoder(None)
    set_fast_decoder(decoder)
    return decoder


def test_the_scope_puts_back_what_it_found() -> None:
    def mine(blocks, qtype, dtype):
        return None

    set_fast_decoder(mine)
    try:
        with compiled_decoding("compiled", "cpu"):
            assert installed() not in (None, mine)
        assert installed() is mine
    finally:
        set_fast_decoder(None)
    with (
        pytest.raises(ValueError, match="decode mode must be one of"),
        compiled_decoding("fast", "cpu"),
    ):
        pass
