"""LoRA applied to a model from outside (``llamatrain.lora``).

Adapting may add the adapter tensors and nothing else: the base's names (llama.cpp's) and
values stay, everything but the adapters is frozen, a fresh adapter computes exactly what the
base computes (B = 0), and the two op sets, activation checkpointing (applied before or
after) and the merged model all compute the same network. Bad settings are one ConfigError.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from llamatrain import activation_checkpointing as ac
from llamatrain.errors import ConfigError, GGUFError
from llamatrain.gguf import file as gguf_file
from llamatrain.gguf.llama import LlamaFile
from llamatrain.gguf.write import DeferredTensor, write_gguf
from llamatrain.lora import (
    ALL_TARGETS,
    LoraLinear,
    apply_lora,
    load_lora_state_dict,
    lora_modules,
    lora_state_dict,
    merge_lora,
    merged_tensors,
    store_frozen_targets,
    stored_type,
    trainable_parameter_count,
)
from llamatrain.model import Llama, ModelConfig
from llamatrain.model_config import tensor_shapes
from llamatrain.model_source import build_lora_base

SMALL = dict(vocab_size=40, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)


def make_model(seed: int = 0, **changes: object) -> Llama:
    torch.manual_seed(seed)
    return Llama(ModelConfig(**{**SMALL, **changes})).double()


def adapted(
    rank: int = 4, alpha: float = 8.0, seed: int = 0, dropout: float = 0.0, **changes: object
) -> Llama:
    """A float64 model with LoRA on every target and B random, so the adapters matter."""
    model = apply_lora(make_model(seed, **changes), rank, alpha, dropout)
    with torch.no_grad():
        for name, tensor in lora_state_dict(model).items():
            if name.endswith("lora_b"):
                tensor.normal_(0.0, 0.1)
    return model


def batch(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model: Llama) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model.loss(*batch(model.cfg))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_names_stay_llama_cpps_and_only_the_adapters_train() -> None:
    base = make_model(attention_bias=True, mlp_bias=True)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = apply_lora(base, rank=4, alpha=8.0)
    state = model.state_dict()
    adapters = {
        f"blk.{i}.{t}.{ab}" for i in range(3) for t in ALL_TARGETS for ab in ("lora_a", "lora_b")
    }
    assert set(state) == set(before) | adapters
    assert set(lora_state_dict(model)) == adapters
    for name, tensor in before.items():
        assert torch.equal(state[name], tensor), name
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == adapters
    block = model.blk[0]
    assert isinstance(block.attn_k, LoraLinear) and block.attn_k.bias is not None
    assert block.attn_k.lora_a.shape == (4, 32) and block.attn_k.lora_b.shape == (16, 4)
    shapes = tensor_shapes(model.cfg)
    expected = sum(
        4 * sum(shapes[f"blk.{i}.{t}.weight"]) for i in range(3) for t in ALL_TARGETS
    )  # r·(in + out) per adapted projection
    assert trainable_parameter_count(model) == expected


def test_a_fresh_adapter_is_the_base_model_and_peft_initialised() -> None:
    base = make_model()
    tokens, _ = batch(base.cfg)
    with torch.no_grad():
        expected = base(tokens)
        model = apply_lora(base, rank=8, alpha=16.0)
        assert torch.equal(model(tokens), expected)
    for _, tensor in lora_state_dict(model).items():
        if tensor.shape[0] == 8:  # A: kaiming-uniform(a=√5), bound 1/√in, as nn.Linear's
            bound = 1 / math.sqrt(tensor.shape[1])
            assert tensor.abs().max() <= bound and tensor.abs().max() > 0.8 * bound
        else:  # B
            assert not tensor.any()


def test_chosen_targets_only() -> None:
    model = apply_lora(make_model(), rank=2, alpha=2.0, targets=("attn_v", "ffn_down"))
    kinds = {name.split(".")[2] for name in lora_state_dict(model)}
    assert kinds == {"attn_v", "ffn_down"}
    assert not isinstance(model.blk[0].attn_q, LoraLinear)


def test_gradients_reach_only_the_adapters() -> None:
    model = adapted()
    _, grads = loss_and_grads(model)
    assert set(grads) == set(lora_state_dict(model))
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_both_op_sets_compute_the_same_adapted_model() -> None:
    ggml = adapted()
    torch_ops = Llama(dataclasses.replace(ggml.cfg, ops="torch")).double()
    apply_lora(torch_ops, rank=4, alpha=8.0)
    torch_ops.load_state_dict(ggml.state_dict())
    (loss, grads), (loss_ref, grads_ref) = loss_and_grads(ggml), loss_and_grads(torch_ops)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("order", ["lora_then_checkpointing", "checkpointing_then_lora"])
def test_activation_checkpointing_before_or_after(order: str) -> None:
    plain = adapted()
    loss_ref, grads_ref = loss_and_grads(plain)
    if order == "lora_then_checkpointing":
        model = adapted()
        ac.apply(model, "full")
    else:
        model = make_model()
        ac.apply(model, "every_n", every_n=2)
        apply_lora(model, rank=4, alpha=8.0)
        load_lora_state_dict(model, lora_state_dict(plain))
    assert isinstance(model.blk, ac.CheckpointedBlocks)
    assert model.state_dict().keys() == plain.state_dict().keys()
    loss, grads = loss_and_grads(model)
    assert torch.equal(loss, loss_ref)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=0, atol=0)


def test_merge_gives_a_plain_model_with_the_same_outputs() -> None:
    model = adapted(attention_bias=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merge_lora(model)
    assert type(merged) is Llama and not any(isinstance(m, LoraLinear) for m in merged.modules())
    assert merged.state_dict().keys() == tensor_shapes(model.cfg).keys()
    tokens, _ = batch(model.cfg)
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), model(tokens), rtol=1e-12, atol=1e-12)
        lora = model.blk[1].attn_k
        w = lora.weight + lora.scale * lora.lora_b @ lora.lora_a
        assert torch.equal(merged.state_dict()["blk.1.attn_k.weight"], w)
    for name, tensor in model.state_dict().items():  # the adapted model is left as it was
        assert torch.equal(tensor, before[name])
    assert merged.token_embd.weight.data_ptr() != model.token_embd.weight.data_ptr()


def test_adapter_tensors_load_into_a_model_adapted_alike() -> None:
    source = adapted(seed=0)
    target = apply_lora(make_model(seed=0), rank=4, alpha=8.0)
    load_lora_state_dict(target, lora_state_dict(source))
    tokens, _ = batch(source.cfg)
    with torch.no_grad():
        assert torch.equal(target(tokens), source(tokens))
    other_rank = apply_lora(make_model(), rank=2, alpha=8.0)
    with pytest.raises(ConfigError, match="apply_lora with the adapter's rank"):
        load_lora_state_dict(other_rank, lora_state_dict(source))
    fewer = apply_lora(make_model(), rank=4, alpha=8.0, targets=("attn_q",))
    with pytest.raises(ConfigError, match=r"unexpected blk\.0\.attn_k\.lora_a"):
        load_lora_state_dict(fewer, lora_state_dict(source))


def test_dropout_acts_in_training_only() -> None:
    model = adapted(dropout=0.5)
    tokens, _ = batch(model.cfg)
    with torch.no_grad():
        evaluated = [model.eval()(tokens) for _ in range(2)]
        trained = [model.train()(tokens) for _ in range(2)]
    assert torch.equal(*evaluated)
    assert not torch.equal(*trained) and not torch.equal(trained[0], evaluated[0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(targets=("attn_q", "wq")), "unknown projection 'wq'; choose among attn_q"),
        (dict(targets=()), "at least one"),
        (dict(targets=("attn_q", "attn_q")), "each projection once"),
        (dict(rank=0), "lora.rank = 0 must be a positive integer"),
        (dict(rank=2.5), "positive integer"),
        (dict(rank=17), r"exceeds attn_k's smaller side min\(32, 16\) = 16"),
        (dict(alpha=0.0), "lora.alpha = 0.0 must be positive"),
        (dict(dropout=1.0), r"lora.dropout = 1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_settings_are_one_line_errors(kwargs: dict, message: str) -> None:
    model = make_model()
    settings = {"rank": 4, "alpha": 8.0, **kwargs}
    with pytest.raises(ConfigError, match=message) as error:
        apply_lora(model, **settings)
    assert "\n" not in str(error.value)
    assert not any(isinstance(m, LoraLinear) for m in model.modules())  # nothing half-applied
    assert all(p.requires_grad for p in model.parameters())


def test_applying_twice_is_refused() -> None:
    model = apply_lora(make_model(), rank=4, alpha=8.0)
    with pytest.raises(ConfigError, match="has LoRA adapters already"):
        apply_lora(model, rank=4, alpha=8.0, targets=("attn_q",))


# ---- a frozen base kept narrower than float32 (``[lora] base_dtype``) -----------------------

QUANT_SHAPES = dict(dim=64, ffn_dim=96)  # rows of whole 32-value Q8_0 blocks


def with_frozen_targets(model: Llama, storage: Callable[[torch.Tensor], torch.Tensor], qtype: str):
    """A copy of ``model`` whose targets are FrozenLinears of ``qtype`` holding
    ``storage(W)``: everything else is ``model``'s own weights."""
    copy = Llama(model.cfg)
    copy.load_state_dict(model.state_dict())
    names = [f"blk.{i}.{t}.weight" for i in range(model.cfg.n_layers) for t in ALL_TARGETS]
    store_frozen_targets(copy, dict.fromkeys(names, qtype))
    state, source = copy.state_dict(), model.state_dict()
    for name in names:
        state[name].copy_(storage(source[name]))
    return copy


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(gguf_quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0))


