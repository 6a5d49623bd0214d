"""HF safetensors weights: names, the q/k row permutation, and reading folders of shards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from llamatrain.errors import CheckpointError
from llamatrain.hf.weights import (
    hf_state_dict,
    hf_tensor_name,
    read_hf_weights,
    to_adjacent_pairs,
    to_rotate_half,
)
from llamatrain.model_config import ModelConfig, tensor_shapes
from llamatrain.ops.sets import torch_rope

CFG = ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=40, max_seq_len=16
)


def hf_rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """transformers' llama rope: ``x * cos + rotate_half(x) * sin`` (x: batch, seq, heads, hd)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float64) / (2 * half))
    angles = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)[None, :, None, :]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * angles.cos() + rotated * angles.sin()


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_permuted_q_k_give_hf_attention_scores_under_adjacent_pair_rope(n_heads, n_kv_heads):
    """The point of the permutation: HF's q/k with rotate-half rope and ours with adjacent
    pairs give the same q·k for every query/key position (so the same attention)."""
    torch.manual_seed(0)
    hd, dim, t = 8, 32, 6
    x = torch.randn(1, t, dim, dtype=torch.float64)
    wq = torch.randn(n_heads * hd, dim, dtype=torch.float64)
    wk = torch.randn(n_kv_heads * hd, dim, dtype=torch.float64)
    pos = torch.arange(t, dtype=torch.float64)

    def scores(q_w, k_w, rope):
        q = rope((x @ q_w.T).view(1, t, n_heads, hd))
        k = rope((x @ k_w.T).view(1, t, n_kv_heads, hd))
        k = k.repeat_interleave(n_heads // n_kv_heads, dim=2)
        return torch.einsum("bqhd,bkhd->bhqk", q, k)

    theirs = scores(wq, wk, lambda v: hf_rope(v, pos, 500.0))
    ours = scores(
        to_adjacent_pairs(wq, n_heads),
        to_adjacent_pairs(wk, n_kv_heads),
        lambda v: torch_rope(v, pos, theta=500.0),
    )
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_rotate_half_undoes_adjacent_pairs_for_weights_and_biases():
    for shape in [(24, 5), (24,)]:
        w = torch.randn(shape)
        assert torch.equal(to_rotate_half(to_adjacent_pairs(w, 3), 3), w)
        assert not torch.equal(to_adjacent_pairs(w, 3), w)
    bias = torch.arange(8.0)  # one head of 8: NEOX pairs (0,4) (1,5) (2,6) (3,7) become adjacent
    assert to_adjacent_pairs(bias, 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_tensor_names_are_transformers_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.1.attn_output.bias") == "model.layers.1.self_attn.o_proj.bias"
    assert (
        hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("blk.0.ffn_gate.weight") == "model.layers.0.mlp.gate_proj.weight"


def random_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {name: torch.randn(shape) for name, shape in tensor_shapes(cfg).items()}


def test_export_then_read_gives_the_same_tensors_from_shards(tmp_path):
    """hf_state_dict (export) and read_hf_weights (import) are inverse, across shards and
    dtypes: a bfloat16 shard is read as float32."""
    ours = random_tensors(CFG)
    state = hf_state_dict(CFG, ours)
    assert set(state) == {hf_tensor_name(n) for n in ours}
    names = sorted(state)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    save_file({n: state[n] for n in first}, tmp_path / "model-00001-of-00002.safetensors")
    save_file(
        {n: state[n].bfloat16() for n in second}, tmp_path / "model-00002-of-00002.safetensors"
    )
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in second}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    back = read_hf_weights(tmp_path, CFG)
    assert set(back) == set(ours)
    for name in ours:
        hf_name = hf_tensor_name(name)
        expected = ours[name] if hf_name in first else ours[name].bfloat16().float()
        assert back[name].dtype == torch.float32
        assert torch.equal(back[name], expected), name


def test_tied_model_ignores_a_stored_lm_head_and_writes_none(tmp_path):
    tied = ModelConfig(**{**CFG.__dict__, "tie_embeddings": True})
    state = hf_state_dict(tied, random_tensors(tied))
    assert "lm_head.weight" not in state
    save_file({**state, "lm_head.weight": torch.zeros(40, 32)}, tmp_path / "model.safetensors")
    assert "output.weight" not in read_hf_weights(tmp_path, tied)


def write_single(folder: Path, state: dict[str, torch.Tensor]) -> None:
    save_file(state, folder / "model.safetensors")


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path):
    state = hf_state_dict(CFG, random_tensors(CFG))
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # ignored, as HF does
    write_single(tmp_path, state)
    with pytest.raises(CheckpointError) as error:
        read_hf_weights(tmp_path, CFG)
    message = str(error.value)
    assert "missing: ['model.layers.1.mlp.up_proj.weight']" in message
    assert "unexpected: ['model.layers.0.self_attn.q_norm.weight']" in message
    state = hf_state_dict(CFG, random_tensors(CFG))
    state["model.norm.weight"] = torch.ones(31)
    write_single(tmp_path, state)
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \(31,\)"):
        read_hf_weights(tmp_path, CFG)


def test_folders_without_readable_weights_are_reported(tmp_path):
    with pytest.raises(CheckpointError, match="has no model.safetensors"):
        read_hf_weights(tmp_path, CFG)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="safe_serialization=True"):
        read_hf_weights(tmp_path, CFG)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        read_hf_weights(tmp_path, CFG)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="lacks the shard"):
        read_hf_weights(tmp_path, CFG)
