"""The LoRA-adapted linear (``ops.lora_linear`` and ``ops.torch_lora_linear``).

* float64 ``gradcheck`` of the written-out backward: x, A and B (and W when it is made
  trainable), with the adapter reading x itself or a separate (dropped-out) input;
* float32 agreement of the two op sets, forward and every gradient;
* agreement with PEFT's own LoRA layer (``peft.tuners.lora.Linear`` around an
  ``nn.Linear`` with a bias) on the same W, bias, A and B, with dropout too: same seed, same
  mask, so the outputs and gradients match;
* the point of the op: with W frozen no (out, in) tensor is ever made (W + s·B·A is never
  materialised, nor W's gradient); under bf16 autocast the backward runs in bf16 like the
  forward;
* a base kept narrower (QLoRA): float64 gradcheck with W widened in row chunks; Q8_0/Q4_0
  blocks from gguf-py's quantizer give what the float32 op gives on gguf-py's dequantized W;
  a bf16/f16 W what it gives on the rounded W; a quantized W is never widened whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.autograd import gradcheck
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llamatrain.lora import LoraLinear
from llamatrain.model import Linear
from llamatrain.ops import lora_linear, torch_lora_linear
from llamatrain.ops.sets import op_set

F64 = torch.float64
SCALE_TOL = 1e-6
"""float32 agreement, relative to the largest value compared: measured at most 2.0e-7 (two
ulps) against PEFT and between the op sets, which sum in different orders (PEFT scales G
before multiplying by B, we after). Elementwise tolerances would not do: a gradient entry
that cancels to near zero keeps the rounding of its large terms."""
OPS = {"ggml": lora_linear, "torch": torch_lora_linear}


def randn(*shape: int, seed: int, dtype: torch.dtype = F64, grad: bool = True) -> torch.Tensor:
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return t.requires_grad_(grad)


def assert_close_to_scale(
    actual: torch.Tensor, expected: torch.Tensor, tol: float = SCALE_TOL
) -> None:
    error = (actual.double() - expected.double()).abs().max().item()
    scale = expected.abs().max().item()
    assert error <= tol * scale, f"max |Δ| = {error:.2e} on values up to {scale:.2e}"


def operands(n_in: int, n_out: int, rank: int, dtype: torch.dtype = F64, w_grad: bool = False):
    """W, A, B with B nonzero (a fresh adapter's zero B would hide every error in dA)."""
    return (
        randn(n_out, n_in, seed=1, dtype=dtype, grad=w_grad),
        randn(rank, n_in, seed=2, dtype=dtype),
        randn(n_out, rank, seed=3, dtype=dtype),
    )


@pytest.mark.parametrize(
    ("x_shape", "n_out", "rank"),
    [((7,), 5, 2), ((3, 6), 4, 1), ((2, 3, 8), 9, 3), ((1, 1, 4), 4, 4)],
)
@pytest.mark.parametrize("w_grad", [False, True])
def test_lora_linear_gradcheck(x_shape: tuple, n_out: int, rank: int, w_grad: bool) -> None:
    x = randn(*x_shape, seed=0)
    w, a, b = operands(x_shape[-1], n_out, rank, w_grad=w_grad)
    assert gradcheck(lambda *t: lora_linear(*t, 0.75), (x, w, a, b))


def test_lora_linear_gradcheck_with_a_separate_adapter_input() -> None:
    """Dropout gives the adapter its own input x'; the gradient reaches x through both."""
    x, x_adapter = randn(2, 3, 6, seed=0), randn(2, 3, 6, seed=4)
    w, a, b = operands(6, 5, 2)
    assert gradcheck(lambda *t: lora_linear(*t[:4], 1.5, t[4]), (x, w, a, b, x_adapter))
    mask = (randn(2, 3, 6, seed=5, grad=False) > 0).to(F64) * 2.0
    assert gradcheck(lambda *t: lora_linear(*t, 1.5, t[0] * mask), (x, w, a, b))


@pytest.mark.parametrize("separate", [False, True])
def test_both_op_sets_agree_in_float32(separate: bool) -> None:
    x = randn(4, 9, 48, seed=0, dtype=torch.float32)
    w, a, b = operands(48, 40, 8, dtype=torch.float32, w_grad=True)
    x_adapter = randn(4, 9, 48, seed=4, dtype=torch.float32) if separate else None
    inputs = (x, w, a, b) + ((x_adapter,) if separate else ())
    up = randn(4, 9, 40, seed=5, dtype=torch.float32, grad=False)
    results = []
    for op in OPS.values():
        out = op(x, w, a, b, 0.5, x_adapter)
        results.append((out, torch.autograd.grad(out, inputs, up)))
    (out, grads), (ref, grads_ref) = results
    for value, reference in zip((out, *grads), (ref, *grads_ref), strict=True):
        assert_close_to_scale(value, reference)


def peft_layer(n_in: int, n_out: int, rank: int, alpha: float, dropout: float) -> nn.Module:
    """PEFT's LoRA layer around an ``nn.Linear`` with a bias, A and B random (nonzero)."""
    holder = nn.Module()
    holder.proj = nn.Linear(n_in, n_out)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=["proj"])
    layer = get_peft_model(holder, config).base_model.model.proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0.0, 0.5)
    return layer


