"""A preference pair's chosen and rejected replies share their prompt's computation.

The data lays a pair as one document: its prompt but the last token once (the trunk), then a
branch per reply that starts from that last prompt token (``llamatrain.data.preferences``);
attention lets a branch see the trunk and itself, and rope gives each branch the positions it
has unshared (``llamatrain.ops.attention``). The proofs: for every op set and attention path,
and for llama, qwen3 and gemma3 (sliding windows reaching across the branch gap, soft-capped
logits), packed or not, each pair's summed chosen/rejected log-probs and their gradients equal
those of each reply run alone after its prompt; the flash op with branches is the true
derivative (float64 gradcheck) of an explicitly built mask, with small blocks whose kv columns
start inside a trunk; and a row holds prompt length - 1 fewer tokens per pair.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from random_models import move_off_neutral
from test_flash_attn import _inputs, assert_same_attention  # the same random q, k, v

from llamatrain.data.examples import Example
from llamatrain.data.preferences import Pair, cut_pairs, pair_rows
from llamatrain.model import Llama, ModelConfig, document_positions
from llamatrain.objectives.preference.losses import pair_logps, token_logps
from llamatrain.ops.attention import flash_attn
from llamatrain.ops.sets import IGNORE_INDEX

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors (conftest)

VOCAB = 40
ARCHS = {
    "llama": dict(arch="llama", n_layers=2),
    "qwen3": dict(arch="qwen3", n_layers=2),
    # every layer but the last slides a window of 4: shorter than the 9-token prompts, so a
    # reply's window reaches back into the prompt across the other reply's branch
    "gemma3": dict(
        arch="gemma3", n_layers=3, sliding_window=4, rope_theta_swa=500.0, final_logit_softcap=2.0
    ),
}
PROMPTS = (9, 9, 1, 7)  # a 1-token prompt leaves no trunk: two branches from position 0


def random_pairs(seed: int = 0) -> list[Pair]:
    """Pairs whose replies to one prompt differ in length; only the replies are scored."""
    rng = np.random.default_rng(seed)

    def example(prompt: np.ndarray, reply: int) -> Example:
        ids = np.concatenate([prompt, rng.integers(3, VOCAB, reply)]).astype(np.int64)
        return Example(ids, np.arange(len(ids)) >= len(prompt))

    pairs = []
    for length in PROMPTS:
        prompt = rng.integers(3, VOCAB, length)
        pairs.append(Pair(example(prompt, 2 + len(pairs)), example(prompt, 5 - len(pairs))))
    return pairs


def random_model(arch: str, ops: str, attention: str) -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=32, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=64, ops=ops,
        attention=attention, **ARCHS[arch],
    )  # fmt: skip
    return move_off_neutral(Llama(cfg))


def alone(model: Llama, example: Example) -> torch.Tensor:
    """The summed log-prob of an example's scored tokens, run as a sequence of its own."""
    ids = torch.from_numpy(example.ids)[None]
    targets = torch.where(torch.from_numpy(example.scored)[None, 1:], ids[:, 1:], IGNORE_INDEX)
    return token_logps(model(ids[:, :-1]), targets).sum()


def gradients(model: Llama, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("arch", "ops", "attention"),
    list(itertools.product(ARCHS, ("ggml", "torch"), ("flash", "softmax", "sdpa"))),
)
def test_shared_prompts_give_each_reply_what_it_has_alone(arch, ops, attention) -> None:
    """float32 sums of 2-5 log-probs near -ln 40 (|sum| < 25, an ulp ~2e-6): a shared row
    computes every logit through other matmul shapes and softmaxes over other keys (masked
    ones add exact zeros), so the sums differ by a few ulp (<= 2e-6 seen); 1e-5 leaves room,
    while a key too many or a rope position off by one moves them by more than 1e-2. The same
    holds for gradients relative to each parameter's largest entry."""
    model, pairs = random_model(arch, ops, attention), random_pairs()
    weights = torch.randn(2, len(pairs), generator=torch.Generator().manual_seed(1))
    chosen = torch.stack([alone(model, p.chosen) for p in pairs])
    rejected = torch.stack([alone(model, p.rejected) for p in pairs])
    want = gradients(model, weights[0] @ chosen + weights[1] @ rejected)
    for packing in (True, False):
        rows = pair_rows(pairs, 40, 2, packing=packing)
        assert (len(rows) < len(pairs)) == packing
        batch = rows.batch(np.arange(len(rows)))
        logits = model(batch.inputs, documents=batch.documents)
        shared = pair_logps(token_logps(logits, batch.targets), batch.targets, batch.documents)
        torch.testing.assert_close(shared.chosen, chosen, rtol=0, atol=1e-5)
        torch.testing.assert_close(shared.rejected, rejected, rtol=0, atol=1e-5)
        got = gradients(model, weights[0] @ shared.chosen + weights[1] @ shared.rejected)
        for name, grad in want.items():
            error = (got[name] - grad).abs().max() / grad.abs().max()
            assert error <= 1e-5, (name, float(error))


