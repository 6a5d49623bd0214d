"""Tests for ``llamatrain.ops.attention.flash_attn``.

The explicit blockwise path is checked three ways: float64 gradcheck (its hand-written
backward is the true derivative), float32 agreement with ``F.scaled_dot_product_attention``
(it is the attention everyone else computes), and memory accounting that does not depend on
timing (autograd keeps only q, k, v, out and the log-sum-exp, and no op ever produces a
seq×seq_kv tensor per head).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from llamatrain.ops.attention import BLOCK_SIZE, flash_attn

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors (conftest)


def _inputs(
    b: int,
    h: int,
    hkv: int,
    t: int,
    s: int,
    d: int,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(b, hkv, s, d, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(b, hkv, s, d, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


def assert_same_attention(
    out: torch.Tensor, ref: torch.Tensor, qkv: tuple[torch.Tensor, ...], tol: float = 1e-5
) -> None:
    """``out`` equals ``ref`` and so do their gradients w.r.t. ``qkv`` under one random output
    gradient, within ``tol`` (absolute and relative)."""
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, qkv, dout)
    for got, want in zip(grads, torch.autograd.grad(ref, qkv, dout), strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None
) -> torch.Tensor:
    """SDPA with K/V expanded to every query head and an explicit end-aligned causal mask."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    t, s = q.shape[2], k.shape[2]
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# (batch, heads, kv_heads, seq, seq_kv, causal, block_size)
GRADCHECK_CASES = [
    pytest.param(2, 2, 2, 7, 7, True, BLOCK_SIZE, id="odd-seq-7"),
    pytest.param(1, 2, 2, 13, 13, True, 4, id="odd-seq-13-multiblock"),
    pytest.param(2, 2, 2, 1, 1, True, BLOCK_SIZE, id="seq-1"),
    pytest.param(1, 2, 2, 1, 6, True, BLOCK_SIZE, id="decode-seq1-kv6"),
    pytest.param(1, 4, 2, 5, 11, True, 2, id="end-aligned-gqa-multiblock"),
    pytest.param(1, 4, 2, 8, 8, True, 3, id="gqa-4-2"),
    pytest.param(1, 6, 2, 7, 7, True, 3, id="gqa-6-2"),
    pytest.param(2, 4, 1, 6, 6, True, 4, id="gqa-4-1"),
    pytest.param(1, 4, 2, 7, 9, False, 3, id="noncausal-kv-longer"),
    pytest.param(1, 2, 2, 9, 5, False, 4, id="noncausal-kv-shorter"),
    pytest.param(1, 2, 2, 10, 10, False, BLOCK_SIZE, id="noncausal"),
]


@pytest.mark.parametrize("b, h, hkv, t, s, causal, block", GRADCHECK_CASES)
def test_gradcheck(b: int, h: int, hkv: int, t: int, s: int, causal: bool, block: int) -> None:
    q, k, v = _inputs(b, h, hkv, t, s, d=4)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn(q, k, v, causal=causal, block_size=block), (q, k, v)
    )


def test_default_block_size_is_the_module_constant() -> None:
    """A plain call uses BLOCK_SIZE; a sequence longer than one block runs several blocks,
    and the result does not depend on the block size beyond rounding."""
    q, k, v = _inputs(1, 4, 2, 2 * BLOCK_SIZE + 3, 2 * BLOCK_SIZE + 3, d=4)
    plain = flash_attn(q, k, v, scale=0.3)
    assert torch.equal(plain, flash_attn(q, k, v, scale=0.3, block_size=BLOCK_SIZE))
    torch.testing.assert_close(plain, flash_attn(q, k, v, scale=0.3, block_size=7))


# float32 against SDPA. Measured over these cases (3 seeds): worst |ours − SDPA| is 9.5e-7 for
# the output and 2.4e-6 for the gradients, and each of the two is as far from a float64
# reference as the other. The tolerances leave 4-5x headroom.
FWD_ATOL, GRAD_ATOL, RTOL = 5e-6, 1e-5, 1e-5


