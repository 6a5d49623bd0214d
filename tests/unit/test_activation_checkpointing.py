"""Activation checkpointing, applied to a model from outside (``activation_checkpointing``).

Checkpointing may change memory use and nothing else: the loss, every gradient, the parameter
names (the GGUF names) and the state_dict must be what the plain model gives. It must also
really happen during training (blocks recomputed in backward) and never where it cannot help:
without gradients, or while decoding with a KV cache.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

from llamatrain import activation_checkpointing as ac
from llamatrain.generate import generate
from llamatrain.model import Blocks, KVCache, Llama, ModelConfig

SMALL = dict(vocab_size=40, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=16)


def make_model(dtype: torch.dtype = torch.float64, **changes: object) -> Llama:
    torch.manual_seed(0)
    return Llama(ModelConfig(**{**SMALL, **changes})).to(dtype)


def batch(cfg: ModelConfig, b: int = 2, t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (b, t + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model: Llama, tokens, targets) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model.loss(tokens, targets)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@contextmanager
def checkpoint_calls() -> Iterator[list[int]]:
    """Count calls of ``torch.utils.checkpoint.checkpoint`` (one per checkpointed segment).

    Observed with the interpreter's profiling hook rather than by replacing the function, so
    the code under test runs unchanged.
    """
    target = Path(torch.utils.checkpoint.__file__).resolve()
    calls = [0]

    def profile(frame, event, arg):
        code = frame.f_code
        in_checkpoint = code.co_name == "checkpoint" and Path(code.co_filename).resolve() == target
        if event == "call" and in_checkpoint:
            calls[0] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


def count_block_runs(model: Llama) -> list[int]:
    """Forward runs of each block, counted by forward pre-hooks (a recomputation is a run)."""
    runs = [0] * model.cfg.n_layers
    for i, block in enumerate(model.blk):
        block.register_forward_pre_hook(lambda module, args, i=i: runs.__setitem__(i, runs[i] + 1))
    return runs


# ---- which segments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "policy, every_n, n_layers, expected",
    [
        ("none", 3, 16, 0),
        ("full", 3, 16, 1),
        ("every_n", 3, 16, 3),
        ("every_n", 3, 2, 2),  # a segment never spans more blocks than there are
        ("every_n", 16, 4, 4),
    ],
)
def test_segment_length_per_policy(policy, every_n, n_layers, expected):
    assert ac.segment_length(policy, every_n, n_layers) == expected


def test_auto_follows_the_2023_rule():
    """Keep k = sqrt(n·v/u) segment inputs (rounded, 1..n), so segments of ceil(n/k) blocks."""
    # 16 layers, each block saving 9x its input: keep sqrt(16·9) = 12 inputs -> 2 per segment
    assert ac.segment_length("auto", 0, 16, u=1, v=9) == 2
    # cheap blocks (v = u): keep sqrt(16) = 4 inputs, segments of 4
    assert ac.segment_length("auto", 0, 16, u=1, v=1) == 4
    # very expensive blocks: keeping every input (segments of 1) is the best there is
    assert ac.segment_length("auto", 0, 16, u=1, v=1000) == 1
    # activations smaller than the input cannot make a segment longer than the model
    assert ac.segment_length("auto", 0, 4, u=100, v=1) == 4


def test_auto_measures_the_model():
    """(u, v) come from running a block, not from a formula: u is exactly the block input's
    bytes, and a wider feed-forward makes v grow by at least the two (tokens x ffn) tensors
    SwiGLU's backward needs (gate and up), while u stays the same; fewer kv heads save less."""
    n_seq, n_ctx = 2, 16
    tokens = n_seq * n_ctx
    narrow = make_model(torch.float32, n_layers=16, ffn_dim=32)
    wide = make_model(torch.float32, n_layers=16, ffn_dim=64)
    u_narrow, v_narrow = ac.block_activation_bytes(narrow, n_seq, n_ctx)
    u_wide, v_wide = ac.block_activation_bytes(wide, n_seq, n_ctx)
    assert u_narrow == u_wide == tokens * SMALL["dim"] * 4
    assert v_wide - v_narrow >= 2 * tokens * (64 - 32) * 4
    # so the two models are checkpointed differently: 16·v/u crosses a rounding boundary
    assert ac.segment_length("auto", 0, 16, u_narrow, v_narrow) == 2
    assert ac.apply(narrow, "auto", n_seq=n_seq, n_ctx=n_ctx) == 2
    assert ac.apply(wide, "auto", n_seq=n_seq, n_ctx=n_ctx) == 1
    # grouped-query attention: one kv head instead of two keeps smaller k and v
    mqa = make_model(torch.float32, n_layers=16, ffn_dim=32, n_kv_heads=1)
    assert ac.block_activation_bytes(mqa, n_seq, n_ctx)[1] < v_narrow
    # and the measurement is of the block at the training shape: twice the tokens, twice u
    assert ac.block_activation_bytes(narrow, 2 * n_seq, n_ctx)[0] == 2 * u_narrow


# ---- what it changes and what it must not --------------------------------------------------


