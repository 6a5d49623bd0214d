"""Token embedding lookup with ggml's ``get_rows`` / ``get_rows_back`` semantics.

The lookup itself is trivial; the op exists so the gradient is exactly ggml's: a zero table
into which every incoming gradient row is *added* at its token id, so a token that occurs
several times in a batch accumulates all of its gradients (a scatter-add, not a scatter).
"""

from __future__ import annotations

from typing import Any

import torch

from llamatrain.ops.dtypes import LOW_PRECISION


class _GetRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if table.dim() != 2:
            raise ValueError(
                f"get_rows: table must be 2-D (rows, dim), got shape {tuple(table.shape)}"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"get_rows: ids must be an integer tensor, got {ids.dtype}")
        flat = ids.reshape(-1)
        ctx.save_for_backward(flat)
        ctx.table_shape = tuple(table.shape)
        return table.index_select(0, flat).reshape(*ids.shape, table.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        # ggml get_rows_back: dT = zeros_like(T); dT[ids[i]] += dY[i] for every i
        # (duplicate ids accumulate). The ids get no gradient.
        if not ctx.needs_input_grad[0]:
            return None, None
        (flat,) = ctx.saved_tensors
        g = grad.reshape(-1, ctx.table_shape[1])
        # Accumulate half-precision gradients in float32: a frequent token sums many rows.
        acc_dtype = torch.float32 if g.dtype in LOW_PRECISION else g.dtype
        d_table = torch.zeros(ctx.table_shape, dtype=acc_dtype, device=g.device)
        d_table.index_add_(0, flat, g.to(acc_dtype))
        return d_table.to(grad.dtype), None


def get_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Look up rows ``table[ids]``: ids of any integer shape give ``ids.shape + (dim,)``.

    Backward is ggml's ``get_rows_back`` (scatter-add of gradient rows into a zero table).
    ``ids`` receive no gradient.
    """
    return _GetRows.apply(table, ids)
