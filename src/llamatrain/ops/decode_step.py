"""A decoding step of a llama model's blocks in one C++ call (``ops/kernels/decode_step.cpp``).

Why: one new token per row through SmolLM2-135M's 30 layers is ~210 quantized products of
tens of microseconds each and ~25 small PyTorch ops a layer (norms, rope, the cache append,
attention, gating, residual adds), each a Python call with its dispatch: measured on one core,
about half of a batch-1 step went to the small ops and their calls. The C++ step runs every
layer's small ops as plain loops and the projections through the quantized kernels'
``lt_matmul`` (``ops.quantized_matmul``'s library; its function pointer is handed over, so the
two libraries stay independent), so a step costs its products and little else.

It computes what a block computes for a row's one new token: ``x += o(attention(rope(q),
rope(k), v over the cache)); x += down(silu(gate) * up)`` after the RMS norms, the cache's
padding hidden from every query but its own slot, grouped kv heads as ``flash_attn`` groups
them. The arithmetic is the same in float32, summed in another order (the norm's squares in
double, as ggml sums them), so its outputs equal the PyTorch ops' to float rounding, and the
products see their 8-bit activations rounded from those (``tests/unit/test_decode_step.py``).

A projection may carry a LoRA update (:class:`Adapter`: a QLoRA run's adapters, unmerged),
which the step adds after the base product as ``ops.lora`` does, through the rank-r
bottleneck in float32: ``u = A·x``, then ``y += scale·B·u`` (no dropout: the step decodes),
and a bias, added last (qwen2's q/k/v).

The tensor side only: which layers qualify and when a step takes this path is the model's
(``llamatrain.fused_decode``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llamatrain.ops.kernel_build import load_kernels
from llamatrain.ops.quantized_matmul import KERNEL_TYPES

__all__ = [
    "PROJECTIONS", "Adapter", "LayerWeights", "StepLayers", "decode_step", "reads",
    "step_available",
]  # fmt: skip

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
"""A layer's projections, in the C++ layer record's order."""


class _Projection(ctypes.Structure):
    _fields_ = [
        ("blocks", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
        ("type", ctypes.c_int64),
        ("lora_a", ctypes.c_void_p),
        ("lora_b", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("scale", ctypes.c_double),
        ("bias", ctypes.c_void_p),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _Projection) for name in PROJECTIONS] + [
        ("attn_norm", ctypes.c_void_p),
        ("ffn_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "batch", "dim", "heads", "kv_heads", "head_dim", "hidden", "capacity", "length",
            "padding_stride",
        )
    ] + [("eps", ctypes.c_double), ("scale", ctypes.c_double)] + [
        ("neox", ctypes.c_int64), ("threads", ctypes.c_int64),
    ]  # fmt: skip


def reads(*tensors: torch.Tensor) -> bool:
    """Whether the step can read ``tensors`` through their pointers as they are: float32 and
    contiguous (the C++ side walks raw float arrays)."""
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


@dataclass(frozen=True)
class Adapter:
    """A projection's LoRA update, ``y += scale·B·(A·x)`` after its base product (``ops.lora``'s
    formula): A (rank, in) and B (out, rank), float32 and contiguous."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float

    def __post_init__(self) -> None:
        a, b = self.lora_a, self.lora_b
        if not reads(a, b):
            raise ValueError("the decoding step needs contiguous float32 LoRA factors")
        if b.shape[1] != a.shape[0]:
            raise ValueError(f"LoRA factors of ranks {a.shape[0]} and {b.shape[1]}")


@dataclass(frozen=True)
class LayerWeights:
    """One layer's tensors: the seven projections' blocks (uint8 (out, row bytes), contiguous
    rows) with their ggml types, in :data:`PROJECTIONS` order, the two norms' weights, each
    projection's :class:`Adapter` or None and its bias (float32 (out,), contiguous) or None
    (empty sequences: none at all)."""

    blocks: Sequence[torch.Tensor]
    qtypes: Sequence[str]
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    adapters: Sequence[Adapter | None] = ()
    biases: Sequence[torch.Tensor | None] = ()


@functools.cache
def _step_function() -> ctypes._CFuncPtr | None:
    """The C++ step with its signature, or None without its library (``kernel_build``
    warned)."""
    step = load_kernels("decode_step")
    if step is None:
        return None
    function = step.lt_decode_step
    function.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(_Layer), ctypes.c_int64, ctypes.POINTER(_Shape),
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    function.restype = ctypes.c_int
    return function


def _kernels_matmul() -> int | None:
    """The address of the quantized kernels' ``lt_matmul``, or None without their library."""
    products = load_kernels()
    return None if products is None else ctypes.cast(products.lt_matmul, ctypes.c_void_p).value


