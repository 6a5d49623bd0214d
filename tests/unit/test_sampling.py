"""Sampling filters: each knob does what llama.cpp's sampler does (its own chain over the same
logits: tests/integration/test_sampling_llama_cpp.py); the filters over top-k's candidates keep
what they keep over the whole vocabulary, and the draw picks each token with its probability."""

import math

import pytest
import torch

from llamatrain.sampling import (
    SamplingParams,
    apply_repeat_penalty,
    candidates,
    draw,
    filter_min_p,
    filter_top_p,
    pick,
    sample_next,
)


def test_repeat_penalty_pushes_seen_tokens_down_whatever_their_sign():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_repeat_penalty(logits, torch.tensor([[0, 1]]), 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_top_k_keeps_k_largest():
    only_k = SamplingParams(top_k=2, top_p=None, min_p=0.0)
    ids, kept = candidates(torch.tensor([[0.1, 3.0, 2.0, -1.0]]), only_k)
    assert ids[torch.isfinite(kept)].tolist() == [1, 2]


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])  # sorted, and summing to 1: log_total 0
    out = filter_top_p(probs.log(), 0.75, torch.zeros(1, 1))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    # the most likely token always survives, even when it alone exceeds p
    assert torch.isfinite(filter_top_p(probs.log(), 0.1, torch.zeros(1, 1))).sum() == 1


def test_min_p_keeps_tokens_at_least_p_times_the_most_probable():
    """llama.cpp's min-p (default 0.05): relative to the row's most probable token, whatever
    the mass of the rest."""
    probs = torch.tensor([[0.6, 0.3, 0.04, 0.031, 0.029]])
    out = filter_min_p(probs.log(), 0.05)  # floor 0.03
    assert torch.isfinite(out).tolist() == [[True, True, True, True, False]]
    assert torch.isfinite(filter_min_p(probs.log(), 1.0)).sum() == 1


def test_greedy_and_sampled_choices():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert sample_next(logits, SamplingParams(temperature=0)).item() == 1
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_k=1)
    assert all(sample_next(logits, params, generator=g).item() == 1 for _ in range(20))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1),
        dict(top_k=0),
        dict(top_p=0.0),
        dict(min_p=-0.1),
        dict(min_p=float("nan")),
        dict(repeat_penalty=0),
    ],
)
def test_invalid_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_defaults_are_llama_cpps_sampler_defaults():
    """One home for sampling defaults, and it is llama.cpp's (llama-cli without flags)."""
    assert SamplingParams() == SamplingParams(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0, repeat_last_n=64
    )


def test_cli_generate_flags_take_their_defaults_from_sampling_params():
    from llamatrain.cli import build_parser

    args = build_parser().parse_args(["generate", "run"])
    defaults = SamplingParams()
    assert (
        SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repeat_penalty=args.repeat_penalty,
            repeat_last_n=args.repeat_last_n,
        )
        == defaults
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0, 5.0])
def test_allowed_tokens_are_the_only_ones_ever_drawn(temperature):
    """The seen-tokens mask: over many draws from logits that favour the masked-out tokens,
    only allowed ids come out (greedy included)."""
    vocab = 50
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[torch.tensor([3, 7, 11, 40])] = True
    logits = torch.where(allowed, 0.0, 5.0).expand(64, vocab)  # unseen tokens look best
    params = SamplingParams(temperature=temperature, top_k=None, top_p=None)
    generator = torch.Generator().manual_seed(0)
    drawn = torch.cat([sample_next(logits, params, None, generator, allowed) for _ in range(50)])
    assert set(drawn.tolist()) <= {3, 7, 11, 40}
    if temperature > 0:
        assert set(drawn.tolist()) == {3, 7, 11, 40}  # every allowed token still has its chance


def test_nan_logits_are_one_model_error_not_a_traceback():
    """A model whose weights hold NaN samples NaN logits: one line naming the cause and the
    fix, before torch.multinomial would fail on them."""
    from llamatrain.errors import ModelError

    logits = torch.tensor([[0.0, float("nan"), 1.0]])
    for params in (SamplingParams(), SamplingParams(temperature=0)):
        with pytest.raises(ModelError, match="NaN or infinite values.*info --verify"):
            sample_next(logits, params)


