"""Settings that size an allocation are bounded before step 1: the memory plan counts a
step's batch of token ids (``train.n_batch``) and the KV cache a sample or a GRPO rollout
allocates up front (``train.sample_tokens``; the step's rows), and a run that cannot hold
them is refused in one line naming the key; ``train.sample_tokens`` is at most what
``generate --max-tokens`` allows. PyTorch's CPU allocator failing is one line too."""

from __future__ import annotations

import pytest
import torch
from user_errors import error_of

from llamatrain import memory
from llamatrain.config import load_config
from llamatrain.errors import MemoryBudgetError
from llamatrain.memory import check_fits, kv_cache_bytes, out_of_memory_in, plan_memory
from llamatrain.model import KVCache, ModelConfig

ONE_B = ModelConfig(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
    max_seq_len=131072, tie_embeddings=True,
)  # fmt: skip
"""Llama-3.2-1B's shape: 64 KiB of float32 keys and values a token."""
SMALL = ModelConfig(
    dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=512, max_seq_len=64
)


def refusal(monkeypatch, cfg, model=ONE_B, available_gb: float = 16) -> str:
    monkeypatch.setattr(memory, "available_memory", lambda: int(available_gb * (1 << 30)))
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)
    return error_of(check_fits, cfg, model, None)


def test_the_planned_kv_cache_is_what_generate_allocates():
    cache = KVCache(SMALL, 3, 40, torch.device("cpu"), torch.float32)
    assert kv_cache_bytes(SMALL, 3 * 40) == sum(b.nbytes for b in cache.buffers())


def test_a_sample_too_long_for_the_machine_is_refused_naming_sample_tokens(monkeypatch):
    cfg = load_config("tiny", ["train.sample_tokens=1048576", "data.n_ctx=64"])
    plan = plan_memory(cfg, ONE_B)
    prompt = len(cfg.train.sample_prompt.encode()) + 1
    assert plan.decoding == kv_cache_bytes(ONE_B, 1048576 + prompt)  # 64 GB
    message = refusal(monkeypatch, cfg)
    assert "decoding 64.0 GB" in message
    assert message.endswith("lower train.sample_tokens (= 1048576): a sample's KV cache holds "
                            "every token it may generate")  # fmt: skip
    default = load_config("tiny", ["data.n_ctx=64"])
    assert plan_memory(default, ONE_B).decoding < plan_memory(default, ONE_B).activations


def test_a_grpo_rollout_too_large_is_refused_naming_n_batch(monkeypatch):
    grpo = [
        'train.objective="grpo"', 'data.format="jsonl"', 'train.rewards=["builtin:format"]',
        "data.n_ctx=4096", "train.n_batch=1048576", "train.n_ubatch=4096", "train.sample_tokens=0",
        "train.max_completion_length=256",
    ]  # fmt: skip
    cfg = load_config("tiny", grpo)
    assert plan_memory(cfg, ONE_B).decoding == kv_cache_bytes(ONE_B, 1048576)  # 256 rows
    assert refusal(monkeypatch, cfg).endswith(
        "lower train.n_batch (= 1048576) or data.n_ctx: a rollout's KV cache holds every row of "
        "the step, n_ctx tokens each"
    )


def test_a_batch_larger_than_the_machine_is_refused_naming_n_batch(monkeypatch):
    cfg = load_config("tiny", ["data.n_ctx=64", "train.n_batch=6400000000", "train.n_ubatch=64"])
    message = refusal(monkeypatch, cfg, SMALL)
    assert "batch 143.1 GB" in message
    assert message.endswith(
        "lower train.n_batch (= 6400000000): a step draws all its tokens at once"
    )


def test_sample_tokens_is_bounded_by_validation():
    message = error_of(load_config, "tiny", ["train.sample_tokens=1000000000"])
    assert message.startswith("train.sample_tokens in --set train.sample_tokens=1000000000 must "
                              "be <= 1048576")  # fmt: skip


def test_the_cpu_allocator_failing_is_one_line():
    failed = pytest.raises(MemoryBudgetError, match=r"^out of memory in a test \(.*can't allocate")
    with failed, out_of_memory_in("in a test", remedy="lower it"):
        torch.empty(1 << 62, dtype=torch.uint8)
