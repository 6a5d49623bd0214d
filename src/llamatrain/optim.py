"""Optimizers and the learning-rate schedule of llama.cpp's 2023 trainer.

AdamW decays only tensors with at least ``decay_min_ndim`` dimensions (matrices, not norms),
as ``train-text-from-scratch`` did; its update is exactly ggml's (bias-corrected, decoupled
decay). The schedule is linear warmup, then cosine decay to ``lr_min`` with optional warm
restarts whose period grows by ``cos_decay_restart`` each cycle.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llamatrain.config import OptimSection


def parameter_groups(model: nn.Module, weight_decay: float, decay_min_ndim: int) -> list[dict]:
    """Split parameters into a decayed group (ndim >= decay_min_ndim) and an undecayed one."""
    params = [p for p in model.parameters() if p.requires_grad]
    decayed = [p for p in params if p.dim() >= decay_min_ndim]
    plain = [p for p in params if p.dim() < decay_min_ndim]
    return [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: OptimSection) -> torch.optim.Optimizer:
    """AdamW or L-BFGS, at the schedule's starting lr.

    AdamW uses PyTorch's fused kernel on every device: one pass per tensor with no
    temporaries, where the foreach implementation makes several, with the same update (a
    test pins it to ggml's formula; bench/README.md has the measured difference).
    """
    if cfg.name == "lbfgs":
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.LBFGS(
            params,
            lr=cfg.lr,
            max_iter=cfg.lbfgs_max_iter,
            history_size=cfg.lbfgs_history,
            line_search_fn="strong_wolfe",
        )
    return torch.optim.AdamW(
        parameter_groups(model, cfg.weight_decay, cfg.decay_min_ndim),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=True,
    )


def lr_at(step: int, cfg: OptimSection) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Warmup: lr·(step+1)/warmup_steps. Then cosine from lr to lr_min over cos_decay_steps;
    with ``cos_decay_restart`` > 0 the cosine restarts and each period is that factor longer
    than the last (1.0 keeps it constant); with 0 the rate holds at lr_min after one decay.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = step - cfg.warmup_steps
    period = float(cfg.cos_decay_steps)
    if cfg.cos_decay_restart > 0:
        while t >= period:
            t -= period
            period *= cfg.cos_decay_restart
    elif t >= period:
        return cfg.lr_min
    cosine = 0.5 * (1.0 + math.cos(math.pi * t / period))
    return cfg.lr_min + (cfg.lr - cfg.lr_min) * cosine


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