def q8_0_values(blocks: torch.Tensor) -> torch.Tensor:
    """gguf-py's dequantization: the reference, independent of ``ops.dequantize``."""
    return torch.from_numpy(gguf_quants.dequantize(blocks.numpy(), GGMLQuantizationType.Q8_0))


STORAGES: dict[str, tuple[Callable, Callable]] = {
    "Q8_0": (q8_0, q8_0_values),
    "BF16": (lambda w: w.to(torch.bfloat16), lambda w: w.float()),
}
"""ggml type -> (W as stored, the stored W's values as float32)."""


def adapted_alike(model: Llama) -> Llama:
    torch.manual_seed(5)
    apply_lora(model, 4, 8.0)
    with torch.no_grad():
        for name, tensor in lora_state_dict(model).items():
            if name.endswith("lora_b"):
                tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(6)))
    return model


@pytest.mark.usefixtures("decoded_products")
@pytest.mark.parametrize("qtype", ["Q8_0", "BF16"])
def test_a_frozen_narrow_base_is_the_float32_model_on_its_stored_values(qtype: str) -> None:
    """Targets held as Q8_0 blocks (or bf16) compute, train and merge as the float32 model
    whose targets are those blocks dequantized by gguf-py (or the bf16 values widened): same
    names, same trainable tensors, loss and adapter gradients within float32 rounding (1e-6 of
    the largest value: only the chunked matmuls' summation order differs)."""
    torch.manual_seed(0)
    model = Llama(ModelConfig(**{**SMALL, **QUANT_SHAPES}))
    store, values = STORAGES[qtype]
    narrow = adapted_alike(with_frozen_targets(model, store, qtype))
    frozen = {f"{name}.weight" for name, _ in lora_modules(narrow)}
    reference = Llama(model.cfg)
    reference.load_state_dict(
        {n: values(t) if n in frozen else t for n, t in narrow.state_dict().items()
         if not n.endswith(("lora_a", "lora_b"))}
    )  # fmt: skip
    reference = adapted_alike(reference)
    assert narrow.state_dict().keys() == reference.state_dict().keys()
    assert all(narrow.get_buffer(name).dtype != torch.float32 for name in frozen)
    assert trainable_parameter_count(narrow) == trainable_parameter_count(reference)
    loss, grads = loss_and_grads(narrow)
    expected_loss, expected = loss_and_grads(reference)
    assert grads.keys() == expected.keys()
    assert torch.allclose(loss, expected_loss, rtol=1e-6)
    for name, grad in grads.items():
        assert (grad - expected[name]).abs().max() <= 1e-6 * expected[name].abs().max(), name
    merged, merged_reference = merge_lora(narrow).state_dict(), merge_lora(reference).state_dict()
    for name, tensor in merged_reference.items():
        assert merged[name].dtype == torch.float32 and torch.allclose(merged[name], tensor), name


