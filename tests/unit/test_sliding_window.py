"""Sliding-window attention (``flash_attn(window=w)``) and attention soft-capping.

The window is llama.cpp's standard SWA: query i sees key j iff ``i - w < j <= i`` (masked iff
``p1 - p0 >= n_swa``). Checked: float64 gradcheck of the blockwise op (alone, with GQA, with
packed documents, end-aligned, with soft-capping); float32 agreement with a dense softmax under
an explicit T×T mask; ``w >= seq_kv`` is exactly the plain op and ``w = 1`` returns V; every
op set's attention paths (flash, softmax, sdpa; ggml and torch) honour the same window and
scale; and, without timing, that kv columns outside every row's window are never multiplied
(the largest tensor any op builds, and the matmul FLOPs counted by ``FlopCounterMode``).
"""

from __future__ import annotations

import pytest
import torch
from test_flash_attn import _inputs  # the same random q, k, v
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from llamatrain.ops.attention import flash_attn
from llamatrain.ops.sets import op_set

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors (conftest)


def _documents(*lengths_per_row: tuple[int, ...]) -> torch.Tensor:
    rows = [
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        for lengths in lengths_per_row
    ]
    return torch.stack(rows)


def _dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    documents: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Explicit (t, t_kv) mask, end-aligned: visible iff i' - window < j <= i', i' = i + off."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    t, s = q.shape[2], k.shape[2]
    rows = torch.arange(t)[:, None] + (s - t)
    cols = torch.arange(s)[None, :]
    visible = cols <= rows
    if window is not None:
        visible = visible & (cols > rows - window)
    if documents is not None:
        visible = visible & (documents[:, :, None] == documents[:, None, :])
        visible = visible[:, None]
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


_DOCS = _documents((3, 6, 1, 3), (1, 9, 3))

# (batch, heads, kv_heads, seq, seq_kv, block, window)
GRADCHECK_CASES = [
    pytest.param(1, 2, 2, 13, 13, 4, 3, id="w3-multiblock"),
    pytest.param(1, 2, 2, 13, 13, 4, 6, id="w6-wider-than-block"),
    pytest.param(1, 4, 2, 11, 11, 3, 1, id="w1-gqa"),
    pytest.param(2, 4, 2, 9, 9, 4, 5, id="w5-gqa-batch"),
    pytest.param(1, 6, 2, 10, 10, 64, 4, id="w4-one-block"),
    pytest.param(1, 4, 2, 5, 11, 2, 4, id="w4-end-aligned-decode"),
    pytest.param(1, 2, 2, 1, 6, 64, 3, id="w3-seq1-kv6"),
    pytest.param(1, 2, 2, 7, 7, 3, 7, id="w-equals-seq"),
]


@pytest.mark.parametrize("b, h, hkv, t, s, block, window", GRADCHECK_CASES)
def test_window_gradcheck(b: int, h: int, hkv: int, t: int, s: int, block: int, window: int):
    q, k, v = _inputs(b, h, hkv, t, s, d=4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn(q, k, v, block_size=block, window=window), (q, k, v)
    )


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("window", [1, 2, 5])
def test_window_with_documents_gradcheck(heads: tuple[int, int], window: int) -> None:
    q, k, v = _inputs(2, *heads, t=13, s=13, d=4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn(q, k, v, block_size=4, documents=_DOCS, window=window),
        (q, k, v),
    )


@pytest.mark.parametrize(
    "window, documents", [(None, None), (3, None), (4, _DOCS)], ids=["plain", "window", "docs"]
)
def test_softcap_gradcheck(window: int | None, documents: torch.Tensor | None) -> None:
    q, k, v = _inputs(2, 4, 2, 13, 13, d=4)
    q = (q.detach() * 3).requires_grad_()  # scores large enough for the cap to bend them
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn(
            q, k, v, block_size=4, documents=documents, window=window, softcap=2.0
        ),
        (q, k, v),
    )


