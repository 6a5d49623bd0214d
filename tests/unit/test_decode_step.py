"""The C++ decoding step (``ops.decode_step``, ``fused_decode``) against the blocks it replaces.

Two comparisons, because the step's products are the quantized kernels', whose 8-bit
activations turn a float rounding difference in their input into up to half an 8-bit step of
an activation (``tests/unit/test_quantized_matmul.py``):

- the small ops alone: the step multiplies through an exact product handed in (float64 over
  the decoded blocks) and the blocks run over those decoded weights as float32 ``Linear``s, so
  the two differ by float32 rounding only: 1e-5 of the largest value (measured ~1e-7);
- the model as generation runs it (the kernels' own products on both sides): logits within
  ``LOGIT_BOUND`` of the largest logit, the size of an activation's 8-bit step flipping
  somewhere (the blocks and the step round it apart when their float inputs differ in the last
  bit); measured up to ~1e-3 here.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import weakref

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from random_models import move_off_neutral

from llamatrain import activation_checkpointing, fused_decode
from llamatrain.config import TrainSection
from llamatrain.fused_decode import FusedDecodeBlocks, fuse_decoding, fused_decoding
from llamatrain.lora import apply_lora, load_lora_state_dict, lora_state_dict, store_frozen_targets
from llamatrain.model import KVCache, Llama, ModelConfig, Rope
from llamatrain.objectives.grpo.rollout import sample_completions
from llamatrain.objectives.grpo.rules import rollout_params
from llamatrain.ops.decode_step import (
    Adapter,
    LayerWeights,
    StepLayers,
    decode_step,
    step_available,
)
from llamatrain.ops.dequantize import dequantize
from llamatrain.ops.rope import rope_angles

pytestmark = pytest.mark.skipif(not step_available(), reason="no C++ compiler")

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
VOCAB, ROWS, CAPACITY, PROMPT = 50, 3, 12, 5
LOGIT_BOUND = 1e-2


def quantized_pair(qtype: str, arch: str = "llama") -> tuple[Llama, Llama]:
    """(a model of ``arch`` whose projections are ``qtype`` blocks, the same model with them
    decoded to float32 ``Linear`` weights); qwen2's q/k/v biases random, nonzero."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=VOCAB,
        max_seq_len=64, arch=arch,
    )  # fmt: skip
    dense = move_off_neutral(Llama(cfg)).eval()
    kept = copy.deepcopy(dense)
    names = [f"blk.{i}.{t}.weight" for i in range(cfg.n_layers) for t in TARGETS]
    store_frozen_targets(kept, dict.fromkeys(names, qtype))
    state = dense.state_dict()
    with torch.no_grad():
        for name in names:
            ggml_type = GGMLQuantizationType[qtype]
            blocks = torch.from_numpy(gguf_quants.quantize(state[name].numpy(), ggml_type))
            kept.get_submodule(name.removesuffix(".weight")).weight.copy_(blocks)
            state[name].copy_(dequantize(blocks, qtype, state[name].shape[1]))
    return kept, dense


@torch.no_grad()
def adapted_pair(qtype: str, rank: int, arch: str = "llama") -> tuple[Llama, Llama]:
    """:func:`quantized_pair` with LoRA of ``rank`` on every projection of both, the same
    random nonzero factors on each (PEFT's B is zero: a fresh adapter would change nothing)."""
    kept, dense = quantized_pair(qtype, arch)
    for model in (kept, dense):
        apply_lora(model, rank, alpha=2.0 * rank).eval()
    generator = torch.Generator().manual_seed(2)
    factors = lora_state_dict(dense)
    for tensor in factors.values():
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.1)
    load_lora_state_dict(kept, factors)
    return kept, dense


