"""Tests of the fused lm head + cross-entropy (``llamatrain.ops.fused``).

The fused op must be the unfused one, ``F.cross_entropy(F.linear(h, W), targets)``, to
float32 rounding, whatever the chunking. Checks:

* ``gradcheck`` in float64 (analytic gradients against finite differences); the scaling of
  the stored gradients by other upstream gradients is checked separately;
* float32 agreement with PyTorch's unfused ops, forward and both gradients, at chunk sizes
  that divide the rows, do not, are 1, or exceed the rows; and with ggml's own unfused ops
  (``cross_entropy(mul_mat(...))``) in float64;
* ignored rows, all rows ignored, a frozen weight or frozen inputs, bf16 autocast, no_grad.

float32 tolerance: ``rtol=1e-5, atol=2e-7`` for gradients, ``rtol=1e-6, atol=1e-7`` for the
loss. Measured over the float32 cases here (all chunk sizes): gradient entries differ from
PyTorch's by at most 1e-7 absolute (values up to 0.09; the dW of the 32000-class case, whose
entries sum 300 rows, is the worst), the loss by at most 2.2e-7 relative - float32 rounding
of a different summation order and of the base-2 softmax. A formula error shows up at >= 1e-3.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

from llamatrain.ops import cross_entropy, mul_mat
from llamatrain.ops.fused import default_chunk_rows, linear_cross_entropy

F64 = torch.float64
GRAD_TOL = {"rtol": 1e-5, "atol": 2e-7}
LOSS_TOL = {"rtol": 1e-6, "atol": 1e-7}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make(rows, dim, vocab, *, seed=0, dtype=torch.float32, ignore_every=0, device="cpu"):
    """h (*rows, dim), weight (vocab, dim), targets (*rows) with every k-th row ignored."""
    g = torch.Generator().manual_seed(seed)
    rows = (rows,) if isinstance(rows, int) else tuple(rows)
    h = torch.randn(*rows, dim, generator=g, dtype=dtype)
    w = (torch.randn(vocab, dim, generator=g, dtype=dtype) * 0.5).to(dtype)
    t = torch.randint(0, vocab, rows, generator=g)
    if ignore_every:
        t.view(-1)[::ignore_every] = -100
    return (
        h.to(device).requires_grad_(),
        w.to(device).requires_grad_(),
        t.to(device),
    )


def reference(h, w, t, ignore_index=-100):
    """The unfused computation: full logits, then PyTorch's cross-entropy."""
    logits = F.linear(h, w).flatten(0, -2).float()
    return F.cross_entropy(logits, t.flatten(), ignore_index=ignore_index)


def loss_and_grads(fn, h, w, t, **kw):
    loss = fn(h, w, t, **kw)
    inputs = [x for x in (h, w) if x.requires_grad]
    grads = torch.autograd.grad(loss, inputs)
    return loss.detach(), grads


# --------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize(
    ("rows", "dim", "vocab", "chunk", "ignore_every"),
    [
        ((2, 5), 6, 11, 3, 4),  # batch × seq input, chunk not dividing 10 rows, ignored rows
        (7, 4, 9, 7, 0),  # one chunk exactly
        (6, 3, 5, 1, 3),  # one row per chunk
        (5, 8, 13, 64, 2),  # chunk larger than the input
    ],
)
def test_gradcheck_float64(rows, dim, vocab, chunk, ignore_every):
    h, w, t = make(rows, dim, vocab, dtype=F64, ignore_every=ignore_every)
    assert gradcheck(
        lambda h, w: linear_cross_entropy(h, w, t, chunk_rows=chunk), (h, w), eps=1e-6, atol=1e-7
    )


def test_gradcheck_weight_frozen_and_h_frozen():
    h, w, t = make(9, 5, 7, dtype=F64, ignore_every=4)
    w_frozen = w.detach()
    assert gradcheck(lambda h: linear_cross_entropy(h, w_frozen, t, chunk_rows=4), (h,))
    h_frozen = h.detach()
    assert gradcheck(lambda w: linear_cross_entropy(h_frozen, w, t, chunk_rows=4), (w,))


def test_float64_matches_ggml_unfused_ops():
    """Same as the unfused ggml graph: mul_mat then cross_entropy (cross_entropy_loss_back)."""
    h, w, t = make((3, 11), 8, 50, dtype=F64, ignore_every=5)
    fused, fused_g = loss_and_grads(linear_cross_entropy, h, w, t, chunk_rows=4)
    unfused, unfused_g = loss_and_grads(lambda h, w, t: cross_entropy(mul_mat(h, w), t), h, w, t)
    torch.testing.assert_close(fused, unfused, rtol=1e-12, atol=0)
    for a, b in zip(fused_g, unfused_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-15)


