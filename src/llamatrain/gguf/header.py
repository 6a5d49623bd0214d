"""The GGUF header parser: a file's metadata and tensor table, checked before anything is read.

Every count, length, dimension and offset in the header is checked against the file size
before it is used, so a damaged or crafted file is one ``GGUFError`` naming the file, never an
overflow, a huge allocation or an odd exception from deep inside. ``llamatrain.gguf.file``
reads tensor data through the ``TensorInfo`` byte ranges this returns.

It imports gguf's type enums and block-size table (the format's own constants), nothing of
gguf's reader or writer; with ``llamatrain.gguf.file`` and ``llamatrain.gguf.export_types``
it is one of the three modules that import the ``gguf`` package.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeAlias

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from llamatrain.errors import GGUFError, shown
from llamatrain.gguf.export_types import EXPORT_TYPES

__all__ = ["TensorInfo", "ValueType", "open_gguf", "parse_header"]

_V = GGUFValueType

ValueType: TypeAlias = tuple[GGUFValueType, GGUFValueType | None]
"""A key's stored GGUF type and, for an array, its items' type."""

_SCALARS: dict[int, tuple[str, int]] = {
    int(_V.UINT8): ("<B", 1),
    int(_V.INT8): ("<b", 1),
    int(_V.UINT16): ("<H", 2),
    int(_V.INT16): ("<h", 2),
    int(_V.UINT32): ("<I", 4),
    int(_V.INT32): ("<i", 4),
    int(_V.FLOAT32): ("<f", 4),
    int(_V.BOOL): ("<?", 1),
    int(_V.UINT64): ("<Q", 8),
    int(_V.INT64): ("<q", 8),
    int(_V.FLOAT64): ("<d", 8),
}
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses a tensor of more
_MAX_INT64 = (1 << 63) - 1  # ggml counts elements and bytes in int64
_MIN_STRING_BYTES = 8  # a string's length field
_MIN_KEY_BYTES = 8 + 4 + 1  # a key's name length, value type and the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset (a 0-d tensor)
_PREAMBLE_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor count, key count


class _Corrupt(Exception):
    """Raised inside the parser; turned into one GGUFError naming the file."""


@dataclass
class TensorInfo:
    """Where a tensor's bytes are and what they hold, resolved and checked against the file."""

    name: str
    np_shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute, in bytes
    n_bytes: int


