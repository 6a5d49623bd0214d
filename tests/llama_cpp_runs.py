"""Running a GGUF in real llama.cpp the way the comparisons need it, for any test module.

llama.cpp with an F32 KV cache, no flash attention and one thread is exact enough to compare
its logits with ours at 1e-5 (two threads on shared cores lose time to spin-waiting, and the
f16 cache alone rounds at 1e-3).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def cpp_logits(
    llama_cpp: Any, path: Path, ids: list[int], *, lora: Path | None = None, n_ctx: int = 256
) -> np.ndarray:
    """llama.cpp's logits (len(ids), vocab) for ``ids`` on the model at ``path`` (with the
    LoRA adapter ``lora`` applied, if given), as float64."""
    llm = open_exact(llama_cpp, path, lora=lora, n_ctx=n_ctx)
    try:
        return logits_of(llm, ids)
    finally:
        llm.close()


def open_exact(llama_cpp: Any, path: Path, *, lora: Path | None = None, n_ctx: int = 256) -> Any:
    """A ``llama_cpp.Llama`` configured for exact comparisons; the caller closes it."""
    return llama_cpp.Llama(
        str(path), lora_path=None if lora is None else str(lora), n_ctx=n_ctx, logits_all=True,
        type_k=0, type_v=0, flash_attn=False, n_threads=1, n_threads_batch=1, seed=0,
        verbose=False,
    )  # fmt: skip


def logits_of(llm: Any, ids: list[int]) -> np.ndarray:
    """The logits of an open model for ``ids`` from a fresh context."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)
