"""The token cache: every corpus is tokenized once, then memory-mapped.

:func:`load_tokens` writes the token stream as a flat binary file in the cache (``uint16`` when
the vocabulary fits, else ``uint32``) and memory-maps it, so a restarted or repeated run starts
without re-tokenizing and a corpus larger than memory still trains. The cache key hashes each
file's *contents* (not size/mtime: a copied or touched file keeps its cache, an edited one of
equal size does not) together with the tokenizer's fingerprint and the document-separator
policy.

Stream layout: each file is one document and is followed by EOS, so the model learns where a
text ends and llama.cpp stops generating there. Callers that prefix every training window with
BOS leave it out of the stream; otherwise each document starts with BOS so the model still
learns what follows llama.cpp's always-present BOS.

Documents are read a block at a time and encoded in pieces of at most :data:`CHUNK_CHARS`
characters cut at line ends (a line longer than that mid-line), batched across documents into
``encode_batch`` calls: no file, however large and however long its lines, is held or
tokenized whole (sentencepiece is superlinear on huge strings), and pieces give the progress
bar something to count. Each piece start gets
sentencepiece's dummy-prefix space, i.e. about one word per piece is tokenized as if it
followed a space; harmless, and stated here so nobody is surprised.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llamatrain.data.sources import text_blocks
from llamatrain.errors import DataError, LlamatrainWarning
from llamatrain.files import write_text_atomically, written_atomically

if TYPE_CHECKING:
    from llamatrain.tokenizer import Tokenizer

__all__ = [
    "CHUNK_CHARS",
    "GROUP_CHARS",
    "PROGRESS_MIN_BYTES",
    "chunk_stream",
    "chunk_text",
    "load_tokens",
    "read_description",
    "sha256_file",
    "token_dtype",
]

CHUNK_CHARS = 1 << 16
"""Longest piece of text given to one encode (cut at a line end)."""

GROUP_CHARS = 1 << 20
"""Characters per ``encode_batch`` call: the progress bar's step."""

PROGRESS_MIN_BYTES = 4 << 20
"""Corpora at least this large show a progress bar unless told otherwise."""

_CACHE_VERSION = 1
"""Part of every cache key: bump it when the stream a given key describes changes."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and page cache of uint32), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def chunk_text(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """``text`` cut into pieces of at most ``size`` characters, each ending at a line end.

    A line longer than ``size`` is cut mid-line. Joined, the pieces are ``text`` again.
    """
    return list(chunk_stream([text], size))


def chunk_stream(blocks: Iterable[str], size: int = CHUNK_CHARS) -> Iterator[str]:
    """:func:`chunk_text` of the blocks' concatenation, holding no more than one block and
    one piece of it at a time. The pieces are the same: a cut at ``start`` depends only on
    ``text[start : start + size]`` and on more than ``size`` characters following ``start``,
    and it is made only once that many are read."""
    pending, start = "", 0
    for block in blocks:
        pending, start = pending[start:] + block, 0
        while len(pending) - start > size:
            cut = pending.rfind("\n", start, start + size)
            cut = start + size if cut < 0 else cut + 1
            yield pending[start:cut]
            start = cut
    if start < len(pending):
        yield pending[start:]


def load_tokens(
    paths: Sequence[Path],
    tokenizer: Tokenizer,
    cache_dir: str | Path,
    *,
    doc_bos: bool = False,
    doc_eos: bool = True,
    progress: bool | None = None,
    chunk_chars: int = CHUNK_CHARS,
) -> np.ndarray:
    """The documents as one token stream, memory-mapped from the cache (tokenized if new).

    ``doc_bos``/``doc_eos`` put BOS before and EOS after each document. ``progress``: None
    shows a bar only for corpora of :data:`PROGRESS_MIN_BYTES` or more. ``chunk_chars`` is the
    longest piece given to one encode (see the module docstring). The file is written under a
    temporary name and renamed into place, so a crash never leaves a truncated cache that a
    later run would trust.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise DataError("no input files to tokenize")
    layout = _Layout(
        bos=tokenizer.bos_id if doc_bos else None,
        eos=tokenizer.eos_id if doc_eos else None,
        chunk_chars=chunk_chars,
    )
    key_src = _key_source(paths, tokenizer, layout)
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:24]
    folder = Path(cache_dir).expanduser() / "tokens"
    bin_path, meta_path = folder / f"{key}.bin", folder / f"{key}.json"

    dtype = token_dtype(tokenizer.vocab_size)
    expected = {**key_src, "dtype": dtype.name}
    cached = _open_cached(bin_path, meta_path, expected, tokenizer.vocab_size)
    if cached is not None:
        return cached
    folder.mkdir(parents=True, exist_ok=True)
    n_tokens = _write_stream(bin_path, paths, tokenizer, layout, dtype, progress)
    digest, _ = _scan(np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,)))
    meta = {"n_tokens": n_tokens, "sha256": digest, **expected}
    meta["paths"] = [str(p) for p in paths]  # for people reading the cache; not in the key
    _write_json(meta_path, meta)
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,))


