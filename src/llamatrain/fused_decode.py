"""A model's decoding steps through one C++ call for all its blocks (``ops.decode_step``),
where the model is one the call computes exactly.

Why: at small widths (SmolLM2-135M: 30 layers of 576) a decoding step over a quantized file
spent about half its time outside the products, in the blocks' small PyTorch ops and their
Python calls; the C++ step leaves the products and a few microseconds a layer.

:func:`fuse_decoding` swaps ``model.blk`` for :class:`FusedDecodeBlocks` (the same blocks,
the same parameter names, as ``activation_checkpointing`` swaps it): a forward takes the C++
step when it is a decoding step the step computes as the blocks do (:meth:`FusedDecodeBlocks
.step_layers`): one new token per row on a float32 KV cache, no graph recorded, no autocast,
and every layer a plain llama block (rope on every layer, no window, no q/k norms or
sandwich norms, SwiGLU) whose seven projections are frozen blocks that the quantized kernels
multiply at this batch (``ops.quantized_matmul.kernel_rows``), each with or without a
float32 bias (qwen2's q/k/v) and a LoRA update the step adds (``lora.LoraLinear``: float32
factors, no dropout drawn; switched off by ``lora.adapters_disabled``: the base alone).
Anything else (a prompt, a float weight, dropout in training mode, training) runs the blocks
as before.

:func:`fused_decoding` does the same swap for the length of a ``with``, for a model built to
be trained (GRPO's rollouts sample from it).

The layers' pointers are laid out once per KV cache (a generation or a rollout makes its own):
the model's weights and adapter factors may change in place between caches (an optimizer's
step), but must not be replaced while one cache decodes (``lora.decoded_base``
swaps them around a whole rollout, before its cache exists).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator

import torch

from llamatrain.lora import FrozenLinear, LoraLinear
from llamatrain.model import Block, Blocks, KVCache, Llama, Rope
from llamatrain.ops.decode_step import (
    Adapter,
    LayerWeights,
    StepLayers,
    decode_step,
    reads,
    step_available,
)
from llamatrain.ops.grad_mode import records_graph
from llamatrain.ops.quantized_matmul import kernel_rows
from llamatrain.ops.rope import rope_angles
from llamatrain.parallel import sharded

__all__ = ["FusedDecodeBlocks", "fuse_decoding", "fused_decoding"]

_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
"""A block's projections in ``ops.decode_step.PROJECTIONS`` order."""


def _plain_block(block: Block) -> bool:
    """Whether ``block`` computes nothing the C++ step leaves out."""
    cfg = block.cfg
    return (
        block.rotates
        and block.window is None
        and block.attn_q_norm is None
        and block.post_attention_norm is None
        and block.post_ffw_norm is None
        and cfg.family.activation == "swiglu"
    )


def _steps_adapter(module: LoraLinear) -> bool:
    """Whether the step computes ``module``'s update as the module does: no dropout drawn
    (eval mode, or none configured), contiguous float32 factors (adapters of a bf16 Linear
    are bf16)."""
    return reads(module.lora_a, module.lora_b) and not (module.training and module.dropout)


def _projection(
    module: torch.nn.Module, rows: int
) -> tuple[torch.Tensor, str, Adapter | None, torch.Tensor | None] | None:
    """(blocks, qtype, LoRA update or None, bias or None) of a projection the step computes
    at ``rows`` rows, or None: a float weight or one the kernels do not multiply, a bias not
    float32, an update the step does not compute. Switched-off adapters
    (``lora.adapters_disabled``): the base's."""
    if not isinstance(module, FrozenLinear | LoraLinear):
        return None
    bias = module.bias
    if bias is not None and not reads(bias):
        return None
    adapter = None
    if isinstance(module, LoraLinear):
        if not _steps_adapter(module):
            return None
        if not module.disabled:
            adapter = Adapter(module.lora_a.detach(), module.lora_b.detach(), module.scale)
    weight = module.weight
    n_in = module.lora_a.shape[1] if isinstance(module, LoraLinear) else module.in_features
    if not (weight.is_contiguous() and kernel_rows(weight, module.qtype, n_in, rows)):
        return None
    return weight, module.qtype, adapter, None if bias is None else bias.detach()


