"""An HF config.json's claims are checked before they are believed (issue 30, items 4 and 6).

Each lie — a count past the weights (10^9 layers, a 10^8 vocabulary), a value of the wrong
type (a string, a bool or a fraction for a count, NaN for a number), an integer past 4,300
digits, JSON nested 100,000 deep — ends as one CheckpointError line naming the key, in < 2 s
and < 500 MB (``fuzz_bounds.bounded``), where it used to allocate gigabytes or end in a
traceback.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fuzz.fuzz_bounds import bounded

from llamatrain.errors import CheckpointError, LlamatrainError
from llamatrain.hf.folder import read_hf_folder, write_hf_folder
from llamatrain.model_config import ModelConfig, tensor_shapes
from llamatrain.tokenizer import TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, BpeTokenizer
from llamatrain.tokenizer.bpe import BYTE_TO_CHAR

CFG = ModelConfig(
    vocab_size=258, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokens = [BYTE_TO_CHAR[b] for b in range(256)] + ["<|begin|>", "<|end|>"]
    types = [TOKEN_TYPE_NORMAL] * 256 + [TOKEN_TYPE_CONTROL] * 2
    tokenizer = BpeTokenizer(tokens, types, [], pre="llama-bpe", bos_id=256, eos_id=257)
    torch.manual_seed(0)
    tensors = {name: torch.randn(shape) for name, shape in tensor_shapes(CFG).items()}
    return write_hf_folder(tmp_path_factory.mktemp("hf") / "model", CFG, tensors, tokenizer)


def lying(folder: Path, tmp_path: Path, text: str) -> Path:
    """A copy of ``folder`` whose config.json is ``text``."""
    copy = tmp_path / "lying"
    copy.mkdir()
    for file in folder.iterdir():
        shutil.copy(file, copy / file.name)
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(text)
    return copy


def edited(folder: Path, **changes: object) -> str:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    return json.dumps(config)


def refusal(path: Path) -> str:
    caught: list[LlamatrainError] = []

    def read() -> None:
        try:
            read_hf_folder(path)
        except LlamatrainError as e:
            caught.append(e)

    bounded(read, "a lying config.json")
    assert caught and isinstance(caught[0], CheckpointError), "read without complaint"
    message = str(caught[0])
    assert "\n" not in message, message
    return message


def test_the_honest_folder_reads(folder: Path) -> None:
    assert read_hf_folder(folder).config == CFG


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"num_hidden_layers": 10**9}, ["num_hidden_layers is 1,000,000,000", "layers 0 to 1"]),
        ({"num_hidden_layers": 3}, ["num_hidden_layers is 3"]),
        ({"vocab_size": 10**8}, ["vocab_size 100,000,000", "(258, 32)"]),
        ({"hidden_size": 2**20, "head_dim": 8}, ["hidden_size 1,048,576"]),
        ({"intermediate_size": 10**9}, ["config.json needs (32, 1000000000)"]),
        ({"num_attention_heads": 2**31}, ["o_proj", "config.json needs (32, 17179869184)"]),
        ({"max_position_embeddings": 2**62}, ["max_seq_len"]),
        ({"model_type": "smollm3", "num_hidden_layers": 10**9}, ["num_hidden_layers"]),
    ],
)
def test_counts_past_the_weights(folder: Path, tmp_path: Path, changes, words) -> None:
    message = refusal(lying(folder, tmp_path, edited(folder, **changes)))
    assert all(w in message for w in words), message


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("num_hidden_layers", "2", 'num_hidden_layers = "2" must be a whole number'),
        ("num_hidden_layers", True, "num_hidden_layers = true must be a whole number"),
        ("vocab_size", 258.5, "vocab_size = 258.5 must be a whole number"),
        ("hidden_size", -32, "hidden_size = -32 must be a whole number >= 1"),
        ("num_key_value_heads", 0, "num_key_value_heads = 0"),
        ("intermediate_size", [48], "intermediate_size = a list"),
        # a number's range is its field's one rule (settings.check_rules), as for GGUF keys
        ("rope_theta", float("nan"), "model.rope_theta must be a finite number, got nan"),
        ("rms_norm_eps", float("inf"), "model.norm_eps must be a finite number, got inf"),
        ("rms_norm_eps", -1e-5, "model.norm_eps must be > 0, got -1e-05"),
        ("rms_norm_eps", "1e-5", 'rms_norm_eps = "1e-5" must be a number'),
        ("rope_scaling", {"rope_type": "linear", "factor": 1e400}, "must be a finite number"),
        ("rope_scaling", {"rope_type": "llama3", "factor": float("inf")}, "factor = inf"),
        ("rope_scaling", {"rope_type": "llama3", "low_freq_factor": -1}, "finite number > 0"),
        ("rope_scaling", {"rope_type": "llama3", "factor": 0}, "finite number > 0"),  # was let by
        ("tie_word_embeddings", "false", 'tie_word_embeddings = "false" must be true or false'),
        ("rope_scaling", "linear", "rope_scaling must be an object or null, not str"),
        ("rope_scaling", {"rope_type": "linear", "factor": "2"}, 'rope_scaling.factor = "2"'),
    ],
)
def test_values_of_the_wrong_type(folder: Path, tmp_path: Path, key, value, words) -> None:
    message = refusal(lying(folder, tmp_path, edited(folder, **{key: value})))
    assert words in message, message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"model_type": "llama", "vocab_size": ' + "9" * 5000 + "}", "4300 digits"),
        ("[" * 100_000 + "]" * 100_000, "nests deeper than Python can read"),
        ("\xff", "not valid JSON"),
    ],
)
def test_json_python_cannot_hold(folder: Path, tmp_path: Path, text: str, words: str) -> None:
    path = lying(folder, tmp_path, "")
    (path / "config.json").write_bytes(text.encode("latin-1"))
    message = refusal(path)
    assert words in message and "config.json" in message, message
