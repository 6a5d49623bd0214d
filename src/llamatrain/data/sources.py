"""Which files a run trains on, checked before anything reads them for real.

``data.path`` names files, folders, globs or built-in corpora; :func:`resolve_inputs` turns it
into a sorted, de-duplicated list and rejects empty or binary files up front, naming the file
and byte offset, because a tokenizer fed a PDF fails much later and much less clearly.

For ``data.format = "parquet"`` the inputs are Parquet files (a folder: every ``*.parquet``
below it) and for ``"hf"`` folders written by HF ``datasets``' ``save_to_disk``;
:func:`table_rows` reads their rows as dicts, through the optional extras ``llamatrain[parquet]``
(pyarrow) and ``llamatrain[datasets]``, named in one line when missing.

Every reader is confined to what the user named. A folder (or a glob's folder) gives only the
files inside it: a link in it that leads out is refused, naming it. A ``save_to_disk`` folder
names its own files (``state.json``'s Arrow files, a DatasetDict's split folders), and
``datasets`` would open whatever they name: only files inside the folder the user named are
read (:func:`hf_files`), a name that is absolute, holds ``..`` or reaches out through a link
refused before anything reads it. So neither the rows nor the caches keyed by those files'
bytes can come from elsewhere.
"""

from __future__ import annotations

import codecs
import glob
import importlib
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from types import ModuleType
from typing import Any, TextIO

from llamatrain.data.arrow_stream import check_arrow_stream
from llamatrain.data.shakespeare import shakespeare_corpus
from llamatrain.errors import DataError, shown

__all__ = [
    "READ_BLOCK",
    "SHAKESPEARE",
    "SONNETS",
    "SONNETS_PATH",
    "TABLE_FORMATS",
    "check_text_file",
    "hf_files",
    "open_text",
    "read_text",
    "resolve_inputs",
    "table_rows",
    "text_blocks",
]

TABLE_FORMATS = ("parquet", "hf")
"""The ``data.format`` values whose inputs are tables of rows rather than text files."""

PARQUET_MAGIC = b"PAR1"
"""The four bytes a Parquet file starts and ends with."""

TABLE_BATCH = 1024
"""Rows read from a table at a time, so a large one never sits in memory whole as dicts."""

MAX_CHUNK_BYTES = 1 << 29
"""The most bytes one Parquet row group, or one record batch of an HF folder's Arrow file, may
hold uncompressed (512 MiB: what a JSONL line may, ``jsonl.MAX_LINE_CHARS`` characters of up to
4 bytes). Checked from the footer or the batch's metadata before anything is read: a cell is
decompressed whole, so a 92 KB file holding one zstd cell of 1 GB would otherwise take
gigabytes (:mod:`~llamatrain.data.arrow_stream`)."""

SHAKESPEARE = "shakespeare"
"""The ``data.path`` value that selects Shakespeare's plays and poems (downloaded once)."""

SONNETS = "sonnets"
"""The ``data.path`` value that selects :data:`SONNETS_PATH`, which ships with the package."""

SONNETS_PATH = Path(__file__).with_name("sonnets.txt")
"""Shakespeare's Sonnets I–L (public domain, 31 KB): a corpus that needs no download, so
small configs and tests run anywhere, from any working directory."""

READ_BLOCK = 1 << 24
"""Bytes read at a time when checking a file, so multi-GB corpora never sit in memory whole."""

TEXT_BLOCK = 1 << 20
"""Characters :func:`text_blocks` reads at a time (4 MB of ``str`` at most)."""


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
    with open_text(path) as f:
        return f.read()


def open_text(path: Path) -> TextIO:
    """``path`` opened to read the text :func:`read_text` gives, a piece at a time: UTF-8
    with a leading BOM dropped (``utf-8-sig``), CRLF and CR read as LF (universal newlines,
    which also join a CR and LF that fall in different reads)."""
    return path.open(encoding="utf-8-sig", newline=None)


def text_blocks(path: Path, block_chars: int = TEXT_BLOCK) -> Iterator[str]:
    """:func:`read_text`'s text in blocks of at most ``block_chars`` characters: joined, they
    are that text, but a multi-GB corpus (or a 1 GB line) never sits in memory whole."""
    with open_text(path) as f:
        while block := f.read(block_chars):
            yield block