def _layer_weights(block: Block, rows: int) -> LayerWeights | None:
    """The block's tensors as the C++ step takes them, or None where a projection is not
    frozen blocks the kernels multiply at ``rows`` rows, with or without a LoRA update and a
    bias (:func:`_projection`)."""
    projections = [_projection(getattr(block, name), rows) for name in _PROJECTIONS]
    norms = (block.attn_norm.weight, block.ffn_norm.weight)
    if None in projections or not reads(*norms):
        return None
    blocks, qtypes, adapters, biases = zip(*projections, strict=True)
    return LayerWeights(blocks, qtypes, *norms, adapters=adapters, biases=biases)


class FusedDecodeBlocks(Blocks):
    """The model's blocks, a decoding step through the C++ step where it computes them
    (module docstring), else run one by one."""

    def __init__(self, blocks: Blocks) -> None:
        super().__init__(blocks)
        # per cache, while it lives (its buffers' address, the layers laid out on them): a
        # finished generation's cache, and the k/v its layers hold, are not kept
        self._prepared: weakref.WeakKeyDictionary[KVCache, tuple[int, StepLayers | None]]
        self._prepared = weakref.WeakKeyDictionary()

    def step_layers(self, x: torch.Tensor, cache: KVCache | None) -> StepLayers | None:
        """The C++ step's layers for this call, or None where the blocks must run."""
        if cache is None or x.shape[1] != 1 or x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        if records_graph(x) or torch.is_autocast_enabled("cpu") or cache.k.dtype != torch.float32:
            return None
        known = self._prepared.get(cache)
        if known is None or known[0] != cache.k.data_ptr():
            known = self._prepared[cache] = (cache.k.data_ptr(), self._lay_out(x, cache))
        return known[1]

    def _lay_out(self, x: torch.Tensor, cache: KVCache) -> StepLayers | None:
        """The layers laid out for ``cache``, or None where any block does not qualify."""
        if not step_available():
            return None
        layers = []
        for block in self:
            weights = _layer_weights(block, x.shape[0]) if _plain_block(block) else None
            if weights is None:
                return None
            layers.append(weights)
        return StepLayers(layers, cache.k, cache.v)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        layers = None if documents is not None else self.step_layers(x, cache)
        if layers is None:
            return super().forward(x, rope, cache, documents)
        block = self[0]
        cfg = block.cfg
        settings = rope.frequencies()
        neox = settings.pop("mode") == "neox"
        cos, sin = rope_angles(rope.pos, cfg.head_dim, **settings)
        half = cfg.head_dim // 2
        batch = x.shape[0]
        cos, sin = (t.reshape(-1, half).expand(batch, half) for t in (cos, sin))
        scale = block.scale if block.scale is not None else 1.0 / math.sqrt(cfg.head_dim)
        out = decode_step(
            layers, x.reshape(batch, -1).clone(), cos, sin, cache.padding, cache.length,
            heads=cfg.n_heads, eps=cfg.norm_eps, scale=scale, neox=neox,
        )  # fmt: skip
        return out.view(batch, 1, -1)


def fuse_decoding(model: Llama) -> Llama:
    """``model`` with its blocks in a :class:`FusedDecodeBlocks` (module docstring); returns
    the model."""
    if not isinstance(model.blk, FusedDecodeBlocks):
        model.blk = FusedDecodeBlocks(model.blk)
    return model


@contextlib.contextmanager
def fused_decoding(model: torch.nn.Module) -> Iterator[bool]:
    """Within it, ``model``'s decoding steps take the C++ step where it computes them (a
    training model's rollouts: GRPO samples from the model it trains, which
    ``model_source.inference_model`` did not build); yields whether the blocks were swapped.

    The swap is :func:`fuse_decoding`'s over the very blocks (no parameter, buffer or name
    changes), undone on exit, so training, checkpoints and exports never see it; checkpointed
    blocks are wrapped as they are (they checkpoint nothing while a cache decodes) and put
    back. A model that is not a plain ``Llama`` (a DDP wrapper, a compiled one), one that
    FSDP shards (its blocks' parameters are shards between their forwards, which the step
    would skip), or one fused already is left as it is. The adapters' factors are read
    through pointers laid out per KV cache, i.e. per rollout: an optimizer's in-place update
    is seen by the next."""
    blocks = getattr(model, "blk", None)
    plain = isinstance(model, Llama) and isinstance(blocks, Blocks) and not sharded(model)
    if not plain or isinstance(blocks, FusedDecodeBlocks):
        yield False
        return
    model.blk = FusedDecodeBlocks(blocks)
    try:
        yield True
    finally:
        model.blk = blocks