def test_softcap_noncausal_gradcheck() -> None:
    q, k, v = _inputs(1, 4, 2, 7, 9, d=4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn(q, k, v, causal=False, block_size=3, softcap=1.5), (q, k, v)
    )


# float32 against the dense reference: O(1) values, sums over <= 100 keys in another order.
# Measured over these cases and 3 seeds: worst difference 2.2e-6 (outputs and gradients), so
# 1e-5 leaves 4x room (as test_document_mask).
TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize(
    "b, h, hkv, t, s, block, window, docs",
    [
        pytest.param(2, 4, 2, 77, 77, 16, 1, False, id="w1"),
        pytest.param(2, 4, 2, 77, 77, 16, 10, False, id="w10"),
        pytest.param(2, 4, 2, 77, 77, 16, 16, False, id="w-equals-block"),
        pytest.param(2, 4, 2, 77, 77, 16, 40, False, id="w40"),
        pytest.param(1, 6, 2, 40, 100, 16, 25, False, id="end-aligned-gqa"),
        pytest.param(1, 4, 1, 1, 33, 64, 8, False, id="decode"),
        pytest.param(2, 4, 2, 13, 13, 4, 2, True, id="docs-w2"),
        pytest.param(2, 4, 2, 13, 13, 5, 4, True, id="docs-w4-block5"),
        pytest.param(2, 2, 2, 13, 13, 64, 7, True, id="docs-w7-one-block"),
    ],
)
def test_window_matches_dense_mask_float32(
    b: int, h: int, hkv: int, t: int, s: int, block: int, window: int, docs: bool
) -> None:
    q, k, v = _inputs(b, h, hkv, t, s, d=16, dtype=torch.float32, seed=1)
    documents = _DOCS[:b] if docs else None
    out = flash_attn(q, k, v, block_size=block, window=window, documents=documents, scale=0.2)
    ref = _dense(q, k, v, window, documents, scale=0.2)
    torch.testing.assert_close(out, ref, **TOL)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    for name, got, want in zip(
        "qkv",
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(ref, (q, k, v), dout),
        strict=True,
    ):
        torch.testing.assert_close(got, want, **TOL, msg=f"d{name} differs")