# --------------------------------------------------------------------------- float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 100, None])
def test_float32_matches_unfused(chunk, device):
    """64 rows: chunks that divide them (1, 16, 64), do not (7), exceed them (100), default."""
    h, w, t = make((4, 16), 32, 257, ignore_every=7, device=device)
    fused, (dh, dw) = loss_and_grads(linear_cross_entropy, h, w, t, chunk_rows=chunk)
    ref, (rdh, rdw) = loss_and_grads(reference, h, w, t)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, ref, **LOSS_TOL)
    torch.testing.assert_close(dh, rdh, **GRAD_TOL)
    torch.testing.assert_close(dw, rdw, **GRAD_TOL)


def test_float32_vocab_32000_default_chunks():
    """The real vocabulary: 300 rows is 2 default chunks of 131 plus a partial one."""
    assert default_chunk_rows(32000, 64) == 131
    assert default_chunk_rows(32000, 256) == 256
    h, w, t = make(300, 64, 32000, seed=3, ignore_every=11)
    fused, (dh, dw) = loss_and_grads(linear_cross_entropy, h, w, t)
    ref, (rdh, rdw) = loss_and_grads(reference, h, w, t)
    torch.testing.assert_close(fused, ref, **LOSS_TOL)
    torch.testing.assert_close(dh, rdh, **GRAD_TOL)
    torch.testing.assert_close(dw, rdw, **GRAD_TOL)


def test_chunking_does_not_change_the_result():
    h, w, t = make(53, 16, 97, seed=1, ignore_every=6)
    base, base_g = loss_and_grads(linear_cross_entropy, h, w, t, chunk_rows=53)
    for chunk in (1, 2, 5, 52, 54, 1000):
        loss, grads = loss_and_grads(linear_cross_entropy, h, w, t, chunk_rows=chunk)
        torch.testing.assert_close(loss, base, **LOSS_TOL)
        for a, b in zip(grads, base_g, strict=True):
            torch.testing.assert_close(a, b, **GRAD_TOL)


def test_upstream_gradient_scales_and_retain_graph():
    """backward scales the stored gradients; a second backward sees them unchanged."""
    h, w, t = make(10, 4, 9, ignore_every=3)
    loss = linear_cross_entropy(h, w, t, chunk_rows=3)
    (loss * 3.0).backward(retain_graph=True)
    dh3, dw3 = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    (loss * -0.5).backward()
    torch.testing.assert_close(h.grad * -6.0, dh3, **GRAD_TOL)
    torch.testing.assert_close(w.grad * -6.0, dw3, **GRAD_TOL)
    _, (rdh, rdw) = loss_and_grads(reference, h, w, t)
    torch.testing.assert_close(dh3, 3.0 * rdh, **GRAD_TOL)
    torch.testing.assert_close(dw3, 3.0 * rdw, **GRAD_TOL)


def test_unit_upstream_gradient_hands_over_the_stored_gradients():
    """``loss.backward()``: the gradients the forward computed become ``.grad`` as they are,
    no product, no copy (the same storage)."""
    h, w, t = make(10, 4, 9, ignore_every=3)
    loss = linear_cross_entropy(h, w, t, chunk_rows=3)
    stored = [s.data_ptr() for s in loss.grad_fn.saved_tensors]
    loss.backward()
    assert [h.grad.data_ptr(), w.grad.data_ptr()] == stored
    _, ref_grads = loss_and_grads(reference, h, w, t)
    for got, want in zip((h.grad, w.grad), ref_grads, strict=True):
        torch.testing.assert_close(got, want, **GRAD_TOL)


