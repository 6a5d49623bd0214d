"""The llama module: config rules, GGUF naming, op sets and attention choices, decoding."""

import dataclasses
import warnings

import pytest
import torch

from llamatrain import Llama, ModelConfig
from llamatrain.errors import ConfigError
from llamatrain.generate import generate
from llamatrain.model import KVCache
from llamatrain.model_config import tensor_shapes
from llamatrain.ops.sets import ATTENTIONS
from llamatrain.sampling import SamplingParams

SMALL = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)
GREEDY = SamplingParams(temperature=0)


def make_model(dtype: torch.dtype = torch.float32, **overrides) -> Llama:
    """A small model with the weights of seed 0, whatever its op set or attention."""
    torch.manual_seed(0)
    return Llama(ModelConfig(**{**SMALL, **overrides})).to(dtype)


def make_pair(dtype: torch.dtype, **overrides) -> tuple[Llama, Llama]:
    """The same weights under both op sets."""
    return make_model(dtype, ops="ggml", **overrides), make_model(dtype, ops="torch", **overrides)


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
        (dict(dim=30, n_heads=4), "divisible by model.n_heads"),
        (dict(n_kv_heads=3), "must divide model.n_heads"),
        (dict(dim=12, n_heads=4), "must be even"),
        (dict(n_layers=0), "model.n_layers must be > 0"),
        (dict(ops="numpy"), "model.ops must be one of 'ggml', 'torch'"),
        (dict(attention="linear"), "model.attention must be one of 'flash', 'softmax', 'sdpa'"),
    ],
)
def test_config_rejects_impossible_shapes_and_choices(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**SMALL, **kwargs})


def test_a_llama_needs_the_sizes_a_run_derives():
    with pytest.raises(ConfigError, match="vocab_size must be set"):
        Llama(ModelConfig(dim=32, n_heads=4, max_seq_len=8))
    with pytest.raises(ConfigError, match="max_seq_len must be set"):
        Llama(ModelConfig(dim=32, n_heads=4, vocab_size=8))


def test_architecture_leaves_out_the_run_choices():
    cfg = ModelConfig(**SMALL, ops="torch", attention="softmax", init_from="base.gguf")
    arch = cfg.architecture()
    assert "ops" not in arch and "attention" not in arch and "init_from" not in arch
    assert arch == dataclasses.replace(cfg, ops="ggml", init_from=None).architecture()
    assert arch["vocab_size"] == 61 and arch["max_seq_len"] == 64


