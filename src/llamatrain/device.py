"""Which device a run uses, the run choices ``auto`` leaves to it, and the process-wide
settings that make training fast there.

``auto`` in ``model.ops``, ``model.attention`` and ``train.dtype`` is made concrete once, by
:func:`resolve_run_settings`, before anything reads them: on CUDA PyTorch's ops, its fused
attention kernels and bf16 autocast; on the CPU ggml's semantics in float32 (a QLoRA run in bf16
where the CPU multiplies it in AMX tiles).

The process settings change the whole process (the C library's malloc, PyTorch's matmul
precision), so no constructor applies them behind the caller's back: the entry points
(``llamatrain fit``, ``llamatrain.fit``, the benchmarks) call :func:`configure_process`
once, visibly.
"""

from __future__ import annotations

import dataclasses

import torch

from llamatrain.allocator import retain_freed_memory
from llamatrain.config import Config
from llamatrain.errors import TrainingError
from llamatrain.ops.sets import AUTO, OpSet, run_choices


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, so the same config runs on a laptop and a GPU box."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device = 'cuda' but no CUDA device is available; use 'auto'")
    return torch.device(name)


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 in hardware (a CUDA GPU from Ampere on): autocast to
    bf16 elsewhere is emulated or slow, so ``train.dtype = "auto"`` keeps float32 there."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def amx_bf16() -> bool:
    """Whether this CPU multiplies bf16 in matrix tiles (Intel AMX, Sapphire Rapids on): there
    a bf16 product runs several times float32's speed; elsewhere a CPU emulates it, slower."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def fast_bf16(cfg: Config, ops: str, device: torch.device) -> bool:
    """Whether ``train.dtype = "auto"`` computes in bf16: PyTorch's ops on a GPU with native
    bf16, or a QLoRA run on a CPU with AMX. QLoRA's base is 4-8 bits a weight already, bf16
    is its usual compute dtype (the QLoRA paper's), and there the step's products, float32
    otherwise, are what keeps it from llama.cpp's speed (a Llama-3.2-1B-shape Q4_0 step of 64
    tokens: ~1.5 s against ~2.9 s in float32; ``bench/scale.py``)."""
    if device.type == "cuda":
        return ops == "torch" and native_bf16(device)
    qlora = cfg.lora.rank > 0 and cfg.lora.base_dtype == "quantized"
    return qlora and device.type == "cpu" and amx_bf16()


def resolve_run_settings(cfg: Config, built: OpSet | None = None) -> Config:
    """``cfg`` with every ``auto`` run choice made concrete for the device it trains on.

    ``model.ops`` and ``model.attention``: ``llamatrain.ops.sets.run_choices``. ``train.dtype``
    ``auto``: bf16 autocast where :func:`fast_bf16` says, float32 otherwise, so ``model.ops =
    "ggml"`` alone gives the ggml path (ggml ops, blockwise attention, float32) on a GPU too.
    ``train.device`` stays as set: a resume on another machine finds its device again. The
    result is what the run records (its ``config.toml``), so a resume with it computes the
    same arithmetic. On the CPU every ``auto`` is the choice it replaced as the default:
    ggml, flash, float32 (but QLoRA's bf16 on an AMX CPU).

    ``built``: the op set of a model built before the run was configured (a ``Trainer``
    given one; a model is built with the CPU's choices, ``llamatrain.ops.sets.op_set``): its
    ops and attention are the run's whatever ``cfg`` says, so ``auto``'s dtype follows what
    will run and the record says what ran.
    """
    device = resolve_device(cfg.train.device)
    if built is None:
        cuda = device.type == "cuda"
        ops, attention = run_choices(cfg.model.ops, cfg.model.attention, cuda=cuda)
    else:
        ops, attention = built.name, built.attend
    dtype = cfg.train.dtype
    if dtype == AUTO:
        dtype = "bfloat16" if fast_bf16(cfg, ops, device) else "float32"
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, ops=ops, attention=attention),
        train=dataclasses.replace(cfg.train, dtype=dtype),
    )


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