def ours_on_the_same_weights(layer: nn.Module, rank: int, alpha: float, dropout: float, ops: str):
    """Our ``LoraLinear`` holding the PEFT layer's W, bias, A and B (copies)."""
    base_layer = layer.base_layer
    base = Linear(base_layer.in_features, base_layer.out_features, op_set(ops), bias=True)
    with torch.no_grad():
        base.weight.copy_(base_layer.weight)
        base.bias.copy_(base_layer.bias)
    ours = LoraLinear(base, rank, alpha, dropout, base.ops)
    with torch.no_grad():
        ours.lora_a.copy_(layer.lora_A["default"].weight)
        ours.lora_b.copy_(layer.lora_B["default"].weight)
    return ours


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_matches_peft_lora_layer(ops: str, dropout: float) -> None:
    """Same output and same gradients of x, A and B as PEFT's layer; with dropout, the same
    seed gives the same mask (both drop x on the adapter path only, with ``F.dropout``)."""
    rank, alpha = 4, 12.0
    torch.manual_seed(0)
    layer = peft_layer(24, 20, rank, alpha, dropout).train()
    ours = ours_on_the_same_weights(layer, rank, alpha, dropout, ops).train()
    x = randn(3, 5, 24, seed=7, dtype=torch.float32)
    up = randn(3, 5, 20, seed=8, dtype=torch.float32, grad=False)
    results = []
    for module, a, b in (
        (layer, layer.lora_A["default"].weight, layer.lora_B["default"].weight),
        (ours, ours.lora_a, ours.lora_b),
    ):
        torch.manual_seed(123)
        out = module(x)
        results.append((out, torch.autograd.grad(out, (x, a, b), up)))
    (out, grads), (ref, grads_ref) = results
    for value, reference in zip((out, *grads), (ref, *grads_ref), strict=True):
        assert_close_to_scale(value, reference)
    if dropout:  # the mask mattered: without it the output differs
        assert_close_to_scale(ours.eval()(x), layer.eval()(x))
        assert not torch.allclose(ours.eval()(x), out)


