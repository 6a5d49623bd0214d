"""Fuzz the llama-level GGUF reader: a model's keys, vocabulary and tensor set, property-based.

Valid files of every kind llamatrain writes — f32 / f16 / q8_0 exports of a random model of
each family (llama, qwen2, qwen3, smollm3, gemma3), LoRA adapters, and the checkpoints of real
runs (a full finetune and a LoRA run that records its base) — are edited at the level of their
keys and tensors (``fuzz_gguf_layout``): keys deleted, retyped or set to telling values (counts,
head counts that do not divide, rope settings, our recorded config), vocabulary arrays cut,
grown or given items of the wrong type, tensors dropped, renamed, duplicated, reshaped or
relabelled as another ggml type; a checkpoint's checksums are recomputed half the time, so the
edit reaches what lies behind them. Then each way a user reads a model file — ``load_gguf``,
``load`` (run folders, checkpoints, LoRA runs merged into their base), ``read_model``,
``read_tokenizer``, ``describe_gguf`` — returns something usable (a model that runs a forward
pass, a tokenizer that encodes and decodes) or raises a LlamatrainError in one line, within
``fuzz_bounds.bounded``'s time and memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fuzz_bounds import bounded
from fuzz_gguf_layout import Bases, edit, edits, read_layout, resign, write
from fuzz_models import TEXT, base_files
from gguf import GGUFValueType as _V
from hypothesis import example, given
from hypothesis import strategies as st

from llamatrain import api
from llamatrain.gguf.adapter import read_lora_adapter
from llamatrain.gguf.describe import describe_gguf
from llamatrain.gguf.llama import CONFIG_KEY, read_model, read_tokenizer

pytestmark = pytest.mark.fuzz


def run_model(model, tokenizer) -> None:
    ids = tokenizer.encode(TEXT, bos=True, special=True)
    tokenizer.decode(ids)
    with torch.no_grad():
        model(torch.tensor([[i % model.cfg.vocab_size for i in ids[:8]]]))


def loaded(load):
    def use(path: Path) -> None:
        run_model(*load(path))

    return use


def tokenizer_used(path: Path) -> None:
    tokenizer = read_tokenizer(path)
    tokenizer.decode(tokenizer.encode(TEXT, bos=True, special=True))


READERS = {
    "load_gguf": loaded(api.load_gguf),
    "load": loaded(api.load),
    "read_model": read_model,
    "read_tokenizer": tokenizer_used,
    "describe_gguf": describe_gguf,
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Bases:
    files = base_files(tmp_path_factory.getbasetemp() / "fuzz_files", cache_dir)
    return Bases({name: read_layout(path) for name, path in files.items()})


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_gguf_model_cases")


BASES = [
    *(f"{arch}-{kind}" for arch in ("llama", "qwen2", "qwen3", "smollm3", "gemma3")
      for kind in ("f32", "f16", "q8_0")),
    "lora-llama", "lora-qwen3", "checkpoint-full", "checkpoint-lora",
]  # fmt: skip


def case(base: str, reader: str, *changes: tuple, signed: bool = False) -> Any:
    """A seeded case: a crash the fuzzing found, kept."""
    return example(base=base, changes=list(changes), signed=signed, reader=reader)


@given(
    base=st.sampled_from(BASES),
    changes=st.lists(edits, min_size=1, max_size=3),
    signed=st.booleans(),
    reader=st.sampled_from(sorted(READERS)),
)
@case("qwen2-f32", "load", ("retype", "tokenizer.ggml.tokens", _V.UINT32, 0, 0))
@case("llama-f32", "read_model", ("retype", "tokenizer.ggml.scores", _V.FLOAT32, 0, 0))
@case("llama-f16", "describe_gguf", ("retype", "tokenizer.ggml.token_type", _V.INT32, 0, 0))
@case("llama-f32", "read_tokenizer", ("set", "general.name", _V.UINT32, 7, 1))
@case("gemma3-f32", "read_model", ("set", CONFIG_KEY, _V.STRING, "[]", 1))
@case(
    "qwen3-q8_0",
    "load_gguf",
    ("delete", CONFIG_KEY, _V.UINT32, 0, 1),
    ("set", "{a}.block_count", _V.UINT32, 2**32 - 1, 1),
)
def test_edited_model_file_is_read_or_refused_in_one_line(
    layouts: dict, folder: Path, base: str, changes: list, signed: bool, reader: str
) -> None:
    layout = layouts[base].copy()
    for change in changes:
        edit(layout, change)
    path = write(resign(layout) if signed else layout, folder / "m.gguf")
    bounded(lambda: READERS[reader](path), f"{reader} of {base} after {changes}")


def test_every_base_file_reads(layouts: Bases, folder: Path) -> None:
    """The unedited files, written back by the fuzz writer, are what the edits start from."""
    for base in BASES:
        path = write(layouts[base], folder / f"{base}.gguf")
        if base.startswith("lora-"):
            assert read_lora_adapter(path).rank == 2
        elif base != "checkpoint-lora":
            assert read_model(path, tensor_data=False).config.n_layers == 2