def whole_vocabulary(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The reference: each filter over the whole vocabulary (top-k keeping ties, top-p by a
    sort of every token), then the tempered softmax: (rows, vocab) probabilities."""
    if params.top_k is not None:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        ranked, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(ranked, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if params.min_p > 0:
        logits = filter_min_p(logits, params.min_p)
    return torch.softmax(logits / params.temperature, dim=-1)


def scattered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampler's distribution over the vocabulary: its candidates' tempered softmax."""
    ids, kept = candidates(logits, params)
    probs = torch.softmax(kept / params.temperature, dim=-1)
    return torch.zeros_like(logits).scatter(-1, ids, probs)


LOGITS = {  # (rows, vocab): peaked like a trained model's, flatter, flat, bf16's many ties
    "peaked": torch.randn(4, 3000, generator=torch.Generator().manual_seed(0)) * 4,
    "spread": torch.randn(4, 8000, generator=torch.Generator().manual_seed(3)) * 2,
    "flat": torch.randn(4, 3000, generator=torch.Generator().manual_seed(1)) * 0.5,
    "ties": (torch.randn(4, 3000, generator=torch.Generator().manual_seed(2)) * 2)
    .bfloat16()
    .float(),
}
SETTINGS = [
    SamplingParams(),  # llama.cpp's defaults: top-k 40, top-p 0.95, min-p 0.05
    SamplingParams(top_k=None),  # top-p over the 256 largest, 4,096 (spread), all (flat)
    SamplingParams(top_k=None, top_p=0.5, min_p=0.0, temperature=1.5),
    SamplingParams(top_k=7, top_p=None, min_p=0.0),
    SamplingParams(top_k=5000, top_p=0.9),  # more than the vocabulary
    SamplingParams(top_k=1),
    SamplingParams(top_k=None, top_p=None, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=None, top_p=None, min_p=0.0),  # GRPO's
]


@pytest.mark.parametrize("kind", list(LOGITS))
@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_the_candidates_are_the_whole_vocabularys_distribution(kind, params):
    """Filtering top-k's candidates (and top-p's largest few) gives the distribution the
    filters over the whole vocabulary give, to float32 rounding: as many tokens kept, the
    largest logits, ties at the k-th included, and the same probabilities. Where equal logits
    straddle top-p's cut (bf16), which of them stay is arbitrary in the reference too (its
    sort's order of equals): the sorted probabilities are compared, not their places."""
    logits = LOGITS[kind]
    ours, reference = scattered(logits, params), whole_vocabulary(logits, params)
    kept = ours > 0
    assert torch.equal(kept.sum(dim=-1), (reference > 0).sum(dim=-1))
    lowest_kept = logits.masked_fill(~kept, float("inf")).min(dim=-1).values
    assert bool((lowest_kept >= logits.masked_fill(kept, float("-inf")).max(dim=-1).values).all())
    ranked = [p.sort(dim=-1, descending=True).values for p in (ours, reference)]
    torch.testing.assert_close(*ranked, rtol=1e-5, atol=1e-7)
    if kind != "ties":
        assert torch.equal(kept, reference > 0)


def test_the_draw_picks_each_entry_with_its_probability():
    """20,000 draws over five entries (one of probability 0): each count within 5 standard
    deviations of its expectation, the impossible entry never."""
    probs = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.1])
    n = 20_000
    picks = draw(probs.expand(n, -1), torch.Generator().manual_seed(0)).squeeze(-1)
    counts = torch.bincount(picks, minlength=5)
    for count, p in zip(counts.tolist(), probs.tolist(), strict=True):
        assert abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p))


def test_no_draw_lands_on_a_token_of_no_chance():
    """At the ends of the uniform range: a target of 0 skips leading impossible entries, a
    target rounded up to the total takes the last possible entry, never one past it."""
    cdf = torch.tensor([[0.0, 0.0, 0.5, 1.0, 1.0]], dtype=torch.float64)
    assert pick(cdf, torch.zeros(1, 1, dtype=torch.float64)).item() == 2
    assert pick(cdf, torch.ones(1, 1, dtype=torch.float64)).item() == 3


def test_each_row_draws_with_its_own_generator_as_it_does_alone():
    probs = torch.softmax(LOGITS["flat"], dim=-1)
    together = draw(probs, [torch.Generator().manual_seed(s) for s in (3, 4, 5, 6)])
    for row, seed in enumerate((3, 4, 5, 6)):
        alone = draw(probs[row : row + 1], torch.Generator().manual_seed(seed))
        assert together[row].item() == alone.item()