def test_ffn_width_follows_llama_rule():
    assert ModelConfig(dim=4096, n_heads=32, multiple_of=256).hidden_dim == 11008
    assert ModelConfig(dim=288, n_heads=6, multiple_of=32).hidden_dim == 768  # stories15M
    assert ModelConfig(dim=64, n_heads=4, ffn_dim=100).hidden_dim == 100


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
    model = Llama(ModelConfig(vocab_size=512, dim=128, n_layers=8, n_heads=4, max_seq_len=8))
    sd = model.state_dict()
    assert sd["blk.0.attn_q.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert sd["blk.0.ffn_down.weight"].std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.all(sd["blk.3.ffn_norm.weight"] == 1)


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


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("ops", ["ggml", "torch"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_op_sets_and_attention_choices_compute_the_same_model(ops, attention, tie):
    # float64 against ggml ops + flash: the op sets and the attentions (blockwise flash,
    # scores + diag_mask_inf + soft_max, SDPA) differ only in summation order (~1e-13
    # observed); 1e-10 asserted, logits, loss and every gradient.
    ref = make_model(torch.float64, tie_embeddings=tie)
    model = make_model(torch.float64, ops=ops, attention=attention, tie_embeddings=tie)
    tokens, targets = batch(ref.cfg)
    logits_r, loss_r, grads_r = loss_and_grads(ref, tokens, targets)
    logits, loss, grads = loss_and_grads(model, tokens, targets)
    torch.testing.assert_close(logits, logits_r, rtol=0, atol=1e-10)
    torch.testing.assert_close(loss, loss_r, rtol=0, atol=1e-10)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_r[name], rtol=0, atol=1e-10, msg=name)


VARIANTS = {
    "key_length": dict(key_length=6),  # 4 heads of 6 in a 32-wide model
    "biases": dict(attention_bias=True, mlp_bias=True),
    "rope": dict(rope_freq_factors=True, rope_scaling_factor=3.0),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("ops", "attention"), [("torch", "flash"), ("ggml", "softmax")])
def test_variants_compute_the_same_model_in_every_op_set(variant, ops, attention):
    # The llama variants llama.cpp loads (test_llama_cpp_variants proves them against it):
    # the op sets agree on them as on the plain llama, float64, 1e-10; the biases and rope
    # factors are set away from their neutral values so they take part.
    def variant_model(**run_choice):
        model = make_model(torch.float64, **VARIANTS[variant], **run_choice)
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                if name.endswith(".bias"):
                    tensor.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
                elif name == "rope_freqs.weight":
                    tensor.copy_(torch.linspace(1.0, 8.0, tensor.numel()))
        return model

    ref, model = variant_model(), variant_model(ops=ops, attention=attention)
    assert set(ref.state_dict()) == set(tensor_shapes(ref.cfg))
    tokens, targets = batch(ref.cfg)
    logits_r, loss_r, grads_r = loss_and_grads(ref, tokens, targets)
    logits, loss, grads = loss_and_grads(model, tokens, targets)
    torch.testing.assert_close(logits, logits_r, rtol=0, atol=1e-10)
    for name in grads:
        torch.testing.assert_close(grads[name], grads_r[name], rtol=0, atol=1e-10, msg=name)
    assert "rope_freqs.weight" not in grads  # a buffer: no optimizer ever sees it


def test_rope_factors_and_linear_scaling_change_the_model():
    # Factors of 1 and a scale of 1 are the plain llama; other values must reach the output.
    plain = make_model(torch.float64)
    scaled = make_model(torch.float64, rope_freq_factors=True, rope_scaling_factor=1.0)
    scaled.load_state_dict({**plain.state_dict(), "rope_freqs.weight": torch.ones(4)})
    tokens, _ = batch(plain.cfg)
    torch.testing.assert_close(scaled(tokens), plain(tokens), rtol=0, atol=0)
    scaled.rope_freqs.weight.fill_(4.0)
    assert (scaled(tokens) - plain(tokens)).abs().max() > 1e-5  # (0 exactly when ignored)


@pytest.mark.parametrize("ops", ["ggml", "torch"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_kv_cache_decoding_matches_full_forward(ops, attention):
    # Decoding attends with fewer queries than keys: every attention aligns its causal mask
    # to the end of the keys.
    model = make_model(torch.float64, ops=ops, attention=attention).eval()
    tokens, _ = batch(model.cfg, b=2, t=12)
    full = model(tokens)
    cache = KVCache(model.cfg, 2, 12, "cpu", torch.float64)
    pieces = [model(tokens[:, :5], cache=cache)]  # prefill, then one token at a time
    pieces += [model(tokens[:, i : i + 1], cache=cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-10)


def test_greedy_generate_equals_argmax_of_full_forward():
    model = make_model(torch.float64)
    prompt = torch.tensor([3, 14, 15, 9])
    out = generate(model, prompt, 10, GREEDY)
    assert out.shape == (14,) and torch.equal(out[:4], prompt)
    for i in range(4, 14):
        assert out[i].item() == model(out[None, :i])[0, -1].argmax().item()


def test_sampled_generate_is_reproducible_from_seed():
    torch.manual_seed(0)
    model = Llama(ModelConfig(**SMALL))
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, repeat_penalty=1.1)
    a = generate(model, prompt, 16, params, seed=7)
    b = generate(model, prompt, 16, params, seed=7)
    c = generate(model, prompt, 16, params, seed=8)
    assert a.shape == (2, 19) and torch.equal(a, b) and not torch.equal(a, c)


def test_generate_goes_past_the_trained_context_with_one_warning():
    # As llama.cpp does: every requested token comes, each the argmax of a full forward.
    model = make_model(torch.float64, max_seq_len=10)
    prompt = torch.tensor([1, 2, 3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(model, prompt, 20, GREEDY)
    assert out.shape == (23,)
    assert [str(w.message) for w in caught if "trained on" in str(w.message)] == [
        "generating 23 tokens, past the 10 the model was trained on (llama.context_length); "
        "llama.cpp continues too, quality may drop"
    ]
    # pointing at the line that asked for the tokens, not at the library's decoder
    assert {w.filename for w in caught if "trained on" in str(w.message)} == {__file__}
    for i in (9, 10, 22):
        assert out[i].item() == model(out[None, :i])[0, -1].argmax().item()


@pytest.mark.parametrize("ops", ["ggml", "torch"])
@pytest.mark.parametrize("tie", [False, True])
def test_training_loss_equals_forward_loss(ops, tie):
    # model.loss fuses lm head + cross-entropy (ggml); value and grads must match forward's.
    model = make_model(torch.float64, ops=ops, tie_embeddings=tie)
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
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :3] = -100  # ignored rows: every row traced, the eager head skips them
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
