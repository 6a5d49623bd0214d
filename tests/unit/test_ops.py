"""Gradient tests for the ggml-semantics ops (a port of ggml's test-grad0 and of
test-backend-ops in ``grad`` mode).

Three kinds of check:

* ``torch.autograd.gradcheck`` in float64: the analytic backward (ggml's formula) against
  central finite differences, over odd sizes, single rows, irregular positions, masks,
  duplicate ids and ignored rows. Stricter than ggml's own test (mean relative error
  <= 1e-4, rope 1e-3).
* float32 agreement with PyTorch's own ops (or, for rope, a reference written here in a
  different way), forward and every gradient.
* the special cases: masked entries get exactly zero gradient, ids / positions / masks get
  none, all-ignored cross-entropy is 0 with zero gradient.

float32 tolerances: ``rtol=1e-5, atol=1e-6`` (``F32_TOL``). Measured at these sizes: every
forward and gradient differs from PyTorch's by a few float32 ulps (different summation
order); with rtol 1e-5 no comparison needs an atol above 1e-10, and with rtol 1e-6 the worst
needs 1.8e-7 (the 32000-class loss, 5.7e-6 absolute on a value of 16.9). So the tolerance is
a few x float32 rounding, far below what a formula error produces (>= 1e-3). mul_mat and
get_rows match F.linear / F.embedding bit for bit. Half-precision inputs use 2e-2 (one bf16
rounding is ~4e-3 relative).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck
from torch.utils.checkpoint import checkpoint

from llamatrain.ops import (
    cross_entropy,
    cross_entropy_loss,
    diag_mask_inf,
    diag_mask_zero,
    get_rows,
    mul_mat,
    rms_norm,
    rope,
    silu,
    soft_max,
    swiglu,
)
from llamatrain.ops.sets import op_set

F64 = torch.float64
F32_TOL = {"rtol": 1e-5, "atol": 1e-6}

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64, grad: bool = True):
    t = torch.randn(*shape, generator=gen(seed), dtype=dtype)
    return t.requires_grad_(grad)


def close32(a: torch.Tensor, b: torch.Tensor, **tol: float) -> None:
    torch.testing.assert_close(a, b, **(tol or F32_TOL))


def grads_of(fn, inputs, upstream):
    """Forward ``fn(*inputs)`` and the gradients of ``sum(out * upstream)`` wrt inputs."""
    out = fn(*inputs)
    gs = torch.autograd.grad(out, inputs, upstream)
    return out, gs


# --------------------------------------------------------------------------- get_rows


@pytest.mark.parametrize(
    ("rows", "dim", "ids"),
    [
        (13, 7, [3, 0, 12, 5]),
        (13, 7, [[1, 4, 1], [4, 4, 12]]),  # duplicates accumulate
        (5, 3, [2]),  # one row
        (1, 9, [0, 0, 0]),
    ],
)
def test_get_rows_gradcheck(rows: int, dim: int, ids: list) -> None:
    table = randn(rows, dim)
    idx = torch.tensor(ids)
    assert gradcheck(lambda t: get_rows(t, idx), (table,))
    assert get_rows(table, idx).shape == (*idx.shape, dim)


def test_get_rows_matches_embedding() -> None:
    table = randn(50, 16, dtype=torch.float32)
    ids = torch.randint(0, 50, (4, 9), generator=gen(1))
    ids[0, :3] = 7  # duplicates
    up = randn(4, 9, 16, seed=2, dtype=torch.float32, grad=False)
    out, (g,) = grads_of(lambda t: get_rows(t, ids), (table,), up)
    ref, (g_ref,) = grads_of(lambda t: F.embedding(ids, t), (table,), up)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    close32(g, g_ref)


def test_get_rows_duplicates_accumulate_and_ids_get_no_grad() -> None:
    table = torch.zeros(4, 2, requires_grad=True)
    ids = torch.tensor([1, 1, 3, 1])
    get_rows(table, ids).sum().backward()
    expected = torch.tensor([[0.0, 0.0], [3.0, 3.0], [0.0, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(table.grad, expected)
    assert not ids.requires_grad and ids.grad is None
    # A table without grad gives an output without grad.
    assert not get_rows(torch.zeros(4, 2), ids).requires_grad
    with pytest.raises(ValueError, match="integer"):
        get_rows(table, ids.float())


# --------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("shape", [(7,), (1, 13), (3, 5, 16), (2, 1)])
@pytest.mark.parametrize("eps", [1e-5, 0.3])
def test_rms_norm_gradcheck(shape: tuple, eps: float) -> None:
    x = randn(*shape)
    assert gradcheck(lambda t: rms_norm(t, eps), (x,))


def test_rms_norm_backward_is_ggml_formula() -> None:
    # Literal ggml rms_norm_back: dx = (dz - x*sum(x*dz)/(sum(x^2) + N*eps)) / sqrt(mean(x^2)+eps)
    n, eps = 11, 1e-3
    x = randn(4, n)
    dz = randn(4, n, seed=1, grad=False)
    (dx,) = torch.autograd.grad(rms_norm(x, eps), (x,), dz)
    xd = x.detach()
    sum_xdz = (xd * dz).sum(-1, keepdim=True)
    sum_xx = (xd * xd).sum(-1, keepdim=True)
    expected = (dz - xd * sum_xdz / (sum_xx + n * eps)) / torch.sqrt(sum_xx / n + eps)
    torch.testing.assert_close(dx, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(4, 7, 64), (1, 13)])
def test_rms_norm_matches_torch(shape: tuple) -> None:
    eps = 1e-5
    x = randn(*shape, dtype=torch.float32) * 3
    x = x.detach().requires_grad_()
    up = randn(*shape, seed=1, dtype=torch.float32, grad=False)
    out, (g,) = grads_of(lambda t: rms_norm(t, eps), (x,), up)
    ref, (g_ref,) = grads_of(lambda t: F.rms_norm(t, (shape[-1],), eps=eps), (x,), up)
    close32(out, ref)
    close32(g, g_ref)


# --------------------------------------------------------------------------- rope


def rope_reference(
    x: torch.Tensor, pos: torch.Tensor, theta: float, mode: str, fs: float, factors=None
):
    """Independent rope: explicit per-pair loop (norm) / HF rotate_half (neox), float64 angles;
    ``factors`` divide each pair's frequency as ggml_rope_ext's freq_factors do."""
    hd = x.shape[-1]
    h = hd // 2
    p = pos.to(F64)
    if p.dim() == 1:
        p = p.unsqueeze(0)
    f = [1.0] * h if factors is None else factors.tolist()
    inv = torch.tensor([theta ** (-2.0 * i / hd) / f[i] for i in range(h)], dtype=F64)
    ang = (fs * p).unsqueeze(-1) * inv  # (B|1, T, h)
    cos = torch.cos(ang).unsqueeze(2).to(x.dtype)
    sin = torch.sin(ang).unsqueeze(2).to(x.dtype)
    if mode == "neox":
        cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        rot_half = torch.cat((-x[..., h:], x[..., :h]), -1)
        return x * cos2 + rot_half * sin2
    cols = []
    for i in range(h):
        x0, x1 = x[..., 2 * i], x[..., 2 * i + 1]
        c, s = cos[..., i], sin[..., i]
        cols += [x0 * c - x1 * s, x0 * s + x1 * c]
    return torch.stack(cols, -1)


ROPE_CASES = [
    # (x shape (B, T, H, hd), positions, theta, freq_scale)
    ((2, 4, 3, 8), [0, 1, 2, 3], 10000.0, 1.0),
    ((2, 4, 3, 8), [5, 9, 10, 100], 10000.0, 1.0),  # irregular, non-zero offset
    ((2, 3, 2, 6), [[0, 1, 2], [7, 3, 40]], 500.0, 0.25),  # batch-dependent, scaled
    ((1, 1, 1, 2), [13], 10000.0, 2.0),  # one token, one pair
    ((3, 5, 1, 4), [[2, 3, 4, 5, 6]], 10000.0, 1.0),  # (1, T) positions broadcast
]


@pytest.mark.parametrize(("shape", "pos", "theta", "fs"), ROPE_CASES)
@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_rope_gradcheck(shape, pos, theta, fs, mode) -> None:
    x = randn(*shape)
    p = torch.tensor(pos)
    assert gradcheck(lambda t: rope(t, p, theta=theta, mode=mode, freq_scale=fs), (x,))


@pytest.mark.parametrize(("shape", "pos", "theta", "fs"), ROPE_CASES)
@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_rope_matches_reference(shape, pos, theta, fs, mode) -> None:
    x = randn(*shape, dtype=torch.float32)
    p = torch.tensor(pos)
    up = randn(*shape, seed=1, dtype=torch.float32, grad=False)
    out, (g,) = grads_of(lambda t: rope(t, p, theta=theta, mode=mode, freq_scale=fs), (x,), up)
    ref, (g_ref,) = grads_of(lambda t: rope_reference(t, p, theta, mode, fs), (x,), up)
    close32(out, ref)
    close32(g, g_ref)


@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_rope_frequency_factors(mode: str) -> None:
    # Llama 3.1's rope_freqs: per-pair divisors of the frequency; gradcheck, the reference,
    # and no gradient for the factors (they are loaded, never trained).
    x = randn(2, 4, 3, 8)
    p = torch.tensor([0, 3, 17, 250])
    factors = torch.tensor([1.0, 2.0, 5.5, 8.0], dtype=F64, requires_grad=True)
    assert gradcheck(lambda t: rope(t, p, mode=mode, freq_scale=0.5, freq_factors=factors), (x,))
    out = rope(x, p, mode=mode, freq_scale=0.5, freq_factors=factors)
    torch.testing.assert_close(out, rope_reference(x, p, 10000.0, mode, 0.5, factors))
    out.sum().backward()
    assert factors.grad is None
    with pytest.raises(ValueError, match="freq_factors"):
        rope(x, p, freq_factors=torch.ones(3))


def test_rope_angles_made_once_per_positions_tensor_follow_every_change(monkeypatch) -> None:
    """The angles of one positions tensor are made once and shared by every rope over it (a
    forward's 2 x n_layers calls), yet each call gets its own settings' angles, a positions
    tensor changed in place gets new ones, and one made under inference_mode (no version
    counter) works too."""
    import importlib

    rope_module = importlib.import_module("llamatrain.ops.rope")
    builds = []
    angles = rope_module._angles
    monkeypatch.setattr(rope_module, "_angles", lambda *a: builds.append(a) or angles(*a))
    x = randn(1, 3, 2, 8, dtype=torch.float32)
    p = torch.tensor([0, 5, 9])
    for _ in range(5):  # a forward's layers: one build for all of them
        rope(x, p, theta=10000.0), rope(x, p, theta=10000.0, mode="neox")
    assert len(builds) == 1
    for theta, fs in [(10000.0, 1.0), (500000.0, 1.0), (10000.0, 0.25), (10000.0, 1.0)]:
        close32(rope(x, p, theta=theta, freq_scale=fs), rope_reference(x, p, theta, "norm", fs))
    p.add_(7)  # same tensor, new positions
    close32(rope(x, p), rope_reference(x, p, 10000.0, "norm", 1.0))
    with torch.inference_mode():
        q = torch.tensor([1, 2, 3])
        close32(rope(x, q), rope_reference(x, q, 10000.0, "norm", 1.0))
        q.add_(40)
        close32(rope(x, q), rope_reference(x, q, 10000.0, "norm", 1.0))


def test_rope_large_positions_float32() -> None:
    # Angles are built in float64 by both sides, so only the float32 rotation differs.
    x = randn(2, 6, 2, 64, dtype=torch.float32)
    p = torch.tensor([0, 1, 511, 2047, 4095, 16383])
    close32(rope(x, p), rope_reference(x, p, 10000.0, "norm", 1.0))


def test_rope_norm_is_neox_on_hf_permuted_dims() -> None:
    # llama.cpp's converter maps HF (neox) rows to llama (norm) order per head:
    # new[2j] = old[j], new[2j+1] = old[j + hd/2]. Rotations must commute with that map.
    hd = 8
    x = randn(2, 5, 3, hd, grad=False)
    p = torch.tensor([3, 1, 4, 1, 5])
    perm = torch.stack((torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2), -1).flatten()
    torch.testing.assert_close(
        rope(x[..., perm], p, mode="norm"), rope(x, p, mode="neox")[..., perm]
    )


@pytest.mark.parametrize("mode", ["norm", "neox"])
def test_rope_relative_positions(mode: str) -> None:
    # <rope(q, i), rope(k, j)> depends only on i - j: shifting all positions changes nothing.
    q, k = randn(1, 4, 2, 6, grad=False), randn(1, 4, 2, 6, seed=1, grad=False)
    p = torch.tensor([0, 2, 3, 7])

    def scores(off: int) -> torch.Tensor:
        qr, kr = rope(q, p + off, mode=mode), rope(k, p + off, mode=mode)
        return torch.einsum("bthd,bshd->bhts", qr, kr)

    torch.testing.assert_close(scores(0), scores(1000))


def test_rope_validation_and_no_position_grad() -> None:
    x = randn(1, 3, 2, 4)
    p = torch.arange(3)
    rope(x, p).sum().backward()
    assert x.grad is not None and p.grad is None and not p.requires_grad
    with pytest.raises(ValueError, match="mode"):
        rope(x, p, mode="glm")
    with pytest.raises(ValueError, match="even"):
        rope(randn(1, 3, 2, 5), p)
    with pytest.raises(ValueError, match="integer"):
        rope(x, p.double())
    with pytest.raises(ValueError, match="pos must be shaped"):
        rope(x, torch.arange(4))
    with pytest.raises(ValueError, match="head_dim"):
        rope(randn(3, 2, 4), p)


# --------------------------------------------------------------------------- silu, swiglu


@pytest.mark.parametrize("shape", [(7,), (3, 13), (1, 1)])
def test_silu_gradcheck(shape: tuple) -> None:
    x = (randn(*shape) * 4).detach().requires_grad_()  # cover the saturated regions too
    assert gradcheck(silu, (x,))


@pytest.mark.parametrize("shape", [(7,), (3, 13), (1, 1)])
def test_swiglu_gradcheck(shape: tuple) -> None:
    g = (randn(*shape) * 4).detach().requires_grad_()
    u = randn(*shape, seed=1)
    assert gradcheck(swiglu, (g, u))


def test_silu_swiglu_match_torch() -> None:
    shape = (4, 9, 48)
    x = (randn(*shape, dtype=torch.float32) * 5).detach().requires_grad_()
    u = randn(*shape, seed=1, dtype=torch.float32)
    up = randn(*shape, seed=2, dtype=torch.float32, grad=False)
    out, (g,) = grads_of(silu, (x,), up)
    ref, (g_ref,) = grads_of(F.silu, (x,), up)
    close32(out, ref)
    close32(g, g_ref)
    out, gs = grads_of(swiglu, (x, u), up)
    ref, gs_ref = grads_of(lambda a, b: F.silu(a) * b, (x, u), up)
    close32(out, ref)
    for a, b in zip(gs, gs_ref, strict=True):
        close32(a, b)


def test_swiglu_one_input_without_grad() -> None:
    g = randn(3, 5)
    u = randn(3, 5, seed=1, grad=False)
    swiglu(g, u).sum().backward()
    assert g.grad is not None and u.grad is None
    g2 = randn(3, 5, grad=False)
    u2 = randn(3, 5, seed=1)
    swiglu(g2, u2).sum().backward()
    torch.testing.assert_close(u2.grad, F.silu(g2))


# --------------------------------------------------------------------------- soft_max


def causal_mask(rows: int, cols: int, n_past: int = 0) -> torch.Tensor:
    m = torch.zeros(rows, cols, dtype=F64)
    return m.masked_fill(torch.ones(rows, cols, dtype=torch.bool).triu(n_past + 1), -math.inf)


SOFTMAX_CASES = [
    # (x shape, mask builder or None, scale)
    ((7,), None, 1.0),
    ((3, 13), None, 0.37),
    ((1, 5), None, 2.0),  # one row
    ((2, 2, 5, 5), lambda: causal_mask(5, 5), 1 / math.sqrt(8)),
    ((2, 4, 6), lambda: causal_mask(4, 6, n_past=2), 0.5),
    ((3, 13), lambda: torch.where(torch.arange(13) % 3 == 1, -math.inf, 0.25), 1.0),
]


@pytest.mark.parametrize(("shape", "mask_fn", "scale"), SOFTMAX_CASES)
def test_soft_max_gradcheck(shape, mask_fn, scale) -> None:
    x = randn(*shape)
    mask = mask_fn() if mask_fn else None
    assert gradcheck(lambda t: soft_max(t, mask, scale), (x,))


@pytest.mark.parametrize(("shape", "mask_fn", "scale"), SOFTMAX_CASES)
def test_soft_max_matches_torch(shape, mask_fn, scale) -> None:
    x = randn(*shape, dtype=torch.float32)
    mask = mask_fn().float() if mask_fn else None
    up = randn(*shape, seed=1, dtype=torch.float32, grad=False)
    out, (g,) = grads_of(lambda t: soft_max(t, mask, scale), (x,), up)

    def ref_fn(t: torch.Tensor) -> torch.Tensor:
        z = t * scale
        return torch.softmax(z if mask is None else z + mask, -1)

    ref, (g_ref,) = grads_of(ref_fn, (x,), up)
    close32(out, ref)
    close32(g, g_ref)
    if mask is not None:
        masked = torch.isinf(mask).expand_as(g)
        assert torch.all(g[masked] == 0) and torch.all(out[masked] == 0)


def test_soft_max_mask_gets_no_grad() -> None:
    x = randn(2, 4, 4)
    mask = causal_mask(4, 4).requires_grad_()
    soft_max(x, mask, 0.5).pow(2).sum().backward()
    assert mask.grad is None and x.grad is not None
    assert torch.all(x.grad[:, torch.isinf(mask.detach())] == 0)
    with pytest.raises(ValueError, match="additive float mask"):
        soft_max(x, torch.ones(4, 4, dtype=torch.bool))


@pytest.mark.parametrize(("shape", "n_past"), [((4, 4), 0), ((2, 3, 6), 3), ((5, 3), 1)])
@pytest.mark.parametrize("op", [diag_mask_inf, diag_mask_zero])
def test_diag_mask(shape: tuple, n_past: int, op) -> None:
    x = randn(*shape)
    rows, cols = shape[-2:]
    upper = torch.ones(rows, cols, dtype=torch.bool).triu(n_past + 1)
    fill = -math.inf if op is diag_mask_inf else 0.0
    out = op(x, n_past)
    torch.testing.assert_close(out, x.detach().masked_fill(upper, fill))
    up = randn(*shape, seed=1, grad=False)
    (g,) = torch.autograd.grad(out, (x,), up)
    torch.testing.assert_close(g, up.masked_fill(upper, 0.0), rtol=0, atol=0)
    if op is diag_mask_zero:
        assert gradcheck(lambda t: op(t, n_past), (x,))
    else:  # -inf outputs are not finite-differentiable on their own; check through softmax
        assert gradcheck(lambda t: soft_max(op(t, n_past), None, 0.7), (x,))


def test_diag_mask_inf_soft_max_matches_torch() -> None:
    x = randn(2, 2, 6, 6, dtype=torch.float32)
    up = randn(2, 2, 6, 6, seed=1, dtype=torch.float32, grad=False)
    out, (g,) = grads_of(lambda t: soft_max(diag_mask_inf(t, 0), None, 0.5), (x,), up)
    upper = torch.ones(6, 6, dtype=torch.bool).triu(1)
    ref, (g_ref,) = grads_of(
        lambda t: torch.softmax((t * 0.5).masked_fill(upper, -math.inf), -1), (x,), up
    )
    close32(out, ref)
    close32(g, g_ref)
    assert torch.all(g[..., upper] == 0)


# --------------------------------------------------------------------------- cross entropy


def random_probs(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.softmax(randn(*shape, seed=seed, dtype=dtype, grad=False) * 2, -1)


@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 13), (1, 5)])
def test_cross_entropy_loss_gradcheck(shape: tuple) -> None:
    z = randn(*shape)
    t = random_probs(*shape, seed=1).requires_grad_()  # soft targets, not one-hot
    assert gradcheck(cross_entropy_loss, (z, t))


def test_cross_entropy_loss_matches_ggml_backward() -> None:
    # ggml cross_entropy_loss_back: dz = (softmax(z) - t) * grad / rows
    z = randn(6, 11)
    t = random_probs(6, 11, seed=1)
    (g,) = torch.autograd.grad(cross_entropy_loss(z, t) * 3.0, (z,))
    torch.testing.assert_close(g, (torch.softmax(z.detach(), -1) - t) * 3.0 / 6)


@pytest.mark.parametrize("vocab", [13, 32000])
def test_cross_entropy_loss_matches_torch_soft_targets(vocab: int) -> None:
    z = (randn(2, 5, vocab, dtype=torch.float32) * 3).detach().requires_grad_()
    t = random_probs(2, 5, vocab, seed=1, dtype=torch.float32).requires_grad_()
    loss, gs = grads_of(cross_entropy_loss, (z, t), None)
    ref, gs_ref = grads_of(
        lambda a, b: F.cross_entropy(a.reshape(-1, vocab), b.reshape(-1, vocab)), (z, t), None
    )
    close32(loss, ref)
    for a, b in zip(gs, gs_ref, strict=True):
        close32(a, b)


def test_cross_entropy_loss_targets_without_grad() -> None:
    z = randn(3, 7)
    t = random_probs(3, 7, seed=1)
    cross_entropy_loss(z, t).backward()
    assert z.grad is not None and t.grad is None


CE_CASES = [
    # (logits shape, targets, ignore_index)
    ((4, 7), [3, 0, 6, 3], -100),
    ((2, 3, 13), [[1, -100, 12], [0, 5, -100]], -100),  # ignored rows
    ((1, 5), [4], -100),  # one row
    ((5, 6), [2, 1, 2, 0, 2], 2),  # a valid class id used as ignore_index
]


@pytest.mark.parametrize(("shape", "targets", "ignore"), CE_CASES)
def test_cross_entropy_gradcheck(shape, targets, ignore) -> None:
    z = randn(*shape)
    tg = torch.tensor(targets)
    assert gradcheck(lambda t: cross_entropy(t, tg, ignore), (z,))


@pytest.mark.parametrize(("shape", "targets", "ignore"), CE_CASES)
def test_cross_entropy_matches_torch(shape, targets, ignore) -> None:
    z = randn(*shape, dtype=torch.float32)
    tg = torch.tensor(targets)
    loss, (g,) = grads_of(lambda t: cross_entropy(t, tg, ignore), (z,), torch.tensor(1.7))
    ref, (g_ref,) = grads_of(
        lambda t: F.cross_entropy(t.reshape(-1, shape[-1]), tg.reshape(-1), ignore_index=ignore),
        (z,),
        torch.tensor(1.7),
    )
    close32(loss, ref)
    close32(g, g_ref)
    assert torch.all(g[tg == ignore] == 0)


def test_cross_entropy_large_vocab_matches_torch() -> None:
    vocab = 32000
    z = (randn(3, 8, vocab, dtype=torch.float32) * 4).detach().requires_grad_()
    tg = torch.randint(0, vocab, (3, 8), generator=gen(1))
    tg[1, 2:5] = -100
    loss, (g,) = grads_of(lambda t: cross_entropy(t, tg), (z,), None)
    ref, (g_ref,) = grads_of(
        lambda t: F.cross_entropy(t.reshape(-1, vocab), tg.reshape(-1)), (z,), None
    )
    close32(loss, ref)
    close32(g, g_ref)


def test_cross_entropy_all_ignored_is_zero() -> None:
    z = randn(2, 3, 7, dtype=torch.float32)
    tg = torch.full((2, 3), -100)
    loss = cross_entropy(z, tg)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(z.grad == 0) and not torch.isnan(z.grad).any()


def test_cross_entropy_equals_one_hot_cross_entropy_loss() -> None:
    z = randn(2, 4, 9)
    tg = torch.randint(0, 9, (2, 4), generator=gen(3))
    one_hot = F.one_hot(tg, 9).to(F64)
    a, (ga,) = grads_of(lambda t: cross_entropy(t, tg), (z,), None)
    b, (gb,) = grads_of(lambda t: cross_entropy_loss(t, one_hot), (z,), None)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ga, gb)


def test_cross_entropy_validation() -> None:
    z = randn(2, 5)
    with pytest.raises(ValueError, match="targets shape"):
        cross_entropy(z, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="integer"):
        cross_entropy(z, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="target_probs shape"):
        cross_entropy_loss(z, random_probs(2, 4))


# --------------------------------------------------------------------------- mul_mat


@pytest.mark.parametrize(
    ("x_shape", "w_shape"),
    [((7,), (3, 7)), ((3, 5), (4, 5)), ((2, 3, 5), (1, 5)), ((1, 13), (7, 13))],
)
def test_mul_mat_gradcheck(x_shape: tuple, w_shape: tuple) -> None:
    assert gradcheck(mul_mat, (randn(*x_shape), randn(*w_shape, seed=1)))


def test_mul_mat_matches_linear() -> None:
    x = randn(4, 9, 48, dtype=torch.float32)
    w = randn(40, 48, seed=1, dtype=torch.float32)
    up = randn(4, 9, 40, seed=2, dtype=torch.float32, grad=False)
    out, gs = grads_of(mul_mat, (x, w), up)
    ref, gs_ref = grads_of(F.linear, (x, w), up)
    close32(out, ref)
    for a, b in zip(gs, gs_ref, strict=True):
        close32(a, b)


def test_mul_mat_non_contiguous_and_partial_grad() -> None:
    base = randn(5, 3, 4)
    x = base.transpose(0, 1)  # (3, 5, 4), not contiguous
    w = randn(6, 4, seed=1, grad=False)
    up = randn(3, 5, 6, seed=2, grad=False)
    out, (gx,) = grads_of(lambda t: mul_mat(t, w), (x,), up)  # w needs no grad
    torch.testing.assert_close(out, F.linear(x, w))
    torch.testing.assert_close(gx, up @ w)


# --------------------------------------------------------------------------- all ops


def tiny_block(x, table, ids, pos, w_q, w_g, w_u, targets):
    """Every op once, the way a llama block uses them (float64 so results compare exactly)."""
    b, t = ids.shape
    h = get_rows(table, ids) + x
    n = rms_norm(h, 1e-5)
    q = rope(mul_mat(n, w_q).view(b, t, 2, 4), pos).reshape(b, t, 8)
    s = soft_max(diag_mask_inf(q @ q.transpose(1, 2), 0), None, 0.5)
    f = swiglu(mul_mat(s @ n, w_g), mul_mat(n, w_u)) + silu(q)
    logits = mul_mat(f, table[:, :8])
    return cross_entropy(logits, targets) + cross_entropy_loss(
        logits, torch.softmax(logits, -1).detach()
    )


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_ops_under_activation_checkpointing(use_reentrant: bool) -> None:
    # The Functions keep no state outside ctx, so recomputation gives identical gradients.
    ids = torch.tensor([[1, 4, 4], [0, 2, 9]])
    pos = torch.tensor([[3, 4, 5], [0, 1, 2]])
    targets = torch.tensor([[2, 3, -100], [9, 9, 1]])
    params = [
        randn(2, 3, 8, seed=0),
        randn(10, 8, seed=1),
        randn(8, 8, seed=2),
        randn(8, 8, seed=3),
        randn(8, 8, seed=4),
    ]

    def run(ckpt: bool):
        x, table, w_q, w_g, w_u = params
        args = (x, table, ids, pos, w_q, w_g, w_u, targets)
        if ckpt:
            return checkpoint(tiny_block, *args, use_reentrant=use_reentrant)
        return tiny_block(*args)

    def grads(ckpt: bool) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        run(ckpt).backward()  # reentrant checkpointing does not support autograd.grad
        return [p.grad for p in params]

    plain, ck = grads(False), grads(True)
    for a, b in zip(plain, ck, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_inputs_without_grad_and_no_grad_mode() -> None:
    x = randn(2, 3, 2, 4, grad=False)
    pos = torch.arange(3)
    outs = [
        rope(x, pos),
        rms_norm(x, 1e-5),
        silu(x),
        swiglu(x, x),
        soft_max(x, None, 0.5),
        diag_mask_inf(x, 0),
        diag_mask_zero(x, 1),
        get_rows(x[0, 0], torch.tensor([1, 1])),
        mul_mat(x, x[0, 0]),
        cross_entropy(x, torch.zeros(2, 3, 2, dtype=torch.long)),
        cross_entropy_loss(x, torch.softmax(x, -1)),
    ]
    assert not any(o.requires_grad for o in outs)
    with torch.no_grad():
        assert not rope(randn(1, 2, 1, 4), torch.arange(2)).requires_grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_inputs_keep_dtype(dtype: torch.dtype, device: str) -> None:
    """Half-precision inputs: outputs and gradients keep the input dtype and stay close to
    float32 (tolerance 2e-2: one bf16 rounding of O(1) values is ~4e-3)."""
    tol = {"rtol": 2e-2, "atol": 2e-2}
    kw = {"device": device}
    x32 = torch.randn(2, 5, 2, 8, generator=gen(5)).to(**kw)
    up32 = torch.randn(2, 5, 2, 8, generator=gen(6)).to(**kw)
    pos = torch.tensor([4, 8, 15, 16, 23], device=device)
    table32 = torch.randn(9, 16, generator=gen(7)).to(**kw)
    ids = torch.tensor([[0, 3, 3], [8, 1, 0]], device=device)
    tg = torch.tensor([[0, 3, -100], [8, 1, 0]], device=device)
    cases = [
        (lambda t: rope(t, pos), x32, up32),
        (lambda t: rope(t, pos, mode="neox"), x32, up32),
        (lambda t: rms_norm(t, 1e-5), x32, up32),
        (silu, x32, up32),
        (lambda t: swiglu(t, t * 0.5), x32, up32),
        (lambda t: soft_max(diag_mask_inf(t, 1), None, 0.3), x32[0, :, 0, :5], up32[0, :, 0, :5]),
        (lambda t: get_rows(t, ids), table32, torch.randn(2, 3, 16, generator=gen(8)).to(**kw)),
        (lambda t: mul_mat(t, table32.to(t.dtype)), x32.reshape(10, 16), torch.ones(10, 9, **kw)),
        (lambda t: cross_entropy(t, tg), table32[:6].reshape(2, 3, 16), None),
        (
            lambda t: cross_entropy_loss(t, torch.softmax(t.float(), -1).to(t.dtype).detach()),
            table32,
            None,
        ),
    ]
    for fn, inp32, up in cases:
        ref, (g_ref,) = grads_of(fn, (inp32.clone().requires_grad_(),), up)
        inp = inp32.to(dtype).requires_grad_()
        out, (g,) = grads_of(fn, (inp,), None if up is None else up.to(dtype))
        if out.dim():  # losses are returned in float32
            assert out.dtype == dtype
        assert g.dtype == dtype
        torch.testing.assert_close(out.float(), ref, **tol)
        torch.testing.assert_close(g.float(), g_ref, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_mul_mat_backward_runs_under_the_forwards_autocast(device: str) -> None:
    """bf16 autocast (float32 master weights): the backward matmuls run in bf16 like the
    forward, exactly as PyTorch's own autocast ``F.linear`` does, and the weight gradient
    comes back in float32. Compared bit for bit with F.linear's autocast gradients."""
    x = torch.randn(3, 7, 24, generator=gen(11)).to(device)
    w = torch.randn(10, 24, generator=gen(12)).to(device)
    up = torch.randn(3, 7, 10, generator=gen(13)).to(device)
    results = []
    for fn in (mul_mat, F.linear):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = fn(xr, wr)
        y.backward(up.to(y.dtype))
        results.append((y, xr.grad, wr.grad))
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = results
    assert y.dtype == torch.bfloat16 and dx.dtype == dw.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=0)
    torch.testing.assert_close(dw, dw_ref, rtol=0, atol=0)
    # and not the float32 backward it would be without the autocast state
    dw32 = up.reshape(-1, 10).t() @ x.reshape(-1, 24)
    assert not torch.equal(dw, dw32)


@pytest.mark.parametrize("ops", ["ggml", "torch"])
def test_head_loss_computes_only_scored_rows(ops: str) -> None:
    """Both op sets' lm head + loss leave the ignored rows (chat SFT's prompts) out: the value
    and gradients of the full logits', and an ignored row's hidden state (here infinite)
    reaches nothing."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 9, 16, generator=g)
    w = torch.randn(40, 16, generator=g) * 0.3
    t = torch.randint(0, 40, (2, 9), generator=g)
    t[0, :4] = t[1, :6] = -100
    full_h, full_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(full_h, full_w).flatten(0, 1), t.flatten(), ignore_index=-100)
    ref_grads = torch.autograd.grad(ref, (full_h, full_w))
    h[t == -100] = math.inf
    h.requires_grad_()
    w.requires_grad_()
    loss = op_set(ops).head_loss(h, w, t)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    grads = torch.autograd.grad(loss, (h, w))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-7)
    assert torch.all(grads[0][t == -100] == 0)
