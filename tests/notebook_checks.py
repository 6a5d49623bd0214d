"""What each example notebook's ``SUMMARY {json}`` line must show: that it trained, exported
and generated, not only ran. Shared by tests/integration/test_notebooks.py (each notebook
executed from a folder of its own) and tests/unit/test_docs_site.py (the docs build's
executions, read from the rendered pages)."""

from __future__ import annotations

import math


def check_quickstart(summary: dict) -> None:
    assert summary["quick"] is True and summary["steps"] > 0
    # 24 steps take the loss well below the uniform ln(384) = 5.95 it starts near
    assert summary["last_loss"] < summary["first_loss"] - 0.5
    assert math.isfinite(summary["val_loss"]) and summary["val_loss"] < 5.5
    assert summary["pytorch_text"].strip()
    assert summary["llama_cpp_tokens"] > 0 and summary["llama_cpp_text"].strip()
    assert summary["gguf_bytes"] > 100_000


def check_baby_llama(summary: dict) -> None:
    assert summary["quick"] is True
    for name in ("AdamW", "L-BFGS"):
        first, last = summary["val_loss"][name]
        assert last < 0.8 * first, f"{name} did not learn: {first} -> {last}"
        start, end = summary["matrix_loss"][name]
        assert end < 1e-6 * start, f"{name} did not solve the two-matrix problem: {end}"
        assert 0 <= summary["continuation_error"][name] <= 30


def check_lora_chat(summary: dict) -> None:
    assert summary["quick"] is True and summary["steps"] > 0
    assert summary["last_loss"] < summary["first_loss"] - 1.0  # the replies' loss fell
    assert 0 < summary["trainable"] < summary["total"] / 4  # adapters only
    assert summary["adapter_bytes"] > 10_000
    # llama.cpp with the exported --lora adapter over the base gives the greedy reply PyTorch gives
    assert summary["pytorch_reply"] and summary["llama_cpp_reply"] == summary["pytorch_reply"]


def check_grpo(summary: dict) -> None:
    assert summary["quick"] is True and summary["steps"] == 20
    rewards = summary["reward_len"]  # -|20 - characters|: the only function, weight 1
    assert summary["rewards"] == rewards and all(r <= 0 for r in rewards)
    assert all(1 <= n <= 16 for n in summary["mean_length"])  # max_completion_length 16
    # the reward moved toward 20 characters: the last 10 steps' mean above the first 5's
    assert sum(rewards[-10:]) / 10 > sum(rewards[:5]) / 5
    assert summary["table_rows"] > 0 and summary["adapter_bytes"] > 10_000
    # llama.cpp with the run's GGUF adapter over the base replies as our decoder does, greedy
    assert summary["pytorch_reply"] and summary["llama_cpp_reply"] == summary["pytorch_reply"]


def check_grpo_tools(summary: dict) -> None:
    assert summary["quick"] is True and summary["steps"] == 10
    assert all(0.0 <= r <= 1.0 for r in summary["rewards"])  # right_answer: 0 or 1 each
    assert all(f >= 0.0 for f in summary["call_frequency"])  # the tool metrics were logged
    assert summary["table_rows"] > 0 and summary["table_tools"]  # each row's tool counts
    assert summary["adapter_bytes"] > 10_000
    # llama.cpp with the run's adapter replies to the tool prompt as our decoder does, greedy
    assert summary["pytorch_reply"] and summary["llama_cpp_reply"] == summary["pytorch_reply"]


CHECKS = {
    "quickstart.ipynb": check_quickstart,
    "baby_llama.ipynb": check_baby_llama,
    "lora_chat.ipynb": check_lora_chat,
    "grpo.ipynb": check_grpo,
    "grpo_tools.ipynb": check_grpo_tools,
}