def resolve_inputs(
    path_spec: str | Path | Sequence[str | Path],
    cache_dir: str | Path = ".cache/llamatrain",
    *,
    format: str = "text",
) -> list[Path]:
    """The training files named by ``data.path``, in a deterministic order, all checked.

    Each item is a built-in corpus (:data:`SHAKESPEARE`, downloaded into ``cache_dir``, or
    :data:`SONNETS`), a file, a folder (every ``*.txt`` below it, sorted) or a glob (``**``
    recurses; matches sorted). Relative paths are relative to the working directory. Items
    keep their order; duplicates are dropped. ``format`` (``data.format``): ``"parquet"``
    makes a folder mean its ``*.parquet`` files and checks each is one; ``"hf"`` takes each
    item as a ``save_to_disk`` folder.
    """
    items = [path_spec] if isinstance(path_spec, (str, Path)) else list(path_spec)
    if not items:
        raise DataError("data.path is an empty list; name at least one text file or folder")
    if format == "hf":
        return list(dict.fromkeys(_hf_folder(str(item)) for item in items))
    suffix = "*.parquet" if format == "parquet" else "*.txt"
    files = [path for item in items for path in _files_of(str(item), cache_dir, suffix)]
    unique = list(dict.fromkeys(files))
    for path in unique:
        if format == "parquet":
            _check_parquet(path)
        else:
            check_text_file(path)
    return unique


def _files_of(spec: str, cache_dir: str | Path, suffix: str = "*.txt") -> list[Path]:
    """The files one ``data.path`` item names, unchecked."""
    if spec == SHAKESPEARE:
        return shakespeare_corpus(cache_dir)
    if spec == SONNETS:
        return [SONNETS_PATH]
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        return _glob_files(spec, path)
    if path.is_dir():
        return _folder_files(spec, path, suffix)
    if path.is_file():
        return [path]
    if path.exists():  # a pipe, a socket, a device: nothing to read twice or to hash
        raise DataError(
            f"data.path {spec!r} is not a regular file or a folder (a pipe, a socket or a "
            "device); llamatrain reads its data more than once — save it to a file first"
        )
    raise DataError(
        f"data.path {spec!r} does not exist (relative paths start at the working directory "
        f"{Path.cwd()}); use {SHAKESPEARE!r} or {SONNETS!r} for a built-in corpus"
    )


