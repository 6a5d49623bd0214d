"""Prompts of different lengths decoded as one batch (``generate_stream``'s ragged prompts, on
``decoding.RowDecoder``): each row, left-padded to the longest, decodes as it would alone.

Every row's logits, after its prompt and at each of the decode steps (what the sampler draws
from), equal the row's own decode alone, on both op sets and every attention (the blockwise
flash kernel, the explicit softmax graph, SDPA), for llama and for gemma3 (a sliding window of
4 that the longer prompts slide past, soft-capping, sandwich norms). Greedy tokens are equal
token for token; sampled ones too, each row with its own seed; and the padding is no token to
the repetition penalty.

Tolerance 1e-5 absolute on float32 logits of size ~1.5: a padded row's attention sums over more
columns (the hidden padding adds exact zeros, but the reductions run in another order and
length) and its matmuls have another shape, so the rows agree to float32 rounding, measured
7.5e-7 at most on 2 x86 cores (a few ulps). Without the mask or the shifted positions they
differ by ~0.1 and more.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from llamatrain import Llama, ModelConfig, decoding
from llamatrain.generate import generate_stream
from llamatrain.sampling import SamplingParams, sample_next

ATOL = 1e-5  # see the module docstring
FAMILIES = {
    "llama": dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48),
    "gemma3": dict(
        arch="gemma3", vocab_size=61, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48,
        sliding_window=4, rope_theta_swa=500.0, final_logit_softcap=2.0,
    ),
}  # fmt: skip
PROMPTS = [[3, 14, 15, 9, 2, 6, 5, 11, 12], [50, 8], [7, 7, 7, 1, 9]]
STEPS = 6  # the prompt pass and 5 decode steps
GREEDY = SamplingParams(temperature=0)


def model(family: str, ops: str = "ggml", attention: str = "flash", **changes) -> Llama:
    """A random model with sharp attention (so a wrongly seen key shows) and norms off 1."""
    torch.manual_seed(0)
    cfg = ModelConfig(**FAMILIES[family], max_seq_len=64, ops=ops, attention=attention, **changes)
    m = Llama(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(4.0) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return m


def decode(
    m: Llama, prompts, params: SamplingParams = GREEDY, seed=None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The logits each step drew from (the prompt pass's first) and the tokens (batch,
    steps) drawn."""
    logits: list[torch.Tensor] = []

    def recorded(step_logits: torch.Tensor, *args) -> torch.Tensor:
        logits.append(step_logits.clone())
        return sample_next(step_logits, *args)

    with mock.patch.object(decoding, "sample_next", recorded):
        tokens = torch.stack(list(generate_stream(m, prompts, STEPS, params, seed)), dim=1)
    return logits, tokens


def row_logits(logits: list[torch.Tensor], row: int) -> list[torch.Tensor]:
    """Row ``row``'s logits at each step."""
    return [step[row] for step in logits]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("ops", ["ggml", "torch"])
@pytest.mark.parametrize("attention", ["flash", "softmax", "sdpa"])
def test_each_row_of_a_ragged_batch_decodes_as_it_does_alone(family, ops, attention):
    m = model(family, ops, attention)
    batch_logits, batch_tokens = decode(m, PROMPTS)
    assert len(batch_logits) == STEPS and batch_tokens.shape == (len(PROMPTS), STEPS)
    for row, prompt in enumerate(PROMPTS):
        alone_logits, alone_tokens = decode(m, torch.tensor(prompt))
        assert torch.equal(batch_tokens[row], alone_tokens[0])
        ours, theirs = row_logits(batch_logits, row), row_logits(alone_logits, 0)
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=f"row {row}, step {step}")


def test_without_the_padding_mask_the_rows_would_differ(monkeypatch):
    """The check above is not vacuous: a padded row that saw its padding keys would differ."""
    m = model("llama")
    monkeypatch.setattr("llamatrain.model.KVCache.padding_until", lambda self, end: None)
    batch_logits, _ = decode(m, PROMPTS)
    alone_logits, _ = decode(m, torch.tensor(PROMPTS[1]))
    gap = (row_logits(batch_logits, 1)[0] - alone_logits[0][0]).abs().max()
    assert gap > 100 * ATOL


def test_sampled_rows_draw_with_their_own_seeds_as_they_do_alone():
    """Each row's sampler is its own seed's: the batch draws what each row draws alone with
    that seed (a float64 model, so rounding cannot move a draw across a token boundary)."""
    m = model("llama").double()
    params = SamplingParams(temperature=1.0, top_k=None, top_p=None, min_p=0.0)
    seeds = [11, 12, 13]
    _, batch = decode(m, PROMPTS, params, seeds)
    for row, (prompt, seed) in enumerate(zip(PROMPTS, seeds, strict=True)):
        _, alone = decode(m, torch.tensor(prompt), params, seed)
        assert torch.equal(batch[row], alone[0])
    assert len({tuple(r) for r in batch.tolist()}) == len(PROMPTS)  # not one draw repeated
    with pytest.raises(ValueError, match="2 seeds for a batch of 3 rows"):
        decode(m, PROMPTS, params, seeds[:2])


def test_padding_is_no_token_to_the_repetition_penalty():
    """The padding (token 0 in the padded ids) is not in a row's penalised history: with token
    0 made the short row's greedy first choice, a heavy penalty on it would change the pick."""
    m = model("llama", tie_embeddings=False)
    short = torch.tensor(PROMPTS[1])
    first = int(m(short[None])[0, -1].argmax())
    with torch.no_grad():  # swap the head's rows: token 0 is now that first choice
        m.output.weight[[0, first]] = m.output.weight[[first, 0]]
    params = SamplingParams(temperature=0, repeat_penalty=50.0, repeat_last_n=64)
    _, alone = decode(m, short, params)
    assert alone[0, 0] == 0
    _, batch = decode(m, PROMPTS, params)
    assert torch.equal(batch[1], alone[0])


def test_prompts_of_one_length_take_the_plain_path_bit_for_bit():
    """Ragged input whose prompts share a length is the (batch, seq) tensor's decode exactly:
    no padding, no positions, the same logits to the bit."""
    m = model("llama")
    prompts = [[3, 14, 15, 9], [50, 8, 21, 37]]
    listed_logits, listed = decode(m, prompts)
    tensor_logits, tensor = decode(m, torch.tensor(prompts))
    assert torch.equal(listed, tensor)
    assert all(torch.equal(a, b) for a, b in zip(listed_logits, tensor_logits, strict=True))


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        next(generate_stream(model("llama"), [[1, 2], []], 3, GREEDY))