class _CreatedShapes(TorchDispatchMode):
    """Records the shape of every tensor any aten op creates while active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_no_out_by_in_tensor_is_made_for_a_frozen_base() -> None:
    n_in, n_out, rank = 48, 40, 4
    x = randn(6, 11, n_in, seed=0, dtype=torch.float32)
    w, a, b = operands(n_in, n_out, rank, dtype=torch.float32)
    with _CreatedShapes() as created:
        lora_linear(x, w, a, b, 2.0).sum().backward()
    assert (n_out, n_in) not in created.shapes
    assert w.grad is None
    assert a.grad.shape == (rank, n_in) and b.grad.shape == (n_out, rank)
    with _CreatedShapes() as created:  # the probe sees one when there is one
        lora_linear(x, w.detach().requires_grad_(), a, b, 2.0).sum().backward()
    assert (n_out, n_in) in created.shapes


def test_backward_runs_under_the_forwards_autocast() -> None:
    """bf16 autocast over float32 parameters, as training with ``train.dtype = bfloat16``:
    output bf16, gradients float32, both op sets within bf16 rounding of the float32 result
    (2e-2 of the largest value; one bf16 rounding is 4e-3)."""
    x = randn(3, 7, 32, seed=0, dtype=torch.float32)
    w, a, b = operands(32, 24, 4, dtype=torch.float32)
    up = randn(3, 7, 24, seed=5, dtype=torch.float32, grad=False)
    ref = lora_linear(x, w, a, b, 0.5)
    grads_ref = torch.autograd.grad(ref, (x, a, b), up)
    for op in OPS.values():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = op(x, w, a, b, 0.5)
        grads = torch.autograd.grad(out, (x, a, b), up.to(out.dtype))
        assert out.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads)
        for value, reference in zip((out, *grads), (ref, *grads_ref), strict=True):
            assert_close_to_scale(value, reference, tol=2e-2)


def test_shape_mismatch_is_refused() -> None:
    w, a, b = operands(6, 5, 2)
    with pytest.raises(ValueError, match="lora_a \\(r, in\\)"):
        lora_linear(randn(3, 6, seed=0), w, a, b.t(), 1.0)
    with pytest.raises(ValueError, match="lora_linear"):
        lora_linear(randn(3, 7, seed=0), w, a, b, 1.0)


def test_no_grad_mode_and_inputs_without_grad() -> None:
    w, a, b = operands(6, 5, 2)
    x = randn(3, 6, seed=0, grad=False)
    with torch.no_grad():
        assert not lora_linear(x, w, a, b, 1.0).requires_grad
    frozen = [t.detach() for t in (w, a, b)]
    assert not lora_linear(x, *frozen, 1.0).requires_grad
    expected = F.linear(x, w) + F.linear(F.linear(x, a), b)
    torch.testing.assert_close(lora_linear(x, *frozen, 1.0), expected.detach())


# ---- a frozen base kept narrower than float32 (bf16/f16, GGUF blocks: QLoRA) ----------------


def test_gradcheck_with_the_base_in_row_chunks() -> None:
    """dx, dA, dB in float64 with W's rows taken 3 at a time (W has 10): the chunked
    forward (columns of y) and the chunked dx (a sum over chunks) are the same function."""
    weight, lora_a, lora_b = operands(8, 10, 2)
    x = randn(2, 3, 8, seed=0)

    def chunked(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return lora_linear(x, weight, a, b, 0.5, chunk_rows=3)

    assert gradcheck(chunked, (x, lora_a, lora_b))


def quantized_base(qtype: str, n_out: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W's blocks as gguf-py's quantizer writes them (uint8 (out, row_bytes)) and gguf-py's
    own dequantization of them (float32): the reference the op is held to."""
    weights = randn(n_out, n_in, seed=11, dtype=torch.float32, grad=False).numpy()
    kind = GGMLQuantizationType[qtype]
    blocks = gguf_quants.quantize(weights, kind)
    return torch.from_numpy(blocks), torch.from_numpy(gguf_quants.dequantize(blocks, kind))


