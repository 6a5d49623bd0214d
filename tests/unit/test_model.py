"""The llama module: config rules, GGUF naming, ggml vs torch op sets, KV-cache decoding."""

import pytest
import torch

from llamatrain import Llama, ModelConfig
from llamatrain.errors import ConfigError
from llamatrain.model import tensor_shapes

SMALL = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)


def make_pair(dtype: torch.dtype, **overrides) -> tuple[Llama, Llama]:
    """The same weights under both op sets."""
    cfg = ModelConfig(**{**SMALL, **overrides})
    torch.manual_seed(0)
    ggml = Llama(cfg, ops="ggml").to(dtype)
    torch_model = Llama(cfg, ops="torch").to(dtype)
    torch_model.load_state_dict(ggml.state_dict())
    return ggml, torch_model


def batch(cfg: ModelConfig, b: int = 2, t: int = 11, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    targets[0, :3] = -100  # ignored positions take part in every comparison
    return tokens, targets


def loss_and_grads(model: Llama, tokens, targets):
    model.zero_grad()
    logits, loss = model(tokens, targets)
    loss.backward()
    return logits, loss, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dim=30, n_heads=4), "divisible by n_heads"),
        (dict(n_kv_heads=3), "must divide n_heads"),
        (dict(dim=12, n_heads=4), "must be even"),
        (dict(n_layers=0), "n_layers must be a positive integer"),
    ],
)
def test_config_rejects_impossible_shapes(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**SMALL, **kwargs})


def test_ffn_width_follows_llama_rule():
    assert ModelConfig(32000, 4096, 1, 32, multiple_of=256).hidden_dim == 11008
    assert ModelConfig(32000, 288, 1, 6, multiple_of=32).hidden_dim == 768  # stories15M
    assert ModelConfig(10, 64, 1, 4, ffn_dim=100).hidden_dim == 100


