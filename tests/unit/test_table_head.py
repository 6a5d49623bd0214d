"""The lm head over a table kept as stored (``llamatrain.ops.table_head``).

It must be the dense head over the decoded table, which ``ops.logps`` and ``ops.fused``
compute (themselves checked against the full logits):

* float64 ``gradcheck`` w.r.t. the hidden states (the table is frozen), over a float table and
  Q4_0 blocks, with and without a soft cap, ignored rows, and vocabulary chunks that do and do
  not divide the vocabulary;
* float32 log-probs, loss and dH against ``linear_logps`` / ``linear_cross_entropy`` over the
  decoded table (Q4_0, Q8_0, Q5_1 blocks and an F16 table), chunked and in one chunk;
* each scored row's entropy (``table_logps_and_entropy``) equal to the dense head's over the
  decoded table, computed in float64 from the full logits, with maxima that grow from chunk to
  chunk (the running rescale) and logits large enough for absolute sums to cancel;
* logits equal to the decoded table's product; all rows ignored: loss 0, gradient 0;
* under bf16 autocast, the log-probs of the bf16-rounded logits (the products run in bf16);
* in float32 over a kernel type (``ops.quantized_matmul``: both products over the stored
  blocks), the dense head of the hidden rows as the kernel rounds them to 8 bits, in float64.

The exact comparisons (float32, entropy, and bf16's float32 reference) run with the kernels
off (``decoded_products``, conftest): over the blocks the logits carry the rows' 8-bit
rounding, which the last test checks on its own.

float32 tolerance ``TOL`` (relative to the largest |value| of each compared tensor): the
products are the same, but the log-sum-exp is summed a vocabulary chunk at a time and the
chunks combined, another order than the dense head's one sum per row, and dH is accumulated
over the chunks. Measured at these sizes: log-probs and losses <= 1.7e-7, dH <= 5.2e-7
relative; a formula error (a wrong row, a missing cap factor) moves them by > 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from torch.autograd import gradcheck

from llamatrain.ops.dequantize import dequantize
from llamatrain.ops.fused import linear_cross_entropy
from llamatrain.ops.logps import linear_logps
from llamatrain.ops.table_head import (
    table_cross_entropy,
    table_logits,
    table_logps,
    table_logps_and_entropy,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # small tensors (conftest)

F64 = torch.float64
TOL = 2e-6
LOG2E, LN2 = math.log2(math.e), math.log(2.0)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def stored(vocab: int, dim: int, qtype: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (vocab, dim) table as ``qtype`` blocks (None: float16), and it decoded."""
    w = torch.randn(vocab, dim, generator=gen(0)) * 0.5
    if qtype is None:
        table = w.half()
        return table, table.float()
    blocks = gguf_quants.quantize(w.numpy(), GGMLQuantizationType[qtype])
    table = torch.from_numpy(blocks)
    return table, dequantize(table, qtype, dim)


def hidden(*shape: int, vocab: int, dtype: torch.dtype = torch.float32, ignore_every: int = 4):
    h = torch.randn(*shape, generator=gen(1), dtype=dtype).requires_grad_(True)
    t = torch.randint(0, vocab, shape[:-1], generator=gen(2))
    t.view(-1)[::ignore_every] = -100
    return h, t


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("chunk", [1, 7, 64])  # vocab 20: one row, a remainder, one chunk
def test_gradcheck_float64(chunk, softcap) -> None:
    h, t = hidden(2, 5, 8, vocab=20, dtype=F64)
    w = torch.randn(20, 8, generator=gen(3), dtype=F64)
    assert gradcheck(lambda h: table_logps(h, w, t, chunk_rows=chunk, softcap=softcap), (h,))
    loss = table_cross_entropy
    assert gradcheck(lambda h: loss(h, w, t, chunk_rows=chunk, softcap=softcap), (h,))


def test_gradcheck_float64_over_blocks() -> None:
    """Q4_0 blocks decoded to float64 (exactly their float32 values)."""
    table, _ = stored(20, 32, "Q4_0")
    h, t = hidden(3, 4, 32, vocab=20, dtype=F64)
    fn = table_logps
    assert gradcheck(lambda h: fn(h, table, t, qtype="Q4_0", chunk_rows=6, softcap=3.0), (h,))