def _check_parquet(path: Path) -> None:
    """DataError unless ``path`` starts and ends with Parquet's magic bytes."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(4)
        f.seek(max(size - 4, 0))
        tail = f.read(4)
    if size < 12 or head != PARQUET_MAGIC or tail != PARQUET_MAGIC:
        raise DataError(
            f"{path} is not a Parquet file (it does not start and end with {PARQUET_MAGIC!r}); "
            "data.format = 'parquet' reads Parquet files only"
        )


def _hf_folder(spec: str) -> Path:
    """A ``datasets`` ``save_to_disk`` folder (a Dataset or a DatasetDict) whose files all
    lie inside it (:func:`hf_files`)."""
    path = Path(spec).expanduser()
    markers = (*_HF_DATASET, _HF_DICT)
    if not path.is_dir() or not any((path / m).is_file() for m in markers):
        what = "is not a folder" if not path.is_dir() else "has none of " + ", ".join(markers)
        raise DataError(
            f"data.path {spec!r} {what}; data.format = 'hf' reads folders written by "
            "datasets' Dataset.save_to_disk (relative paths start at the working directory "
            f"{Path.cwd()})"
        )
    hf_files(path)
    return path


_HF_DATASET = ("dataset_info.json", "state.json")
"""The files that make a ``save_to_disk`` folder a Dataset (as ``datasets.load_from_disk``
tells them apart: both there)."""
_HF_DICT = "dataset_dict.json"
"""The file that makes one a DatasetDict, listing its split folders."""


def hf_files(folder: Path) -> list[Path]:
    """Every file reading ``folder``'s rows reads — its Dataset's (a DatasetDict's ``train``
    split's) ``dataset_info.json``, ``state.json`` and each Arrow file ``state.json`` names —
    each checked to lie inside ``folder`` (:func:`_inside`); DataError in one line otherwise."""
    split = _hf_dataset(folder)
    files = [_inside(folder, split, name, f"{split}") for name in _HF_DATASET]
    entries = _hf_json(files[1]).get("_data_files")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise DataError(f"{files[1]} has no list of data files; re-save the dataset")
    named_by = f"{files[1]}'s _data_files"
    files += [_inside(folder, split, e.get("filename"), named_by) for e in entries]
    for file in files:
        if not file.is_file():
            raise DataError(f"{file} is not a file; re-save the dataset with save_to_disk")
    return files


def _hf_dataset(folder: Path) -> Path:
    """The Dataset folder whose rows are read: ``folder`` itself, or its ``train`` split when
    it is a DatasetDict (the other splits are never opened)."""
    if all((folder / name).is_file() for name in _HF_DATASET):
        return folder
    splits = _hf_json(_inside(folder, folder, _HF_DICT, str(folder))).get("splits")
    splits = splits if isinstance(splits, list) else []
    if "train" not in splits:
        names = ", ".join(shown(str(split), 40) for split in splits[:8]) or "none"
        raise DataError(
            f"{folder} is a DatasetDict without a 'train' split (it has {names}); name the "
            "split's folder instead"
        )
    return _inside(folder, folder, "train", f"{folder / _HF_DICT}")


def _inside(top: Path, base: Path, name: object, named_by: str) -> Path:
    """``base / name`` when it stays inside ``top`` (the folder the user named): ``name`` a
    relative path without ``..``, and every link on the way resolving inside ``top``. A
    crafted folder must not make llamatrain read — or key its cache by — a file elsewhere."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise DataError(
            f"{named_by} names {shown(repr(name), 40)} where a file name goes; re-save the dataset"
        )
    windows = PureWindowsPath(name)
    if PurePosixPath(name).is_absolute() or windows.drive or ".." in windows.parts:
        raise DataError(
            f"{named_by} names '{shown(name)}', a path outside {top}; data.format = 'hf' reads "
            "only files inside the folder named: re-save the dataset with save_to_disk"
        )
    path = base / name
    if not _resolves_inside(path, top):
        raise DataError(
            f"{named_by} names '{shown(name)}', a link leading out of {top}; data.format = 'hf' "
            "reads only files inside the folder named: copy the file in instead of linking it"
        )
    return path


def _hf_json(path: Path) -> dict[str, Any]:
    """A ``save_to_disk`` folder's JSON object, or DataError naming the file."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise DataError(
            f"{path} cannot be read as datasets' JSON ({shown(str(e))}); re-save the dataset"
        ) from None
    if not isinstance(value, dict):
        raise DataError(f"{path} is not the JSON object datasets writes there; re-save it")
    return value


def optional_module(name: str, extra: str) -> ModuleType:
    """``import name``, or DataError in one line naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise DataError(
            f"{name} is not installed; pip install 'llamatrain[{extra}]' to read this data"
        ) from None


def table_rows(path: Path, format: str) -> Iterator[dict[str, Any]]:
    """The rows of a Parquet file (``format = "parquet"``) or a ``save_to_disk`` folder
    (``"hf"``: a Dataset, or a DatasetDict's ``train`` split) as dicts, in order."""
    if format == "parquet":
        parquet = optional_module("pyarrow.parquet", "parquet")
        try:
            table = parquet.ParquetFile(path)
        except Exception as e:  # pyarrow's errors: ArrowInvalid, OSError …
            raise DataError(f"{path} cannot be read as Parquet: {e}") from None
        _check_row_groups(path, table.metadata)
        yield from _parquet_rows(path, table)
        return
    datasets = optional_module("datasets", "datasets")
    files = hf_files(path)  # each inside the folder, before datasets opens any
    for arrow in files[len(_HF_DATASET) :]:  # the Arrow files state.json names
        check_arrow_stream(arrow, MAX_CHUNK_BYTES)
    try:
        dataset = datasets.Dataset.load_from_disk(str(_hf_dataset(path)))
    except Exception as e:  # a damaged or foreign folder
        raise DataError(f"{path} cannot be read as a datasets folder: {shown(str(e))}") from None
    yield from dataset  # rows as dicts (datasets reads them in batches from its Arrow files)