def test_parameter_names_are_gguf_names():
    model = Llama(ModelConfig(**SMALL))
    names = set(model.state_dict())
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output"]
    per_layer += ["ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{i}.{n}.weight" for i in range(2) for n in per_layer}
    assert names == expected
    sd = model.state_dict()
    assert sd["blk.0.attn_k.weight"].shape == (2 * 8, 32)  # [Hkv·hd, E]
    assert sd["blk.1.ffn_down.weight"].shape == (32, 48)  # [E, F]
    tied = Llama(ModelConfig(**SMALL, tie_embeddings=True))
    assert "output.weight" not in tied.state_dict()


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_embeddings": True}, {"n_kv_heads": None, "ffn_dim": 96}, {"n_layers": 3}],
)
def test_tensor_shape_map_matches_the_module(overrides):
    model = Llama(ModelConfig(**{**SMALL, **overrides}))
    assert tensor_shapes(model.cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_num_params_counts_every_weight():
    model = Llama(ModelConfig(**SMALL))
    layer = 2 * 32 + 32 * 32 * 2 + 2 * (16 * 32) + 3 * 32 * 48
    assert model.num_params() == 61 * 32 * 2 + 32 + 2 * layer
    assert model.num_params(non_embedding=True) == model.num_params() - 61 * 32


def test_initialisation_scales_residual_projections():
    torch.manual_seed(0)
    model = Llama(ModelConfig(vocab_size=512, dim=128, n_layers=8, n_heads=4))
    sd = model.state_dict()
    assert sd["blk.0.attn_q.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert sd["blk.0.ffn_down.weight"].std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.all(sd["blk.3.ffn_norm.weight"] == 1)


@pytest.mark.parametrize("tie", [False, True])
def test_ggml_and_torch_ops_agree_in_float64(tie):
    # float64 leaves only summation-order differences: ~1e-13 observed, 1e-10 asserted.
    ggml, ref = make_pair(torch.float64, tie_embeddings=tie)
    tokens, targets = batch(ggml.cfg)
    logits_g, loss_g, grads_g = loss_and_grads(ggml, tokens, targets)
    logits_t, loss_t, grads_t = loss_and_grads(ref, tokens, targets)
    torch.testing.assert_close(logits_g, logits_t, rtol=0, atol=1e-10)
    torch.testing.assert_close(loss_g, loss_t, rtol=0, atol=1e-10)
    for name in grads_g:
        torch.testing.assert_close(grads_g[name], grads_t[name], rtol=0, atol=1e-10, msg=name)


def test_ggml_and_torch_ops_agree_in_float32():
    # float32: different kernels round differently; logits ~1e-6, grads ~1e-6 relative.
    ggml, ref = make_pair(torch.float32)
    tokens, targets = batch(ggml.cfg)
    logits_g, loss_g, grads_g = loss_and_grads(ggml, tokens, targets)
    logits_t, loss_t, grads_t = loss_and_grads(ref, tokens, targets)
    torch.testing.assert_close(logits_g, logits_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_g, loss_t, rtol=1e-5, atol=1e-6)
    for name in grads_g:
        torch.testing.assert_close(grads_g[name], grads_t[name], rtol=1e-4, atol=1e-6, msg=name)


def test_forward_without_targets_returns_logits_only():
    model = Llama(ModelConfig(**SMALL))
    tokens, _ = batch(model.cfg, b=3, t=5)
    assert model(tokens).shape == (3, 5, 61)


def test_sequence_longer_than_max_seq_len_is_rejected():
    model = Llama(ModelConfig(**SMALL, max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("segment", [1, 2, 3])
def test_activation_checkpointing_gives_identical_gradients(segment):
    model, _ = make_pair(torch.float64, n_layers=3)
    tokens, targets = batch(model.cfg)
    _, loss_plain, grads_plain = loss_and_grads(model, tokens, targets)
    model.checkpoint_segment = segment
    _, loss_ckpt, grads_ckpt = loss_and_grads(model, tokens, targets)
    assert loss_plain.item() == loss_ckpt.item()
    for name in grads_plain:
        torch.testing.assert_close(grads_plain[name], grads_ckpt[name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("ops", ["ggml", "torch"])
def test_kv_cache_decoding_matches_full_forward(ops):
    from llamatrain.model import KVCache

    torch.manual_seed(0)
    model = Llama(ModelConfig(**SMALL), ops=ops).double().eval()
    tokens, _ = batch(model.cfg, b=2, t=12)
    full = model(tokens)
    cache = KVCache(model.cfg, 2, 12, "cpu", torch.float64)
    pieces = [model(tokens[:, :5], cache=cache)]  # prefill, then one token at a time
    pieces += [model(tokens[:, i : i + 1], cache=cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-10)


def test_greedy_generate_equals_argmax_of_full_forward():
    torch.manual_seed(0)
    model = Llama(ModelConfig(**SMALL)).double()
    prompt = torch.tensor([3, 14, 15, 9])
    out = model.generate(prompt, 10, temperature=0)
    assert out.shape == (14,) and torch.equal(out[:4], prompt)
    for i in range(4, 14):
        assert out[i].item() == model(out[None, :i])[0, -1].argmax().item()


def test_sampled_generate_is_reproducible_from_seed():
    torch.manual_seed(0)
    model = Llama(ModelConfig(**SMALL))
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    kw = dict(temperature=1.0, top_k=20, top_p=0.9, repeat_penalty=1.1)
    a = model.generate(prompt, 16, seed=7, **kw)
    b = model.generate(prompt, 16, seed=7, **kw)
    c = model.generate(prompt, 16, seed=8, **kw)
    assert a.shape == (2, 19) and torch.equal(a, b) and not torch.equal(a, c)


def test_generate_stops_at_max_seq_len():
    model = Llama(ModelConfig(**SMALL, max_seq_len=10))
    assert model.generate(torch.tensor([1, 2, 3]), 50, temperature=0).shape == (10,)


@pytest.mark.parametrize("ops", ["ggml", "torch"])
@pytest.mark.parametrize("tie", [False, True])
def test_training_loss_equals_forward_loss(ops, tie):
    # model.loss fuses lm head + cross-entropy (ggml); value and grads must match forward's.
    torch.manual_seed(0)
    model = Llama(ModelConfig(**{**SMALL, "tie_embeddings": tie}), ops=ops).double()
    tokens, targets = batch(model.cfg)
    _, loss_ref, grads_ref = loss_and_grads(model, tokens, targets)
    model.zero_grad()
    loss = model.loss(tokens, targets)
    loss.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads_ref[name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    "backend",
    # aot_eager traces dynamo + AOT autograd through our Functions in seconds; inductor
    # also generates the C++ kernels (a minute or more on 2 cores).
    ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)],
)
def test_torch_compile_of_the_ggml_training_loss(backend):
    """``train.compile``: the compiled ggml path (real-valued rope under tracing, the causal
    bias traced as a constant) gives the eager loss and gradients, and a second call with
    the same shapes reuses the compiled graph (no guard on a mutable cache)."""
    torch._dynamo.reset()
    cfg = ModelConfig(vocab_size=40, dim=16, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=8)
    torch.manual_seed(0)
    model = Llama(cfg)
    params = list(model.parameters())
    tokens = torch.randint(0, 40, (2, 9))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    compiled = torch.compile(model.loss, backend=backend, dynamic=False)
    loss = compiled(inputs, targets)
    grads = torch.autograd.grad(loss, params)
    eager = model.loss(inputs, targets)
    eager_grads = torch.autograd.grad(eager, params)
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=1e-6)
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = compiled(inputs, targets)
    torch.testing.assert_close(again, loss, rtol=0, atol=0)
    torch._dynamo.reset()
