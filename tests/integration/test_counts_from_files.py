"""A count a file claims is bounded by what the file holds: a small GGUF whose
``general.base_model.count`` and ``general.dataset.count`` claim 10^12 entries exports (GGUF
and HF) with the entries it has, as quickly as any other, instead of building 10^12 of them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llamatrain.build import build_tokenizer
from llamatrain.config import load_config
from llamatrain.data import resolve_inputs
from llamatrain.gguf.file import read_gguf_metadata
from llamatrain.gguf.llama import write_model
from llamatrain.model import Llama

pytestmark = pytest.mark.slow

CLAIMS = {
    "general.base_model.count": np.uint64(10**12),
    "general.base_model.0.name": "Grandparent",
    "general.base_model.0.repo_url": "https://huggingface.co/someone/grandparent",
    "general.base_model.7.name": "Seventh",  # present, and below the count
    "general.base_model.01.name": "not an index as the writer spells one",
    "general.dataset.count": np.uint64(10**12),
    "general.dataset.0.repo_url": "https://huggingface.co/datasets/someone/data",
}


@pytest.fixture(scope="module")
def claiming(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A tiny random model (byte-level BPE, so an HF export can hold its tokenizer) whose
    GGUF carries :data:`CLAIMS` among its keys."""
    sets = [f'data.cache_dir="{cache_dir}"', 'tokenizer.model_type="byte_bpe"']
    cfg = load_config("tiny", [*sets, "tokenizer.vocab_size=320"])
    tokenizer = build_tokenizer(cfg, resolve_inputs(cfg.data.path, cfg.data.cache_dir))
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size, max_seq_len=64)
    torch.manual_seed(0)
    tensors = {k: v.detach() for k, v in Llama(model_cfg).state_dict().items()}
    path = tmp_path_factory.mktemp("counts") / "claiming.gguf"
    return write_model(path, model_cfg, tensors, tokenizer, inherited=CLAIMS)


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llamatrain", "export", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_gguf_export_finishes_and_keeps_the_files_own_keys(claiming, tmp_path):
    """A conversion copies its file's lineage keys as they are (the claim included); reading
    them costs the keys present. Before: a loop of 10^12 entries past 2.8 GB."""
    out = tmp_path / "out.gguf"
    done = export(str(claiming), "-o", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    keys = read_gguf_metadata(out)
    assert {k: keys[k] for k in CLAIMS} == CLAIMS


def test_an_hf_export_cards_the_entries_present_not_the_count_claimed(claiming, tmp_path):
    done = export(str(claiming), "-o", str(tmp_path / "hf"), "--format", "hf")
    assert done.returncode == 0, done.stderr[-2000:]
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "someone/grandparent" in card and "someone/data" in card
    card_head = card.split("---")[1]
    assert card_head.count("base_model") == 1, card_head