@dataclass(frozen=True)
class _Layout:
    """How documents become one stream: the ids around each one (None = none), piece size."""

    bos: int | None
    eos: int | None
    chunk_chars: int


def _key_source(paths: list[Path], tokenizer: Tokenizer, layout: _Layout) -> dict[str, Any]:
    """Everything the stream depends on; its hash names the cache entry."""
    key_src: dict[str, Any] = {
        "version": _CACHE_VERSION,
        "tokenizer": tokenizer.fingerprint(),
        "doc_bos": layout.bos,
        "doc_eos": layout.eos,
        "files": [sha256_file(p) for p in paths],
    }
    if layout.chunk_chars != CHUNK_CHARS:  # the default is implied, so existing keys stay valid
        key_src["chunk_chars"] = layout.chunk_chars
    return key_src


def sha256_file(path: Path) -> str:
    """A file's sha256: what a cache built from it is keyed by (its bytes, not its name)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _open_cached(
    bin_path: Path, meta_path: Path, expected: dict[str, Any], vocab_size: int
) -> np.ndarray | None:
    """The cached stream, or None (with a warning when an entry was there) to rebuild it.

    Nothing in the cache is believed unchecked: its description must be the one this run
    would write (key fields, dtype), the file exactly ``n_tokens`` long, its bytes the
    recorded sha256 and every id inside the vocabulary. An edited or damaged entry would
    otherwise train silently on garbage; rebuilding costs one tokenization.
    """
    if not (meta_path.is_file() and bin_path.is_file()):
        return None
    problem, stream = _checked_stream(bin_path, meta_path, expected, vocab_size)
    if problem:
        warnings.warn(
            f"token cache {bin_path} {problem}; tokenizing again", LlamatrainWarning, stacklevel=4
        )
        return None
    return stream


def _checked_stream(
    bin_path: Path, meta_path: Path, expected: dict[str, Any], vocab_size: int
) -> tuple[str | None, np.ndarray | None]:
    """(what is wrong with a cache entry or None, its stream when nothing is)."""
    problem, meta = read_description(meta_path, expected)
    if problem:
        return problem, None
    n_tokens = meta.get("n_tokens")
    dtype = np.dtype(expected["dtype"])
    if type(n_tokens) is not int or bin_path.stat().st_size != n_tokens * dtype.itemsize:
        return "does not hold the number of tokens its description says", None
    if n_tokens == 0:
        return "is empty", None
    if "sha256" not in meta:
        return "was written before caches recorded their sha256", None
    stream = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,))
    digest, top = _scan(stream)
    if digest != meta.get("sha256"):
        return "does not match its recorded sha256", None
    if top >= vocab_size:
        return f"holds id {top}, outside the {vocab_size}-token vocabulary", None
    return None, stream


def read_description(meta_path: Path, expected: dict[str, Any]) -> tuple[str | None, dict]:
    """A cache entry's JSON description, when it is readable and says exactly ``expected``
    (what this run would write); else what is wrong with it. Every cache of derived data (the
    token streams, a preference run's reference log-probs) starts its checks here."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return "has an unreadable description", {}
    if not isinstance(meta, dict) or any(meta.get(k) != v for k, v in expected.items()):
        return "is described for other settings than this run's", {}
    return None, meta


def _scan(stream: np.ndarray, chunk: int = 1 << 24) -> tuple[str, int]:
    """(sha256 of the stream's bytes, its largest id), in one pass of ``chunk`` ids."""
    digest, top = hashlib.sha256(), 0
    for start in range(0, len(stream), chunk):
        part = np.asarray(stream[start : start + chunk])
        digest.update(part.tobytes())
        top = max(top, int(part.max()))
    return digest.hexdigest(), top


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    write_text_atomically(path, json.dumps(obj, indent=1), "token cache description")


def _write_stream(
    bin_path: Path,
    paths: list[Path],
    tokenizer: Tokenizer,
    layout: _Layout,
    dtype: np.dtype,
    progress: bool | None,
) -> int:
    """Tokenize ``paths`` into ``bin_path`` (atomically); the number of tokens written."""
    from tqdm.auto import tqdm  # imported here: only a run that tokenizes needs it

    total_bytes = sum(p.stat().st_size for p in paths)
    show = total_bytes >= PROGRESS_MIN_BYTES if progress is None else progress
    with written_atomically(bin_path, "token cache") as tmp:
        with (
            tmp.open("wb") as out,
            tqdm(
                total=total_bytes, unit="B", unit_scale=True, desc="tokenize", disable=not show
            ) as bar,
        ):
            n_tokens = 0
            for group in _piece_groups(paths, layout.chunk_chars):
                ids = _encode_group(group, tokenizer, layout)
                out.write(ids.astype(dtype).tobytes())
                n_tokens += ids.size
                bar.update(sum(len(piece.text.encode("utf-8")) for piece in group))
            out.flush()
            os.fsync(out.fileno())
        if n_tokens == 0:
            raise DataError(f"the input files ({len(paths)}) tokenize to zero tokens")
    return n_tokens


@dataclass(frozen=True)
class _Piece:
    """Part of a document; ``first``/``last`` mark where BOS and EOS go."""

    path: Path
    text: str
    first: bool
    last: bool


def _piece_groups(paths: Sequence[Path], chunk_chars: int) -> Iterator[list[_Piece]]:
    """Every document's pieces in order, grouped into ~:data:`GROUP_CHARS` batches."""
    group: list[_Piece] = []
    size = 0
    for path in paths:
        for piece in _pieces(path, chunk_chars):
            group.append(piece)
            size += len(piece.text)
            if size >= GROUP_CHARS:
                yield group
                group, size = [], 0
    if group:
        yield group


def _pieces(path: Path, chunk_chars: int) -> Iterator[_Piece]:
    """One document's pieces, read from its file a block at a time (a multi-GB corpus never
    sits in memory whole); an empty document is one empty piece, so it still gets EOS."""
    texts = chunk_stream(text_blocks(path), chunk_chars)
    text, first = next(texts, ""), True
    for following in texts:
        yield _Piece(path, text, first=first, last=False)
        text, first = following, False
    yield _Piece(path, text, first=first, last=True)


def _encode_group(group: list[_Piece], tokenizer: Tokenizer, layout: _Layout) -> np.ndarray:
    """The pieces' ids with BOS/EOS at document edges, checked against the vocabulary."""
    parts: list[np.ndarray] = []
    for piece, ids in zip(group, tokenizer.encode_batch([p.text for p in group]), strict=True):
        if piece.first and layout.bos is not None:
            parts.append(np.array([layout.bos], dtype=np.int64))
        parts.append(np.asarray(ids, dtype=np.int64))
        if piece.last and layout.eos is not None:
            parts.append(np.array([layout.eos], dtype=np.int64))
    arr = np.concatenate(parts)
    outside = arr[(arr < 0) | (arr >= tokenizer.vocab_size)]
    if outside.size:
        raise DataError(
            f"the tokenizer produced id {int(outside[0])} outside its vocabulary of "
            f"{tokenizer.vocab_size} while encoding {group[0].path}; the tokenizer is broken"
        )
    return arr
