"""Sampling filters: each knob does what llama.cpp's sampler does."""

import pytest
import torch

from llamatrain.sampling import (
    SamplingParams,
    apply_repeat_penalty,
    filter_min_p,
    filter_top_k,
    filter_top_p,
    sample_next,
)


def test_repeat_penalty_pushes_seen_tokens_down_whatever_their_sign():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_repeat_penalty(logits, torch.tensor([[0, 1]]), 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_top_k_keeps_k_largest():
    out = filter_top_k(torch.tensor([[0.1, 3.0, 2.0, -1.0]]), 2)
    assert torch.isfinite(out).tolist() == [[False, True, True, False]]


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = filter_top_p(probs.log(), 0.75)
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    # the most likely token always survives, even when it alone exceeds p
    assert torch.isfinite(filter_top_p(probs.log(), 0.1)).sum() == 1


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
