"""The llama model as one readable ``nn.Module``, built from a ``ModelConfig``
(``llamatrain.model_config``, the ``[model]`` section).

Parameter names *are* llama.cpp's GGUF tensor names (``token_embd.weight``,
``blk.0.attn_q.weight``, ...): the module tree is laid out so that ``state_dict()`` keys need
no translation, which makes ``llamatrain.model_config.tensor_shapes`` the single name map
that export and import consult. Rope uses llama.cpp's convention for the family (NORM,
adjacent pairs, for llama and smollm3; NEOX, pairs i and i + head_dim/2, for qwen2, qwen3,
gemma3), so Q/K are stored as llama.cpp's GGUF stores them.

One decoder serves every family in ``llamatrain.model_config.FAMILIES`` (llama.cpp's
``general.architecture``): they differ from llama by a few switches (``Family``) — the
rope's pairing, rope left out on some layers (NoPE), per-head q/k RMSNorm, q/k/v biases —
which the modules read, never the family's name (gemma3 adds scaled embeddings, sandwich
norms, GELU gating and sliding-window layers with their own rope base). llama.cpp fixes the
switches by the architecture (its GGUF has no key for them), so ``ModelConfig.arch`` chooses
them all at once.

The same module runs on two interchangeable op sets, ``ops="ggml"`` (ggml's backward
formulas) and ``ops="torch"`` (plain PyTorch), with three attention choices: the modules
call the methods of the ``OpSet`` that ``llamatrain.ops.sets.op_set`` picks.

The model knows nothing of files, activation checkpointing, LoRA, parallelism or sampling:
those wrap it from outside (``llamatrain.activation_checkpointing`` swaps ``blk`` for a
container that recomputes segments; the names stay the same). ``llamatrain.generate``
decodes with it, handing it a :class:`KVCache`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from llamatrain.errors import ConfigError
from llamatrain.model_config import ModelConfig  # also offered here: public API
from llamatrain.ops.layout import document_layout, layout_positions
from llamatrain.ops.logps import linear_logps, linear_logps_and_entropy
from llamatrain.ops.sets import IGNORE_INDEX, OpSet, op_set


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Rope positions (B, T) of packed documents: each token's index within its document or,
    with branch ids ((B, T, 2) ``documents``), within its trunk + own branch
    (``llamatrain.ops.layout.layout_positions``).

    Ids must be non-decreasing along each row, and branch ids non-negative and non-decreasing
    within a document (its trunk, 0, first): the attention mask relies on both.
    """
    ids, branches = document_layout(documents)
    if ids.dim() != 2 or bool((ids.diff(dim=1) < 0).any()):
        raise ValueError(
            f"documents must be (batch, seq) ids, non-decreasing along seq, or (batch, seq, 2) "
            f"ids and branch ids; got shape {tuple(documents.shape)}"
        )
    if branches is not None:
        back = (ids.diff(dim=1) == 0) & (branches.diff(dim=1) < 0)
        if bool(back.any() | (branches < 0).any()):
            raise ValueError(
                "branch ids must be non-negative and non-decreasing within each document"
            )
    return layout_positions(ids, branches)


# ---- the modules -------------------------------------------------------------------------


class Rope(NamedTuple):
    """What rotary embedding needs, made once per forward and handed to every block (as Meta's
    llama hands its ``freqs_cis`` down): token positions and the model's frequency settings."""

    pos: torch.Tensor
    theta: float
    freq_scale: float = 1.0
    freq_factors: torch.Tensor | None = None
    mode: str = "norm"
    theta_swa: float | None = None
    """The base of the sliding-window layers, which rope unscaled (llama.cpp's
    ``rope_freq_base_train_swa`` / ``rope_freq_scale_train_swa = 1``)."""

    def frequencies(self, sliding: bool = False) -> dict:
        """The keyword arguments of ``OpSet.rope`` besides ``x`` and ``pos``, for a full or a
        sliding-window layer."""
        if sliding:
            return dict(
                theta=self.theta_swa, freq_scale=1.0, freq_factors=self.freq_factors,
                mode=self.mode,
            )  # fmt: skip
        return dict(
            theta=self.theta,
            freq_scale=self.freq_scale,
            freq_factors=self.freq_factors,
            mode=self.mode,
        )


class RMSNorm(nn.Module):
    """RMS normalisation followed by a learned per-channel scale (ggml: rms_norm then mul)."""

    def __init__(self, dim: int, eps: float, ops: OpSet) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.eps) * self.weight


