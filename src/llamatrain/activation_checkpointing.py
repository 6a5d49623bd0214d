"""Activation (gradient) checkpointing, applied to a model from outside.

Checkpointing trades compute for memory: a segment of blocks keeps only its input during the
forward pass and recomputes its activations in the backward pass. The policy is one of

* ``none`` — keep everything;
* ``full`` — every block is its own segment;
* ``every_n`` — segments of n blocks;
* ``auto`` — the 2023 trainer's spacing. Keeping k segment inputs of u bytes each and
  recomputing one segment of n/k blocks of v bytes each costs k·u + (n/k)·v, smallest at
  k = sqrt(n·v/u). u and v are measured on the model (not guessed), so the rule stays honest
  for grouped-query attention, wide feed-forwards or another op set.

:func:`apply` wraps the model as torchtitan's ``apply_ac`` does: it replaces ``model.blk``
with a container of the *same* blocks that runs them in segments under
``torch.utils.checkpoint``. The model's code and its parameter names (``blk.N.*``, the GGUF
names) do not change, and the model never learns how it is being run.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from llamatrain.model import Blocks, KVCache, Llama, Rope

POLICIES = ("none", "full", "every_n", "auto")


def block_activation_bytes(
    model: Llama, n_seq: int, n_ctx: int, autocast: torch.dtype | None = None
) -> tuple[int, int]:
    """Measure (u, v): bytes of one block's input and of everything one block saves.

    The block runs once on zeros of the training shape, under the training's autocast dtype
    (bf16 activations are half the size); every tensor autograd saves that is not a parameter
    is counted once.
    """
    block = model.blk[0]
    param = next(model.parameters())
    x = torch.zeros(n_seq, n_ctx, model.cfg.dim, device=param.device, requires_grad=True)
    rope = model.rope_for(torch.arange(n_ctx, device=param.device))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and t.data_ptr() not in saved:
            saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    mixed = torch.autocast(param.device.type, dtype=autocast, enabled=autocast is not None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), mixed:
        block(x, rope)
    return x.numel() * x.element_size(), sum(saved.values())


def segment_length(policy: str, every_n: int, n_layers: int, u: int = 1, v: int = 1) -> int:
    """Blocks per checkpointed segment for ``policy`` (0 = no checkpointing)."""
    if policy == "none":
        return 0
    if policy == "full":
        return 1
    if policy == "every_n":
        return max(1, min(every_n, n_layers))
    kept = min(n_layers, max(1, round(math.sqrt(n_layers * v / u))))
    return math.ceil(n_layers / kept)


class CheckpointedBlocks(Blocks):
    """The model's blocks, run in segments of ``segment`` whose activations are recomputed.

    Checkpointing applies only where it helps: while gradients are recorded and not during
    cached decoding (which records none).
    """

    def __init__(self, blocks: Blocks, segment: int) -> None:
        super().__init__(blocks)
        self.segment = segment

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if cache is not None or not torch.is_grad_enabled():
            return super().forward(x, rope, cache, documents)
        blocks = list(self)
        for start in range(0, len(blocks), self.segment):
            segment = blocks[start : start + self.segment]
            x = checkpoint(_run_segment, segment, x, rope, documents, use_reentrant=False)
        return x


def _run_segment(
    blocks: list[torch.nn.Module],
    x: torch.Tensor,
    rope: Rope,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    for block in blocks:
        x = block(x, rope, documents=documents)
    return x


def segment_of(model: Llama) -> int:
    """Blocks per recomputed segment the model runs with (0 = no checkpointing)."""
    return model.blk.segment if isinstance(model.blk, CheckpointedBlocks) else 0


def apply(
    model: Llama,
    policy: str,
    *,
    every_n: int = 2,
    n_seq: int = 1,
    n_ctx: int = 1,
    autocast: torch.dtype | None = None,
) -> int:
    """Checkpoint ``model``'s blocks as ``policy`` says; returns the segment length used.

    ``n_seq`` × ``n_ctx`` is the micro-batch shape and ``autocast`` the training's mixed
    precision dtype (None = none), which ``auto`` measures the block with. Applying again
    replaces the earlier policy.
    """
    blocks = Blocks(model.blk)
    u = v = 1
    if policy == "auto":
        u, v = block_activation_bytes(model, n_seq, n_ctx, autocast)
    segment = segment_length(policy, every_n, len(blocks), u, v)
    model.blk = CheckpointedBlocks(blocks, segment) if segment else blocks
    return segment
