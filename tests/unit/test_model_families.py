"""The families' switches in the model (one decoder, no subclasses), the config and the op sets.

llama.cpp and transformers parity is ``tests/integration/test_families.py``; here: what each
family's config allows, its tensors, that both op sets compute the same family, that NEOX rope
is the same function in both op sets (its ggml backward's float64 gradcheck is
``test_ops.test_rope_gradcheck[neox]``), and that a family trains from ``[model] arch``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.autograd import gradcheck

from llamatrain.config import load_config
from llamatrain.errors import ConfigError
from llamatrain.model import Llama, ModelConfig
from llamatrain.model_config import ARCHS, FAMILIES, tensor_shapes
from llamatrain.ops import rope
from llamatrain.ops.sets import op_set, torch_rope

SMALL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=40, max_seq_len=16)


def model(arch: str, seed: int = 0, **changes) -> Llama:
    torch.manual_seed(seed)
    m = Llama(ModelConfig(arch=arch, **{**SMALL, **changes})).eval()
    with torch.no_grad():  # norms and biases off neutral, so dropping one would show
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.normal_(0, 0.1)
    return m


def test_the_families_are_llama_cpps_architectures() -> None:
    assert ARCHS == ("llama", "qwen2", "qwen3", "smollm3", "gemma3")
    assert FAMILIES["llama"] == FAMILIES["llama"]._make(FAMILIES["llama"]._field_defaults.values())
    assert ModelConfig().arch == "llama" and ModelConfig().family == FAMILIES["llama"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_shapes_are_the_state_dict(arch: str) -> None:
    m = model(arch)
    assert tensor_shapes(m.cfg) == {k: tuple(v.shape) for k, v in m.state_dict().items()}


def test_each_family_has_llama_cpps_tensors() -> None:
    names = {arch: set(tensor_shapes(model(arch).cfg)) for arch in ARCHS}
    assert names["smollm3"] == names["llama"]
    assert names["qwen2"] - names["llama"] == {
        f"blk.{i}.attn_{x}.bias" for i in range(4) for x in "qkv"
    }
    assert names["qwen3"] - names["llama"] == {
        f"blk.{i}.attn_{x}_norm.weight" for i in range(4) for x in "qk"
    }
    assert tensor_shapes(model("qwen3", key_length=16).cfg)["blk.0.attn_q_norm.weight"] == (16,)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention", ["flash", "softmax", "sdpa"])
def test_both_op_sets_compute_the_same_family(arch: str, attention: str) -> None:
    ggml = model(arch)
    other = Llama(dataclasses.replace(ggml.cfg, ops="torch", attention=attention)).eval()
    other.load_state_dict(ggml.state_dict())
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(ids, -1, 1)
    loss_g = ggml.loss(ids, targets)
    loss_t = other.loss(ids, targets)
    torch.testing.assert_close(loss_g, loss_t)
    loss_g.backward()
    loss_t.backward()
    grads = dict(other.named_parameters())
    for name, p in ggml.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_smollm3_leaves_rope_out_of_every_4th_layer() -> None:
    cfg = ModelConfig(arch="smollm3", **{**SMALL, "n_layers": 8})
    assert [cfg.uses_rope(i) for i in range(8)] == [True, True, True, False] * 2
    assert all(ModelConfig(arch=a).uses_rope(3) for a in ("llama", "qwen2", "qwen3"))
    m = model("smollm3")
    assert [b.rotates for b in m.blk] == [True, True, True, False]


@pytest.mark.parametrize(
    ("arch", "key"),
    [
        ("qwen2", "attention_bias"),
        ("qwen2", "mlp_bias"),
        ("qwen3", "attention_bias"),
        ("smollm3", "mlp_bias"),
        ("qwen3", "rope_freq_factors"),
    ],
)
def test_a_family_refuses_what_llama_cpp_does_not_load(arch: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"model.{key} = true.*'{arch}'"):
        ModelConfig(arch=arch, **{key: True})


def test_an_unknown_family_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="'llama', 'qwen2', 'qwen3', 'smollm3'"):
        load_config("tiny", overrides=['model.arch="gemma"'])


def test_model_arch_is_a_config_key() -> None:
    cfg = load_config("tiny", overrides=['model.arch="qwen3"'])
    assert cfg.model.arch == "qwen3" and cfg.model.family.qk_norm


def test_a_recorded_config_without_arch_is_a_llama() -> None:
    recorded = json.loads(json.dumps(ModelConfig(**SMALL).architecture()))
    del recorded["arch"]
    assert ModelConfig(**recorded).arch == "llama"


# ---- NEOX rope in both op sets ----------------------------------------------------------


def test_neox_rope_is_the_same_in_both_op_sets() -> None:
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([0, 4, 9, 100, 2047])
    kw = dict(theta=1e6, freq_scale=0.5, freq_factors=None, mode="neox")
    g, t = op_set("ggml").rope(x, pos, **kw), op_set("torch").rope(x, pos, **kw)
    torch.testing.assert_close(g, t)
    up = torch.randn_like(g)
    (dg,) = torch.autograd.grad(g, x, up)
    (dt,) = torch.autograd.grad(t, x, up)
    torch.testing.assert_close(dg, dt)
    assert gradcheck(lambda v: torch_rope(v, pos, theta=1e6, mode="neox"), (x,))
    assert gradcheck(lambda v: rope(v, pos, theta=1e6, mode="neox"), (x,))
    # HF's rotate_half: the first half of a head pairs with the second
    half = torch.cat((-x[..., 4:], x[..., :4]), -1)
    angle = pos[:, None].double() * 0.5 * 1e6 ** (-torch.arange(0, 8, 2).double() / 8)
    cos, sin = angle.cos().repeat(1, 2)[:, None], angle.sin().repeat(1, 2)[:, None]
    torch.testing.assert_close(g, x * cos + half * sin)


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_with_a_kv_cache_gives_the_full_forwards_logits(arch: str) -> None:
    from llamatrain.model import KVCache

    m = model(arch)
    ids = torch.randint(0, 40, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(ids)
        cache = KVCache(m.cfg, 1, 10, "cpu", torch.float32)
        steps = [m(ids[:, :6], cache=cache)] + [
            m(ids[:, i : i + 1], cache=cache) for i in (6, 7, 8, 9)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