def test_softcap_matches_dense_float32() -> None:
    q, k, v = _inputs(2, 4, 2, 50, 50, d=16, dtype=torch.float32, seed=1)
    out = flash_attn(q, k, v, block_size=16, window=12, softcap=1.5)
    ref = _dense(q, k, v, 12, softcap=1.5)
    torch.testing.assert_close(out, ref, **TOL)
    for got, want in zip(
        torch.autograd.grad(out.square().sum(), (q, k, v)),
        torch.autograd.grad(ref.square().sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("window", [23, 24, 1000])
def test_window_at_least_seq_kv_is_the_plain_op(window: int) -> None:
    """w >= seq_kv hides nothing causality does not: bit-identical to no window."""
    q, k, v = _inputs(1, 4, 2, 20, 23, d=8, dtype=torch.float32)
    out = flash_attn(q, k, v, block_size=8, window=window)
    plain = flash_attn(q, k, v, block_size=8)
    assert torch.equal(out, plain)
    for a, b in zip(
        torch.autograd.grad(out.sum(), (q, k, v)),
        torch.autograd.grad(plain.sum(), (q, k, v)),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_window_1_sees_only_itself() -> None:
    q, k, v = _inputs(2, 4, 2, 30, 30, d=8, dtype=torch.float32)
    out = flash_attn(q, k, v, block_size=7, window=1)
    torch.testing.assert_close(out, v.repeat_interleave(2, dim=1), atol=1e-6, rtol=0)


def test_window_block_size_does_not_change_result() -> None:
    q, k, v = _inputs(2, 4, 2, 45, 45, d=8, dtype=torch.float32)
    outs = []
    for block in (1, 4, 9, 16, 64):
        out = flash_attn(q, k, v, block_size=block, window=9)
        outs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("ops", ["ggml", "torch"])
@pytest.mark.parametrize("attend", ["flash", "softmax", "sdpa"])
@pytest.mark.parametrize("docs", [False, True], ids=["plain", "docs"])
def test_every_attention_path_honours_window_and_scale(ops: str, attend: str, docs: bool) -> None:
    q, k, v = _inputs(2, 4, 2, 13, 13, d=8, dtype=torch.float32, seed=4)
    documents = _DOCS if docs else None
    out = op_set(ops, attend).attention(q, k, v, documents, window=4, scale=0.3)
    ref = _dense(q, k, v, 4, documents, scale=0.3)
    torch.testing.assert_close(out, ref, **TOL)
    for got, want in zip(
        torch.autograd.grad(out.sum(), (q, k, v)),
        torch.autograd.grad(ref.sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("ops", ["ggml", "torch"])
@pytest.mark.parametrize("attend", ["flash", "softmax", "sdpa"])
def test_attention_path_end_aligned_window(ops: str, attend: str) -> None:
    q, k, v = _inputs(1, 4, 2, 5, 12, d=8, dtype=torch.float32, seed=5)
    out = op_set(ops, attend).attention(q, k, v, None, window=3)
    torch.testing.assert_close(out, _dense(q, k, v, 3), **TOL)


# --- kv columns outside the window are skipped, not masked ---------------------------------


class _LargestMatmul(TorchDispatchMode):
    """Records the largest tensor any matmul produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
            self.largest = max(self.largest, result.numel())
        return result


def _forward_tile_columns(t: int, block: int, window: int) -> int:
    """Σ over query blocks of the kv columns the window lets the block see (seq_kv == seq)."""
    return sum(min(i0 + block, t) - max(0, i0 - window + 1) for i0 in range(0, t, block))


def test_blocks_outside_window_are_not_computed() -> None:
    b, h, hkv, t, d, block, window = 1, 4, 2, 256, 8, 16, 24
    q, k, v = _inputs(b, h, hkv, t, t, d=d, dtype=torch.float32)
    grad = torch.randn(b, h, t, d)
    # The largest product is one block's score tile: block + window - 1 columns, not up to t.
    with _LargestMatmul() as mode:
        out = flash_attn(q, k, v, block_size=block, window=window)
        torch.autograd.grad(out, (q, k, v), grad)
    assert mode.largest == b * h * block * (block + window - 1)

    def flops(fn) -> tuple[int, int]:
        with FlopCounterMode(display=False) as fwd:
            o = fn()
        with FlopCounterMode(display=False) as bwd:
            torch.autograd.grad(o, (q, k, v), grad)
        return fwd.get_total_flops(), bwd.get_total_flops()

    win_fwd, win_bwd = flops(lambda: flash_attn(q, k, v, block_size=block, window=window))
    full_fwd, full_bwd = flops(lambda: flash_attn(q, k, v, block_size=block))
    # Forward: S = Q·Kᵀ and P·V over exactly the window's columns, 2·(2·h·rows·cols·d) each.
    assert win_fwd == 4 * b * h * block * d * _forward_tile_columns(t, block, window)
    # Causal without a window multiplies ~t/2 columns per row; with w = 24 about 39: < 1/3.
    assert win_fwd * 3 < full_fwd and win_bwd * 3 < full_bwd


def test_window_saves_nothing_more() -> None:
    q, k, v = _inputs(1, 4, 2, 64, 64, d=8, dtype=torch.float32)
    sizes: list[list[int]] = []
    for window in (None, 5):
        saved: list[int] = []

        def pack(x: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(x.numel())
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            flash_attn(q, k, v, block_size=16, window=window)
        sizes.append(saved)
    assert sizes[0] == sizes[1]


# --- validation -------------------------------------------------------------------------------


def test_window_and_softcap_validation() -> None:
    q = torch.zeros(1, 2, 4, 8)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            flash_attn(q, q, q, window=bad)
    with pytest.raises(ValueError, match="causal"):
        flash_attn(q, q, q, causal=False, window=2)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            flash_attn(q, q, q, softcap=bad)