def test_a_row_holds_each_prompt_once_but_its_last_token() -> None:
    pairs = random_pairs()
    for packing in (True, False):
        rows = pair_rows(pairs, 40, 2, packing=packing)
        unshared = sum(len(p.chosen.ids) + len(p.rejected.ids) for p in pairs)
        saved = sum(max(length - 1, 0) for length in PROMPTS)
        assert int(rows.filled.sum()) == unshared - saved
    pair = pairs[0]  # prompt P = 9 tokens, chosen reply 2, rejected reply 5
    row = pair_rows([pair], 40, 2, packing=False)
    n = len(pair)
    prompt = pair.chosen.ids[:9].tolist()
    chosen, rejected = pair.chosen.ids[9:].tolist(), pair.rejected.ids[9:].tolist()
    assert row.tokens[0, :n].tolist() == prompt + chosen + prompt[-1:] + rejected
    assert row.documents[0, :n, 1].tolist() == [0] * 8 + [1] * 3 + [2] * 6
    assert row.documents[0, :n, 0].tolist() == [0] * n
    assert row.documents[0, n:, 0].tolist() == list(range(1, 41 - n))  # each padding token
    positions = document_positions(torch.from_numpy(row.documents))[0, :n]
    assert positions.tolist() == [*range(11), *range(8, 14)]


def test_a_pair_is_cut_only_past_what_its_shared_layout_fits() -> None:
    pair = random_pairs()[0]  # 11 + 14 tokens, 17 with the 8-token trunk laid once
    (whole,), cut, dropped = cut_pairs([pair], 17)
    assert (whole, cut, dropped) == (pair, 0, 0)
    (short,), cut, dropped = cut_pairs([pair], 15)  # 7 left for branches of 3 and 6
    assert (cut, dropped) == (1, 0) and short.trunk == pair.trunk and len(short) == 15
    assert (len(short.chosen.ids), len(short.rejected.ids)) == (11, 12)
    assert np.array_equal(short.rejected.ids, pair.rejected.ids[:12])
    assert cut_pairs([pair], 9) == ([], 1, 1)  # the trunk leaves one token: no reply scored


# ---- the flash op with branches -----------------------------------------------------------


def _layout(*rows: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(documents, branches) of rows given as (branch, length) runs; branch 0 after another
    starts the next document."""
    documents, branches = [], []
    for runs in rows:
        doc, last, ids, brs = 0, 0, [], []
        for branch, length in runs:
            if ids and branch <= last:
                doc += 1
            ids += [doc] * length
            brs += [branch] * length
            last = branch
        documents.append(ids)
        branches.append(brs)
    return torch.tensor(documents), torch.tensor(branches)


# Row 0: a pair (trunk 3, chosen 3, rejected 2) then one (trunk 1, chosen 2, rejected 2);
# row 1: a pair (trunk 4, chosen 3, rejected 3), then padding. 4-row blocks start inside
# branches, whose windows reach back into the trunk past the other branch: the block of rows
# 4-7 of row 0 needs key 1 for its row 6 (a rejected token at position 3), not for its first.
_DOCS, _BRANCHES = _layout(
    [(0, 3), (1, 3), (2, 2), (0, 1), (1, 2), (2, 2)], [(0, 4), (1, 3), (2, 3), (0, 3)]
)


def _dense(q, k, v, window: int | None, softcap: float | None) -> torch.Tensor:
    """Attention with a mask built by listing each query's keys: its document's trunk, then
    its own branch, up to itself -- the unshared sequence -- of which a window keeps the last
    ``window``."""
    b, t = _DOCS.shape
    visible = torch.zeros(b, t, t, dtype=torch.bool)
    for row, i in itertools.product(range(b), range(t)):
        doc, branch = int(_DOCS[row, i]), int(_BRANCHES[row, i])
        keys = [
            j
            for j in range(i + 1)
            if _DOCS[row, j] == doc and int(_BRANCHES[row, j]) in (0, branch)
        ]
        visible[row, i, keys[-window:] if window else keys] = True
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1) @ v


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, None), (3, 2.0)])
def test_flash_attn_with_branches_passes_gradcheck(window, softcap) -> None:
    q, k, v = _inputs(2, 4, 2, t=13, s=13, d=4, dtype=torch.float64)

    def attend(q, k, v):
        return flash_attn(
            q, k, v, block_size=4, documents=_DOCS, branches=_BRANCHES, window=window,
            softcap=softcap,
        )  # fmt: skip

    assert torch.autograd.gradcheck(attend, (q, k, v))
    torch.testing.assert_close(attend(q, k, v), _dense(q, k, v, window, softcap))


@pytest.mark.parametrize("block", [3, 4, 64])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (2, None), (3, 2.0)])
def test_flash_attn_with_branches_matches_the_explicit_mask(block, window, softcap) -> None:
    q, k, v = _inputs(2, 4, 2, t=13, s=13, d=8, dtype=torch.float32, seed=1)
    out = flash_attn(
        q, k, v, block_size=block, documents=_DOCS, branches=_BRANCHES, window=window,
        softcap=softcap,
    )  # fmt: skip
    ref = _dense(q, k, v, window, softcap)
    # float32, O(1) values, sums over <= 13 keys in another order (as test_document_mask)
    assert_same_attention(out, ref, (q, k, v), tol=1e-5)


def test_branches_need_documents_of_their_shape() -> None:
    q, k, v = _inputs(2, 2, 2, 13, 13, 4, torch.float32)
    with pytest.raises(ValueError, match="pass documents"):
        flash_attn(q, k, v, branches=_BRANCHES)
    with pytest.raises(ValueError, match="shaped like documents"):
        flash_attn(q, k, v, documents=_DOCS, branches=_BRANCHES[:, :5])
    backwards = torch.stack([_DOCS, _BRANCHES.flip(1)], dim=-1)
    with pytest.raises(ValueError, match="non-decreasing within each document"):
        document_positions(backwards)