class LmHead:
    """What the lm head computes from final-normed hidden states over its (vocab, dim)
    ``weight``: logits, each target's log-prob (a chunk of rows at a time, ``ops.logps``; also
    with each row's entropy, what GRPO logs) and the mean loss (the op set's ``head_loss``).
    Mixed into the two modules that serve as the head (``output``; ``token_embd`` when tied),
    so that a module keeping its table otherwise (a frozen one in a GGUF's blocks:
    ``lora.FrozenTable``) replaces either by offering the same four calls, and the model does
    not know how its head is stored."""

    weight: torch.Tensor
    ops: OpSet

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.weight)

    def logps(
        self, hidden: torch.Tensor, targets: torch.Tensor, softcap: float | None
    ) -> torch.Tensor:
        return linear_logps(hidden, self.weight, targets, IGNORE_INDEX, softcap=softcap)

    def logps_and_entropy(
        self, hidden: torch.Tensor, targets: torch.Tensor, softcap: float | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return linear_logps_and_entropy(hidden, self.weight, targets, IGNORE_INDEX, softcap=softcap)

    def loss(
        self, hidden: torch.Tensor, targets: torch.Tensor, softcap: float | None
    ) -> torch.Tensor:
        return self.ops.head_loss(hidden, self.weight, targets, softcap=softcap)


class Embedding(nn.Embedding, LmHead):
    """The token table: ``forward(ids)`` gives their rows through the op set's lookup (ggml's
    ``get_rows`` and its backward, or ``F.embedding``); tied, it is the lm head too."""

    def __init__(self, vocab_size: int, dim: int, ops: OpSet) -> None:
        super().__init__(vocab_size, dim)
        self.ops = ops

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.embedding(self.weight, ids)


class Linear(nn.Module, LmHead):
    """A projection whose matmul comes from the selected op set; llama's have no bias, some
    derived models (``attention_bias`` / ``mlp_bias``) add one after the matmul, as ggml does.
    The model's ``output`` is one, hence the head's calls (:class:`LmHead`)."""

    def __init__(self, in_features: int, out_features: int, ops: OpSet, bias: bool = False) -> None:
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class RopeFrequencyFactors(nn.Module):
    """llama.cpp's ``rope_freqs.weight``: per-pair divisors of rope's frequencies that come with
    a model (Llama 3.1+) and stay as loaded — a buffer, so no optimizer ever updates it."""

    def __init__(self, n_pairs: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones(n_pairs))


class KVCache(nn.Module):
    """Preallocated keys/values of every layer for incremental decoding: two buffers
    (layers, batch, kv_heads, max_len, head_dim), which ``.to()`` moves like the model's.

    Keys are stored after rope, so a decoding step only computes its own positions.
    ``padding`` (batch, max_len) bools, when given, marks the slots that hold a ragged batch's
    left padding rather than tokens: every attention hides those keys (``OpSet.attention``'s
    ``padding``). Which slots they are is the decoder's to say, as are the rope positions of the
    tokens after them (``Llama.forward``'s ``positions``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        max_len: int,
        device,
        dtype,
        padding: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        shape = (cfg.n_layers, batch, cfg.kv_heads, max_len, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        if padding is not None and tuple(padding.shape) != (batch, max_len):
            raise ValueError(f"padding must be shaped ({batch}, {max_len}); got {padding.shape}")
        self.register_buffer("padding", padding, persistent=False)
        self.length = 0

    def padding_until(self, end: int) -> torch.Tensor | None:
        """Which of the first ``end`` slots are padding (batch, end); None when none can be."""
        return None if self.padding is None else self.padding[:, :end]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append this step's k/v (batch, heads, t, hd) and return all keys/values so far, in
        the dtype this step computed them in. The cache takes the first step's dtype (bf16
        under autocast, where it was made in the model's float32): kept in float32, every
        later step would cast all the keys and values so far, a copy of the whole cache per
        layer per token."""
        if self.length == 0 and layer == 0:
            self.k, self.v = self.k.to(k.dtype), self.v.to(v.dtype)
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        return self.k[layer, :, :, :end].to(k.dtype), self.v[layer, :, :, :end].to(v.dtype)


class Block(nn.Module):
    """One transformer layer: x + attn(norm(x)), then h + ffn(norm(h)).

    The sub-layers hang directly off the block so that parameter names read exactly like
    llama.cpp's (``blk.N.attn_q.weight``, ``blk.N.ffn_gate.weight``, ...). The family's
    switches (``cfg.family``) add q/k norms, q/k/v biases, sandwich norms (x + post(attn(...)),
    h + post(ffn(...))), GELU gating, a sliding window with its own rope base, or leave rope
    out of this layer.
    """

    def __init__(self, cfg: ModelConfig, layer: int, ops: OpSet) -> None:
        super().__init__()
        self.cfg, self.layer, self.ops = cfg, layer, ops
        self.rotates = cfg.uses_rope(layer)
        self.sliding = cfg.is_sliding(layer)
        self.window = cfg.sliding_window if self.sliding else None
        self.scale = cfg.attention_scale
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        qkv, mlp = cfg.qkv_bias, cfg.mlp_bias
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.attn_q = Linear(cfg.dim, q_dim, ops, qkv)
        self.attn_k = Linear(cfg.dim, kv_dim, ops, qkv)
        self.attn_v = Linear(cfg.dim, kv_dim, ops, qkv)
        self.attn_output = Linear(q_dim, cfg.dim, ops, cfg.attention_bias)
        if cfg.family.qk_norm:  # per head, over head_dim (llama.cpp's build_norm on 3-d q/k)
            self.attn_q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, ops)
            self.attn_k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, ops)
        else:
            self.attn_q_norm = self.attn_k_norm = None
        if cfg.family.post_norms:  # llama.cpp: attn_post_norm / ffn_post_norm
            self.post_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        else:
            self.post_attention_norm = None
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.ffn_gate = Linear(cfg.dim, cfg.hidden_dim, ops, mlp)
        self.ffn_up = Linear(cfg.dim, cfg.hidden_dim, ops, mlp)
        self.ffn_down = Linear(cfg.hidden_dim, cfg.dim, ops, mlp)
        self.post_ffw_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops) if cfg.family.post_norms else None
        self.gating = ops.geglu if cfg.family.activation == "geglu" else ops.swiglu

    def attention(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.attn_q(x).view(b, t, self.cfg.n_heads, hd)
        k = self.attn_k(x).view(b, t, self.cfg.kv_heads, hd)
        v = self.attn_v(x).view(b, t, self.cfg.kv_heads, hd)
        if self.attn_q_norm is not None:
            q, k = self.attn_q_norm(q), self.attn_k_norm(k)
        if self.rotates:
            q = self.ops.rope(q, rope.pos, **rope.frequencies(self.sliding))
            k = self.ops.rope(k, rope.pos, **rope.frequencies(self.sliding))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        padding = None
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
            padding = cache.padding_until(k.shape[2])
        if self.window is None and self.scale is None and padding is None:
            out = self.ops.attention(q, k, v, documents)  # (b, heads, t, hd), causal
        else:  # within the window (and the document, past the padding), Gemma's scale
            out = self.ops.attention(
                q, k, v, documents, window=self.window, scale=self.scale, padding=padding
            )
        return self.attn_output(out.transpose(1, 2).reshape(b, t, -1))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ffn_down(self.gating(self.ffn_gate(x), self.ffn_up(x)))

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``documents`` (B, T): packed document ids, attention staying within each document;
        or (B, T, 2) ids and branch ids (see :meth:`Llama.hidden_states`)."""
        a = self.attention(self.attn_norm(x), rope, cache, documents)
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        h = x + a
        f = self.feed_forward(self.ffn_norm(h))
        if self.post_ffw_norm is not None:
            f = self.post_ffw_norm(f)
        return h + f


class Blocks(nn.ModuleList):
    """The stack of blocks, run in order (a container others may replace; see module doc)."""

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for block in self:
            x = block(x, rope, cache, documents)
        return x


class Llama(nn.Module):
    """A llama-family decoder (any of ``FAMILIES``). ``forward(tokens)`` gives logits; with
    ``targets`` also the loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        for name in ("vocab_size", "max_seq_len"):
            if getattr(cfg, name) is None:
                raise ConfigError(f"ModelConfig.{name} must be set to build a Llama")
        self.cfg = cfg
        ops = op_set(cfg.ops, cfg.attention)
        self.token_embd = Embedding(cfg.vocab_size, cfg.dim, ops)
        self.rope_freqs = RopeFrequencyFactors(cfg.head_dim // 2) if cfg.rope_freq_factors else None
        self.blk = Blocks(Block(cfg, i, ops) for i in range(cfg.n_layers))
        self.output_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, ops)
        self.ops = ops
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """GPT-2 / nanoGPT initialisation.

        Matrices ~ N(0, 0.02); the two projections that write into the residual stream
        (attn_output, ffn_down) are scaled down by sqrt(2·n_layers) so the residual's variance
        does not grow with depth; norm weights start at 1, biases at 0.
        """
        residual_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(("attn_output.weight", "ffn_down.weight")):
                nn.init.normal_(param, 0.0, residual_std)
            elif param.dim() >= 2:
                nn.init.normal_(param, 0.0, std)
            elif name.endswith(".bias"):
                nn.init.zeros_(param)
            else:
                nn.init.ones_(param)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; ``non_embedding`` leaves out the token table (the N of 6·N)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.token_embd.weight.numel() if non_embedding else n

    @property
    def lm_head(self) -> LmHead:
        """The module the head's calls go to: ``output``, or the token table when tied."""
        return self.token_embd if self.output is None else self.output

    @property
    def embed_scale(self) -> float:
        """sqrt(dim) rounded to float32, as ggml's ``sqrtf(n_embd)`` (families with
        ``embed_scale``)."""
        return float(torch.tensor(math.sqrt(self.cfg.dim), dtype=torch.float32))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm head on final-normed hidden states, soft-capped when the config says so."""
        logits = self.lm_head.logits(hidden)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else self.ops.softcap(logits, cap)

    def head_logps(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Each target's log-probability (batch, seq) under :meth:`head_logits` on final-normed
        hidden states, 0 where it is not scored (-100), a chunk of rows at a time: the (batch,
        seq, vocab) logits never exist (``llamatrain.ops.logps``). Both op sets use it, as
        neither has a log-prob op of its own; its values and gradients are the full logits'.

        ``temperature``: of the logits divided by it (what GRPO's sampler drew from, TRL's
        ``logits / temperature``): ``softcap(h·Wᵀ, c) / T = softcap((h / T)·Wᵀ, c / T)``, so
        the hidden states and the cap are scaled instead, and the chunked head is unchanged.
        ``with_entropy``: also each scored position's entropy of that softmax (detached, 0 where
        not scored), from the same chunks: TRL's ``entropy`` metric."""
        cap = self.cfg.final_logit_softcap
        if temperature != 1.0:
            hidden = hidden / temperature
            cap = None if cap is None else cap / temperature
        if with_entropy:
            return self.lm_head.logps_and_entropy(hidden, targets, cap)
        return self.lm_head.logps(hidden, targets, cap)

    def rope_for(self, pos: torch.Tensor) -> Rope:
        """The rope settings for tokens at ``pos``, as every block receives them."""
        factors = None if self.rope_freqs is None else self.rope_freqs.weight
        scale = 1.0 / self.cfg.rope_scaling_factor
        mode, swa = self.cfg.family.rope_mode, self.cfg.rope_theta_swa
        return Rope(pos, self.cfg.rope_theta, scale, factors, mode, swa)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states (batch, seq, dim) — everything but the lm head.

        ``documents`` (batch, seq): ids of the documents packed into each row (non-decreasing);
        each document then runs as if alone: rope positions restart at 0 at its first token
        and its tokens attend only within it. (batch, seq, 2): ids and branch ids, each branch
        of a document running as if alone after the document's trunk (a preference pair's
        replies after their shared prompt; ``llamatrain.ops.attention``). Training only (no
        KV cache).

        ``positions`` (batch, seq): each token's rope position, where it is not its index
        after the cache's tokens (a left-padded row of a ragged batch, its first token at 0 as
        if unpadded; the cache's ``padding`` hides the padding from the attention).
        """
        if documents is not None and (cache is not None or positions is not None):
            raise ValueError(
                "documents (packed training rows) set their own positions and use no KV cache"
            )
        start = cache.length if cache is not None else 0
        if positions is not None:
            pos = positions
        elif documents is None:
            pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        else:
            pos = document_positions(documents)
        x = self.token_embd(tokens)
        if self.cfg.family.embed_scale:  # llama.cpp: ggml_scale by sqrtf(n_embd)
            x = x * self.embed_scale
        x = self.blk(x, self.rope_for(pos), cache, documents)
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.output_norm(x)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        logps_of: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits (batch, seq, vocab); with ``targets`` (-100 = ignore) also the mean loss.

        ``documents``, ``positions``: see :meth:`hidden_states`. ``logps_of`` (batch, seq)
        targets: instead of the logits, each one's log-probability (:meth:`head_logps`, at
        ``temperature``; ``with_entropy``: and each position's entropy), what a preference or
        GRPO objective scores — through ``forward``, so the wrappers that call it (DDP, FSDP,
        compile: ``llamatrain.parallel``) serve it as they serve the logits.
        """
        if logps_of is not None and targets is not None:
            raise ValueError("pass targets (for the loss) or logps_of (for log-probs), not both")
        hidden = self.hidden_states(tokens, cache, documents, positions)
        if logps_of is not None:
            return self.head_logps(hidden, logps_of, temperature, with_entropy)
        logits = self.head_logits(hidden)
        if targets is None:
            return logits
        return logits, self.ops.cross_entropy(logits, targets)

    def loss(
        self, tokens: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean next-token loss for training, without returning logits.

        With the ggml op set the lm head and cross-entropy run fused over row chunks, so the
        (tokens x vocab) logits never exist at once — the largest tensor of a small-model,
        large-vocabulary step. Same value and gradients as ``forward(tokens, targets)[1]``.
        ``documents``: see :meth:`hidden_states`.
        """
        hidden = self.hidden_states(tokens, documents=documents)
        return self.lm_head.loss(hidden, targets, self.cfg.final_logit_softcap)