@pytest.mark.parametrize(
    "b, h, hkv, t, s, causal, block",
    [
        pytest.param(2, 4, 4, 128, 128, True, BLOCK_SIZE, id="t128"),
        pytest.param(2, 4, 2, 77, 77, True, 16, id="gqa-odd-multiblock"),
        pytest.param(1, 6, 2, 40, 100, True, 16, id="end-aligned-gqa"),
        pytest.param(1, 4, 1, 1, 33, True, BLOCK_SIZE, id="decode"),
        pytest.param(2, 4, 2, 50, 70, False, 16, id="noncausal"),
    ],
)
def test_matches_sdpa_float32(
    b: int, h: int, hkv: int, t: int, s: int, causal: bool, block: int
) -> None:
    q, k, v = _inputs(b, h, hkv, t, s, d=32, dtype=torch.float32, seed=1)
    grad = torch.randn(b, h, t, 32, generator=torch.Generator().manual_seed(2))
    out = flash_attn(q, k, v, causal=causal, block_size=block)
    ref = _reference(q, k, v, causal)
    torch.testing.assert_close(out, ref, atol=FWD_ATOL, rtol=RTOL)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for name, g, w in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(g, w, atol=GRAD_ATOL, rtol=RTOL, msg=f"d{name} differs")


def test_explicit_scale_and_default_scale() -> None:
    q, k, v = _inputs(1, 2, 2, 9, 9, d=16, dtype=torch.float32)
    torch.testing.assert_close(
        flash_attn(q, k, v, scale=0.05),
        _reference(q, k, v, True, scale=0.05),
        atol=FWD_ATOL,
        rtol=RTOL,
    )
    torch.testing.assert_close(
        flash_attn(q, k, v), flash_attn(q, k, v, scale=1 / math.sqrt(16)), atol=0, rtol=0
    )


def test_block_size_does_not_change_result() -> None:
    q, k, v = _inputs(2, 4, 2, 23, 30, d=8, dtype=torch.float32)
    outs = []
    for block in (1, 5, 23, 64):
        out = flash_attn(q, k, v, block_size=block)
        outs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            torch.testing.assert_close(a, b, atol=GRAD_ATOL, rtol=RTOL)


