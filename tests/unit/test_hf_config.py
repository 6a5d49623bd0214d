"""config.json ⇄ ModelConfig: every key's mapping, transformers' defaults, refusals."""

from __future__ import annotations

import re

import pytest

from llamatrain.errors import CheckpointError
from llamatrain.hf.config import hf_config, model_config_from_hf
from llamatrain.model import ModelConfig
from llamatrain.tokenizer import TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, BpeTokenizer
from llamatrain.tokenizer.bpe import BYTE_TO_CHAR

SMOL = {  # the shape of SmolLM2-135M's config.json, shrunk
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 258,
    "hidden_size": 48,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def tokenizer(pad: bool = False) -> BpeTokenizer:
    tokens = [BYTE_TO_CHAR[b] for b in range(256)] + ["<|begin|>", "<|end|>"]
    types = [TOKEN_TYPE_NORMAL] * 256 + [TOKEN_TYPE_CONTROL] * 2
    return BpeTokenizer(
        tokens, types, [], pre="llama-bpe", bos_id=256, eos_id=257, pad_id=257 if pad else None
    )


def test_every_key_maps_to_its_field():
    cfg = model_config_from_hf(SMOL, "config.json")
    assert cfg == ModelConfig(
        vocab_size=258,
        dim=48,
        n_layers=3,
        n_heads=6,
        n_kv_heads=2,
        ffn_dim=128,
        max_seq_len=512,
        norm_eps=1e-5,
        rope_theta=100000.0,
        tie_embeddings=True,
    )
    more = {
        **SMOL,
        "head_dim": 16,  # not hidden_size / heads = 8
        "attention_bias": True,
        "mlp_bias": True,
        "rope_scaling": {"type": "linear", "factor": 4.0},
    }
    cfg = model_config_from_hf(more, "config.json")
    assert (cfg.key_length, cfg.head_dim, cfg.attention_bias, cfg.mlp_bias) == (16, 16, True, True)
    assert (cfg.rope_scaling_factor, cfg.rope_freq_factors) == (4.0, False)
    llama3 = {**SMOL, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert model_config_from_hf(llama3, "c").rope_freq_factors
    assert model_config_from_hf({**SMOL, "head_dim": 8}, "c").key_length is None


def test_absent_keys_take_transformers_defaults():
    bare = {k: SMOL[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size")}
    bare |= {"num_hidden_layers": 1, "num_attention_heads": 6}
    cfg = model_config_from_hf(bare, "c")
    assert (cfg.kv_heads, cfg.norm_eps, cfg.rope_theta, cfg.max_seq_len) == (6, 1e-6, 1e4, 2048)
    assert not (cfg.tie_embeddings or cfg.attention_bias or cfg.mlp_bias)


def test_a_mistral_without_sliding_window_is_a_llama():
    mistral = {**SMOL, "model_type": "mistral", "sliding_window": None}
    assert model_config_from_hf(mistral, "c") == model_config_from_hf(SMOL, "c")


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
            "'gemma' (GemmaForCausalLM)",
        ),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window = 4096"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' rope scaling"),
        ({"hidden_size": None}, "lacks hidden_size"),
        ({"num_attention_heads": 5}, "invalid llama model"),
        # issue 37: linear scaling without its factor was a KeyError traceback
        ({"rope_scaling": {"type": "linear"}}, "linear rope scaling without its factor"),
        ({"rope_parameters": {"rope_type": "linear", "factor": None}}, "without its factor"),
    ],
)
def test_what_is_not_a_llama_is_refused_in_one_line(change, message):
    with pytest.raises(CheckpointError, match=re.escape(message)) as error:
        model_config_from_hf({**SMOL, **change}, "m/config.json")
    assert str(error.value).startswith("m/config.json") and "\n" not in str(error.value)


def test_written_config_reads_back_as_the_same_model():
    for hf in (
        SMOL,
        {**SMOL, "head_dim": 16, "attention_bias": True, "tie_word_embeddings": False},
    ):
        cfg = model_config_from_hf(hf, "c")
        written = hf_config(cfg, tokenizer(pad=True), None)
        assert model_config_from_hf(written, "c") == cfg
        assert written["architectures"] == ["LlamaForCausalLM"]
        assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (
            256,
            257,
            257,
        )
        assert written["torch_dtype"] == "float32"
    scaling = {"rope_type": "llama3", "factor": 8.0}
    assert hf_config(cfg, tokenizer(), scaling)["rope_scaling"] == scaling
    assert "pad_token_id" not in hf_config(cfg, tokenizer(), None)