def step_available() -> bool:
    """Whether both libraries load (the step and the quantized products it calls)."""
    return _step_function() is not None and _kernels_matmul() is not None


class StepLayers:
    """The layers' pointers laid out once for one KV cache's buffers (k, v: (layers, batch,
    kv_heads, capacity, head_dim) float32, contiguous), as the C++ step reads them; the
    tensors are held so that the pointers stay valid. The step reads the weights and adapter
    factors through these pointers at each call: updated in place (an optimizer's step), the
    next call sees the new values; replaced by other tensors, it does not."""

    def __init__(self, layers: Sequence[LayerWeights], k: torch.Tensor, v: torch.Tensor) -> None:
        if not reads(k, v):
            raise ValueError("the decoding step needs contiguous float32 k and v caches")
        self.array = (_Layer * len(layers))()
        self.count = len(layers)
        self.held = (layers, k, v)
        self.hidden = layers[0].blocks[PROJECTIONS.index("gate")].shape[0]
        for i, layer in enumerate(layers):
            record = self.array[i]
            none = [None] * len(PROJECTIONS)
            extras = zip(layer.adapters or none, layer.biases or none, strict=True)
            for name, blocks, qtype, (adapter, bias) in zip(
                PROJECTIONS, layer.blocks, layer.qtypes, extras, strict=True
            ):
                setattr(record, name, _projection(blocks, qtype, adapter, bias))
            record.attn_norm = layer.attn_norm.data_ptr()
            record.ffn_norm = layer.ffn_norm.data_ptr()
            record.k_cache, record.v_cache = k[i].data_ptr(), v[i].data_ptr()


def _projection(
    blocks: torch.Tensor, qtype: str, adapter: Adapter | None, bias: torch.Tensor | None
) -> _Projection:
    """One projection's record: its blocks, its adapter's factors and its bias (null
    without)."""
    part = _Projection(blocks.data_ptr(), blocks.shape[0], blocks.stride(0), KERNEL_TYPES[qtype])
    if adapter is not None:
        part.lora_a, part.lora_b = adapter.lora_a.data_ptr(), adapter.lora_b.data_ptr()
        part.rank, part.scale = adapter.lora_a.shape[0], adapter.scale
    if bias is not None:
        if not reads(bias):
            raise ValueError("the decoding step needs contiguous float32 biases")
        part.bias = bias.data_ptr()
    return part


def decode_step(
    layers: StepLayers,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    padding: torch.Tensor | None,
    length: int,
    *,
    heads: int,
    eps: float,
    scale: float,
    neox: bool,
    matmul: int | None = None,
) -> torch.Tensor:
    """Every layer over ``x`` (batch, dim) float32, one new token per row at cache slot
    ``length``; returns the blocks' output (x itself, overwritten). ``cos``/``sin`` (batch,
    head_dim / 2) float32: each row's angles; ``padding`` (batch, capacity) bools or None: the
    cache's padding (this step's slot included); ``heads``: query heads; ``scale``: the score
    scale; ``neox``: rope's pairing; ``matmul``: the address of a function of ``lt_matmul``'s
    signature to multiply with (None: the quantized kernels' own; tests hand in an exact one).
    Call where :func:`step_available` says yes."""
    function = _step_function()
    matmul = _kernels_matmul() if matmul is None else matmul
    assert function is not None and matmul is not None  # step_available said so
    _, k, _ = layers.held
    batch, kv_heads, capacity, head_dim = k.shape[1:]
    if not (reads(x) and x.shape[0] == batch):
        raise ValueError(f"the decoding step needs x ({batch}, dim) contiguous float32")
    if cos.shape != (batch, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"the decoding step needs cos and sin ({batch}, {head_dim // 2})")
    if length >= capacity:
        raise ValueError(f"the KV cache holds {capacity} slots; slot {length} is past them")
    if padding is not None and (padding.dtype != torch.bool or padding.stride(-1) != 1):
        raise ValueError("the decoding step needs padding as bools, contiguous along a row")
    shape = _Shape(
        batch, x.shape[1], heads, kv_heads, head_dim, layers.hidden, capacity, length,
        0 if padding is None else padding.stride(0), eps, scale, int(neox),
        torch.get_num_threads(),
    )  # fmt: skip
    cos, sin = cos.float().contiguous(), sin.float().contiguous()  # held through the call
    hidden = None if padding is None else padding.data_ptr()
    status = function(
        matmul, layers.array, layers.count, ctypes.byref(shape), x.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), hidden,
    )  # fmt: skip
    if status:
        raise ValueError("decoding step: a projection's rows are not whole blocks")
    return x
