"""The batched KV-cache decoder (``decoding.RowDecoder``) under ``generate`` and GRPO's rollouts:
the cache in the compute dtype, the plain path while no row leaves a hole, the repetition
penalty over each row's own tokens, the past-the-context warning.

Its logits against a full forward of each row alone are checked in test_grpo_tool_turns.py
(chunks of any widths, float64) and test_generate_ragged.py (ragged prompts, every attention).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from llamatrain import Llama, ModelConfig, decoding
from llamatrain.decoding import RowDecoder
from llamatrain.sampling import SamplingParams, sample_next

GREEDY = SamplingParams(temperature=0)


def model(**changes) -> Llama:
    torch.manual_seed(0)
    shape = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    return Llama(ModelConfig(**shape, max_seq_len=64, **changes)).eval()


@pytest.mark.parametrize("ops", ["ggml", "torch"])
def test_under_bf16_autocast_the_cache_holds_bf16(ops):
    """The cache takes the dtype the keys are computed in, so no step casts the whole cache
    (float32 → bf16, every layer, every token); what it returns is what it would have returned
    holding them in float32 (bf16 values are float32 ones), so the decode's logits are a full
    forward's over the same tokens, to bf16 rounding."""
    m = model(ops=ops)
    tokens = [[3, 14, 15, 9, 2], [50, 8, 7, 1, 4]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = RowDecoder(m, 2, 8, GREEDY, None)
        decoder.feed([row[:3] for row in tokens])
        assert decoder.cache.k.dtype == decoder.cache.v.dtype == torch.bfloat16
        for step in (3, 4):
            decoder.feed([row[step : step + 1] for row in tokens])
        with torch.no_grad():
            full = m(torch.tensor(tokens))[:, -1]
    torch.testing.assert_close(decoder.logits.float(), full.float(), rtol=0, atol=0.05)
    float32 = RowDecoder(m, 2, 8, GREEDY, None)
    float32.feed(tokens)
    assert float32.cache.k.dtype == torch.float32


def test_rows_of_one_length_fed_together_take_the_plain_path():
    """No padding and no positions until a row leaves a hole: then both, from then on."""
    decoder = RowDecoder(model(), 2, 4, GREEDY, None)
    decoder.feed([[1, 2], [3, 4]])
    decoder.feed([[5], [6]])
    assert decoder.cache.padding is None
    decoder.feed([[7, 8], [9]])
    assert decoder.cache.padding[:, :5].tolist() == [[False] * 5, [False] * 3 + [True, False]]


def test_the_repetition_penalty_sees_each_rows_own_last_tokens():
    """A row's window is its last ``repeat_last_n`` tokens, whatever holes it has in the cache
    while other rows took more tokens; a short row's window is padded with -1 (no token)."""
    params = SamplingParams(temperature=0, repeat_penalty=1.5, repeat_last_n=3)
    decoder = RowDecoder(model(), 2, 4, params, None)
    seen = []

    def recorded(logits, params, recent, *args):
        seen.append(recent.tolist())
        return sample_next(logits, params, recent, *args)

    with mock.patch.object(decoding, "sample_next", recorded):
        decoder.feed([[1, 2, 3, 4], [5]])
        decoder.sample([0, 1])
        decoder.feed([[6], [7, 8, 9, 10, 11]])
        decoder.feed([[], [12]])
        decoder.sample([0, 1])
    assert seen == [[[2, 3, 4], [-1, -1, 5]], [[3, 4, 6], [10, 11, 12]]]


def test_decoding_past_the_trained_context_warns_once_built():
    with pytest.warns(UserWarning, match="generating 80 tokens, past the 64"):
        RowDecoder(model(), 1, 80, GREEDY, None)


def test_one_seed_per_row():
    with pytest.raises(ValueError, match="2 seeds for a batch of 3 rows"):
        RowDecoder(model(), 3, 8, GREEDY, [1, 2])