@pytest.mark.parametrize(
    "policy, every_n, segments",
    [("full", 2, 4), ("every_n", 2, 2), ("every_n", 3, 2), ("auto", 2, None)],
)
def test_checkpointing_gives_identical_loss_and_gradients(policy, every_n, segments):
    """In float64, recomputing a segment repeats exactly the same operations on the same
    inputs, so loss and gradients must be bit-identical, not merely close."""
    model = make_model()
    tokens, targets = batch(model.cfg)
    plain_loss, plain_grads = loss_and_grads(model, tokens, targets)
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())

    segment = ac.apply(model, policy, every_n=every_n, n_seq=2, n_ctx=16)
    assert segment >= 1
    with checkpoint_calls() as calls:
        loss, grads = loss_and_grads(model, tokens, targets)
    expected_segments = -(-model.cfg.n_layers // segment)  # ceil
    assert calls[0] == expected_segments == (segments or expected_segments)
    assert loss == plain_loss
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name
    # the GGUF names and the state_dict do not change
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    Llama(model.cfg).double().load_state_dict(model.state_dict(), strict=True)


@pytest.mark.parametrize(
    "changes",
    [
        dict(arch="qwen2"),
        dict(arch="qwen3"),
        dict(arch="smollm3"),
        dict(arch="gemma3", sliding_window=4),  # shorter than the batch: the window matters
    ],
    ids=lambda changes: changes["arch"],
)
def test_checkpointing_every_family_gives_identical_loss_and_gradients(changes):
    """Checkpointing wraps blocks, whatever the family's switches do inside them (biases, q/k
    norms, NoPE layers, sandwich norms, windows): the same bit-identity in float64."""
    model = make_model(**changes)
    tokens, targets = batch(model.cfg)
    plain_loss, plain_grads = loss_and_grads(model, tokens, targets)
    ac.apply(model, "full", every_n=2, n_seq=2, n_ctx=16)
    with checkpoint_calls() as calls:
        loss, grads = loss_and_grads(model, tokens, targets)
    assert calls[0] == model.cfg.n_layers
    assert loss == plain_loss
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name


def test_checkpointed_blocks_are_recomputed_in_backward():
    model = make_model(torch.float32)
    tokens, targets = batch(model.cfg)
    ac.apply(model, "every_n", every_n=2)
    runs = count_block_runs(model)
    loss = model.loss(tokens, targets)
    assert runs == [1, 1, 1, 1]
    loss.backward()
    assert runs == [2, 2, 2, 2]  # each segment ran again to rebuild its activations


def test_applying_again_replaces_the_policy():
    model = make_model(torch.float32)
    blocks = list(model.blk)
    tokens, targets = batch(model.cfg)
    assert ac.apply(model, "full") == 1
    assert ac.apply(model, "every_n", every_n=2) == 2
    # not nested: the same blocks in one container, run in segments of 2, not 1 within 2
    assert list(model.blk) == blocks
    assert not any(isinstance(m, Blocks) for m in model.blk.children())
    with checkpoint_calls() as calls:
        model.loss(tokens, targets).backward()
    assert calls[0] == 2
    assert ac.apply(model, "none") == 0
    assert type(model.blk) is Blocks and list(model.blk) == blocks
    runs = count_block_runs(model)
    with checkpoint_calls() as calls:
        model.loss(tokens, targets).backward()
    assert calls[0] == 0 and runs == [1, 1, 1, 1]


def test_no_checkpointing_without_gradients():
    """Inference records nothing to recompute; checkpointing it would only cost time."""
    model = make_model()
    tokens, _ = batch(model.cfg)
    reference = model(tokens)
    ac.apply(model, "full")
    runs = count_block_runs(model)
    with torch.no_grad(), checkpoint_calls() as calls:
        logits = model(tokens)
    assert calls[0] == 0 and runs == [1, 1, 1, 1]
    assert torch.equal(logits, reference)
    with torch.inference_mode(), checkpoint_calls() as calls:
        model(tokens)
    assert calls[0] == 0


def test_no_checkpointing_with_a_kv_cache():
    """A cached forward writes the cache as it goes; a recomputation in backward would write
    the same positions again at a later cache length. So with a cache the blocks run plainly,
    even while gradients are recorded, and the cached decoding of a checkpointed model is the
    plain model's."""
    model = make_model()
    tokens, _ = batch(model.cfg, b=1, t=12)
    full = model(tokens).detach()
    ac.apply(model, "full")
    runs = count_block_runs(model)
    cache = KVCache(model.cfg, 1, 12, "cpu", torch.float64)
    assert torch.is_grad_enabled()
    with checkpoint_calls() as calls:
        prefill = model(tokens[:, :8], cache=cache)
        steps = [model(tokens[:, i : i + 1], cache=cache) for i in range(8, 12)]
    assert calls[0] == 0
    assert runs == [5, 5, 5, 5]  # the prefill and 4 single-token steps, each block once
    torch.testing.assert_close(torch.cat([prefill, *steps], 1).detach(), full, rtol=0, atol=1e-10)
    # generate() decodes with a cache under no_grad: greedy output is the plain model's
    plain = make_model()
    prompt = tokens[0, :4]
    ours = generate(model, prompt, 6, seed=0)
    assert torch.equal(ours, generate(plain, prompt, 6, seed=0))


def test_auto_measures_under_the_training_autocast():
    """Under bf16 autocast a block saves bf16 activations: v shrinks while the block input u
    (the float32 residual stream the segment keeps) does not, so the rule sees the ratio the
    training will have."""
    torch.manual_seed(0)
    model = Llama(ModelConfig(dim=64, n_layers=4, n_heads=4, vocab_size=32, max_seq_len=32))
    u32, v32 = ac.block_activation_bytes(model, 2, 32)
    u16, v16 = ac.block_activation_bytes(model, 2, 32, autocast=torch.bfloat16)
    assert u16 == u32 == 2 * 32 * 64 * 4
    assert v16 < 0.7 * v32  # measured 218,624 vs 333,312 bytes here