def test_noncontiguous_inputs() -> None:
    """Projections are usually viewed (B, T, H, D) and transposed; that must just work."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 20, 4, 8, generator=gen).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 20, 2, 8, generator=gen).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 20, 2, 8, generator=gen).transpose(1, 2).requires_grad_()
    out = flash_attn(q, k, v, block_size=6)
    ref = _reference(q, k, v, True)
    torch.testing.assert_close(out, ref, atol=FWD_ATOL, rtol=RTOL)
    for g, w in zip(
        torch.autograd.grad(out.sum(), (q, k, v)),
        torch.autograd.grad(ref.sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(g, w, atol=GRAD_ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_accumulates_in_float32(dtype: torch.dtype) -> None:
    q32, k32, v32 = _inputs(1, 4, 2, 70, 70, d=16, dtype=torch.float32)
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q32, k32, v32))
    out = flash_attn(q, k, v, block_size=32)
    assert out.dtype == dtype
    # The reference sees the same rounded inputs, computed in float32.
    ref = _reference(*(x.detach().float().requires_grad_() for x in (q, k, v)), True)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=0)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads)


def test_requires_grad_subsets() -> None:
    q, k, v = _inputs(1, 4, 2, 9, 9, d=4)
    k.requires_grad_(False)
    (dq, dv) = torch.autograd.grad(flash_attn(q, k, v, block_size=4).sum(), (q, v))
    (rq, rv) = torch.autograd.grad(_reference(q, k, v, True).sum(), (q, v))
    torch.testing.assert_close(dq, rq)
    torch.testing.assert_close(dv, rv)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant: bool) -> None:
    q, k, v = _inputs(2, 4, 2, 17, 17, d=8)
    flash_attn(q, k, v, block_size=5).sum().backward()
    plain = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    out = checkpoint(
        lambda q, k, v: flash_attn(q, k, v, block_size=5), q, k, v, use_reentrant=reentrant
    )
    out.sum().backward()  # the reentrant variant refuses torch.autograd.grad
    for a, x in zip(plain, (q, k, v), strict=True):
        torch.testing.assert_close(x.grad, a, atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda() -> None:
    """The blockwise path itself on CUDA (the model's attention="sdpa" is PyTorch's kernel)."""
    q, k, v = (x.detach().cuda().requires_grad_() for x in _inputs(2, 6, 2, 50, 50, d=16))
    out = flash_attn(q, k, v, block_size=16)
    ref = _reference(q, k, v, True)
    torch.testing.assert_close(out, ref)
    for g, w in zip(
        torch.autograd.grad(out.sum(), (q, k, v)),
        torch.autograd.grad(ref.sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(g, w)


# --- memory: nothing quadratic is kept, nothing quadratic is ever built ----------------------


def _saved_tensors(fn: Callable[[], object]) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("t", [64, 256])
def test_saves_only_qkv_out_lse(t: int) -> None:
    b, h, hkv, d = 2, 4, 2, 8
    q, k, v = _inputs(b, h, hkv, t, t, d=d, dtype=torch.float32)
    result: list[torch.Tensor] = []
    saved = _saved_tensors(lambda: result.append(flash_attn(q, k, v, block_size=16)))
    out = result[0]
    assert len(saved) == 5
    for tensor, expected in zip(saved[:4], (q, k, v, out), strict=True):
        assert tensor is expected or (
            tensor.data_ptr() == expected.data_ptr() and tensor.shape == expected.shape
        )
    lse = saved[4]
    assert lse.dtype == torch.float32 and lse.numel() == b * h * t
    total = sum(x.numel() * x.element_size() for x in saved)
    # Linear in t: q, out (b·h·t·d), k, v (b·hkv·t·d) and lse (b·h·t), all float32.
    assert total == 4 * t * (2 * b * h * d + 2 * b * hkv * d + b * h)


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(
        self,
        func: Callable[..., Any],
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        for x in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return result


@pytest.mark.parametrize("causal", [True, False])
def test_no_seq_by_seq_tensor_is_ever_built(causal: bool) -> None:
    b, h, hkv, t, d, block = 1, 4, 2, 256, 8, 16
    q, k, v = _inputs(b, h, hkv, t, t, d=d, dtype=torch.float32)
    grad = torch.randn(b, h, t, d)
    with _LargestOutput() as mode:
        out = flash_attn(q, k, v, causal=causal, block_size=block)
        torch.autograd.grad(out, (q, k, v), grad)
    # One block's score tile is the largest thing built: b·h·block·t, 16x below b·h·t·t.
    assert mode.largest == b * h * block * t
    assert mode.largest * (t // block) == b * h * t * t


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "q_shape, kv_shape, causal, match",
    [
        ((1, 3, 4, 8), (1, 2, 4, 8), True, "multiple of n_kv_heads"),
        ((1, 4, 4), (1, 2, 4, 8), True, "shaped"),
        ((2, 4, 4, 8), (1, 2, 4, 8), True, "batch"),
        ((1, 4, 4, 8), (1, 2, 4, 6), True, "head_dim"),
        ((1, 4, 6, 8), (1, 2, 4, 8), True, "seq_kv >= seq"),
    ],
)
def test_validation(
    q_shape: tuple[int, ...], kv_shape: tuple[int, ...], causal: bool, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        flash_attn(
            torch.zeros(q_shape), torch.zeros(kv_shape), torch.zeros(kv_shape), causal=causal
        )


def test_validation_k_v_mismatch_and_dtype() -> None:
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="same shape"):
        flash_attn(q, torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 5, 8))
    with pytest.raises(ValueError, match="dtypes"):
        flash_attn(q, torch.zeros(1, 2, 4, 8, dtype=torch.float64), torch.zeros(1, 2, 4, 8))
    with pytest.raises(ValueError, match="block_size"):
        flash_attn(q, q, q, block_size=0)
