"""ggml-semantics autograd ops.

Every op here is a ``torch.autograd.Function`` whose ``backward`` computes explicitly what
ggml's backward op computes (``ggml_compute_backward`` in ggml.c), not autograd of a
composition — except ``torch_lora_linear``, the LoRA layer in plain PyTorch for the "torch"
op set, which ``lora_linear``'s written-out backward is checked against. ``dequantize``
turns GGUF quantized blocks back into floats (no gradient: the blocks are frozen).
They are pure tensor math: no config objects, no I/O.
"""

from llamatrain.ops.activation import silu, swiglu
from llamatrain.ops.attention import flash_attn
from llamatrain.ops.dequantize import DEQUANTIZABLE, dequantize
from llamatrain.ops.embedding import get_rows
from llamatrain.ops.fused import linear_cross_entropy
from llamatrain.ops.lora import lora_linear, torch_lora_linear
from llamatrain.ops.loss import cross_entropy, cross_entropy_loss
from llamatrain.ops.matmul import mul_mat
from llamatrain.ops.norm import rms_norm
from llamatrain.ops.rope import rope
from llamatrain.ops.softmax import diag_mask_inf, diag_mask_zero, soft_max

__all__ = [
    "DEQUANTIZABLE",
    "cross_entropy",
    "cross_entropy_loss",
    "dequantize",
    "diag_mask_inf",
    "diag_mask_zero",
    "flash_attn",
    "get_rows",
    "linear_cross_entropy",
    "lora_linear",
    "mul_mat",
    "rms_norm",
    "rope",
    "silu",
    "soft_max",
    "swiglu",
    "torch_lora_linear",
]
