"""Attention's ``padding`` (a ragged batch's left padding as key columns to hide): every attention
choice of both op sets, forward and backward, equals a reference written here from the rule —
query i (at kv position i + t_kv - t) sees key j iff ``j <= i``, within the window, and key j is
not padding unless it is the query's own position — in float64, to 1e-12 (the reductions' order
differs, nothing else).

Shapes: a prompt pass (t == t_kv) and a decode step against a cache (t = 1), grouped-query heads,
with and without a sliding window, rows with 0, 2 and 5 padding columns.
"""

from __future__ import annotations

import math

import pytest
import torch

from llamatrain.ops.sets import ATTENTIONS, OPS, op_set

B, H, HKV, D, T_KV = 3, 4, 2, 8, 9
PADS = [0, 2, 5]


def reference(q, k, v, padding, window):
    """softmax(Q·Kᵀ/sqrt(D) + mask)·V from the rule in the module docstring, heads repeated."""
    t, t_kv = q.shape[2], k.shape[2]
    rows = torch.arange(t)[:, None] + (t_kv - t)
    cols = torch.arange(t_kv)[None, :]
    visible = cols <= rows
    if window is not None:
        visible = visible & (rows - cols < window)
    visible = visible & (~padding[:, None, None, :] | (cols == rows))
    k, v = (x.repeat_interleave(H // HKV, dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~visible, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("ops", OPS)
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("t", [T_KV, 1])
@pytest.mark.parametrize("window", [None, 3])
def test_padding_keys_are_hidden_from_every_query_but_their_own(ops, attention, t, window):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, t, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, HKV, T_KV, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, HKV, T_KV, D, generator=g, dtype=torch.float64, requires_grad=True)
    padding = torch.arange(T_KV)[None, :] < torch.tensor(PADS)[:, None]
    out = op_set(ops, attention).attention(q, k, v, None, window=window, padding=padding)
    expected = reference(q, k, v, padding, window)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    if t == 1:  # a decode step's query is real: nothing flows to the padding's values
        assert bool((ours[2].abs().sum(dim=(1, 3))[padding] == 0).all())


def test_padding_must_mark_each_key_column():
    q = k = v = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match=r"padding must be \(1, 4\) bools"):
        op_set("ggml", "flash").attention(q, k, v, None, padding=torch.zeros(1, 3, dtype=bool))
