"""Optimizers and the learning-rate schedule of llama.cpp's 2023 trainer.

AdamW decays only tensors with at least ``decay_min_ndim`` dimensions (matrices, not norms),
as ``train-text-from-scratch`` did; its update is exactly ggml's (bias-corrected, decoupled
decay), applied by PyTorch's fused AdamW kernel through :class:`AdamW`. The schedule is
linear warmup, then cosine decay to ``lr_min`` with optional warm restarts whose period grows
by ``cos_decay_restart`` each cycle.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from llamatrain.config import OptimSection


def trained_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer updates, in the model's order: all of them, or a LoRA
    run's adapters. The order of AdamW's flat moments and of a checkpoint's."""
    return [p for p in model.parameters() if p.requires_grad]


def parameter_groups(model: nn.Module, weight_decay: float, decay_min_ndim: int) -> list[dict]:
    """Split parameters into a decayed group (ndim >= decay_min_ndim) and an undecayed one."""
    params = trained_parameters(model)
    decayed = [p for p in params if p.dim() >= decay_min_ndim]
    plain = [p for p in params if p.dim() < decay_min_ndim]
    return [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]


class AdamW:
    """AdamW as ``torch.optim.AdamW(fused=True)`` computes it, without ``torch.optim``.

    Why not ``torch.optim.AdamW`` itself: constructing or stepping any ``torch.optim``
    optimizer imports ``torch._dynamo`` (about 800 modules, 72 MB of RSS measured with torch
    2.13), a third of what a small model's whole run needs beside torch (bench/peers.py). The
    update is PyTorch's own fused kernel (``torch._fused_adamw_``: one pass per tensor, no
    temporaries), called as ``torch.optim.AdamW`` calls it, so the numbers are the same; a
    test pins them to ggml's formula. The state keeps ``torch.optim``'s layout
    (``state[param]`` = ``step``, ``exp_avg``, ``exp_avg_sq``; ``param_groups`` with ``lr``)
    for checkpoints, reports and the schedule.
    """

    def __init__(
        self,
        groups: list[dict],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        order: list[torch.Tensor] | None = None,
    ) -> None:
        self.defaults = {"lr": lr, "betas": betas, "eps": eps}
        self.param_groups = [{**self.defaults, "weight_decay": 0.0, **g} for g in groups]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.order = order if order is not None else [p for g in groups for p in g["params"]]
        """The parameters in the order of :meth:`flat_moments` (default: the groups');
        ``build_optimizer`` gives the model's."""
        self._flat = bool(self.order) and _flattenable(self.order)
        """Whether the moments are kept as two flat vectors (decided once: a parameter's
        kind, device and layout do not change while it is being optimized)."""

    def zero_grad(self) -> None:
        """Drop the gradients (``torch.optim``'s default): the next backward writes them
        afresh instead of adding to zeros."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One update from the current gradients. ``closure``, as ``torch.optim`` takes it,
        recomputes the loss and the gradients first; its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss

    @torch.no_grad()
    def _update(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for tensors in _by_device_and_dtype(params).values():
                self._fused_step(tensors, group)

    def _fused_step(self, params: list[torch.Tensor], group: dict) -> None:
        states = [self._state(p) for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            steps,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
        )

    @torch.no_grad()
    def set_state(
        self, p: torch.Tensor, step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
    ) -> None:
        """Give ``p`` its moments after ``step`` updates (a resumed checkpoint's), copied into
        the state's own storage."""
        state = self._state(p)
        state["step"].fill_(float(step))
        state["exp_avg"].copy_(exp_avg)
        state["exp_avg_sq"].copy_(exp_avg_sq)

    def flat_moments(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The first and second moments of ``params`` as two flat vectors, without a copy:
        the storage every parameter's moments are views of, when ``params`` are
        :attr:`order` and the moments are kept that way (see :meth:`_state`); else None.
        :meth:`_state` creates all of them as views of one pair of vectors or none of them,
        and :meth:`set_state` copies into them, so the first parameter's views tell."""
        if not params or [id(p) for p in params] != [id(p) for p in self.order]:
            return None
        first = self._state(params[0])
        if first["exp_avg"]._base is None:
            return None
        return first["exp_avg"]._base, first["exp_avg_sq"]._base

    def _state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """``p``'s state, created at the first step in the layout the fused kernel reads: a
        float32 step count on ``p``'s device beside the two moments, as
        ``torch.optim.AdamW(fused=True)`` keeps them. The moments of all parameters are
        allocated together, as views of two flat vectors in :attr:`order` when the
        parameters allow (plain tensors of one device and dtype): a checkpoint then writes
        those vectors, the 2023 layout, as they are — concatenating them at each save would
        add twice the weights' bytes to the run's peak memory (a third of a full finetune's
        AdamW state)."""
        if p not in self.state:
            if self._flat and any(p is q for q in self.order):
                self._allocate_flat()
            else:
                self.state[p] = _new_state(p, *(torch.zeros_like(p) for _ in range(2)))
        return self.state[p]

    def _allocate_flat(self) -> None:
        size = sum(p.numel() for p in self.order)
        first, second = (self.order[0].new_zeros(size) for _ in range(2))
        offset = 0
        for p in self.order:
            views = (m[offset : offset + p.numel()].view_as(p) for m in (first, second))
            self.state[p] = _new_state(p, *views)
            offset += p.numel()


def _new_state(p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> dict:
    step = torch.zeros((), dtype=torch.float32, device=p.device)
    return {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _flattenable(params: list[torch.Tensor]) -> bool:
    """Plain contiguous tensors of one device and dtype (an FSDP shard, a DTensor, is not)."""
    first = params[0]
    return all(
        type(p.data) is torch.Tensor
        and p.is_contiguous()
        and (p.device, p.dtype) == (first.device, first.dtype)
        for p in params
    )


def _by_device_and_dtype(params: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """The fused kernel takes tensors of one device and dtype per call."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    return groups


Optimizer = AdamW | torch.optim.LBFGS


def build_optimizer(model: nn.Module, cfg: OptimSection) -> Optimizer:
    """AdamW or L-BFGS, at the schedule's starting lr.

    AdamW uses PyTorch's fused kernel on every device (:class:`AdamW`): one pass per tensor
    with no temporaries, where the foreach implementation makes several, with the same
    update (bench/README.md has the measured difference).
    """
    if cfg.name == "lbfgs":
        return torch.optim.LBFGS(
            trained_parameters(model),
            lr=cfg.lr,
            max_iter=cfg.lbfgs_max_iter,
            history_size=cfg.lbfgs_history,
            line_search_fn="strong_wolfe",
        )
    return AdamW(
        parameter_groups(model, cfg.weight_decay, cfg.decay_min_ndim),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        order=trained_parameters(model),
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


def set_lr(optimizer: Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