def test_a_merged_weight_is_written_a_chunk_of_rows_at_a_time(tmp_path, monkeypatch) -> None:
    """A merged weight of a Q8_0 base is encoded 8 rows at a time from its ``rows`` (never
    merged whole: a 7B's largest is 180 MB of float32, twice that while summed) to the bytes
    of the whole merged weight written at once; each chunk is that weight's rows."""
    torch.manual_seed(0)
    model = Llama(ModelConfig(**{**SMALL, **QUANT_SHAPES}))
    narrow = adapted_alike(with_frozen_targets(model, q8_0, "Q8_0"))
    monkeypatch.setattr(gguf_file, "CHUNK_VALUES", 8 * QUANT_SHAPES["dim"])
    tensors = merged_tensors(narrow)
    whole = merge_lora(narrow).state_dict()
    for name in ("blk.0.attn_q.weight", "blk.2.ffn_down.weight"):
        merged = tensors[name]
        assert isinstance(merged, DeferredTensor) and merged.rows is not None
        assert torch.equal(merged.rows(8, 16), whole[name][8:16])

        def never() -> torch.Tensor:
            raise AssertionError("the merged weight was produced whole")

        streamed = DeferredTensor(merged.shape, merged.dtype, never, merged.rows)
        a = write_gguf(tmp_path / "a.gguf", "llama", {}, {name: (streamed, "q8_0")})
        b = write_gguf(tmp_path / "b.gguf", "llama", {}, {name: (whole[name], "q8_0")})
        assert a.read_bytes() == b.read_bytes()


def test_quantized_keeps_only_types_it_can_read_and_needs_a_gguf_base() -> None:
    with pytest.raises(GGUFError, match=r"IQ4_XS; requantize .* Q4_K_M") as err:
        stored_type("quantized", "IQ4_XS", "blk.0.attn_q.weight")
    assert "\n" not in str(err.value)
    assert (
        stored_type("quantized", "F16", "x") == "F16" and stored_type("bf16", "Q4_0", "x") == "BF16"
    )
    model = make_model().float()
    not_a_gguf = LlamaFile(model.cfg, model.state_dict(), None, {})  # e.g. an HF folder
    with pytest.raises(ConfigError, match="needs a GGUF|not a GGUF"):
        build_lora_base(not_a_gguf, "quantized", ALL_TARGETS)
    bf16 = build_lora_base(not_a_gguf, "bf16", ["attn_q"])
    assert bf16.blk[0].attn_q.weight.dtype == torch.bfloat16
    assert torch.equal(bf16.blk[0].attn_q.weight, model.blk[0].attn_q.weight.bfloat16())
    assert torch.equal(bf16.blk[0].ffn_up.weight, model.blk[0].ffn_up.weight)  # not a target
