"""Attention of a decoding step (``ops.attention_inference``): PyTorch's fused kernel under
``flash_attn``'s mask gives the blockwise walk's result, for every mask rule a decoder uses
(end-aligned causality, left and interior padding, the sliding window, grouped kv heads).

Tolerance: both are float32 softmaxes over the same visible keys, summed in another order:
1e-5 absolute on outputs of magnitude ~1 (measured ~5e-7); a key seen by one and hidden by the
other moves an output by ~1e-1."""

from __future__ import annotations

import pytest
import torch

from llamatrain.ops.attention import flash_attn
from llamatrain.ops.attention_inference import MAX_MASK_VALUES, takes_fused

TOL = 1e-5


def _inputs(batch: int, rows: int, keys: int, heads: int = 6, kv_heads: int = 2):
    g = torch.Generator().manual_seed(rows * 100 + keys)
    q = torch.randn(batch, heads, rows, 16, generator=g)
    k = torch.randn(batch, kv_heads, keys, 16, generator=g)
    v = torch.randn(batch, kv_heads, keys, 16, generator=g)
    padding = torch.rand(batch, keys, generator=g) < 0.3  # left and interior holes alike
    return q, k, v, padding


def _blockwise(q, k, v, **kwargs) -> torch.Tensor:
    """``flash_attn`` forced onto its blockwise walk: q asks for a gradient."""
    out = flash_attn(q.clone().requires_grad_(), k, v, **kwargs)
    return out.detach()


@pytest.mark.parametrize("rows, keys", [(1, 2), (1, 40), (3, 40), (16, 17), (5, 130)])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("padded", [False, True])
def test_the_fused_path_gives_the_blockwise_result(rows, keys, window, padded) -> None:
    q, k, v, padding = _inputs(2, rows, keys)
    kwargs = dict(window=window, padding=padding if padded else None, block_size=4)
    with torch.no_grad():
        assert takes_fused(q, k, v, plain=True)
        fused = flash_attn(q, k, v, **kwargs)
    torch.testing.assert_close(fused, _blockwise(q, k, v, **kwargs), atol=TOL, rtol=0)


def test_bf16_is_computed_in_float32_as_the_blockwise_path_does() -> None:
    q, k, v, padding = _inputs(1, 2, 33)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    with torch.no_grad():
        fused = flash_attn(q, k, v, padding=padding)
    assert fused.dtype == torch.bfloat16
    # one bf16 step (2^-7 at magnitudes below 2): float32 sums in another order may round
    # either side of a bf16 value
    torch.testing.assert_close(fused, _blockwise(q, k, v, padding=padding), atol=2**-7, rtol=0)


def test_training_whole_sequences_and_large_masks_keep_the_blockwise_walk() -> None:
    q, k, v, _ = _inputs(1, 4, 8)
    assert not takes_fused(q, k[:, :, :4], v[:, :, :4], plain=True)  # no cache: as trained
    assert not takes_fused(q.requires_grad_(), k, v, plain=True)
    assert not takes_fused(q.detach(), k, v, plain=False)  # documents or soft-cap
    wide = torch.empty(1, 1, 1, MAX_MASK_VALUES + 1)
    assert not takes_fused(torch.empty(1, 1, 1, 1), wide.transpose(2, 3), wide, plain=True)
