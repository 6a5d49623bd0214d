"""Random llamas: the tiny config's (:func:`tiny_llama`), and ones whose every tensor matters,
for tests that compare logits with a reference.

Fresh init leaves norms at 1, biases at 0 and rope frequency factors at 1: a reader that
dropped or misnamed one of them would still give the same logits. These helpers move them away
from their neutral values, and give a LoRA copy of a model random nonzero adapters (PEFT's
init makes B zero, so a fresh adapter changes nothing either).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from llamatrain.build import build_tokenizer
from llamatrain.config import load_config
from llamatrain.data import resolve_inputs
from llamatrain.lora import apply_lora, lora_state_dict
from llamatrain.model import Llama
from llamatrain.tokenizer import Tokenizer

BYTE_BPE = ('tokenizer.model_type="byte_bpe"', "tokenizer.vocab_size=320")
"""``tiny_llama`` overrides for a byte-level BPE vocabulary, which an HF export can hold."""


def tiny_llama(
    cache_dir: Path, seed: int = 0, overrides: Sequence[str] = (), **changes: object
) -> tuple[Llama, Tokenizer]:
    """A random llama of the tiny config (``changes`` to its shape), seeded, with the tiny
    config's vocabulary (trained once into ``cache_dir``; ``overrides`` of the config choose
    another, e.g. ``tokenizer.model_type="byte_bpe"``): the base the fit tests train from."""
    cfg = load_config("tiny", [f'data.cache_dir="{cache_dir}"', *overrides])
    tokenizer = build_tokenizer(cfg, resolve_inputs(cfg.data.path, cfg.data.cache_dir))
    shape = {"vocab_size": tokenizer.vocab_size, "max_seq_len": cfg.data.n_ctx, **changes}
    model_cfg = dataclasses.replace(cfg.model, **shape)
    torch.manual_seed(seed)
    return Llama(model_cfg), tokenizer


@torch.no_grad()
def unit_scaled(model: Llama) -> Llama:
    """Every matrix but the token table ~ N(0, 1/its inputs), so activations stay ~1 and every
    block moves the logits (a quantization's error shows); returns ``model``."""
    for name, p in model.named_parameters():
        if p.dim() == 2 and name != "token_embd.weight":
            p.normal_(0.0, 1 / math.sqrt(p.shape[1]))
    return model


@torch.no_grad()
def move_off_neutral(model: Llama, *, norms: bool = True) -> Llama:
    """Biases ~ N(0, 0.1), rope_freqs a Llama-3.1-like ramp 1..8, and (``norms``) the norm
    weights ~ U(0.5, 1.5); returns ``model``."""
    for name, tensor in model.state_dict().items():
        if name.endswith(".bias"):
            tensor.normal_(0.0, 0.1)
        elif name == "rope_freqs.weight":
            tensor.copy_(torch.linspace(1.0, 8.0, tensor.numel()))
        elif norms and tensor.dim() == 1:
            tensor.uniform_(0.5, 1.5)
    return model


@torch.no_grad()
def randomly_adapted(
    base: Llama, rank: int, alpha: float, *, std_a: float, std_b: float, seed: int = 1
) -> Llama:
    """A copy of ``base`` (eval mode) with LoRA on every target and random A ~ N(0, std_a),
    B ~ N(0, std_b) drawn from their own seeded generator."""
    adapted = Llama(base.cfg).eval()
    adapted.load_state_dict(base.state_dict())
    apply_lora(adapted, rank, alpha)
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in lora_state_dict(adapted).items():
        std = std_b if name.endswith("lora_b") else std_a
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)
    return adapted
