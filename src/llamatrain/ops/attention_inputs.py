"""What ``ops.attention.flash_attn`` accepts, checked before any tile is computed: q, k, v
shapes (grouped-query heads), dtypes and devices, and the packed documents, preference
branches and padding columns that mask them. Each problem is a ValueError naming the argument
and what it must be: the op's callers (the model, the tests) pass tensors, never user input,
so a wrong one is a bug to be told plainly, not a config error.
"""

from __future__ import annotations

import torch

__all__ = ["check_branches", "check_documents", "check_inputs", "check_padding"]


def check_documents(documents: torch.Tensor, q: torch.Tensor, seq_kv: int, causal: bool) -> None:
    """Packed documents need plain self-attention: causal, queries and keys the same tokens."""
    B, _, T, _ = q.shape
    if not causal or seq_kv != T:
        raise ValueError(
            f"documents need causal self-attention (seq_kv == seq); got causal={causal}, "
            f"seq={T}, seq_kv={seq_kv}"
        )
    if tuple(documents.shape) != (B, T):
        raise ValueError(f"documents must be shaped ({B}, {T}); got {tuple(documents.shape)}")
    if documents.dtype.is_floating_point or documents.dtype == torch.bool:
        raise ValueError(f"documents must hold integer ids; got {documents.dtype}")
    if documents.device != q.device:
        raise ValueError(f"documents are on {documents.device}, q on {q.device}")


def check_branches(branches: torch.Tensor, documents: torch.Tensor | None) -> None:
    """Branch ids split documents: they come with documents, shaped and typed alike."""
    if documents is None:
        raise ValueError("branches split documents: pass documents with them")
    if branches.shape != documents.shape:
        raise ValueError(
            f"branches must be shaped like documents {tuple(documents.shape)}; got "
            f"{tuple(branches.shape)}"
        )
    if branches.dtype.is_floating_point or branches.dtype == torch.bool:
        raise ValueError(f"branches must hold integer ids; got {branches.dtype}")
    if branches.device != documents.device:
        raise ValueError(f"branches are on {branches.device}, documents on {documents.device}")


def check_padding(padding: torch.Tensor, k: torch.Tensor) -> None:
    """Padding marks key columns: one bool per row and kv position, beside the keys."""
    B, _, S, _ = k.shape
    if tuple(padding.shape) != (B, S) or padding.dtype != torch.bool:
        raise ValueError(
            f"padding must be ({B}, {S}) bools; got {tuple(padding.shape)} {padding.dtype}"
        )
    if padding.device != k.device:
        raise ValueError(f"padding is on {padding.device}, k on {k.device}")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """q, k, v as ``flash_attn`` takes them: (batch, heads, seq, head_dim), grouped-query
    heads, one float dtype and device, a causal mask that fits."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "flash_attn expects q, k, v shaped (batch, heads, seq, head_dim); got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    B, H, T, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if Bk != B:
        raise ValueError(f"q and k/v batch sizes differ: {B} vs {Bk}")
    if Dk != D:
        raise ValueError(f"q and k/v head_dim differ: {D} vs {Dk}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"n_heads ({H}) must be a multiple of n_kv_heads ({Hkv}) for grouped-query attention"
        )
    if T == 0 or S == 0:
        raise ValueError(f"seq and seq_kv must be positive; got seq={T}, seq_kv={S}")
    if causal and S < T:
        raise ValueError(
            f"causal attention needs seq_kv >= seq (the mask is aligned to the end); "
            f"got seq={T}, seq_kv={S}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.is_floating_point():
        raise ValueError(f"flash_attn needs floating-point inputs; got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
