"""Cross-entropy losses with ggml's ``cross_entropy_loss`` / ``cross_entropy_loss_back``.

ggml's loss takes *probabilities* per class (one-hot rows in training) and averages over
all rows: ``loss = -(1/rows) * sum(t * log_softmax(z))``; its backward is
``dz = (softmax(z) - t) * grad / rows``. ``cross_entropy_loss`` is that op.

``cross_entropy`` is the same loss for integer class targets, which is what training uses:
with a 32000-token vocabulary the logits are the largest tensor of a small model, so it
never builds a one-hot matrix, keeps only the logits and one logsumexp per row for the
backward, and builds the gradient in place in a single full-size buffer. Rows whose target
is ``ignore_index`` are left out of the mean (and get zero gradient).

Both compute in float32 for float16/bfloat16 logits and return a float32 loss then; the
gradient is cast back to the logits' dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from llamatrain.ops.dtypes import compute_dtype


class _CrossEntropyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        cdt = compute_dtype(logits.dtype)
        vocab = logits.shape[-1]
        z = logits.reshape(-1, vocab).to(cdt)
        t = target.reshape(-1, vocab).to(cdt)
        rows = z.shape[0]
        lse = torch.logsumexp(z, dim=-1)
        # -sum_j t_j * (z_j - lse) = lse * sum_j t_j - sum_j t_j * z_j, per row
        tz = torch.linalg.vecdot(t, z)
        loss = (lse * t.sum(-1) - tz).sum() / rows
        ctx.save_for_backward(logits, target, lse)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        # ggml cross_entropy_loss_back: dz = (softmax(z) - t) * grad / rows.
        # We return the exact derivative of the forward, (softmax(z) * sum(t) - t) * grad/rows,
        # which is ggml's formula whenever target rows are probabilities (sum to 1).
        # ggml gives the targets no gradient; if they require one we return the true one,
        # dt = -log_softmax(z) * grad / rows.
        logits, target, lse = ctx.saved_tensors
        cdt = lse.dtype
        vocab = logits.shape[-1]
        z = logits.reshape(-1, vocab).to(cdt)
        t = target.reshape(-1, vocab).to(cdt)
        scale = grad.to(cdt) / z.shape[0]
        d_logits = d_target = None
        if ctx.needs_input_grad[0]:
            p = torch.sub(z, lse.unsqueeze(-1)).exp_()
            p.mul_(t.sum(-1, keepdim=True)).sub_(t).mul_(scale)
            d_logits = p.reshape(logits.shape).to(logits.dtype)
        if ctx.needs_input_grad[1]:
            d = torch.sub(lse.unsqueeze(-1), z).mul_(scale)
            d_target = d.reshape(target.shape).to(target.dtype)
        return d_logits, d_target


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int
    ) -> torch.Tensor:
        cdt = compute_dtype(logits.dtype)
        vocab = logits.shape[-1]
        z = logits.reshape(-1, vocab)
        tgt = targets.reshape(-1)
        valid = tgt != ignore_index
        safe = torch.where(valid, tgt, 0).unsqueeze(-1)
        lse = torch.logsumexp(z.to(cdt), dim=-1)
        picked = z.gather(-1, safe).squeeze(-1).to(cdt)
        # Mean over non-ignored rows; with none left the loss is 0 (not 0/0).
        n_valid = valid.sum().clamp_(min=1).to(cdt)
        loss = torch.where(valid, lse - picked, 0.0).sum() / n_valid
        ctx.save_for_backward(logits, safe, valid, lse, n_valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # ggml cross_entropy_loss_back with one-hot t: dz = (softmax(z) - onehot) * grad / n,
        # n = number of non-ignored rows; ignored rows get zero. Built in one buffer in place.
        logits, safe, valid, lse, n_valid = ctx.saved_tensors
        vocab = logits.shape[-1]
        z = logits.reshape(-1, vocab)
        dz = torch.sub(z.to(lse.dtype), lse.unsqueeze(-1)).exp_()  # softmax
        row_scale = valid.to(lse.dtype)
        dz.scatter_add_(-1, safe, -row_scale.unsqueeze(-1))  # - onehot on valid rows
        row_scale.mul_(grad.to(lse.dtype) / n_valid)  # grad/n on valid rows, 0 on ignored
        dz.mul_(row_scale.unsqueeze(-1))
        return dz.reshape(logits.shape).to(logits.dtype), None, None


def cross_entropy_loss(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """ggml's cross-entropy: ``-(1/rows) * sum(t * log_softmax(logits))`` as a scalar.

    ``logits`` (..., V) are flattened to rows; ``target_probs`` has the same shape and holds
    a probability distribution per row (not necessarily one-hot). Backward is ggml's
    ``cross_entropy_loss_back``.
    """
    if target_probs.shape != logits.shape:
        raise ValueError(
            f"cross_entropy_loss: target_probs shape {tuple(target_probs.shape)} must equal "
            f"logits shape {tuple(logits.shape)}"
        )
    return _CrossEntropyLoss.apply(logits, target_probs)


def cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (..., V) against integer class ``targets`` (...).

    Equivalent to :func:`cross_entropy_loss` with one-hot targets, averaged over the rows
    whose target is not ``ignore_index``, without materialising the one-hot matrix. If every
    row is ignored the loss is 0 and the gradient is zero.
    """
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"cross_entropy: targets shape {tuple(targets.shape)} must equal logits shape "
            f"without the class dim {tuple(logits.shape[:-1])}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"cross_entropy: targets must be an integer tensor, got {targets.dtype}")
    return _CrossEntropy.apply(logits, targets, int(ignore_index))
