"""Gemma's element-wise ops: GEGLU (``ops.activation``) and logit soft-capping (``ops.softcap``, and
inside the fused lm head + loss, ``linear_cross_entropy(softcap=...)``).

Each Function's hand-written backward is checked by float64 ``gradcheck``, against the written
formula it claims (ggml's), and against PyTorch's autograd of the plain expression in float32
(``F.gelu(gate, approximate="tanh") * up``, ``cap * tanh(x / cap)``): measured worst
difference 1.2e-7 (1 ulp of O(1) values, 3 seeds); the tolerance is float32's default
(rtol 1.3e-6, atol 1e-5).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from llamatrain.ops import cross_entropy, mul_mat
from llamatrain.ops.activation import geglu, gelu
from llamatrain.ops.fused import linear_cross_entropy
from llamatrain.ops.sets import op_set
from llamatrain.ops.softcap import softcap

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors (conftest)

F64 = torch.float64


def _randn(*shape: int, dtype: torch.dtype = F64, seed: int = 0, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


# --- GELU / GEGLU ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_gelu_gradcheck(shape: tuple[int, ...]) -> None:
    x = _randn(*shape, scale=2.0).requires_grad_()
    assert torch.autograd.gradcheck(gelu, (x,))


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_geglu_gradcheck(shape: tuple[int, ...]) -> None:
    gate = _randn(*shape, scale=2.0).requires_grad_()
    up = _randn(*shape, seed=1).requires_grad_()
    assert torch.autograd.gradcheck(geglu, (gate, up))


def test_gelu_is_ggml_tanh_formula_forward_and_backward() -> None:
    """Forward: ggml_vec_gelu_f32's 0.5x(1 + tanh(√(2/π)(x + 0.044715x³))); backward: the
    derivative written out in the module docstring."""
    x = torch.linspace(-6, 6, 241, dtype=F64).requires_grad_()
    dy = _randn(241, seed=3)
    a, c = 0.044715, math.sqrt(2 / math.pi)
    t = torch.tanh(c * (x + a * x**3))
    y = gelu(x)
    torch.testing.assert_close(y, 0.5 * x * (1 + t), rtol=0, atol=1e-15)
    (dx,) = torch.autograd.grad(y, x, dy)
    want = dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * a * x * x))
    torch.testing.assert_close(dx, want.detach(), rtol=0, atol=1e-14)


def test_geglu_matches_torch_float32() -> None:
    gate = _randn(4, 9, 33, dtype=torch.float32, scale=2.0).requires_grad_()
    up = _randn(4, 9, 33, dtype=torch.float32, seed=1).requires_grad_()
    dout = _randn(4, 9, 33, dtype=torch.float32, seed=2)
    out = geglu(gate, up)
    ref = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(out, ref)
    for got, want in zip(
        torch.autograd.grad(out, (gate, up), dout),
        torch.autograd.grad(ref, (gate, up), dout),
        strict=True,
    ):
        torch.testing.assert_close(got, want)


def test_geglu_one_input_without_grad_and_validation() -> None:
    gate = _randn(3, 4).requires_grad_()
    up = _randn(3, 4, seed=1)
    (dg,) = torch.autograd.grad(geglu(gate, up).sum(), gate)
    (rg,) = torch.autograd.grad((F.gelu(gate, approximate="tanh") * up).sum(), gate)
    torch.testing.assert_close(dg, rg)
    with pytest.raises(ValueError, match="same shape"):
        geglu(gate, up[:, :3])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_geglu_low_precision_keeps_dtype(dtype: torch.dtype) -> None:
    gate = _randn(5, 8, dtype=dtype).requires_grad_()
    up = _randn(5, 8, dtype=dtype, seed=1).requires_grad_()
    out = geglu(gate, up)
    assert out.dtype == dtype
    ref = F.gelu(gate.float(), approximate="tanh") * up.float()
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    grads = torch.autograd.grad(out.float().sum(), (gate, up))
    assert all(g.dtype == dtype and torch.isfinite(g).all() for g in grads)


# --- soft-capping ----------------------------------------------------------------------------


@pytest.mark.parametrize("cap", [0.5, 3.0, 30.0])
def test_softcap_gradcheck(cap: float) -> None:
    x = _randn(3, 7, scale=4.0).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: softcap(x, cap), (x,))


def test_softcap_matches_torch_and_is_bounded() -> None:
    cap = 30.0
    x = _randn(6, 50, dtype=torch.float32, scale=40.0).requires_grad_()
    dout = _randn(6, 50, dtype=torch.float32, seed=1)
    y = softcap(x, cap)
    ref = torch.tanh(x / cap) * cap
    torch.testing.assert_close(y, ref)
    assert (y.abs() <= cap).all()
    torch.testing.assert_close(
        torch.autograd.grad(y, x, dout)[0], torch.autograd.grad(ref, x, dout)[0]
    )


def test_softcap_saves_only_its_output() -> None:
    """dx = dy·(1 − (y/cap)²) needs y, which the loss after it saves anyway."""
    x = _randn(4, 10).requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = softcap(x, 2.0)
    assert len(saved) == 1 and saved[0].data_ptr() == y.data_ptr()


def test_softcap_validation() -> None:
    x = torch.zeros(3)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="cap"):
            softcap(x, bad)
    with pytest.raises(ValueError, match="floating"):
        softcap(torch.zeros(3, dtype=torch.long), 1.0)


# --- the op sets ---------------------------------------------------------------------------


def test_op_sets_geglu_and_softcap_agree() -> None:
    ggml_ops, torch_ops = op_set("ggml"), op_set("torch")
    gate = _randn(2, 5, 16, dtype=torch.float32).requires_grad_()
    up = _randn(2, 5, 16, dtype=torch.float32, seed=1).requires_grad_()
    a, b = ggml_ops.geglu(gate, up), torch_ops.geglu(gate, up)
    torch.testing.assert_close(a, b)
    for got, want in zip(
        torch.autograd.grad(a.sum(), (gate, up)),
        torch.autograd.grad(b.sum(), (gate, up)),
        strict=True,
    ):
        torch.testing.assert_close(got, want)
    x = _randn(3, 40, dtype=torch.float32, scale=20.0).requires_grad_()
    a, b = ggml_ops.softcap(x, 15.0), torch_ops.softcap(x, 15.0)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(
        torch.autograd.grad(a.sum(), x)[0], torch.autograd.grad(b.sum(), x)[0]
    )


# --- soft-capping inside the fused lm head + loss ------------------------------------------


def _head(rows: int, dim: int, vocab: int, dtype: torch.dtype = F64, ignore_every: int = 0):
    h = _randn(rows, dim, dtype=dtype, seed=5, scale=2.0).requires_grad_()
    w = _randn(vocab, dim, dtype=dtype, seed=6).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(7))
    if ignore_every:
        t[::ignore_every] = -100
    return h, w, t


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 64])
def test_linear_cross_entropy_softcap_gradcheck(chunk_rows: int) -> None:
    h, w, t = _head(7, 4, 9, ignore_every=3)
    assert torch.autograd.gradcheck(
        lambda h, w: linear_cross_entropy(h, w, t, chunk_rows=chunk_rows, softcap=2.5), (h, w)
    )


def test_linear_cross_entropy_softcap_is_the_unfused_ggml_graph_float64() -> None:
    """cross_entropy(softcap(mul_mat(h, W))) with each op's own backward, in float64."""
    h, w, t = _head(11, 6, 13, ignore_every=4)
    fused = linear_cross_entropy(h, w, t, chunk_rows=4, softcap=3.0)
    unfused = cross_entropy(softcap(mul_mat(h, w), 3.0), t)
    torch.testing.assert_close(fused, unfused, rtol=1e-12, atol=1e-12)
    for got, want in zip(
        torch.autograd.grad(fused, (h, w)), torch.autograd.grad(unfused, (h, w)), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_rows", [5, 16, 100])
def test_linear_cross_entropy_softcap_matches_torch_float32(chunk_rows: int) -> None:
    h, w, t = _head(37, 16, 300, dtype=torch.float32, ignore_every=5)
    loss = linear_cross_entropy(h, w, t, chunk_rows=chunk_rows, softcap=4.0)
    logits = torch.tanh(F.linear(h, w) / 4.0) * 4.0
    ref = F.cross_entropy(logits, t, ignore_index=-100)
    # test_fused's tolerances (float32 rounding of another summation order).
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    for got, want in zip(
        torch.autograd.grad(loss, (h, w)), torch.autograd.grad(ref, (h, w)), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-7)


def test_op_sets_head_loss_softcap_agree() -> None:
    h, w, t = _head(20, 8, 50, dtype=torch.float32)
    a = op_set("ggml").head_loss(h, w, t, softcap=5.0)
    b = op_set("torch").head_loss(h, w, t, softcap=5.0)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for got, want in zip(
        torch.autograd.grad(a, (h, w)), torch.autograd.grad(b, (h, w)), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-7)
    assert not torch.equal(a, op_set("ggml").head_loss(h, w, t))  # the cap does something


def test_linear_cross_entropy_softcap_validation() -> None:
    h, w, t = _head(3, 4, 5)
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(h, w, t, softcap=0.0)
