"""Gemma 3 in the one decoder (``model.arch = "gemma3"``): its tensors and layer kinds, both op
sets computing the same model with the window, packed documents and soft-capping, documents
composing with the window, and decoding with a KV cache. llama.cpp / transformers parity is
``tests/integration/test_gemma3.py``; the ops' float64 gradchecks are ``test_gemma_ops``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llamatrain.errors import ConfigError
from llamatrain.model import KVCache, Llama, ModelConfig
from llamatrain.model_config import tensor_shapes

SMALL = dict(
    arch="gemma3", dim=32, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=40,
    max_seq_len=16, sliding_window=4, rope_theta_swa=500.0, final_logit_softcap=2.0,
)  # fmt: skip


def model(seed: int = 0, **changes) -> Llama:
    torch.manual_seed(seed)
    m = Llama(ModelConfig(**{**SMALL, **changes})).eval()
    with torch.no_grad():  # sharp attention, norms off neutral
        for p in m.parameters():
            p.mul_(4.0) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    return m


def test_gemma3_has_llama_cpps_tensors_and_layer_kinds() -> None:
    m = model()
    shapes = tensor_shapes(m.cfg)
    assert shapes == {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert {n.split(".", 2)[2] for n in shapes if n.startswith("blk.0.")} == {
        f"{x}.weight"
        for x in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                  "attn_k_norm", "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up",
                  "ffn_down", "post_ffw_norm")
    }  # fmt: skip
    assert [b.window for b in m.blk] == [4, 4, 4, 4, 4, None]
    assert m.cfg.attention_scale == 1 / 8**0.5 and m.embed_scale == float(torch.tensor(32**0.5))


def test_gemma3_defaults_and_refusals() -> None:
    cfg = ModelConfig(arch="gemma3")
    assert (cfg.sliding_window, cfg.rope_theta_swa, cfg.final_logit_softcap) == (4096, 1e4, None)
    assert ModelConfig().sliding_window is None  # llama: no window
    for key, value in (("sliding_window", 8), ("final_logit_softcap", 30.0)):
        with pytest.raises(ConfigError, match=f"model.{key} = .*'qwen3'"):
            ModelConfig(arch="qwen3", **{key: value})


def _packed() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (2, 12), generator=g)
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    return ids, documents


@pytest.mark.parametrize("attention", ["flash", "softmax", "sdpa"])
@pytest.mark.parametrize("packed", [False, True])
def test_both_op_sets_compute_the_same_gemma3(attention: str, packed: bool) -> None:
    ggml = model()
    other = Llama(dataclasses.replace(ggml.cfg, ops="torch", attention=attention)).eval()
    other.load_state_dict(ggml.state_dict())
    ids, documents = _packed()
    documents = documents if packed else None
    targets = torch.roll(ids, -1, 1)
    loss_g, loss_t = ggml.loss(ids, targets, documents), other.loss(ids, targets, documents)
    torch.testing.assert_close(loss_g, loss_t)
    torch.testing.assert_close(ggml.forward(ids, targets, documents=documents)[1], loss_g)
    loss_g.backward()
    loss_t.backward()
    grads = dict(other.named_parameters())
    for name, p in ggml.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("ops", ["ggml", "torch"])
def test_packed_documents_compose_with_the_window(ops: str) -> None:
    """Each packed document computes what it computes alone (positions restart, the window
    never reaches across), and the window matters within it."""
    m = model(ops=ops)
    ids, documents = _packed()
    with torch.no_grad():
        packed = m(ids, documents=documents)
        alone = torch.cat([m(ids[:1, :5]), m(ids[:1, 5:])], 1)
        torch.testing.assert_close(packed[:1], alone, atol=1e-5, rtol=1e-5)
        wide = Llama(dataclasses.replace(m.cfg, sliding_window=64)).eval()
        wide.load_state_dict(m.state_dict())
        assert (wide(ids[:1, 5:]) - alone[:, 5:]).abs().max() > 1e-3


def test_decoding_with_a_kv_cache_keeps_the_window() -> None:
    m = model()
    ids = torch.randint(0, 40, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(ids)
        cache = KVCache(m.cfg, 1, 12, "cpu", torch.float32)
        steps = [m(ids[:, :6], cache=cache)] + [
            m(ids[:, i : i + 1], cache=cache) for i in range(6, 12)
        ]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_soft_capping_bounds_the_logits() -> None:
    m = model(final_logit_softcap=0.5)
    ids, _ = _packed()
    with torch.no_grad():
        assert m(ids).abs().max() < 0.5