def grads_of(op, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, **kwargs):
    x, lora_a, lora_b = (t.detach().requires_grad_() for t in (x, lora_a, lora_b))
    y = op(x, kwargs.pop("weight"), lora_a, lora_b, 0.5, **kwargs)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
    return y.detach(), x.grad, lora_a.grad, lora_b.grad


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("ops", OPS)
def test_quantized_base_is_the_op_on_its_dequantized_weight(qtype: str, ops: str) -> None:
    """Blocks in, chunks of 5 rows widened at a time: y, dx, dA, dB equal the float32 op on
    gguf-py's dequantized W within float32 rounding (SCALE_TOL; the chunked sums group
    the same products as the whole matmul, so only summation order differs)."""
    blocks, dense = quantized_base(qtype, 24, 64)
    _, lora_a, lora_b = operands(64, 24, 4, dtype=torch.float32)
    x = randn(3, 64, seed=0, dtype=torch.float32)
    chunking = {"chunk_rows": 5} if ops == "ggml" else {}
    got = grads_of(OPS[ops], x, lora_a, lora_b, weight=blocks, qtype=qtype, **chunking)
    want = grads_of(lora_linear, x, lora_a, lora_b, weight=dense)
    for actual, expected in zip(got, want, strict=True):
        assert_close_to_scale(actual, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_base_is_the_op_on_its_rounded_weight(dtype: torch.dtype) -> None:
    """A bf16/f16 W with float32 x (widened by chunks, default size) == the float32 op on
    W rounded to that type and widened back: the storage rounds W, nothing else."""
    weight, lora_a, lora_b = operands(32, 16, 4, dtype=torch.float32)
    x = randn(2, 5, 32, seed=0, dtype=torch.float32)
    stored = weight.detach().to(dtype)
    got = grads_of(lora_linear, x, lora_a, lora_b, weight=stored)
    want = grads_of(lora_linear, x, lora_a, lora_b, weight=stored.float())
    for actual, expected in zip(got, want, strict=True):
        assert_close_to_scale(actual, expected)


def test_no_float_copy_of_a_quantized_base_is_whole() -> None:
    """With chunks of 4 rows of a 16-row Q8_0 W, no float tensor the size of W (out, in) is
    made, forward or backward: only chunks are widened."""
    blocks, _ = quantized_base("Q8_0", 16, 64)
    _, lora_a, lora_b = operands(64, 16, 2, dtype=torch.float32)
    x = randn(3, 64, seed=0, dtype=torch.float32)
    with _CreatedShapes() as created:
        lora_linear(x, blocks, lora_a, lora_b, 1.0, qtype="Q8_0", chunk_rows=4).sum().backward()
    assert (16, 64) not in created.shapes and (4, 64) in created.shapes
    with _CreatedShapes() as created:  # the probe sees one when there is one (the reference)
        torch_lora_linear(x, blocks, lora_a, lora_b, 1.0, qtype="Q8_0").sum().backward()
    assert (16, 64) in created.shapes


class _Casts(TorchDispatchMode):
    """The bf16 tensors cast from float32 while active (autocast's casts and the op's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16:
            self.made.append(out)
        return out

    def shapes(self, n_cols: int) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in self.made if t.shape[-1] == n_cols]


def test_under_bf16_autocast_each_chunk_is_rounded_to_bf16_once() -> None:
    """Each widened chunk of W goes to the bf16 matmul as the float32 decode rounded once, and
    x is cast once for all the forward's chunks, not once per chunk. 5 chunks of a (24, 64)
    Q4_0 W: forward, x cast for the adapter's product and once for the base's, each chunk
    once, bit for bit gguf-py's float32 dequantization rounded to bf16; backward, each chunk
    once again."""
    blocks, dense = quantized_base("Q4_0", 24, 64)
    _, a, b = operands(64, 24, 4, dtype=torch.float32)
    x = randn(3, 64, seed=0, dtype=torch.float32)
    chunks = [(5, 64)] * 4 + [(4, 64)]
    with _Casts() as casts, torch.autocast("cpu", dtype=torch.bfloat16):
        out = lora_linear(x, blocks, a, b, 0.5, qtype="Q4_0", chunk_rows=5)
        assert casts.shapes(64) == [(3, 64)] * 2 + chunks
        decoded = torch.cat(casts.made[-len(chunks) - 1 : -1])  # the last: B for its product
        assert torch.equal(decoded, dense.to(torch.bfloat16))
        casts.made.clear()
        out.float().sum().backward()
    assert [s for s in casts.shapes(64) if s[0] != 3] == chunks + [(4, 64)]  # and A


def test_quantized_base_under_bf16_autocast() -> None:
    """Training with ``train.dtype = bfloat16`` over Q4_0 blocks in chunks of 5 rows: output
    bf16, gradients float32, within bf16 rounding of the float32 op on the dequantized W
    (2e-2 of the largest value, as for a float32 base above)."""
    blocks, dense = quantized_base("Q4_0", 24, 64)
    _, a, b = operands(64, 24, 4, dtype=torch.float32)
    x = randn(3, 64, seed=0, dtype=torch.float32)
    up = randn(3, 24, seed=5, dtype=torch.float32, grad=False)
    ref = lora_linear(x, dense, a, b, 0.5)
    grads_ref = torch.autograd.grad(ref, (x, a, b), up)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lora_linear(x, blocks, a, b, 0.5, qtype="Q4_0", chunk_rows=5)
    grads = torch.autograd.grad(out, (x, a, b), up.to(out.dtype))
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in grads)
    for value, reference in zip((out, *grads), (ref, *grads_ref), strict=True):
        assert_close_to_scale(value, reference, tol=2e-2)
