"""The llama model as one readable ``nn.Module``.

Parameter names *are* llama.cpp's GGUF tensor names (``token_embd.weight``,
``blk.0.attn_q.weight``, ...): the module tree is laid out so that ``state_dict()`` keys need
no translation, which makes this file the single name map that export and import consult.
Rope uses llama.cpp's NORM convention (adjacent pairs), so Q/K are exported unpermuted.

The same module runs on two interchangeable op sets: ``ops="ggml"`` (our autograd Functions
with ggml's backward formulas) and ``ops="torch"`` (plain PyTorch: F.embedding, F.rms_norm,
SDPA, F.silu, F.cross_entropy), so each can check the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from llamatrain import ops as ggml_ops
from llamatrain.errors import ConfigError
from llamatrain.sampling import SamplingParams, sample_next

IGNORE_INDEX = -100


@dataclass
class ModelConfig:
    """Hyper-parameters of a llama; the names follow Meta's llama and llama2.c."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    multiple_of: int = 32
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "multiple_of", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"ModelConfig.dim ({self.dim}) must be divisible by n_heads ({self.n_heads}); "
                f"choose n_heads among {_divisors(self.dim)}"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head_dim = dim / n_heads = {self.head_dim} must be even for rope; "
                "change dim or n_heads"
            )
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ConfigError(
                f"ModelConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads "
                f"({self.n_heads}); choose among {_divisors(self.n_heads)}"
            )
        if self.ffn_dim is not None and self.ffn_dim < 1:
            raise ConfigError(f"ModelConfig.ffn_dim must be positive, got {self.ffn_dim}")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ConfigError("ModelConfig.norm_eps and rope_theta must be positive")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        """FFN width: explicit, or Meta's rule 2/3·4·dim rounded up to ``multiple_of``."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def to_dict(self) -> dict:
        return asdict(self)


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """GGUF names and torch shapes of a model's tensors: ``Llama(cfg).state_dict()``.

    The one name map that export and import consult. Computed from the config rather than
    by building a ``Llama`` on the meta device (the first meta-device initialisation in a
    process costs seconds); ``tests/test_model.py`` pins it to ``Llama.state_dict()`` and
    ``load_state_dict(strict=True)`` re-checks every load.
    """
    e, hd, f, v = cfg.dim, cfg.head_dim, cfg.hidden_dim, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, e)}
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        shapes[b + "attn_norm.weight"] = (e,)
        shapes[b + "attn_q.weight"] = (cfg.n_heads * hd, e)
        shapes[b + "attn_k.weight"] = (cfg.kv_heads * hd, e)
        shapes[b + "attn_v.weight"] = (cfg.kv_heads * hd, e)
        shapes[b + "attn_output.weight"] = (e, cfg.n_heads * hd)
        shapes[b + "ffn_norm.weight"] = (e,)
        shapes[b + "ffn_gate.weight"] = (f, e)
        shapes[b + "ffn_up.weight"] = (f, e)
        shapes[b + "ffn_down.weight"] = (e, f)
    shapes["output_norm.weight"] = (e,)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (v, e)
    return shapes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _torch_rope(x: torch.Tensor, pos: torch.Tensor, *, theta: float) -> torch.Tensor:
    """Adjacent-pair (llama.cpp NORM) rope written with differentiable PyTorch ops."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) * 2 / (2 * half))
    compute = torch.promote_types(x.dtype, torch.float32)
    angles = pos.to(torch.float64)[..., None] * inv_freq  # (..., T, half)
    if angles.dim() == 2:
        angles = angles[None]
    cos = angles.cos().to(compute)[:, :, None, :]
    sin = angles.sin().to(compute)[:, :, None, :]
    pairs = x.to(compute).unflatten(-1, (half, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA with causal masking aligned to the end (queries are the last rows of the keys)."""
    t, t_kv = q.shape[-2], k.shape[-2]
    if t == t_kv:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    rows = torch.arange(t, device=q.device)[:, None] + (t_kv - t)
    mask = torch.arange(t_kv, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _torch_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    rows = logits.flatten(0, -2)
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    return F.cross_entropy(rows, targets.flatten(), ignore_index=IGNORE_INDEX)


def _ggml_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ggml_ops.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)


def _ggml_head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ggml_ops.linear_cross_entropy(h, weight, targets, ignore_index=IGNORE_INDEX)


def _torch_head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _torch_cross_entropy(F.linear(h, weight), targets)


OP_SETS = {
    "ggml": SimpleNamespace(
        embedding=ggml_ops.get_rows,
        rms_norm=ggml_ops.rms_norm,
        rope=lambda x, pos, theta: ggml_ops.rope(x, pos, theta=theta, mode="norm"),
        linear=ggml_ops.mul_mat,
        swiglu=ggml_ops.swiglu,
        attention=ggml_ops.flash_attn,
        cross_entropy=_ggml_cross_entropy,
        head_loss=_ggml_head_loss,
    ),
    "torch": SimpleNamespace(
        embedding=lambda table, ids: F.embedding(ids, table),
        rms_norm=lambda x, eps: F.rms_norm(x, (x.shape[-1],), eps=eps),
        rope=lambda x, pos, theta: _torch_rope(x, pos, theta=theta),
        linear=F.linear,
        swiglu=lambda gate, up: F.silu(gate) * up,
        attention=_torch_attention,
        cross_entropy=_torch_cross_entropy,
        head_loss=_torch_head_loss,
    ),
}


class RMSNorm(nn.Module):
    """RMS normalisation followed by a learned per-channel scale (ggml: rms_norm then mul)."""

    def __init__(self, dim: int, eps: float, op_set: SimpleNamespace) -> None:
        super().__init__()
        self.eps = eps
        self.op_set = op_set
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op_set.rms_norm(x, self.eps) * self.weight


class Linear(nn.Module):
    """A bias-free projection whose matmul comes from the selected op set."""

    def __init__(self, in_features: int, out_features: int, op_set: SimpleNamespace) -> None:
        super().__init__()
        self.op_set = op_set
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op_set.linear(x, self.weight)


class KVCache:
    """Preallocated keys/values per layer for incremental decoding.

    Keys are stored after rope, so a decoding step only computes its own positions.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device, dtype) -> None:
        shape = (batch, cfg.kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.length = 0
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append this step's k/v (batch, heads, t, hd) and return all keys/values so far."""
        end = self.length + k.shape[2]
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class Block(nn.Module):
    """One transformer layer: x + attn(norm(x)), then h + ffn(norm(h)).

    The sub-layers hang directly off the block so that parameter names read exactly like
    llama.cpp's (``blk.N.attn_q.weight``, ``blk.N.ffn_gate.weight``, ...).
    """

    def __init__(self, cfg: ModelConfig, layer: int, op_set: SimpleNamespace) -> None:
        super().__init__()
        self.cfg, self.layer, self.op_set = cfg, layer, op_set
        hd, kv_dim = cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, op_set)
        self.attn_q = Linear(cfg.dim, cfg.n_heads * hd, op_set)
        self.attn_k = Linear(cfg.dim, kv_dim, op_set)
        self.attn_v = Linear(cfg.dim, kv_dim, op_set)
        self.attn_output = Linear(cfg.n_heads * hd, cfg.dim, op_set)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, op_set)
        self.ffn_gate = Linear(cfg.dim, cfg.hidden_dim, op_set)
        self.ffn_up = Linear(cfg.dim, cfg.hidden_dim, op_set)
        self.ffn_down = Linear(cfg.hidden_dim, cfg.dim, op_set)

    def attention(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.attn_q(x).view(b, t, self.cfg.n_heads, hd)
        k = self.attn_k(x).view(b, t, self.cfg.kv_heads, hd)
        v = self.attn_v(x).view(b, t, self.cfg.kv_heads, hd)
        q = self.op_set.rope(q, pos, self.cfg.rope_theta).transpose(1, 2)
        k = self.op_set.rope(k, pos, self.cfg.rope_theta).transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        out = self.op_set.attention(q, k, v)  # (b, heads, t, hd), causal, end-aligned
        return self.attn_output(out.transpose(1, 2).reshape(b, t, -1))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_down(self.op_set.swiglu(self.ffn_gate(x), self.ffn_up(x)))

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        h = x + self.attention(self.attn_norm(x), pos, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """A llama decoder. ``forward(tokens)`` gives logits; with ``targets`` also the loss."""

    def __init__(self, cfg: ModelConfig, ops: str = "ggml") -> None:
        super().__init__()
        if ops not in OP_SETS:
            raise ConfigError(f"ops must be one of {sorted(OP_SETS)}, got {ops!r}")
        self.cfg, self.ops = cfg, ops
        self.op_set = OP_SETS[ops]
        self.token_embd = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blk = nn.ModuleList(Block(cfg, i, self.op_set) for i in range(cfg.n_layers))
        self.output_norm = RMSNorm(cfg.dim, cfg.norm_eps, self.op_set)
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, self.op_set)
        # Activation checkpointing (set by the trainer): 0 = off; k = run the blocks in
        # segments of k, keeping only each segment's input and recomputing it in backward.
        self.checkpoint_segment = 0
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """GPT-2 / nanoGPT initialisation.

        Matrices ~ N(0, 0.02); the two projections that write into the residual stream
        (attn_output, ffn_down) are scaled down by sqrt(2·n_layers) so the residual's variance
        does not grow with depth; norm weights start at 1.
        """
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(("attn_output.weight", "ffn_down.weight")):
                nn.init.normal_(param, 0.0, residual_std)
            elif param.dim() >= 2:
                nn.init.normal_(param, 0.0, std)
            else:
                nn.init.ones_(param)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; ``non_embedding`` leaves out the token table (the N of 6·N)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.token_embd.weight.numel() if non_embedding else n

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.token_embd.weight if self.output is None else self.output.weight

    def hidden_states(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Final-normed hidden states (batch, seq, dim) — everything but the lm head."""
        start = cache.length if cache is not None else 0
        t = tokens.shape[1]
        if start + t > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {start + t} tokens exceeds max_seq_len {self.cfg.max_seq_len}"
            )
        pos = torch.arange(start, start + t, device=tokens.device)
        x = self.op_set.embedding(self.token_embd.weight, tokens)
        segment = self.checkpoint_segment
        if segment and torch.is_grad_enabled() and cache is None:
            for start in range(0, self.cfg.n_layers, segment):
                x = checkpoint(
                    self._run_blocks, x, pos, start, start + segment, use_reentrant=False
                )
        else:
            x = self._run_blocks(x, pos, 0, self.cfg.n_layers, cache)
        if cache is not None:
            cache.length += t
        return self.output_norm(x)

    def _run_blocks(
        self, x: torch.Tensor, pos: torch.Tensor, start: int, end: int, cache: KVCache | None = None
    ) -> torch.Tensor:
        for block in self.blk[start:end]:
            x = block(x, pos, cache)
        return x

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (batch, seq, vocab); with ``targets`` (-100 = ignore) also the mean loss."""
        logits = self.op_set.linear(self.hidden_states(tokens, cache), self.lm_head_weight)
        if targets is None:
            return logits
        return logits, self.op_set.cross_entropy(logits, targets)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss for training, without returning logits.

        With the ggml op set the lm head and cross-entropy run fused over row chunks, so the
        (tokens x vocab) logits never exist at once — the largest tensor of a small-model,
        large-vocabulary step. Same value and gradients as ``forward(tokens, targets)[1]``.
        """
        return self.op_set.head_loss(self.hidden_states(tokens), self.lm_head_weight, targets)

    @torch.no_grad()
    def generate_stream(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        params: SamplingParams,
        seed: int | None = None,
        stop_tokens: frozenset[int] = frozenset(),
    ) -> Iterator[torch.Tensor]:
        """Yield the next token (batch,) one step at a time, decoding with a KV cache."""
        if tokens.dim() == 1:
            tokens = tokens[None]
        total = min(tokens.shape[1] + max_new_tokens, self.cfg.max_seq_len)
        if tokens.shape[1] >= total:
            return
        param = next(self.parameters())
        cache = KVCache(self.cfg, tokens.shape[0], total, param.device, param.dtype)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        history = tokens.to(param.device)
        logits = self(history, cache=cache)[:, -1]
        while True:
            next_token = sample_next(logits, params, history, generator)
            yield next_token
            history = torch.cat((history, next_token[:, None]), dim=1)
            if history.shape[1] >= total or (stop_tokens and next_token[0].item() in stop_tokens):
                return
            logits = self(next_token[:, None], cache=cache)[:, -1]

    def generate(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.8,
        top_k: int | None = None,
        top_p: float | None = None,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
    ) -> torch.Tensor:
        """Prompt + up to ``max_new_tokens`` sampled tokens (LongTensor, same batch shape).

        Generation stops early only at ``max_seq_len``; temperature 0 is greedy decoding.
        """
        params = SamplingParams(temperature, top_k, top_p, repeat_penalty)
        squeeze = tokens.dim() == 1
        prompt = tokens[None] if squeeze else tokens
        was_training = self.training
        self.eval()
        try:
            new = list(self.generate_stream(prompt, max_new_tokens, params, seed))
        finally:
            self.train(was_training)
        out = torch.cat([prompt.to(self.token_embd.weight.device)] + [t[:, None] for t in new], 1)
        return out[0] if squeeze else out
