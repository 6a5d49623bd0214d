"""Decoding (``llamatrain.generate``): stop tokens act per row of a batch."""

from __future__ import annotations

import pytest
import torch

from llamatrain import Llama, ModelConfig
from llamatrain.generate import generate
from llamatrain.sampling import SamplingParams

SMALL = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)
GREEDY = SamplingParams(temperature=0)
BUDGET = 12


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(ModelConfig(**SMALL)).double()


def early_stop(model: Llama, early: torch.Tensor, late: torch.Tensor) -> int:
    """A token ``early`` generates (greedy, alone) within its first few steps and ``late``
    never generates within the budget: stopping on it ends one row early, not the other."""
    first = generate(model, early, BUDGET, GREEDY)[len(early) :].tolist()
    other = set(generate(model, late, BUDGET, GREEDY)[len(late) :].tolist())
    token = next(t for t in first[1:4] if t not in other)  # in mid-stream, not at its start
    assert first.index(token) < BUDGET - 1
    return token


@pytest.mark.parametrize("early_row", [0, 1])
def test_a_row_that_stops_does_not_stop_the_batch(model: Llama, early_row: int) -> None:
    """Each row of a batch is what its prompt gives alone (greedy, same seed): a row stops at
    its own stop token and is padded with it, the other row runs to the token budget."""
    prompts = [torch.tensor([3, 14, 15, 9]), torch.tensor([50, 8, 21, 37])]
    early, late = prompts[early_row], prompts[1 - early_row]
    stop = frozenset({early_stop(model, early, late)})
    batch = generate(model, torch.stack(prompts), BUDGET, GREEDY, seed=5, stop_tokens=stop)
    assert batch.shape == (2, 4 + BUDGET)  # the late row used its whole budget
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, BUDGET, GREEDY, seed=5, stop_tokens=stop)
        assert torch.equal(batch[row, : len(alone)], alone)
        assert (batch[row, len(alone) :] == alone[-1]).all()  # padding: the stop token
    alone_early = generate(model, early, BUDGET, GREEDY, seed=5, stop_tokens=stop)
    assert len(alone_early) < 4 + BUDGET and alone_early[-1].item() in stop


def test_the_batch_ends_when_every_row_has_stopped(model: Llama) -> None:
    prompts = torch.tensor([[3, 14, 15, 9], [3, 14, 15, 9]])
    first = generate(model, prompts[0], BUDGET, GREEDY)[4:].tolist()
    stop = frozenset({first[2]})
    out = generate(model, prompts, BUDGET, GREEDY, stop_tokens=stop)
    assert out.shape == (2, 4 + first.index(first[2]) + 1)