class _Parser:
    """GGUF v2/v3 header parser.

    Why not ``gguf.GGUFReader``: it builds a numpy view per array element, which makes reading
    a large vocabulary slow on every checkpoint or tokenizer load; ``struct`` reads the same
    header at a fraction of the cost. Every length is checked against the file size, so a
    truncated or corrupt file is reported as such instead of surfacing as an odd exception.
    """

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0
        self.value_types: dict[str, ValueType] = {}

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Corrupt(f"needs {n} bytes at offset {self.pos}, past the end of the file")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, size: int) -> Any:
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar("<Q", 8)
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Corrupt(f"a string at offset {self.pos - n} is not UTF-8") from e

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(*_SCALARS[vtype])
        if vtype == int(_V.STRING):
            return self.string()
        if vtype == int(_V.ARRAY):
            return self.array()
        raise _Corrupt(f"unknown metadata value type {vtype}")

    def array(self) -> list[Any]:
        """Arrays of scalars or strings: llama.cpp reads no arrays of arrays, and refusing them
        also bounds the recursion a crafted file could ask for."""
        item_type = self.scalar("<I", 4)
        count = self.scalar("<Q", 8)
        if item_type in _SCALARS:
            fmt, size = _SCALARS[item_type]
            return np.frombuffer(self.take(count * size), dtype=np.dtype(fmt)).tolist()
        if item_type != int(_V.STRING):
            raise _Corrupt(f"an array at offset {self.pos} has items of type {item_type}")
        if count > (len(self.buf) - self.pos) // _MIN_STRING_BYTES:
            raise _Corrupt(f"an array claims {count} strings, more than the file holds")
        return self._strings(count)

    def _strings(self, count: int) -> list[str]:
        """``count`` strings, read in one tight loop: a 128k-token vocabulary is ~400k of them
        (tokens and merges), which :meth:`string`'s per-call checks made a second's work."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack_length = struct.Struct("<Q").unpack_from
        out = []
        try:
            for _ in range(count):
                (n,) = unpack_length(buf, pos)
                start, pos = pos + 8, pos + 8 + n
                if pos > end:
                    raise _Corrupt(f"a string at offset {start} runs past the end of the file")
                out.append(str(buf[start:pos], "utf-8"))
        except struct.error as e:
            raise _Corrupt(f"a string length at offset {pos} runs past the end of the file") from e
        except UnicodeDecodeError as e:
            raise _Corrupt(f"a string at offset {start} is not UTF-8") from e
        self.pos = pos
        return out

    def metadata(self, n_kv: int) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self.string()
            if key in meta:
                raise _Corrupt(f"key {shown(key)} appears twice")
            vtype = self.scalar("<I", 4)
            item_type = self._peek_u32() if vtype == int(_V.ARRAY) else None
            meta[key] = self.value(vtype)
            self.value_types[key] = (_V(vtype), None if item_type is None else _V(item_type))
            if vtype == int(_V.FLOAT32):
                # float32 -> the shortest decimal that round-trips, so 1e-5 reads back as 1e-5
                meta[key] = float(str(np.float32(meta[key])))
        return meta

    def _peek_u32(self) -> int:
        """The next uint32 without consuming it (an array's item type, before reading it)."""
        value = self.scalar("<I", 4)
        self.pos -= 4
        return value

    def tensor_info(self) -> tuple[str, list[int], int, int]:
        """(name, ggml dims fastest-first, raw type id, offset in the data section)."""
        name = self.string()
        n_dims = self.scalar("<I", 4)
        if n_dims > _MAX_DIMS:
            raise _Corrupt(f"tensor {shown(name)} claims {n_dims} dimensions")
        dims = [self.scalar("<Q", 8) for _ in range(n_dims)]
        if math.prod(dims) > _MAX_INT64:
            raise _Corrupt(f"tensor {shown(name)} claims {dims} elements, more than 2^63")
        if 0 in dims:
            # ggml's own reader divides by each dimension (its overflow check): a zero one
            # cannot load in llama.cpp, and no model holds an empty tensor.
            raise _Corrupt(f"tensor {shown(name)} claims dimensions {dims}, one of them zero")
        raw_type = self.scalar("<I", 4)
        offset = self.scalar("<Q", 8)
        return name, dims, raw_type, offset


def open_gguf(p: Path) -> BinaryIO:
    """``p`` opened for reading, after checking that it is a file (one GGUFError naming it)."""
    if not p.is_file():
        raise GGUFError(f"GGUF file {str(p)!r} does not exist; check the path")
    return p.open("rb")


def _mapped(p: Path, f: BinaryIO) -> memoryview | None:
    """The bytes of the open file ``f``, memory-mapped (no second open), after checking it is
    a GGUF at all."""
    size = os.fstat(f.fileno()).st_size
    data = memoryview(np.memmap(f, mode="r", dtype=np.uint8)) if size else None
    _check_magic(p, b"" if data is None else bytes(data[:4]))
    return data


def _check_magic(p: Path, head: bytes) -> None:
    if head != b"GGUF":
        raise GGUFError(
            f"{p} is not a GGUF file (it starts with {head!r}, a GGUF starts with b'GGUF'); "
            "pass a .gguf written by llamatrain or llama.cpp"
        )


def parse_header(
    p: Path, f: BinaryIO | None = None
) -> tuple[dict[str, Any], list[TensorInfo], dict[str, ValueType]]:
    """(metadata, tensor infos, metadata value types) of a GGUF; raises GGUFError. Read
    through ``f``, the file already open (left open), or ``p`` opened for the parse alone."""
    if f is None:
        with open_gguf(p) as opened:
            return parse_header(p, opened)
    r = _Parser(_mapped(p, f))
    size = len(r.buf)
    try:
        r.take(4)
        version = r.scalar("<I", 4)
        if version & 0xFFFF == 0:
            raise GGUFError(f"{p} is a big-endian GGUF; llamatrain reads little-endian files")
        if version not in (2, 3):
            raise GGUFError(f"{p} is GGUF version {version}; llamatrain reads versions 2 and 3")
        n_tensors = r.scalar("<Q", 8)
        n_kv = r.scalar("<Q", 8)
        if n_tensors * _MIN_TENSOR_INFO_BYTES + n_kv * _MIN_KEY_BYTES > size - _PREAMBLE_BYTES:
            raise _Corrupt(
                f"it claims {n_tensors} tensors and {n_kv} keys, more than its {size} bytes "
                "can describe"
            )
        meta = r.metadata(n_kv)
        raw_infos = [r.tensor_info() for _ in range(n_tensors)]
        align = meta.get("general.alignment", 32)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise _Corrupt(f"general.alignment {align!r} is not a power of two")
        data_start = (r.pos + align - 1) // align * align
        value_types = r.value_types
    except _Corrupt as e:
        raise GGUFError(f"{p} is truncated or corrupt ({e}); re-export or re-download it") from e
    finally:
        del r  # release the memory map
    return meta, _tensor_infos(p, raw_infos, data_start, align, size), value_types


def _tensor_infos(
    p: Path,
    raw_infos: list[tuple[str, list[int], int, int]],
    data_start: int,
    align: int,
    size: int,
) -> list[TensorInfo]:
    """Resolve types, shapes and byte ranges, checking the data is laid out as llama.cpp's
    loader requires (``gguf_init_from_file``): each tensor inside the file, on the alignment,
    and exactly where the one before it ends (padded to the alignment), so tensors never
    overlap and each type's byte size is the span the file gives it. After the last tensor
    there may be its padding and nothing more: a type relabelled to a smaller one (an F32
    tensor called Q4_0) leaves bytes no tensor accounts for, and is refused like llama.cpp
    refuses it."""
    infos: list[TensorInfo] = []
    seen: set[str] = set()
    expected = 0  # where the next tensor must start, relative to data_start
    for name, dims, raw_type, offset in raw_infos:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError as e:
            raise GGUFError(
                f"{p}: tensor {shown(name)} has unknown type id {raw_type}; the file is corrupt or "
                f"from a newer llama.cpp — re-export it as {', '.join(EXPORT_TYPES)}"
            ) from e
        if name in seen:
            raise GGUFError(f"{p} is corrupt: tensor {shown(name)} appears twice")
        seen.add(name)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if (dims[0] if dims else 1) % block:
            raise GGUFError(
                f"{p} is corrupt: tensor {shown(name)} rows are not whole {qtype.name} blocks"
            )
        if offset % align:
            raise GGUFError(
                f"{p} is corrupt: tensor {shown(name)} starts off the {align}-byte alignment"
            )
        n_bytes = math.prod(dims) // block * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise GGUFError(
                f"{p} is truncated: tensor {shown(name)} ends at byte {start + n_bytes} but the "
                f"file has {size}; re-export or re-download it"
            )
        if offset != expected:
            raise GGUFError(
                f"{p} is corrupt: tensor {shown(name)} ({qtype.name} {dims}) starts at data offset "
                f"{offset}, but the tensor before it ends at {expected}; overlapping, out of "
                "order or mislabelled tensors (a type or shape edited) do not load in llama.cpp "
                "— re-export the model"
            )
        expected += (n_bytes + align - 1) // align * align
        infos.append(TensorInfo(name, tuple(reversed(dims)), qtype, start, n_bytes))
    if infos and size - data_start > expected:
        last = infos[-1]
        raise GGUFError(
            f"{p} is corrupt: {size - data_start - expected} bytes follow the last tensor "
            f"({shown(last.name)}, {last.qtype.name}, {last.n_bytes} bytes); a tensor's type or "
            "shape was edited so that it no longer fits its data — re-export the model"
        )
    return infos