@pytest.mark.usefixtures("decoded_products")
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize(("qtype", "dim"), [("Q4_0", 64), ("Q8_0", 64), ("Q5_1", 96), (None, 48)])
def test_float32_equals_the_dense_head_over_the_decoded_table(qtype, dim, chunk, softcap) -> None:
    table, w = stored(50, dim, qtype)
    h, t = hidden(3, 9, dim, vocab=50)
    up = torch.randn(t.shape, generator=gen(4))
    got = table_logps(h, table, t, qtype=qtype, chunk_rows=chunk, softcap=softcap)
    (got_dh,) = torch.autograd.grad(got, h, up)
    want = linear_logps(h, w, t, softcap=softcap)
    (want_dh,) = torch.autograd.grad(want, h, up)
    assert relative(got, want) <= TOL and relative(got_dh, want_dh) <= TOL

    loss = table_cross_entropy(h, table, t, qtype=qtype, chunk_rows=chunk, softcap=softcap)
    (loss_dh,) = torch.autograd.grad(loss, h)
    want_loss = linear_cross_entropy(h, w, t, softcap=softcap)
    (want_loss_dh,) = torch.autograd.grad(want_loss, h)
    assert relative(loss, want_loss) <= TOL and relative(loss_dh, want_loss_dh) <= TOL


@pytest.mark.usefixtures("decoded_products")
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("scale", [1.0, 40.0])  # logits of ~1 and of ~±100 (peaked rows)
def test_entropy_equals_the_dense_heads_over_the_decoded_table(chunk, softcap, scale) -> None:
    table, w = stored(50, 64, "Q4_0")
    h, t = hidden(3, 9, 64, vocab=50)
    h = (h.detach() * scale).requires_grad_(True)
    logps, entropy = table_logps_and_entropy(
        h, table, t, qtype="Q4_0", chunk_rows=chunk, softcap=softcap
    )
    logits = h.detach().double() @ w.double().t()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logp = logits.log_softmax(-1)
    want = torch.where(t == -100, 0.0, -(logp.exp() * logp).sum(-1))
    assert not entropy.requires_grad and torch.all(entropy[t == -100] == 0)
    # float32 logits carry ~6e-8 of their size in rounding, which the entropy inherits (at
    # scale 40, |Z| ~ 550; measured: <= 1.0e-5 there, 6e-7 at scale 1)
    tol = 1e-6 + 3e-8 * float(logits.abs().max())
    torch.testing.assert_close(entropy.double(), want, rtol=0, atol=tol)
    plain = table_logps(h, table, t, qtype="Q4_0", chunk_rows=chunk, softcap=softcap)
    assert torch.equal(logps, plain)
    (dh,) = torch.autograd.grad(logps.sum(), h)
    assert torch.equal(dh, torch.autograd.grad(plain.sum(), h)[0])


def test_logits_are_the_decoded_tables_product() -> None:
    table, w = stored(50, 64, "Q4_0")
    h, _ = hidden(2, 3, 64, vocab=50)
    with torch.no_grad():
        got = table_logits(h, table, qtype="Q4_0", chunk_rows=7)
        torch.testing.assert_close(got, h @ w.t(), rtol=1e-6, atol=1e-6)


def test_all_rows_ignored_is_zero_with_zero_gradient() -> None:
    table, _ = stored(50, 64, "Q4_0")
    h, t = hidden(2, 3, 64, vocab=50)
    loss = table_cross_entropy(h, table, torch.full_like(t, -100), qtype="Q4_0")
    (dh,) = torch.autograd.grad(loss, h)
    assert loss.item() == 0.0 and not dh.any()


def test_a_table_of_another_shape_is_refused() -> None:
    table, _ = stored(50, 64, "Q4_0")
    h, t = hidden(2, 3, 32, vocab=50)
    with pytest.raises(ValueError, match=r"Q4_0 blocks \(vocab, 18\), got \(50, 36\)"):
        table_logps(h, table, t, qtype="Q4_0")