def _check_row_groups(path: Path, metadata: Any) -> None:
    """DataError naming the first row group whose uncompressed size (the footer's) passes
    :data:`MAX_CHUNK_BYTES`, before any is decompressed. The row group's total, not its column
    chunks': pyarrow aborts the process on a damaged chunk's metadata, where the total is a
    plain field."""
    first = 1
    for group in range(metadata.num_row_groups):
        rows = metadata.row_group(group)
        if rows.total_byte_size > MAX_CHUNK_BYTES:
            raise DataError(
                f"{path}: rows {first}-{first + rows.num_rows - 1} (row group {group}) hold "
                f"{rows.total_byte_size / 2**20:,.0f} MiB uncompressed, more than the "
                f"{MAX_CHUNK_BYTES >> 20} MiB llamatrain reads at once (a JSONL line's most); "
                "leave the longest cells out, or write the file in smaller row groups "
                "(pyarrow.parquet.write_table(..., row_group_size=1000))"
            )
        first += rows.num_rows


def _parquet_rows(path: Path, table: Any) -> Iterator[dict[str, Any]]:
    """The rows of an opened Parquet file, :data:`TABLE_BATCH` at a time; what pyarrow raises
    on a damaged page is a DataError naming the file."""
    batches = table.iter_batches(batch_size=TABLE_BATCH)
    while True:
        try:
            batch = next(batches, None)
            rows = [] if batch is None else batch.to_pylist()
        except Exception as e:  # pyarrow's errors: ArrowInvalid, OSError …
            raise DataError(f"{path} cannot be read as Parquet: {e}") from None
        if batch is None:
            return
        yield from rows


def _glob_files(spec: str, pattern: Path) -> list[Path]:
    found = sorted(Path(p) for p in glob.glob(str(pattern), recursive=True))
    found = [p for p in found if p.is_file()]
    if not found:
        raise DataError(
            f"data.path glob {spec!r} matched no files (working directory {Path.cwd()})"
        )
    return _confined(found, _glob_root(pattern), f"data.path glob {spec!r}")


def _glob_root(pattern: Path) -> Path:
    """The folder a glob names: its leading parts without wildcards ("." for none)."""
    fixed = itertools.takewhile(lambda part: not any(c in part for c in "*?["), pattern.parts)
    return Path(".", *fixed)


def _folder_files(spec: str, folder: Path, suffix: str = "*.txt") -> list[Path]:
    found = sorted(p for p in folder.rglob(suffix) if p.is_file())
    if not found:
        raise DataError(
            f"data.path folder {spec!r} contains no {suffix} files; name files or a glob "
            "such as 'corpus/**/*.md' instead"
        )
    return _confined(found, folder, f"data.path folder {spec!r}")


def _confined(found: list[Path], top: Path, named: str) -> list[Path]:
    """``found`` (the files a folder or glob gave) when each lies inside ``top``, else
    DataError naming the first link that leads out: a folder's files are what the user named,
    not what a link planted in it points at (the tokenizer, the caches and the run would read
    it as part of the corpus). A file named in data.path itself is the user's to link."""
    for path in found:
        if not _resolves_inside(path, top):
            inner = shown(path.relative_to(top).as_posix())
            raise DataError(
                f"{named} holds '{inner}', a link leading out of {shown(str(top), None)}; "
                "llamatrain reads only files inside the folder named: copy the file in, or "
                "name it in data.path itself"
            )
    return found


def _resolves_inside(path: Path, top: Path) -> bool:
    """Whether ``path``, every link on the way followed, lies inside ``top`` (a link loop
    does not): one rule for every folder llamatrain reads files from."""
    try:
        return path.resolve().is_relative_to(top.resolve())
    except (OSError, RuntimeError):  # a link loop
        return False
