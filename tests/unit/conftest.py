"""Shared test doubles for the unit tests."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))


class CharTokenizer:
    """One id per character: 0 unk, 1 BOS, 2 EOS, then newline and printable ASCII.

    ``texts`` records every text given to :meth:`encode_batch`, so tests can see what was
    (re-)tokenized and in which pieces.
    """

    unk_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, vocab_size: int | None = None) -> None:
        self.index = {c: i + 3 for i, c in enumerate(ALPHABET)}
        self.vocab_size = vocab_size or 3 + len(ALPHABET)
        self.texts: list[str] = []

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        return [self.bos_id] * bos + [self.index.get(c, 0) for c in text] + [self.eos_id] * eos

    def encode_batch(
        self, texts: list[str], bos: bool = False, eos: bool = False
    ) -> list[list[int]]:
        self.texts.extend(texts)
        return [self.encode(t, bos, eos) for t in texts]

    def newline_ids(self) -> list[int]:
        return [self.index["\n"]]

    def fingerprint(self) -> str:
        return f"char-{self.vocab_size}"


@pytest.fixture
def char_tokenizer() -> type[CharTokenizer]:
    """The :class:`CharTokenizer` class: call it (optionally with a vocab_size) for one."""
    return CharTokenizer


@pytest.fixture
def patch() -> Callable[[Path, bytes, bytes], None]:
    """Corrupt a file in place: replace the first ``old`` by ``new`` (same length)."""

    def replace_first(path: Path, old: bytes, new: bytes) -> None:
        assert len(old) == len(new)
        data = bytearray(path.read_bytes())
        i = data.index(old)
        data[i : i + len(old)] = new
        path.write_bytes(bytes(data))

    return replace_first


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One torch thread for tests of tiny tensors: on a busy shared machine each OpenMP
    wake-up costs more than the work (~8 ms). Use with ``pytest.mark.usefixtures``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def code_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The working directory for Python files a spec names (``'file.py:name'``), holding a
    ``broken.py`` that fails when run; the modules run from it are forgotten after, so each
    test runs its files afresh."""
    (tmp_path / "broken.py").write_text("undefined_name\n")
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for key in [k for k in sys.modules if k.startswith(str(tmp_path.resolve()))]:
        del sys.modules[key]
