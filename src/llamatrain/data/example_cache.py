"""The example cache: JSONL / Parquet / HF rows are encoded once, then read back.

Like the token cache (:mod:`~llamatrain.data.cache`), an entry is named by a hash of what the
examples depend on: each input file's sha256 (for an HF ``save_to_disk`` folder, every file in
it that its rows are read from, :func:`~llamatrain.data.sources.hf_files`: all of them inside
it), the tokenizer's fingerprint, the chat template's source, ``data.train_on``,
``data.layout``, ``data.format``, ``data.on_bad_line`` and :data:`_CACHE_VERSION`. Examples
are cached before they are cut to a row, so ``data.n_ctx`` is not part of the key.

An entry is one binary file of flat little-endian arrays — per example its length and
``inexact`` (int64 each), then every id (``uint16``/``uint32``), then every scored flag
(``uint8``) — and a JSON description holding the counts, the sha256, the skipped-line
tallies and the rows that fit several layouts, so a cached run warns about the same lines.
Nothing is believed unchecked (:func:`~llamatrain.data.cache.read_description` first, the
file's size before it is read); a damaged or edited entry is rebuilt with a warning.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llamatrain.data.cache import read_description, sha256_file, token_dtype
from llamatrain.data.examples import Example, LineEncoder, read_examples
from llamatrain.data.jsonl import BadLines
from llamatrain.data.layouts import LAYOUTS, MixedRows
from llamatrain.data.sources import hf_files
from llamatrain.errors import LlamatrainWarning
from llamatrain.files import write_text_atomically, written_atomically

__all__ = ["load_examples"]

_CACHE_VERSION = 2
"""Part of every key: bump it when the examples a given key describes change (2: the rows that
fit several layouts, :class:`~llamatrain.data.layouts.MixedRows`, are recorded)."""

_HEAD = np.dtype("<i8")
"""Per-example length and ``inexact``."""


def load_examples(
    paths: Sequence[Path],
    encoder: LineEncoder,
    bad: BadLines,
    cache_dir: str | Path,
    *,
    format: str = "jsonl",
    layout: str = "auto",
    mixed: MixedRows | None = None,
) -> list[Example]:
    """:func:`~llamatrain.data.examples.read_examples`, from the cache when this run's entry
    is there and sound (``bad`` and ``mixed`` then count what the first reading counted),
    else read, encoded and cached."""
    mixed = MixedRows() if mixed is None else mixed
    paths = [Path(p) for p in paths]
    tokenizer = encoder.tokenizer
    key_src = {
        "version": _CACHE_VERSION,
        "tokenizer": tokenizer.fingerprint(),
        "template": None if encoder.template is None else encoder.template.source,
        "train_on": "all" if encoder.train_all else "completion",
        "max_chars": encoder.max_chars,  # where long lines are cut: it grows with n_ctx
        "layout": layout,
        "format": format,
        "on_bad_line": bad.policy,
        "files": [_sha256_input(p) for p in paths],
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:24]
    folder = Path(cache_dir).expanduser() / "examples"
    bin_path, meta_path = folder / f"{key}.bin", folder / f"{key}.json"
    dtype = token_dtype(tokenizer.vocab_size)
    expected = {**key_src, "dtype": dtype.name}

    if meta_path.is_file() and bin_path.is_file():
        problem, cached = _read_entry(bin_path, meta_path, expected, len(paths), tokenizer)
        if problem is None:
            examples, tallies, kinds = cached
            bad.restore(paths, tallies)
            mixed.kinds.update(kinds)
            return examples
        warnings.warn(
            f"example cache {bin_path} {problem}; encoding again", LlamatrainWarning, stacklevel=3
        )

    examples = read_examples(paths, encoder, bad, format=format, layout=layout, mixed=mixed)
    tallies = bad.tallies(paths)
    data = _to_bytes(examples, dtype)
    with written_atomically(bin_path, "example cache") as tmp:
        tmp.write_bytes(data)
    meta = {
        **expected,
        "n_examples": len(examples),
        "n_tokens": sum(len(ex.ids) for ex in examples),
        "tallies": tallies,
        "mixed": mixed.kinds,
        "sha256": _digest(data, tallies, mixed.kinds),
        "paths": [str(p) for p in paths],  # for people reading the cache; not in the key
    }
    write_text_atomically(meta_path, json.dumps(meta, indent=1), "example cache description")
    return examples


def _sha256_input(path: Path) -> str:
    """A file's sha256; for an HF ``save_to_disk`` folder, one over the relative name and
    sha256 of each file its rows are read from (:func:`~llamatrain.data.sources.hf_files`,
    which refuses a file outside it): the key covers every byte the examples come from."""
    if not path.is_dir():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in hf_files(path):
        h.update(json.dumps([f.relative_to(path).as_posix(), sha256_file(f)]).encode())
    return h.hexdigest()


def _digest(data: bytes, tallies: list[list[Any]], kinds: dict[str, list[Any]]) -> str:
    """The sha256 an entry records: its bytes and what it warns about."""
    return hashlib.sha256(data + json.dumps([tallies, kinds]).encode()).hexdigest()


def _to_bytes(examples: Sequence[Example], dtype: np.dtype) -> bytes:
    lengths = np.array([len(ex.ids) for ex in examples], dtype=_HEAD)
    inexact = np.array([ex.inexact for ex in examples], dtype=_HEAD)
    ids = np.concatenate([ex.ids for ex in examples]).astype(dtype.newbyteorder("<"))
    scored = np.concatenate([ex.scored for ex in examples]).astype(np.uint8)
    return b"".join(a.tobytes() for a in (lengths, inexact, ids, scored))


def _read_entry(
    bin_path: Path, meta_path: Path, expected: dict[str, Any], n_files: int, tokenizer: Any
) -> tuple[str | None, Any]:
    """(what is wrong with an entry or None, (its examples, tallies and mixed rows) when
    nothing is)."""
    problem, meta = read_description(meta_path, expected)
    if problem:
        return problem, None
    n, n_tokens, tallies = meta.get("n_examples"), meta.get("n_tokens"), meta.get("tallies")
    if type(n) is not int or type(n_tokens) is not int or n < 1 or n_tokens < n:
        return "has an unreadable description", None
    if not (
        isinstance(tallies, list)
        and len(tallies) == n_files
        and all(
            isinstance(t, list)
            and len(t) == 3
            and type(t[0]) is int
            and type(t[1]) is int
            and isinstance(t[2], str)
            for t in tallies
        )
    ):
        return "has an unreadable description", None
    kinds = meta.get("mixed")
    if not _mixed_kinds(kinds):
        return "has an unreadable description", None
    dtype = np.dtype(expected["dtype"]).newbyteorder("<")
    size = n * 2 * _HEAD.itemsize + n_tokens * (dtype.itemsize + 1)
    if bin_path.stat().st_size != size:  # before reading it: the file may be any size
        return "does not hold the number of tokens its description says", None
    data = bin_path.read_bytes()
    if len(data) != size:  # it changed since
        return "does not hold the number of tokens its description says", None
    if _digest(data, tallies, kinds) != meta.get("sha256"):
        return "does not match its recorded sha256", None
    lengths = np.frombuffer(data, dtype=_HEAD, count=n)
    inexact = np.frombuffer(data, dtype=_HEAD, count=n, offset=n * _HEAD.itemsize)
    ids = np.frombuffer(data, dtype=dtype, count=n_tokens, offset=2 * n * _HEAD.itemsize)
    scored = np.frombuffer(data, dtype=np.uint8, offset=2 * n * _HEAD.itemsize + ids.nbytes)
    if (
        lengths.min() < 1
        or lengths.max() > n_tokens
        or float(lengths.sum(dtype=np.float64)) > n_tokens + 0.5  # it cannot wrap around
        or int(lengths.sum()) != n_tokens
        or inexact.min() < 0
    ):
        return "holds example lengths that do not add up", None
    if int(ids.max()) >= tokenizer.vocab_size or int(scored.max()) > 1:
        return f"holds ids outside the {tokenizer.vocab_size}-token vocabulary", None
    ids64, flags = ids.astype(np.int64), scored.astype(bool)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    examples = [
        Example(ids64[s : s + k].copy(), flags[s : s + k].copy(), int(x))
        for s, k, x in zip(starts.tolist(), lengths.tolist(), inexact.tolist(), strict=True)
    ]
    return None, (examples, tallies, kinds)


def _mixed_kinds(kinds: Any) -> bool:
    """Whether a description's ``mixed`` is what :class:`MixedRows` records: each kind two
    or more layouts, each count a positive whole number, each first row's place a string."""
    return isinstance(kinds, dict) and all(
        len(kind.split("|")) > 1
        and set(kind.split("|")) <= set(LAYOUTS[1:])  # not "auto"
        and isinstance(value, list)
        and len(value) == 2
        and type(value[0]) is int
        and value[0] >= 1
        and isinstance(value[1], str)
        for kind, value in kinds.items()
    )
