"""``llamatrain info``: a short, complete description of models, checkpoints and vocabularies.

The files are written directly (``write_model``, ``write_vocab``, ``write_gguf``) with a small
hand-made vocabulary, so every number in the description is known in advance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from llamatrain.gguf.describe import describe_gguf
from llamatrain.gguf.llama import write_model, write_vocab
from llamatrain.gguf.write import write_gguf
from llamatrain.model import Llama, ModelConfig
from llamatrain.tokenizer import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    SpmTokenizer,
)

WORDS = ["▁the", "▁a", "▁of", "▁to", "▁and", "▁in", "▁it", "▁is", "▁was", "▁day", "▁new"]
VOCAB_SIZE = 3 + 256 + len(WORDS)
TOKENIZER_LINES = [
    f"tokenizer: model 'llama'; {VOCAB_SIZE} tokens (1 unknown, 2 control, 256 byte, "
    f"{len(WORDS)} normal); bos 1 '<s>'; eos 2 '</s>'; unknown 0 '<unk>'",
    "  add_bos_token true, add_eos_token false, add_space_prefix true",
]


@pytest.fixture(scope="module")
def tok() -> SpmTokenizer:
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *WORDS]
    types = [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL]
    types += [TOKEN_TYPE_BYTE] * 256 + [TOKEN_TYPE_NORMAL] * len(WORDS)
    scores = [0.0] * 259 + [-float(i) for i in range(len(WORDS))]
    return SpmTokenizer(pieces, scores, types)


@pytest.fixture(scope="module")
def model(tok: SpmTokenizer) -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=tok.vocab_size,
                      max_seq_len=128)  # fmt: skip
    return Llama(cfg)


def section(text: str, title: str) -> list[str]:
    """The indented lines under ``title:`` up to the next unindented line."""
    lines = text.splitlines()
    start = lines.index(f"{title}:") + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith(" ")), len(lines))
    return lines[start:end]


def titles(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith(" ")]


def test_model_description(model: Llama, tok: SpmTokenizer, tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", model.cfg, model.state_dict(), tok)
    text = describe_gguf(path)
    total = sum(t.numel() * 4 for t in model.state_dict().values())
    assert titles(text) == [
        f"{path}: llama model, 21 tensors, {total:,} bytes of tensor data",
        "general:",
        "hyper-parameters:",
        *TOKENIZER_LINES[:1],
        "other keys:",
        "tensors (21):",
    ]
    assert section(text, "general") == [
        "  general.architecture: llama",
        "  general.name: llamatrain",
        "  general.file_type: 0",
    ]
    assert section(text, "hyper-parameters") == [
        "  llama.context_length: 128",
        "  llama.embedding_length: 64",
        "  llama.block_count: 2",
        "  llama.feed_forward_length: 192",
        "  llama.attention.head_count: 4",
        "  llama.attention.head_count_kv: 2",
        "  llama.attention.layer_norm_rms_epsilon: 1e-05",
        "  llama.rope.freq_base: 10000.0",
        "  llama.rope.dimension_count: 16",
        f"  llama.vocab_size: {VOCAB_SIZE}",
    ]
    lines = text.splitlines()
    i = lines.index(TOKENIZER_LINES[0])
    assert lines[i : i + 2] == TOKENIZER_LINES
    (config_line,) = section(text, "other keys")
    assert config_line.startswith(
        '  llamatrain.model_config: {"arch": "llama", "attention_bias": false, "dim": 64'
    )
    assert len(config_line) == len("  llamatrain.model_config: ") + 100  # cut, with "..."
    assert config_line.endswith("...")
    assert "tokenizer.ggml.tokens" not in text  # summarised, not dumped
    table = section(text, "tensors (21)")
    assert table[0].split() == ["name", "shape", "type", "bytes"]
    embedding = ["token_embd.weight", f"{VOCAB_SIZE}x64", "F32", f"{VOCAB_SIZE * 64 * 4:,}"]
    assert table[1].split() == embedding
    assert table[2].split() == ["blk.0.attn_norm.weight", "64", "F32", "256"]
    assert table[-1].split() == ["total", f"{total:,}"]
    assert len(table) == 1 + 21 + 1


def test_quantized_tensors_show_their_stored_type_and_size(model, tok, tmp_path) -> None:
    path = write_model(tmp_path / "q.gguf", model.cfg, model.state_dict(), tok, type="q8_0")
    table = section(describe_gguf(path), "tensors (21)")
    row = next(line.split() for line in table if line.split()[0] == "blk.0.ffn_up.weight")
    assert row[1:] == ["192x64", "Q8_0", f"{192 * 64 // 32 * 34:,}"]  # 34 bytes per 32 values
    assert "general.file_type: 7" in describe_gguf(path)


def test_checkpoint_description_has_training_counters(model, tok, tmp_path) -> None:
    n_params = sum(t.numel() for t in model.state_dict().values())
    extra_kv = {
        "training.iteration_count": 4,
        "training.token_count": 2048,
        "training.config": '{"train": {"steps": 4}}',
        "training.rng_state": "c2VjcmV0IGJ5dGVz" * 10,
        "optimizer.type": "adam",
        "optimizer.adam.iteration_count": 4,
    }
    extra_tensors = {
        "optimizer.adam.first_moments": torch.zeros(n_params),
        "optimizer.adam.second_moments": torch.zeros(n_params),
    }
    path = write_model(tmp_path / "ckpt.gguf", model.cfg, model.state_dict(), tok,
                       extra_kv=extra_kv, extra_tensors=extra_tensors)  # fmt: skip
    text = describe_gguf(path)
    assert text.splitlines()[0].startswith(f"{path}: llama training checkpoint, 23 tensors, ")
    assert section(text, "training counters") == [
        "  training.iteration_count: 4",
        "  training.token_count: 2048",
    ]  # training.config and training.rng_state are not for reading
    assert section(text, "optimizer") == [
        "  optimizer.type: adam",
        "  optimizer.adam.iteration_count: 4",
    ]
    row = next(line.split() for line in text.splitlines() if "first_moments" in line)
    assert row == ["optimizer.adam.first_moments", str(n_params), "F32", f"{n_params * 4:,}"]


def test_vocabulary_description(tok: SpmTokenizer, tmp_path: Path) -> None:
    path = write_vocab(tmp_path / "vocab.gguf", tok)
    text = describe_gguf(path)
    assert text.splitlines() == [
        f"{path}: llama vocabulary only, 0 tensors, 0 bytes of tensor data",
        "general:",
        "  general.architecture: llama",
        "  general.name: llamatrain-vocab",
        *TOKENIZER_LINES,
    ]


def test_any_gguf_is_described(tmp_path: Path) -> None:
    """A file of another architecture, with no tokenizer and keys of no known section."""
    metadata = {
        "general.type": "adapter",
        "clip.layers": np.uint32(3),
        "vendor.values": [1, 2, 3],
        "vendor.note": "x" * 150,
        "tokenizer.chat_template": "{{ messages }}",
    }
    path = write_gguf(tmp_path / "other.gguf", "clip", metadata, {"w": (torch.ones(2, 32), "f32")})
    lines = describe_gguf(path).splitlines()
    assert lines[0] == f"{path}: clip adapter, 1 tensors, 256 bytes of tensor data"
    assert "hyper-parameters:" in lines and "  clip.layers: 3" in lines
    assert "tokenizer: none (this file cannot be run on its own)" in lines
    assert "  vendor.values: [3 entries]" in lines
    assert f"  vendor.note: {'x' * 97}..." in lines
    assert "  tokenizer.chat_template: {{ messages }}" in lines
