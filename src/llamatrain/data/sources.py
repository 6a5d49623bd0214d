"""Which files a run trains on, checked before anything reads them for real.

``data.path`` names files, folders, globs or built-in corpora; :func:`resolve_inputs` turns it
into a sorted, de-duplicated list and rejects empty or binary files up front, naming the file
and byte offset, because a tokenizer fed a PDF fails much later and much less clearly.
"""

from __future__ import annotations

import codecs
import glob
from collections.abc import Sequence
from pathlib import Path

from llamatrain.data.shakespeare import shakespeare_corpus
from llamatrain.errors import DataError

__all__ = [
    "READ_BLOCK",
    "SHAKESPEARE",
    "SONNETS",
    "SONNETS_PATH",
    "check_text_file",
    "read_text",
    "resolve_inputs",
]

SHAKESPEARE = "shakespeare"
"""The ``data.path`` value that selects Shakespeare's plays and poems (downloaded once)."""

SONNETS = "sonnets"
"""The ``data.path`` value that selects :data:`SONNETS_PATH`, which ships with the package."""

SONNETS_PATH = Path(__file__).with_name("sonnets.txt")
"""Shakespeare's Sonnets I–L (public domain, 31 KB): a corpus that needs no download, so
small configs and tests run anywhere, from any working directory."""

READ_BLOCK = 1 << 24
"""Bytes read at a time when checking a file, so multi-GB corpora never sit in memory whole."""


def check_text_file(path: Path, *, block_size: int = READ_BLOCK) -> None:
    """Raise DataError unless ``path`` is non-empty UTF-8 text without NUL bytes.

    Reads ``block_size`` bytes at a time; the error names the first bad byte's offset so the
    user can look at it (``xxd -s OFFSET``).
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    any_text = False
    with path.open("rb") as f:
        while block := f.read(block_size):
            nul = block.find(b"\0")
            if nul >= 0:
                raise DataError(
                    f"{path} looks binary (NUL byte at offset {offset + nul}); data.path "
                    "must name plain UTF-8 text files"
                )
            pending = len(decoder.getstate()[0])  # bytes of a character the last block cut
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as e:
                bad = offset - pending + e.start
                raise DataError(
                    f"{path} is not valid UTF-8: byte 0x{e.object[e.start]:02x} at offset {bad}; "
                    "convert it (e.g. iconv -f latin1 -t utf-8) or leave it out of data.path"
                ) from None
            any_text = any_text or bool(text.strip())
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(
            f"{path} is not valid UTF-8: it ends inside a multi-byte character at offset "
            f"{offset}; the file may be truncated"
        ) from None
    if not any_text:
        raise DataError(f"{path} is empty (no text); remove it from data.path or add text")


def read_text(path: Path) -> str:
    """A document as training text: UTF-8, leading BOM dropped, CRLF/CR turned into LF.

    Line endings are normalised so that the same text gives the same tokens on every OS.
    """
    text = path.read_text(encoding="utf-8")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def resolve_inputs(
    path_spec: str | Path | Sequence[str | Path], cache_dir: str | Path = ".cache/llamatrain"
) -> list[Path]:
    """The training files named by ``data.path``, in a deterministic order, all checked.

    Each item is a built-in corpus (:data:`SHAKESPEARE`, downloaded into ``cache_dir``, or
    :data:`SONNETS`), a file, a folder (every ``*.txt`` below it, sorted) or a glob (``**``
    recurses; matches sorted). Relative paths are relative to the working directory. Items
    keep their order; duplicates are dropped.
    """
    items = [path_spec] if isinstance(path_spec, (str, Path)) else list(path_spec)
    if not items:
        raise DataError("data.path is an empty list; name at least one text file or folder")
    files = [path for item in items for path in _files_of(str(item), cache_dir)]
    unique = list(dict.fromkeys(files))
    for path in unique:
        check_text_file(path)
    return unique


def _files_of(spec: str, cache_dir: str | Path) -> list[Path]:
    """The files one ``data.path`` item names, unchecked."""
    if spec == SHAKESPEARE:
        return shakespeare_corpus(cache_dir)
    if spec == SONNETS:
        return [SONNETS_PATH]
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        return _glob_files(spec, path)
    if path.is_dir():
        return _folder_files(spec, path)
    if path.is_file():
        return [path]
    raise DataError(
        f"data.path {spec!r} does not exist (relative paths start at the working directory "
        f"{Path.cwd()}); use {SHAKESPEARE!r} or {SONNETS!r} for a built-in corpus"
    )


def _glob_files(spec: str, pattern: Path) -> list[Path]:
    found = sorted(Path(p) for p in glob.glob(str(pattern), recursive=True))
    found = [p for p in found if p.is_file()]
    if not found:
        raise DataError(
            f"data.path glob {spec!r} matched no files (working directory {Path.cwd()})"
        )
    return found


def _folder_files(spec: str, folder: Path) -> list[Path]:
    found = sorted(p for p in folder.rglob("*.txt") if p.is_file())
    if not found:
        raise DataError(
            f"data.path folder {spec!r} contains no *.txt files; name files or a glob "
            "such as 'corpus/**/*.md' instead"
        )
    return found
