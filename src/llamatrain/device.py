"""Which device a run uses, and the process-wide settings that make training fast there.

The settings change the whole process (the C library's malloc, PyTorch's matmul precision),
so no constructor applies them behind the caller's back: the entry points (``llamatrain fit``,
``llamatrain.fit``, the benchmarks) call :func:`configure_process` once, visibly.
"""

from __future__ import annotations

import torch

from llamatrain.allocator import retain_freed_memory
from llamatrain.errors import TrainingError


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, so the same config runs on a laptop and a GPU box."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device = 'cuda' but no CUDA device is available; use 'auto'")
    return torch.device(name)


def configure_process(device: torch.device, *, bf16: bool) -> None:
    """Process-wide speed settings for training on ``device``.

    On CPU, freed activations are kept for reuse instead of being page-faulted in again every
    step (``llamatrain.allocator``). On CUDA with bf16 autocast, the float32 matmuls autocast
    leaves (the fused lm head + loss computes in float32) may use TF32 tensor cores too: mixed
    precision was asked for.
    """
    if device.type == "cpu":
        retain_freed_memory()
    elif device.type == "cuda" and bf16:
        torch.backends.cuda.matmul.allow_tf32 = True
