"""Packed documents: attention and rope positions restart at every document boundary.

Several examples share one training row; ``documents`` (batch, seq) says which example each
token belongs to. The proofs: ``flash_attn`` with documents is the true derivative (float64
gradcheck) of the attention a dense mask computes, it saves nothing T×T, and a packed row
through ``Llama`` gives each document exactly what running it alone gives.
"""

from __future__ import annotations

import pytest
import torch
from test_flash_attn import _inputs, assert_same_attention  # the same random q, k, v

from llamatrain import activation_checkpointing as ac
from llamatrain.model import KVCache, Llama, ModelConfig, document_positions
from llamatrain.ops.attention import flash_attn
from llamatrain.ops.sets import IGNORE_INDEX

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors (conftest)


def _documents(*lengths_per_row: tuple[int, ...]) -> torch.Tensor:
    """(rows, T) ids: row r holds documents of the given lengths, numbered in order."""
    rows = [
        torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        for lengths in lengths_per_row
    ]
    return torch.stack(rows)


def _dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor
) -> torch.Tensor:
    """Explicit T×T mask (causal and same document) and a plain softmax, K/V repeated."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    t = q.shape[2]
    idx = torch.arange(t)
    visible = (idx[None, :] <= idx[:, None]) & (documents[:, :, None] == documents[:, None, :])
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# Documents that cross the 4-row blocks, a one-token document, and rows laid out differently.
_DOCS = _documents((3, 6, 1, 3), (1, 9, 3))


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_flash_attn_with_documents_passes_gradcheck(heads: tuple[int, int]) -> None:
    q, k, v = _inputs(2, *heads, t=13, s=13, d=4, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attn(q, k, v, block_size=4, documents=_DOCS), (q, k, v)
    )


@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
@pytest.mark.parametrize("block", [4, 5, 64])
def test_flash_attn_with_documents_matches_dense_mask(heads: tuple[int, int], block: int) -> None:
    q, k, v = _inputs(2, *heads, t=13, s=13, d=8, dtype=torch.float32, seed=1)
    ref = _dense_reference(q, k, v, _DOCS)
    out = flash_attn(q, k, v, block_size=block, documents=_DOCS)
    # float32, O(1) values, sums over <= 13 keys in another order: ~1e-6 apart; 1e-5 leaves room.
    assert_same_attention(out, ref, (q, k, v), tol=1e-5)


def test_flash_attn_with_documents_saves_nothing_quadratic() -> None:
    t = 128
    q, k, v = _inputs(1, 2, 1, t, t, 4, torch.float32)
    docs = _documents((40, 1, 87))
    saved: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = flash_attn(q, k, v, block_size=16, documents=docs)
    out.sum().backward()
    assert saved, "autograd saved nothing: the hook did not see the graph"
    assert max(saved) < t * t


def test_document_positions_restart_at_each_document() -> None:
    docs = _documents((3, 1, 4), (8,))
    want = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3], list(range(8))])
    assert torch.equal(document_positions(docs), want)


def test_blocks_receive_positions_within_each_document() -> None:
    """Rope scores depend only on i - j, so logits cannot show the restart: check the wiring.

    Restarting gives each document the rope angles (and their rounding) it has unpacked, which
    the exact float64 comparison of the packed-row test cannot see.
    """
    model = Llama(ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=8, max_seq_len=16))
    seen: list[torch.Tensor] = []
    model.blk[0].register_forward_pre_hook(lambda _, args: seen.append(args[1].pos))
    docs = _documents((3, 1, 4))
    model(torch.zeros(1, 8, dtype=torch.long), documents=docs)
    assert torch.equal(seen[0], torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]]))


def test_documents_need_causal_self_attention_and_no_cache() -> None:
    q, k, v = _inputs(2, 2, 2, 13, 13, 4, torch.float32)
    with pytest.raises(ValueError, match="causal"):
        flash_attn(q, k, v, causal=False, documents=_DOCS)
    model = Llama(ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=8, max_seq_len=16))
    cache = KVCache(model.cfg, 1, 4, "cpu", torch.float32)
    with pytest.raises(ValueError, match="KV cache"):
        model(
            torch.zeros(1, 4, dtype=torch.long),
            cache=cache,
            documents=torch.zeros(1, 4, dtype=torch.long),
        )


# Lengths that put document edges inside the 64-row flash blocks, one a single token; the last
# block's rows all belong to the third document, so it skips the first two's kv columns.
_LENGTHS = (70, 1, 79)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("attention", ["flash", "softmax"])
@pytest.mark.parametrize("ops", ["ggml", "torch"])
def test_packed_row_equals_each_document_alone(
    ops: str, attention: str, checkpointing: str
) -> None:
    cfg = ModelConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=48, max_seq_len=160, ops=ops,
        attention=attention,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Llama(cfg).double()
    ac.apply(model, checkpointing)
    t = sum(_LENGTHS)
    tokens = torch.randint(0, cfg.vocab_size, (1, t))
    docs = _documents(_LENGTHS)
    targets = tokens.roll(-1, dims=1)
    targets[docs != docs.roll(-1, dims=1)] = IGNORE_INDEX  # no target across a boundary
    targets[:, -1] = IGNORE_INDEX

    params = list(model.parameters())
    packed_logits = model(tokens, documents=docs)
    packed_grads = torch.autograd.grad(model.loss(tokens, targets, documents=docs), params)

    # The packed loss is the mean over all targets: Σ_d (n_d / N) · (document d's mean loss).
    n_targets = int((targets != IGNORE_INDEX).sum())
    alone_grads = [torch.zeros_like(p) for p in params]
    start = 0
    for length in _LENGTHS:
        span = slice(start, start + length)
        start += length
        # float64 throughout: only summation order differs (~1e-15); 1e-10 is far below any
        # leak across documents (O(1e-2) in logits) or a wrong rope position.
        logits = model(tokens[:, span])
        torch.testing.assert_close(packed_logits[:, span], logits, atol=1e-10, rtol=1e-10)
        n = int((targets[:, span] != IGNORE_INDEX).sum())
        if n == 0:
            continue
        loss = model.loss(tokens[:, span], targets[:, span]) * (n / n_targets)
        for total, g in zip(alone_grads, torch.autograd.grad(loss, params), strict=True):
            total += g
    for got, want in zip(packed_grads, alone_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_documents_none_is_the_plain_causal_path() -> None:
    """One document covering the row gives the same logits as no documents at all."""
    model = Llama(ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=8, max_seq_len=16))
    tokens = torch.randint(0, 8, (2, 9))
    # float32 with the same arithmetic up to mask construction: equal to rounding.
    torch.testing.assert_close(
        model(tokens, documents=torch.zeros(2, 9, dtype=torch.long)), model(tokens)
    )