def test_unit_upstream_gradient_leaves_a_retained_graph_intact():
    """A retained graph keeps its stored gradients: changing the first backward's ``.grad``
    in place must not reach the second backward."""
    h, w, t = make(10, 4, 9, ignore_every=3)
    loss = linear_cross_entropy(h, w, t, chunk_rows=3)
    loss.backward(retain_graph=True)
    first = (h.grad.clone(), w.grad.clone())
    h.grad.zero_()
    w.grad.zero_()
    h.grad = w.grad = None
    loss.backward()
    for got, want in zip((h.grad, w.grad), first, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    _, ref_grads = loss_and_grads(reference, h, w, t)
    for got, want in zip((h.grad, w.grad), ref_grads, strict=True):
        torch.testing.assert_close(got, want, **GRAD_TOL)


# --------------------------------------------------------------------------- special cases


def test_ignored_rows_get_zero_gradient_and_leave_the_mean():
    h, w, t = make(12, 6, 20, seed=2)
    t_ign = torch.where(t == 7, 8, t)
    t_ign[[0, 5, 11]] = 7  # ignore_index is a real class id here
    loss, (dh, dw) = loss_and_grads(linear_cross_entropy, h, w, t_ign, ignore_index=7, chunk_rows=5)
    keep = t_ign != 7
    ref, (rdh, rdw) = loss_and_grads(reference, h, w, t_ign, ignore_index=7)
    torch.testing.assert_close(loss, ref, **LOSS_TOL)
    torch.testing.assert_close(dh, rdh, **GRAD_TOL)
    torch.testing.assert_close(dw, rdw, **GRAD_TOL)
    assert torch.all(dh[~keep] == 0)
    # The mean is over the 9 kept rows only.
    only_kept = linear_cross_entropy(h[keep], w, t_ign[keep], ignore_index=7)
    torch.testing.assert_close(loss, only_kept.detach(), **LOSS_TOL)


def test_ignored_rows_never_reach_the_head():
    """Only scored rows are computed: an ignored row's hidden state (here infinite, as a
    diverged prompt position could be) changes neither the loss nor any gradient."""
    h, w, t = make(12, 6, 20, seed=3, ignore_every=3)
    ignored = t == -100
    loss, (dh, dw) = loss_and_grads(linear_cross_entropy, h, w, t, chunk_rows=4)
    poisoned = h.detach().clone()
    poisoned[ignored] = math.inf
    poisoned.requires_grad_()
    loss2, (dh2, dw2) = loss_and_grads(linear_cross_entropy, poisoned, w, t, chunk_rows=4)
    torch.testing.assert_close(loss2, loss, rtol=0, atol=0)
    torch.testing.assert_close(dh2, dh, rtol=0, atol=0)
    torch.testing.assert_close(dw2, dw, rtol=0, atol=0)
    assert torch.all(dh2[ignored] == 0)


def test_all_rows_ignored_gives_zero_loss_and_zero_grads():
    h, w, t = make((2, 6), 5, 11)
    t.fill_(-100)
    loss, (dh, dw) = loss_and_grads(linear_cross_entropy, h, w, t, chunk_rows=4)
    assert loss.item() == 0.0
    assert torch.all(dh == 0) and torch.all(dw == 0)
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()


def test_frozen_weight_gets_no_gradient():
    h, w, t = make(20, 8, 30, ignore_every=4)
    w = w.detach()
    loss = linear_cross_entropy(h, w, t, chunk_rows=6)
    loss.backward()
    assert w.grad is None
    _, (rdh,) = loss_and_grads(reference, h, w, t)
    torch.testing.assert_close(h.grad, rdh, **GRAD_TOL)


def test_no_grad_gives_the_same_loss():
    h, w, t = make(20, 8, 30, ignore_every=4)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t, chunk_rows=6)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference(h, w, t).detach(), **LOSS_TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_computes_in_float32(device):
    """Under autocast a bf16 ``h`` is multiplied with the float32 weight in float32."""
    h, w, t = make((2, 9), 16, 40, ignore_every=5, device=device)
    h16 = h.detach().to(torch.bfloat16).requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = linear_cross_entropy(h16, w, t, chunk_rows=4)
    loss.backward()
    assert loss.dtype == torch.float32
    assert h16.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    h32 = h16.detach().float().requires_grad_()
    w32 = w.detach().requires_grad_()
    ref, (rdh, rdw) = loss_and_grads(reference, h32, w32, t)
    torch.testing.assert_close(loss.detach(), ref, **LOSS_TOL)
    torch.testing.assert_close(w.grad, rdw, **GRAD_TOL)
    torch.testing.assert_close(h16.grad, rdh.to(torch.bfloat16))


def test_int32_targets():
    h, w, t = make(10, 4, 9, ignore_every=3)
    ref, ref_g = loss_and_grads(linear_cross_entropy, h, w, t, chunk_rows=4)
    loss, grads = loss_and_grads(linear_cross_entropy, h, w, t.int(), chunk_rows=4)
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    for a, b in zip(grads, ref_g, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_rejects_bad_arguments():
    h, w, t = make(4, 3, 5)
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(h, w.t(), t)
    with pytest.raises(ValueError, match="targets shape"):
        linear_cross_entropy(h, w, t[:3])
    with pytest.raises(ValueError, match="integer"):
        linear_cross_entropy(h, w, t.float())
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy(h, w, t, chunk_rows=0)
