"""``llamatrain.perplexity`` (``llamatrain eval``): llama-perplexity's numbers, computed through
the chunked head, so a chunk's (n_ctx x vocab) logits never exist."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from llamatrain.evaluate import perplexity
from llamatrain.model import Llama
from llamatrain.model_config import ModelConfig

VOCAB, N_CTX = 50, 16


class CharTokenizer:
    """One id per character (BOS = 0): enough text for a few chunks, no vocabulary file;
    ``add_bos`` as a model file says it."""

    bos_id, eos_id, add_eos = 0, VOCAB - 1, False

    def __init__(self, add_bos: bool = True) -> None:
        self.add_bos = add_bos

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return [self.bos_id] * bos + [1 + ord(c) % (VOCAB - 2) for c in text]

    def encode_prompt(self, text: str, special: bool = True) -> list[int]:
        return self.encode(text, self.add_bos)


def full_logits_reference(model: Llama, tokens: list[int], add_bos: bool) -> tuple[float, float]:
    """llama-perplexity's method from the whole logits, in float64: (perplexity, mean loss);
    each chunk starts with BOS where the file adds one."""
    first, chunks = N_CTX // 2, len(tokens) // N_CTX
    second_half, every = 0.0, 0.0
    for i in range(chunks):
        chunk = torch.tensor(tokens[i * N_CTX : (i + 1) * N_CTX])
        if add_bos:
            chunk[0] = CharTokenizer.bos_id
        logits = model(chunk[None])[0].double()
        nll = -torch.log_softmax(logits[:-1], -1).gather(1, chunk[1:, None]).squeeze(1)
        second_half += nll[first:].sum().item()
        every += nll.sum().item()
    return math.exp(second_half / (chunks * (N_CTX - 1 - first))), every / (chunks * (N_CTX - 1))


@pytest.fixture
def model() -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, max_seq_len=N_CTX)
    return Llama(cfg).eval()


@pytest.mark.parametrize("add_bos", [True, False])
def test_perplexity_matches_the_whole_logits_without_building_them(
    model, tmp_path: Path, add_bos: bool
):
    text = tmp_path / "text.txt"
    text.write_text("to be, or not to be, that is the question: " * 3, encoding="utf-8")
    tokenizer = CharTokenizer(add_bos)
    tokens = tokenizer.encode(text.read_text(), add_bos)
    with torch.no_grad():
        expected, mean_loss = full_logits_reference(model, tokens, add_bos)

    def refuse(*_: object) -> None:
        raise AssertionError("perplexity built the whole logits")

    model.head_logits = refuse
    result = perplexity(model, tokenizer, text, n_ctx=N_CTX)
    assert result.n_tokens == len(tokens) and result.n_chunks == len(tokens) // N_CTX >= 5
    # float32 log-probabilities from the chunked head against float64 log-softmax of float32
    # logits: a few float32 roundings per token, far below llama.cpp's own 1e-5 agreement.
    assert result.perplexity == pytest.approx(expected, rel=1e-6)
    assert result.mean_loss == pytest.approx(mean_loss, rel=1e-6)
