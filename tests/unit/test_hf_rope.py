"""HF rope settings: which schemes import, llama3's rope_freqs as llama.cpp computes it, and
the way back to config.json's rope_scaling on export."""

from __future__ import annotations

import math

import pytest
import torch

from llamatrain.errors import CheckpointError
from llamatrain.hf.rope import (
    hf_rope_scaling,
    llama3_freq_factors,
    rope_scaling_of,
    rope_theta_of,
)
from llamatrain.model import ModelConfig

LLAMA_31 = {  # Llama 3.1 8B's rope_scaling
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def converter_loop(scaling: dict, theta: float, head_dim: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf (LlamaModel.generate_extra_tensors), pair by pair."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            out.append(1)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def model(head_dim: int, theta: float, **fields) -> ModelConfig:
    return ModelConfig(
        dim=4 * head_dim, n_heads=4, rope_theta=theta, vocab_size=8, max_seq_len=8, **fields
    )


SCALINGS = [
    (LLAMA_31, 500000.0, 128),
    ({**LLAMA_31, "factor": 32.0}, 500000.0, 64),  # Llama 3.2 1B/3B
    ({**LLAMA_31, "original_max_position_embeddings": 1024, "high_freq_factor": 8.0}, 1e4, 16),
    ({**LLAMA_31, "low_freq_factor": 2.0, "high_freq_factor": 8.0}, 1e4, 64),
    # one pair blended (wavelengths 6.3, 20, 63, 199, ... against the band 64..256)
    ({**LLAMA_31, "original_max_position_embeddings": 256, "factor": 2.5}, 1e4, 16),
    # no pair blended (no wavelength in the band 75..150): the boundaries alone are fitted
    ({**LLAMA_31, "original_max_position_embeddings": 150, "high_freq_factor": 2.0}, 1e4, 16),
]


@pytest.mark.parametrize("scaling, theta, head_dim", SCALINGS)
def test_llama3_factors_are_llama_cpps_bit_for_bit(scaling, theta, head_dim):
    ours = llama3_freq_factors(scaling, theta, head_dim)
    assert torch.equal(ours, converter_loop(scaling, theta, head_dim))
    assert ours.dtype == torch.float32 and ours.shape == (head_dim // 2,)
    assert ours.min() == 1 and ours.max() == scaling["factor"]  # all three regions occur


@pytest.mark.parametrize("scaling, theta, head_dim", SCALINGS)
def test_llama3_factors_export_as_parameters_that_reproduce_them(scaling, theta, head_dim):
    factors = llama3_freq_factors(scaling, theta, head_dim)
    written = hf_rope_scaling(model(head_dim, theta, rope_freq_factors=True), factors)
    assert written["rope_type"] == "llama3"
    assert torch.equal(llama3_freq_factors(written, theta, head_dim), factors)


def test_real_llama3_parameters_come_back_unchanged():
    factors = llama3_freq_factors(LLAMA_31, 500000.0, 128)
    assert hf_rope_scaling(model(128, 500000.0, rope_freq_factors=True), factors) == LLAMA_31


def test_factors_no_llama3_parameters_give_are_refused():
    cfg = model(16, 1e4, rope_freq_factors=True)
    with pytest.raises(CheckpointError, match="rope_freqs.weight is not the llama3"):
        hf_rope_scaling(cfg, torch.tensor([1.0, 3.0, 1.0, 2.0, 5.0, 8.0, 8.0, 8.0]))


def test_linear_scaling_exports_and_cannot_combine_with_factors():
    cfg = model(16, 1e4, rope_scaling_factor=4.0)
    assert hf_rope_scaling(cfg, None) == {"type": "linear", "rope_type": "linear", "factor": 4.0}
    assert hf_rope_scaling(model(16, 1e4), None) is None
    assert hf_rope_scaling(model(16, 1e4, rope_freq_factors=True), torch.ones(8)) is None
    factors = llama3_freq_factors(SCALINGS[2][0], 1e4, 16)
    with pytest.raises(CheckpointError, match="combines linear rope scaling"):
        hf_rope_scaling(model(16, 1e4, rope_scaling_factor=4.0, rope_freq_factors=True), factors)


def test_both_config_spellings_are_read():
    legacy = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    transformers5 = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    for hf in (legacy, transformers5):
        assert rope_theta_of(hf) == 5e5
        assert rope_scaling_of(hf, "c")["rope_type"] == "linear"
    assert rope_theta_of({}) == 10000.0
    assert (
        rope_scaling_of({"rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}, "c")
        is None
    )
    assert rope_scaling_of({"rope_scaling": None}, "c") is None


@pytest.mark.parametrize("kind", ["yarn", "dynamic", "longrope"])
def test_other_rope_scaling_is_refused_by_name(kind):
    with pytest.raises(CheckpointError, match=f"config.json uses '{kind}' rope scaling"):
        rope_scaling_of({"rope_scaling": {"rope_type": kind, "factor": 4.0}}, "config.json")