@pytest.mark.usefixtures("decoded_products")  # the float32 head it is held to: exact
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize(("qtype", "dim", "chunk"), [("Q4_0", 64, 7), ("Q8_0", 256, None)])
def test_bf16_autocast_runs_the_products_in_bf16(qtype, dim, chunk, softcap) -> None:
    """Under bf16 autocast the two products with the table run in bf16, as autocast runs a
    linear lm head: ``h`` and the decoded rows rounded to bf16, float32 accumulation, each
    product rounded to bf16 once; the softmax and its sums stay float32.

    The log-probs are then those of the bf16-rounded logits, to float32 rounding (measured
    <= 4.7e-6 with logits up to 60; the float32 head's differ from them by up to 2^-9 of the
    largest logit: 1e-3 to 4e-3 of the largest log-prob here). dH: against the float32 head,
    within 2^-6 of its largest value (the softmax moved by the logits' rounding, and bf16's
    roundings of its weights and of their product with the rows; measured <= 1.0e-2)."""
    table, w = stored(50, dim, qtype)
    h, t = hidden(3, 9, dim, vocab=50)
    h = (h.detach() * 32 / dim**0.5).requires_grad_(True)  # logits up to ~60: peaked rows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = table_logps(h, table, t, qtype=qtype, chunk_rows=chunk, softcap=softcap)
    (got_dh,) = torch.autograd.grad(got.sum(), h)
    f32 = table_logps(h, table, t, qtype=qtype, chunk_rows=chunk, softcap=softcap)
    (f32_dh,) = torch.autograd.grad(f32.sum(), h)

    bf16 = torch.bfloat16
    z2 = (h.detach() * LOG2E).to(bf16).double() @ w.to(bf16).double().t()
    z2 = z2.to(bf16).double()  # base 2, as the head scores
    if softcap is not None:
        z2 = torch.tanh(z2 / (softcap * LOG2E)) * (softcap * LOG2E)
    logp = (z2 * LN2).log_softmax(-1).gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    want = torch.where(t == -100, 0.0, logp)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert relative(f32, want) > 1e-4  # the float32 head is not what ran
    assert relative(got_dh, f32_dh) <= 2**-6


def eight_bit_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels quantize a product's rows (``ops.quantized_matmul``: int8 per 32
    values, one scale amax/127), in float64."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    return (q.double() * (amax.double() / 127)).reshape(x.shape)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("batch", [3, 24])  # 20 and 162 scored rows: dH over the blocks / decoded
@pytest.mark.parametrize(("qtype", "dim", "chunk"), [("Q4_0", 64, 7), ("Q8_0", 96, None)])
def test_float32_over_the_blocks_is_the_head_of_the_8bit_rows(
    qtype, dim, chunk, batch, softcap
) -> None:
    """Over a kernel type the logits are the kernel's: the hidden rows (times log2(e), as the
    head scores) rounded to 8 bits per 32 values, times the stored rows; dH is the exact
    product of the softmax's weights with the stored rows, over the blocks up to 128 scored
    rows and over decoded chunks past that (``kernel_rows``), the logits the same either way
    and without grad. Against the dense head of those rounded rows in float64: log-probs and
    dH within ``TOL`` (measured <= 1.8e-7 and 3.9e-7: the kernel's integer sums are exact, its
    scales and the head's chunked sums float32), where the exact head is > 1e-4 away (the
    rows' rounding)."""
    table, w = stored(50, dim, qtype)
    h, t = hidden(batch, 9, dim, vocab=50)
    up = torch.randn(t.shape, generator=gen(4))
    got = table_logps(h, table, t, qtype=qtype, chunk_rows=chunk, softcap=softcap)
    (got_dh,) = torch.autograd.grad(got, h, up)

    rounded = eight_bit_rows(h.detach().reshape(-1, dim) * LOG2E) / LOG2E
    rounded = rounded.reshape(h.shape).requires_grad_(True)
    want = linear_logps(rounded, w.double(), t, softcap=softcap)
    (want_dh,) = torch.autograd.grad(want, rounded, up.double())
    assert relative(got.double(), want) <= TOL and relative(got_dh.double(), want_dh) <= TOL
    with torch.no_grad():
        assert torch.equal(
            table_logps(h, table, t, qtype=qtype, chunk_rows=chunk, softcap=softcap), got
        )
    exact = linear_logps(h, w, t, softcap=softcap)
    assert relative(got, exact) > 1e-4  # the exact head is not what ran