def filled_cache(model: Llama) -> KVCache:
    """A cache of ROWS rows holding a ragged prompt (row 1 left-padded by 2, row 2 with an
    interior hole), as the blocks write it."""
    padding = torch.zeros(ROWS, CAPACITY, dtype=torch.bool)
    padding[1, :2] = padding[2, 3] = True
    cache = KVCache(model.cfg, ROWS, CAPACITY, "cpu", torch.float32, padding)
    tokens = torch.randint(0, VOCAB, (ROWS, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(tokens, cache=cache, positions=torch.arange(PROMPT).expand(ROWS, PROMPT))
    return cache


_MATMUL = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
)  # fmt: skip


def exact_matmul(model: Llama) -> _MATMUL:
    """An ``lt_matmul`` whose product is float64 over the decoded blocks, rounded once."""
    decoded = {}
    for block in model.blk:
        for name in TARGETS:
            module = getattr(block, name)
            n_in = module.lora_a.shape[1] if hasattr(module, "lora_a") else module.in_features
            weight = dequantize(module.weight, module.qtype, n_in)
            decoded[module.weight.data_ptr()] = weight.double()

    def product(_type, blocks, n, _stride, x, m, k, y, _threads) -> int:  # noqa: ANN001
        rows = torch.frombuffer((ctypes.c_float * (m * k)).from_address(x), dtype=torch.float32)
        out = torch.frombuffer((ctypes.c_float * (m * n)).from_address(y), dtype=torch.float32)
        out.copy_((rows.view(m, k).double() @ decoded[blocks].t()).float().flatten())
        return 0

    return _MATMUL(product)


def step_layers(model: Llama, cache: KVCache) -> StepLayers:
    layers = []
    for b in model.blk:
        adapters = [
            Adapter(m.lora_a.detach(), m.lora_b.detach(), m.scale) if hasattr(m, "lora_a") else None
            for m in (getattr(b, t) for t in TARGETS)
        ]
        layers.append(
            LayerWeights(
                [getattr(b, t).weight for t in TARGETS],
                [getattr(b, t).qtype for t in TARGETS],
                b.attn_norm.weight,
                b.ffn_norm.weight,
                adapters,
                [getattr(b, t).bias for t in TARGETS],
            )  # fmt: skip
        )
    return StepLayers(layers, cache.k, cache.v)


@pytest.mark.parametrize(
    ("qtype", "mode", "rank", "arch"),
    [
        ("Q4_0", "norm", None, "llama"), ("Q8_0", "norm", None, "llama"),
        ("Q4_0", "neox", None, "llama"), ("Q8_0", "neox", None, "llama"),
        ("Q4_0", "norm", 1, "llama"), ("Q8_0", "neox", 8, "llama"),
        ("Q4_0", "neox", None, "qwen2"), ("Q8_0", "neox", 8, "qwen2"),
    ],
)  # fmt: skip
def test_the_steps_small_ops_are_the_blocks(
    qtype: str, mode: str, rank: int | None, arch: str
) -> None:
    """With a LoRA update of ``rank`` on every projection (the blocks' ``ops.lora_linear``
    over float32 weights) or none; qwen2's q/k/v biases."""
    pair = quantized_pair(qtype, arch) if rank is None else adapted_pair(qtype, rank, arch)
    kept, dense = pair
    ours, theirs = filled_cache(dense), filled_cache(dense)
    pos = torch.tensor([[PROMPT], [PROMPT - 2], [PROMPT]])
    rope = Rope(pos, dense.cfg.rope_theta, mode=mode)
    with torch.no_grad():
        x = dense.token_embd(torch.tensor([[4], [9], [17]]))
        expected = dense.blk(x, rope, theirs)
        cos, sin = (t.reshape(ROWS, -1) for t in rope_tables(rope, dense.cfg.head_dim))
        matmul = exact_matmul(kept)
        got = decode_step(
            step_layers(kept, ours), x.reshape(ROWS, -1).clone(), cos, sin, ours.padding,
            PROMPT, heads=4, eps=dense.cfg.norm_eps, scale=0.25, neox=mode == "neox",
            matmul=ctypes.cast(matmul, ctypes.c_void_p).value,
        )  # fmt: skip
    top = expected.abs().max()
    torch.testing.assert_close(got, expected.reshape(ROWS, -1), atol=1e-5 * top, rtol=0)
    for mine, blocks in [(ours.k, theirs.k), (ours.v, theirs.v)]:
        torch.testing.assert_close(mine[..., PROMPT, :], blocks[..., PROMPT, :], atol=1e-5, rtol=0)


def rope_tables(rope: Rope, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``rope``'s angles, as the step takes them."""
    settings = rope.frequencies()
    del settings["mode"]
    return rope_angles(rope.pos, head_dim, **settings)


@pytest.mark.parametrize(("rank", "arch"), [(None, "llama"), (8, "llama"), (8, "qwen2")])
def test_a_fused_model_decodes_as_its_blocks_do(monkeypatch, rank: int | None, arch: str) -> None:
    """Generation's model (kernels on both sides) over a ragged batch, step after step,
    with the adapters of a QLoRA run unmerged or none (qwen2: with q/k/v biases)."""
    pair = quantized_pair("Q4_0", arch) if rank is None else adapted_pair("Q4_0", rank, arch)
    kept = pair[0]
    fused = fuse_decoding(copy.deepcopy(kept))
    steps = []
    monkeypatch.setattr(
        fused_decode, "decode_step", lambda *a, **k: steps.append(1) or decode_step(*a, **k)
    )
    caches = filled_cache(kept), filled_cache(kept)
    feed = torch.randint(0, VOCAB, (ROWS, CAPACITY - PROMPT), generator=torch.Generator())
    with torch.no_grad():
        for i in range(feed.shape[1]):
            at = torch.tensor([[PROMPT + i], [PROMPT + i - 2], [PROMPT + i]])
            expected, got = (
                model(feed[:, i : i + 1], cache=cache, positions=at)
                for model, cache in zip((kept, fused), caches, strict=True)
            )
            bound = LOGIT_BOUND * expected.abs().max()
            torch.testing.assert_close(got, expected, atol=bound, rtol=0)
    assert len(steps) == feed.shape[1]


def test_the_blocks_run_where_the_step_does_not_compute_them() -> None:
    kept, _ = quantized_pair("Q8_0")
    blocks = fuse_decoding(kept).blk
    assert isinstance(blocks, FusedDecodeBlocks)
    cache = filled_cache(kept)
    one, two = torch.zeros(ROWS, 1, 64), torch.zeros(ROWS, 2, 64)
    with torch.no_grad():
        assert blocks.step_layers(one, cache) is not None
        assert blocks.step_layers(two, cache) is None  # a prompt
        assert blocks.step_layers(one, None) is None  # no cache
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert blocks.step_layers(one, cache) is None
    assert blocks.step_layers(one.requires_grad_(), cache) is None  # a graph
    adapted = apply_lora(kept, rank=2, alpha=4.0, dropout=0.1)  # dropout drawn in training
    cache = filled_cache(adapted)
    with torch.no_grad():
        assert adapted.blk.step_layers(one.detach(), cache) is None
        adapted.eval()  # none drawn: the step's (a new cache, laid out again)
        assert adapted.blk.step_layers(one.detach(), filled_cache(adapted)) is not None


def test_a_finished_generations_cache_is_not_kept_by_the_step() -> None:
    """The layers laid out for a cache hold its k/v buffers; they go with the cache."""
    kept, _ = quantized_pair("Q8_0")
    blocks = fuse_decoding(kept).blk
    cache = filled_cache(kept)
    with torch.no_grad():
        assert blocks.step_layers(torch.zeros(ROWS, 1, 64), cache) is not None
    gone = weakref.ref(cache.k)
    del cache
    gc.collect()
    assert gone() is None


def decode_once(model: Llama) -> torch.Tensor:
    """The logits of one decoding step after :func:`filled_cache`'s prompt (a new cache)."""
    cache = filled_cache(model)
    at = torch.tensor([[PROMPT], [PROMPT - 2], [PROMPT]])
    with torch.no_grad():
        return model(torch.tensor([[4], [9], [17]]), cache=cache, positions=at)


def test_a_training_models_rollout_takes_the_step_with_its_current_adapters(monkeypatch) -> None:
    """GRPO samples from the model it trains (checkpointed blocks, training mode): the rollout
    decodes through the step, each rollout with the factors as the optimizer left them (in
    place, or replaced), and the model is given back with its own blocks and mode."""
    kept, _ = adapted_pair("Q4_0", 8)
    activation_checkpointing.apply(kept, "full")
    own = kept.blk
    kept.train()
    steps = []
    monkeypatch.setattr(
        fused_decode, "decode_step", lambda *a, **k: steps.append(1) or decode_step(*a, **k)
    )
    params = rollout_params(TrainSection(temperature=1.0))
    out = sample_completions(kept, [[1, 2, 3], [4, 5]], 4, params, frozenset(), lambda i: i)
    assert [len(c.tokens) for c in out] == [4, 4] and len(steps) == 3
    assert kept.blk is own and kept.training
    for update in ("in place", "replaced"):
        module = kept.blk[1].ffn_down
        with torch.no_grad():
            if update == "in place":  # as an optimizer's step
                module.lora_b.mul_(-3.0)
            else:
                module.lora_b.data = module.lora_b.detach() * 2.0
        kept.eval()
        expected = decode_once(kept)
        with fused_decoding(kept) as swapped:
            got = decode_once(kept)
        assert swapped and kept.blk is own
        bound = LOGIT_BOUND * expected.abs().max()
        torch.testing.assert_close(got, expected, atol=bound, rtol=0)


def test_a_rollout_under_bf16_autocast_decodes_in_the_step_as_float32_does(monkeypatch) -> None:
    """A QLoRA run on a CPU with AMX trains under bf16 autocast by default; its rollouts
    decode without it where the kernels serve every stored weight (they compute in float32
    anyway), so they take the C++ step and draw the float32 rollout's tokens."""
    kept, _ = adapted_pair("Q4_0", 8)
    steps = []
    monkeypatch.setattr(
        fused_decode, "decode_step", lambda *a, **k: steps.append(1) or decode_step(*a, **k)
    )
    params = rollout_params(TrainSection(temperature=1.0))

    def rollout(autocast):
        out = sample_completions(
            kept, [[1, 2, 3], [4, 5]], 4, params, frozenset(), lambda i: i, autocast=autocast
        )
        return [c.tokens for c in out]

    plain = rollout(None)
    assert len(steps) == 3
    assert rollout(torch.autocast("cpu", dtype=torch.bfloat16)) == plain and len(steps) == 6
