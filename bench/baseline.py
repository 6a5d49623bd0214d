"""A plain eager PyTorch llama and training step, written independently of ``llamatrain``.

Why: ``Llama(ModelConfig(ops="torch"))`` already swaps our ops for PyTorch's, but it is still
our module (our rope, our parameter layout) trained by our ``Trainer``. This is what a PyTorch
user would write from scratch - ``nn.Embedding``, ``nn.RMSNorm``, bias-free ``nn.Linear``, rope
as a complex multiplication (Meta's reference code), ``F.scaled_dot_product_attention`` with
``enable_gqa``, ``F.silu`` gating, ``F.cross_entropy``, ``torch.optim.AdamW`` and the textbook
step of :func:`plain_step` - so ``bench/train.py`` can show where our model and trainer stand
against an ordinary implementation of the same architecture, measured in the same run.

:func:`plain_step` is also the one step of every bench row that does *not* go through
``llamatrain.trainer.Trainer.train_step`` (the baseline, and our model with its loss taken
from the full logits, a path the trainer does not have).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, self.n_heads, self.head_dim), freqs)
        k = apply_rope(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim), freqs)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.n_heads != self.n_kv_heads,
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim, eps=eps)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


def rope_frequencies(head_dim: int, max_len: int, theta: float = 10000.0) -> torch.Tensor:
    """Complex exp(i·pos·theta^(-2j/hd)), shaped (max_len, head_dim/2)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x (b, t, heads, hd) by the complex frequencies (t, hd/2)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs[None, :, None, :]).flatten(-2)
    return out.type_as(x)


class BaselineLlama(nn.Module):
    """Decoder-only llama; ``forward(tokens, targets)`` returns (logits, mean loss)."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        hidden_dim: int | None = None,
        max_seq_len: int = 2048,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        hidden_dim = hidden_dim or 4 * dim
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            Block(dim, n_heads, n_kv_heads, hidden_dim, norm_eps) for _ in range(n_layers)
        )
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        self.register_buffer(
            "freqs", rope_frequencies(dim // n_heads, max_seq_len), persistent=False
        )
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = (
                    0.02 / (2 * n_layers) ** 0.5
                    if name.endswith(("wo.weight", "w2.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.tok_embeddings(tokens)
        freqs = self.freqs[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, freqs)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return logits, loss


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (the usual nanoGPT / llama2.c split)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    on_cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}],
        lr=lr,
        betas=betas,
        eps=eps,
        fused=on_cuda or None,
    )


def plain_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    grad_clip: float = 1.0,
    bf16: bool = False,
    compile_loss: bool = False,
) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """The textbook training step as a function ``step(inputs, targets) -> loss``.

    zero grads, loss (under bf16 autocast on the inputs' device if ``bf16``), backward, clip
    the global gradient norm to ``grad_clip``, optimizer step. ``compile_loss`` wraps ``loss_fn`` in
    ``torch.compile`` with static shapes, as the trainer compiles its loss.
    """
    if compile_loss:
        loss_fn = torch.compile(loss_fn, dynamic=False)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        autocast = (
            torch.autocast(inputs.device.type, dtype=torch.bfloat16)
            if bf16
            else contextlib.nullcontext()
        )
        optimizer.zero_grad()
        with autocast:
            loss = loss_fn(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        return loss.item()

    return step
