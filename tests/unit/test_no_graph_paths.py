"""Ops that skip their autograd Function where no graph is recorded (``ops.grad_mode``): the
values must be the Function's to the bit (the same operations in the same order), in float64
and float32 alike, so that GRPO's no-grad old-policy log-probs equal its training forward's
exactly (an importance ratio starts at exactly 1)."""

from __future__ import annotations

import pytest
import torch

from llamatrain.ops import rms_norm, rope, swiglu
from llamatrain.ops.activation import geglu
from llamatrain.ops.attention_inference import fused_attention
from llamatrain.ops.grad_mode import records_graph


def _both(op, *inputs):
    """(op over inputs without a graph, op over inputs that need gradients)."""
    with torch.no_grad():
        plain = op(*inputs)
    graphed = op(*(t.clone().requires_grad_() for t in inputs))
    assert graphed.grad_fn is not None  # the Function's path was taken
    return plain, graphed.detach()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_norm_and_gating_without_a_graph_are_the_functions_values(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x, up = (torch.randn(3, 5, 576, generator=g).to(dtype) for _ in range(2))
    for op, inputs in [
        (lambda t: rms_norm(t, 1e-5), (x,)),
        (swiglu, (x, up)),
        (geglu, (x, up)),
    ]:
        plain, graphed = _both(op, *inputs)
        assert plain.dtype == dtype and torch.equal(plain, graphed)


@pytest.mark.parametrize("mode", ["norm", "neox"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rope_without_a_graph_is_the_functions_rotation(mode, dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 64, generator=g, dtype=dtype)
    pos = torch.tensor([[7, 8, 9], [0, 1, 2]])
    factors = torch.rand(32, generator=g, dtype=torch.float64) + 0.5
    for kwargs in [{}, dict(theta=5e5, freq_scale=0.25, freq_factors=factors)]:
        plain, graphed = _both(lambda t, kw=kwargs: rope(t, pos, mode=mode, **kw), x)
        assert torch.equal(plain, graphed)


def test_records_graph_follows_grad_mode_and_requires_grad() -> None:
    x, w = torch.ones(2), torch.ones(2, requires_grad=True)
    assert not records_graph(x, None) and records_graph(x, w)
    with torch.no_grad():
        assert not records_graph(w)


def test_a_decoding_steps_mask_is_rebuilt_when_its_padding_changes() -> None:
    """The mask memo of a decoding step's layers (``_mask_of_step``) follows every in-place
    write to the cache's padding: a hidden key at one step, seen at the next."""
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 1, 8, generator=g), *torch.randn(2, 2, 2, 6, 8, generator=g)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    args = (True, 0.35, None)
    with torch.no_grad():
        seen = fused_attention(q, k, v, *args, padding[:, :6])
        padding[0, 2] = True
        hidden = fused_attention(q, k, v, *args, padding[:, :6])
        alone = fused_attention(
            q[:1], k[:1, :, [0, 1, 3, 4, 5]], v[:1, :, [0, 1, 3, 4, 5]], *args, None
        )
    assert torch.equal(seen[1], hidden[1]) and not torch.equal(seen[0], hidden[0])
    torch.testing.assert_close(hidden[:1], alone, atol=1e-6, rtol=0)
