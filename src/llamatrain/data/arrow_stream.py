"""The Arrow files of an HF ``save_to_disk`` folder, checked before ``datasets`` opens them.

``datasets.load_from_disk`` reads every record batch of every Arrow (IPC stream) file as it
opens the folder, and pyarrow believes what a batch's metadata claims: a compressed batch is
decompressed whole into memory (a 7 KB file can hold gigabytes of zstd-compressed text), and a
batch claiming 2^40 rows over a 12-byte buffer is read past its end when the rows are. So
:func:`check_arrow_stream` walks each file first, batch by batch, memory-mapped: it refuses a
compressed batch (``save_to_disk`` never writes one) and a batch of more than the bytes a Parquet
row group may hold (``sources.MAX_CHUNK_BYTES``, what a JSONL line may), both told from the
metadata before anything is decoded, then validates each batch in full (lengths against
buffers, offsets, UTF-8) — no claim is believed unchecked.

Compression is a field of the batch's FlatBuffers metadata (Arrow's ``Message.fbs``), which
pyarrow does not expose: :func:`_compressed` reads just that field, every offset checked.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import TYPE_CHECKING

from llamatrain.errors import DataError, shown

if TYPE_CHECKING:
    import pyarrow

__all__ = ["check_arrow_stream"]

_BATCHES = ("record batch", "dictionary batch")
"""The messages that carry rows (a dictionary batch: the values of a dictionary column)."""


class _Damaged(Exception):
    """An offset in a message's metadata that points outside it."""


def check_arrow_stream(path: Path, max_batch_bytes: int) -> None:
    """DataError in one line unless every batch of the Arrow stream ``path`` is stored plain,
    holds at most ``max_batch_bytes`` and is what its metadata claims."""
    import pyarrow as pa  # datasets' own dependency: there whenever an HF folder is read

    try:
        with pa.memory_map(str(path)) as source:
            for number, message in enumerate(pa.ipc.MessageReader.open_stream(source)):
                if message.type in _BATCHES:
                    _check_batch(path, number, message, max_batch_bytes)
        with pa.memory_map(str(path)) as source:
            for batch in pa.ipc.open_stream(source):
                batch.validate(full=True)
    except (pa.ArrowException, OSError, ValueError, _Damaged) as e:
        said = shown(str(e)) if str(e) else "metadata pointing outside itself"
        raise DataError(
            f"{path} cannot be read as an Arrow stream ({said}); re-save the dataset with "
            "save_to_disk"
        ) from None


def _check_batch(
    path: Path, number: int, message: pyarrow.ipc.Message, max_batch_bytes: int
) -> None:
    """Refuse message ``number`` of ``path`` when its body is compressed or too large."""
    metadata = memoryview(message.metadata)
    if _compressed(metadata, dictionary=message.type == "dictionary batch"):
        raise DataError(
            f"{path}: message {number} is a compressed record batch, which datasets' "
            "save_to_disk never writes and which would be decompressed whole into memory; "
            "re-save the dataset with save_to_disk"
        )
    size = 0 if message.body is None else message.body.size
    if size > max_batch_bytes:
        raise DataError(
            f"{path}: message {number} holds a record batch of {size / 2**20:,.0f} MiB, more "
            f"than the {max_batch_bytes >> 20} MiB llamatrain reads at once (a JSONL line's "
            "most); leave the longest cells out, or save the dataset in smaller batches "
            "(save_to_disk's writer_batch_size)"
        )


def _compressed(metadata: memoryview, *, dictionary: bool) -> bool:
    """Whether a batch message's metadata names a body compression: ``Message.header`` (a
    ``RecordBatch``, or a ``DictionaryBatch`` whose ``data`` is one), its ``compression``."""
    batch = _child(metadata, _root(metadata), 2)  # Message.header
    if dictionary and batch is not None:
        batch = _child(metadata, batch, 1)  # DictionaryBatch.data
    return batch is not None and _field(metadata, batch, 3) is not None


def _root(buf: memoryview) -> int:
    return _read(buf, "<I", 0)


def _field(buf: memoryview, table: int, index: int) -> int | None:
    """Where field ``index`` of the table at ``table`` lies; None when the table leaves it
    out (its vtable is shorter, or holds 0 for it)."""
    vtable = table - _read(buf, "<i", table)
    slot = 4 + 2 * index
    if slot + 2 > _read(buf, "<H", vtable):
        return None
    offset = _read(buf, "<H", vtable + slot)
    return table + offset if offset else None


def _child(buf: memoryview, table: int, index: int) -> int | None:
    """The table field ``index`` of the table at ``table`` points at; None when absent."""
    at = _field(buf, table, index)
    return None if at is None else at + _read(buf, "<I", at)


def _read(buf: memoryview, fmt: str, at: int) -> int:
    if not 0 <= at <= len(buf) - struct.calcsize(fmt):
        raise _Damaged()
    return struct.unpack_from(fmt, buf, at)[0]
