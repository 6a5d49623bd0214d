"""The GGUF container: read any GGUF into Python values and torch tensors, write one atomically.

This module knows the file format and nothing of llama: which keys and tensors a model needs is
``llamatrain.gguf.llama``'s business. It is the only module in llamatrain that imports the
``gguf`` package, so that package's API churn stays behind one door.

Writing goes through ``gguf.GGUFWriter`` (the writer llama.cpp's own converter uses, so the
bytes are laid out the way llama.cpp expects) into a temp file in the target's folder that is
fsynced and renamed over the target: an interrupted save never leaves a half-written file, and
an old file survives a failed overwrite. Reading is a ``struct`` parser of our own (see
``_Parser``) that checks every count, length, dimension and offset against the file size before
using it, so a damaged file is one ``GGUFError``, never an overflow or a huge allocation.
Tensor data is read into place: F32 and integer tensors straight into their result, quantized
ones dequantized (by gguf-py, bit for bit llama.cpp's dequantization) a chunk of rows at a
time, and ``read_tensors_into`` fills a model's parameters themselves, so importing a model
costs the model plus a few MiB (``bench/import_memory.py``).

A checkpoint also records the sha256 of every tensor's stored bytes (``TENSOR_SHA256_KEY``),
which ``verify_gguf`` checks: a flipped bit in a weight would otherwise load without a word.
sha256 because it runs at ~1.2 GB/s with the SHA extensions of current CPUs, near the speed
the file is written at, and is what anyone can recompute; a CRC would be ~2x faster but
saves well under a second per GB.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeAlias

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from gguf import quants as gguf_quants

from llamatrain.errors import ConfigError, GGUFError
from llamatrain.files import is_gguf, written_atomically

GGUF_KIND = "GGUF file"
"""How refusals name what is being written (see :func:`llamatrain.files.check_target`)."""

__all__ = [
    "GGUF_KIND",
    "ALL_EXPORT_TYPES",
    "EXPORT_TYPES",
    "FILE_TYPES",
    "INTEGER_TYPES",
    "QUANT_BLOCK",
    "QUANTIZER_TYPES",
    "TENSOR_SHA256_KEY",
    "GGUFContents",
    "TensorToWrite",
    "general_file_type",
    "read_gguf",
    "read_gguf_metadata",
    "read_stored_into",
    "read_tensors_into",
    "typed_value",
    "verify_gguf",
    "write_gguf",
]

_T = GGMLQuantizationType
_V = GGUFValueType

FILE_TYPES: dict[str, tuple[GGMLQuantizationType, int]] = {
    "f32": (_T.F32, int(LlamaFileType.ALL_F32)),
    "f16": (_T.F16, int(LlamaFileType.MOSTLY_F16)),
    "bf16": (_T.BF16, int(LlamaFileType.MOSTLY_BF16)),
    "q8_0": (_T.Q8_0, int(LlamaFileType.MOSTLY_Q8_0)),
    "q4_0": (_T.Q4_0, int(LlamaFileType.MOSTLY_Q4_0)),
}
"""Export type name -> (the GGML type matrices are stored as, its ``general.file_type``)."""

EXPORT_TYPES: tuple[str, ...] = tuple(FILE_TYPES)
"""The type names a tensor can be written as (here, tensor by tensor), for config checks."""

_F = LlamaFileType
QUANTIZER_TYPES: dict[str, int] = {
    "q4_1": int(_F.MOSTLY_Q4_1),
    "q5_0": int(_F.MOSTLY_Q5_0),
    "q5_1": int(_F.MOSTLY_Q5_1),
    "q2_k": int(_F.MOSTLY_Q2_K),
    "q3_k_s": int(_F.MOSTLY_Q3_K_S),
    "q3_k_m": int(_F.MOSTLY_Q3_K_M),
    "q3_k_l": int(_F.MOSTLY_Q3_K_L),
    "q4_k_s": int(_F.MOSTLY_Q4_K_S),
    "q4_k_m": int(_F.MOSTLY_Q4_K_M),
    "q5_k_s": int(_F.MOSTLY_Q5_K_S),
    "q5_k_m": int(_F.MOSTLY_Q5_K_M),
    "q6_k": int(_F.MOSTLY_Q6_K),
    "iq4_nl": int(_F.MOSTLY_IQ4_NL),
    "iq4_xs": int(_F.MOSTLY_IQ4_XS),
}
"""Export type name -> llama.cpp ftype (``general.file_type``) of the types only llama.cpp's
quantizer writes (``llamatrain.gguf.quantize``): the K-quants' encoders are search heuristics
that gguf-py does not implement. They mix types per tensor as ``llama-quantize`` does (Q4_K_M
keeps some matrices Q6_K). Left out: the IQ1/IQ2/IQ3 types and Q2_K_S, which need an
importance matrix (llama.cpp refuses the first without one), and types our reader cannot read
back (Q1_0) or that suit only models trained for them (TQ1_0, TQ2_0, MXFP4)."""

ALL_EXPORT_TYPES: tuple[str, ...] = EXPORT_TYPES + tuple(QUANTIZER_TYPES)
"""Every type a model can be exported as: ``EXPORT_TYPES`` then ``QUANTIZER_TYPES``; the
choices of ``llamatrain export --type`` and ``llamatrain.export_gguf``."""

QUANT_BLOCK = 32
"""Values per Q8_0 / Q4_0 block: a quantized row must be a whole number of blocks."""

INTEGER_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    _T.I8: torch.int8,
    _T.I16: torch.int16,
    _T.I32: torch.int32,
    _T.I64: torch.int64,
}
"""Integer tensor types: read back with their own dtype, never dequantized to float."""

TENSOR_SHA256_KEY = "training.tensor_sha256"
"""Key of the JSON map tensor name -> sha256 (hex) of its stored bytes. A ``training.*`` key
because only checkpoints carry it: an exported model keeps exactly the keys it had."""


ValueType: TypeAlias = tuple[GGUFValueType, GGUFValueType | None]
"""A key's stored GGUF type and, for an array, its items' type."""


@dataclass
class GGUFContents:
    """A GGUF file read into memory.

    ``metadata``: every key as a plain Python value (str, int, float, bool, list).
    ``tensors``: float tensors dequantized to float32 (integer tensors keep their dtype), in
    torch's (row-major, numpy) shape; meta-device placeholders of that shape and dtype when the
    file was read with ``tensor_data=False``. ``tensor_types``: the stored GGML type name per tensor
    (``"F32"``, ``"Q8_0"``, ...). ``tensor_nbytes``: the bytes each tensor occupies in the file.
    ``value_types``: each key's stored GGUF type (and item type, for arrays), which
    :func:`typed_value` restores.
    """

    path: Path
    metadata: dict[str, Any]
    value_types: dict[str, ValueType] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    tensor_types: dict[str, str] = field(default_factory=dict)
    tensor_nbytes: dict[str, int] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ writing

TensorToWrite: TypeAlias = tuple[torch.Tensor | np.ndarray, str]
"""A tensor and the export type (an ``EXPORT_TYPES`` name) its matrices are to be stored as."""

_EncodedValue: TypeAlias = tuple[Any, GGUFValueType, GGUFValueType | None]
_EncodedTensor: TypeAlias = tuple[np.ndarray, GGMLQuantizationType | None]

_NUMPY_VALUE_TYPES: dict[type, GGUFValueType] = {
    np.uint8: _V.UINT8,
    np.int8: _V.INT8,
    np.uint16: _V.UINT16,
    np.int16: _V.INT16,
    np.uint32: _V.UINT32,
    np.int32: _V.INT32,
    np.uint64: _V.UINT64,
    np.int64: _V.INT64,
    np.float32: _V.FLOAT32,
    np.float64: _V.FLOAT64,
    np.bool_: _V.BOOL,
}


def _check_export_type(type_name: str) -> None:
    """Raise ConfigError unless ``type_name`` is one of ``EXPORT_TYPES``."""
    if type_name in QUANTIZER_TYPES:
        raise ConfigError(
            f"GGUF type {type_name!r} is written by llama.cpp's quantizer, not tensor by tensor; "
            "export the model with llamatrain.export_gguf or `llamatrain export --type`"
        )
    if type_name not in FILE_TYPES:
        raise ConfigError(
            f"unknown GGUF type {type_name!r}; choose one of {', '.join(ALL_EXPORT_TYPES)}"
        )


def general_file_type(type_name: str) -> int:
    """The ``general.file_type`` code of an export type (llama.cpp reports it as the ftype)."""
    _check_export_type(type_name)
    return FILE_TYPES[type_name][1]


def write_gguf(
    path: str | os.PathLike[str],
    architecture: str,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, TensorToWrite],
    *,
    checksums: bool = False,
) -> Path:
    """Write a GGUF atomically and return its path; with ``checksums`` also the sha256 of every
    tensor's stored bytes under ``TENSOR_SHA256_KEY`` (see ``verify_gguf``).

    ``metadata`` values take their GGUF type from numpy where one is given (``np.uint32(4)``
    is UINT32, a 1-D ``np.float32`` array an ARRAY of FLOAT32), so a caller can spell exactly
    the types its readers expect; plain Python values are inferred (bool BOOL, int INT64 or
    UINT64 when too large, float FLOAT64, str STRING, a list an ARRAY of its items' type).
    Each tensor is stored as its export type (see ``_encode_tensor``); integer tensors keep
    an integer type. Everything is encoded before the file system is touched, so a value that
    cannot be stored fails without leaving anything behind.
    """
    path = Path(path)
    if "general.architecture" in metadata:
        raise GGUFError("metadata sets general.architecture; pass it as the architecture instead")
    encoded_metadata = {key: _encode_value(key, value) for key, value in metadata.items()}
    encoded_tensors = {
        name: _encode_tensor(name, data, type_name) for name, (data, type_name) in tensors.items()
    }
    if checksums:
        digests = {name: _sha256(array) for name, (array, _) in encoded_tensors.items()}
        encoded_metadata[TENSOR_SHA256_KEY] = _encode_value(TENSOR_SHA256_KEY, json.dumps(digests))
    writer = GGUFWriter(None, architecture)
    for key, (value, value_type, item_type) in encoded_metadata.items():
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    for name, (array, raw_type) in encoded_tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    _write_atomically(writer, path)
    return path


def _sha256(data: np.ndarray) -> str:
    """Of the bytes as stored: the writer writes an array's C-order bytes as they are."""
    return hashlib.sha256(np.ascontiguousarray(data)).hexdigest()


def _write_atomically(writer: GGUFWriter, path: Path) -> None:
    """Temp file in the target's folder, fsync, rename, fsync the folder; no trace on failure.
    Only a GGUF (or nothing) is replaced: see :mod:`llamatrain.files`."""
    with written_atomically(path, GGUF_KIND, is_gguf) as tmp:
        _write_and_sync(writer, tmp)


def _write_and_sync(writer: GGUFWriter, tmp: Path) -> None:
    """Write the whole file and fsync it; its handle is closed however this ends.

    fsync through the handle that wrote: a write-back error is reported to it for certain.
    Closing never raises: after a failed write it flushes what is still buffered and fails the
    same way, and that second error would bury the first, the one worth reporting.
    """
    try:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.flush()
        for fout in writer.fout or []:
            os.fsync(fout.fileno())
    finally:
        with contextlib.suppress(OSError):
            writer.close()


def _encode_value(key: str, value: Any) -> _EncodedValue:
    """(value as GGUFWriter packs it, GGUF type, item type of an array)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1:
            raise TypeError(f"GGUF key {key!r}: an array value must be 1-D, got {value.shape}")
        value = list(value)
    if isinstance(value, (list, tuple)):
        return _encode_array(key, value)
    scalar, value_type = _encode_scalar(key, value)
    return scalar, value_type, None


def _encode_array(key: str, items: Sequence[Any]) -> _EncodedValue:
    if not items:
        raise TypeError(f"GGUF key {key!r}: GGUF cannot store an empty array; leave the key out")
    encoded = [_encode_scalar(key, item) for item in items]
    item_type = encoded[0][1]
    if any(t != item_type for _, t in encoded):
        raise TypeError(f"GGUF key {key!r}: all items of an array must have the same type")
    return [v for v, _ in encoded], _V.ARRAY, item_type


def _encode_scalar(key: str, value: Any) -> tuple[Any, GGUFValueType]:
    if isinstance(value, np.generic) and type(value) in _NUMPY_VALUE_TYPES:
        return value.item(), _NUMPY_VALUE_TYPES[type(value)]
    if isinstance(value, bool):
        return value, _V.BOOL
    if isinstance(value, int):
        if not -(1 << 63) <= value < 1 << 64:
            raise TypeError(f"GGUF key {key!r}: {value} does not fit in 64 bits")
        return value, (_V.UINT64 if value >= 1 << 63 else _V.INT64)
    if isinstance(value, float):
        return value, _V.FLOAT64
    if isinstance(value, str):
        value.encode("utf-8")  # a lone surrogate fails here rather than mid-write
        return value, _V.STRING
    raise TypeError(
        f"GGUF key {key!r}: cannot store a {type(value).__name__}; use str/int/float/bool, "
        "a numpy scalar or 1-D array, or a list of those"
    )


def _to_numpy(data: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data)
    data = data.detach().cpu()
    if data.dtype in (torch.bfloat16, torch.float16, torch.float64):
        data = data.float()
    return np.ascontiguousarray(data.numpy())


def _encode_tensor(name: str, data: torch.Tensor | np.ndarray, type_name: str) -> _EncodedTensor:
    """(array as GGUFWriter takes it, raw GGML type when numpy's dtype does not say it).

    Matrices take the requested type; 1-D tensors (norms) stay F32 as llama.cpp's own
    converter leaves them; rows that are not whole quantization blocks fall back to F16 (with
    a warning) because llama.cpp cannot hold a partial block. Integer tensors keep an integer
    type.
    """
    _check_export_type(type_name)
    array = _to_numpy(data)
    if array.dtype.kind in "biu":
        return _integer_array(name, array), None
    array = array.astype(np.float32, copy=False)
    qtype = FILE_TYPES[type_name][0]
    if array.ndim < 2 or qtype == _T.F32:
        return array, None
    if qtype in (_T.Q8_0, _T.Q4_0) and array.shape[-1] % QUANT_BLOCK:
        warnings.warn(
            f"{name}: row length {array.shape[-1]} is not a multiple of {QUANT_BLOCK}, so it "
            f"cannot be {qtype.name}; writing it as F16 instead",
            stacklevel=2,
        )
        qtype = _T.F16
    if qtype == _T.F16:
        return array.astype(np.float16), None
    return gguf_quants.quantize(array, qtype), qtype


def _integer_array(name: str, array: np.ndarray) -> np.ndarray:
    """GGUF's integer tensors are signed: bools and unsigned ints widen to one that holds them."""
    signed = np.promote_types(array.dtype, np.int8)
    if signed.kind != "i":
        raise TypeError(f"tensor {name}: GGUF cannot store {array.dtype}; convert it to int64")
    return array.astype(signed, copy=False)


# ------------------------------------------------------------------------------------ reading


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
_MAX_DIMS = 8
_MAX_INT64 = (1 << 63) - 1  # ggml counts elements and bytes in int64
_MIN_STRING_BYTES = 8  # a string's length field


class _Corrupt(Exception):
    """Raised inside the parser; turned into one GGUFError naming the file."""


@dataclass
class _TensorInfo:
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
                raise _Corrupt(f"key {key} appears twice")
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
            raise _Corrupt(f"tensor {name} claims {n_dims} dimensions")
        dims = [self.scalar("<Q", 8) for _ in range(n_dims)]
        if math.prod(dims) > _MAX_INT64:
            raise _Corrupt(f"tensor {name} claims {dims} elements, more than 2^63")
        raw_type = self.scalar("<I", 4)
        offset = self.scalar("<Q", 8)
        return name, dims, raw_type, offset


def _check_magic(p: Path) -> None:
    if not p.is_file():
        raise GGUFError(f"GGUF file {str(p)!r} does not exist; check the path")
    with open(p, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        raise GGUFError(
            f"{p} is not a GGUF file (it starts with {head!r}, a GGUF starts with b'GGUF'); "
            "pass a .gguf written by llamatrain or llama.cpp"
        )


def _parse(p: Path) -> tuple[dict[str, Any], list[_TensorInfo], dict[str, ValueType]]:
    """(metadata, tensor infos, metadata value types) of a GGUF; raises GGUFError."""
    _check_magic(p)
    size = p.stat().st_size
    r = _Parser(memoryview(np.memmap(p, mode="r", dtype=np.uint8)))
    try:
        r.take(4)
        version = r.scalar("<I", 4)
        if version & 0xFFFF == 0:
            raise GGUFError(f"{p} is a big-endian GGUF; llamatrain reads little-endian files")
        if version not in (2, 3):
            raise GGUFError(f"{p} is GGUF version {version}; llamatrain reads versions 2 and 3")
        n_tensors = r.scalar("<Q", 8)
        n_kv = r.scalar("<Q", 8)
        if n_tensors > size or n_kv > size:
            raise _Corrupt(f"it claims {n_tensors} tensors and {n_kv} keys")
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
) -> list[_TensorInfo]:
    """Resolve types, shapes and byte ranges, checking each tensor lies inside the file."""
    infos: list[_TensorInfo] = []
    seen: set[str] = set()
    for name, dims, raw_type, offset in raw_infos:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError as e:
            raise GGUFError(
                f"{p}: tensor {name} has unknown type id {raw_type}; the file is corrupt or "
                f"from a newer llama.cpp — re-export it as {', '.join(EXPORT_TYPES)}"
            ) from e
        if name in seen:
            raise GGUFError(f"{p} is corrupt: tensor {name} appears twice")
        seen.add(name)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if (dims[0] if dims else 1) % block:
            raise GGUFError(f"{p} is corrupt: tensor {name} rows are not whole {qtype.name} blocks")
        if offset % align:
            raise GGUFError(f"{p} is corrupt: tensor {name} starts off the {align}-byte alignment")
        n_bytes = math.prod(dims) // block * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise GGUFError(
                f"{p} is truncated: tensor {name} ends at byte {start + n_bytes} but the file "
                f"has {size}; re-export or re-download it"
            )
        infos.append(_TensorInfo(name, tuple(reversed(dims)), qtype, start, n_bytes))
    return infos


_CHUNK_VALUES = 1 << 22
"""Values dequantized at a time (16 MiB as float32). Reading a tensor then costs its float32
result plus this much: a whole-tensor dequantization holds several float copies of it (gguf's
per-group results, their concatenation, a cast), ~3x the largest tensor on top of the model."""


def _dtype(info: _TensorInfo) -> torch.dtype:
    """What a stored tensor reads back as: integers as stored, anything else float32."""
    return INTEGER_TYPES.get(info.qtype, torch.float32)


def _read_into(p: Path, f: BinaryIO, info: _TensorInfo, target: torch.Tensor) -> None:
    """Fill ``target`` with a stored tensor: integers and F32 read straight into it, any other
    type dequantized into it a chunk of rows at a time (see ``_CHUNK_VALUES``)."""
    if tuple(target.shape) != info.np_shape or target.dtype != _dtype(info):
        raise GGUFError(
            f"{p}: tensor {info.name} is {info.qtype.name} {info.np_shape} but is read into a "
            f"{target.dtype} {tuple(target.shape)} tensor; load it into the model this file "
            "describes (its header gives the config)"
        )
    if target.device.type != "cpu" or not target.is_contiguous():
        raise ValueError(f"tensor {info.name} must be read into a contiguous CPU tensor")
    array = target.detach().numpy()  # shares the tensor's memory (a parameter's too)
    if info.qtype in INTEGER_TYPES or info.qtype == _T.F32:
        f.seek(info.offset)
        if f.readinto(memoryview(array).cast("B")) != info.n_bytes:
            raise GGUFError(f"{p} is truncated: tensor {info.name} ends past the end of the file")
        return
    rows = array.reshape(-1, array.shape[-1] if array.ndim else 1)
    if rows.size == 0:
        return
    row_bytes = info.n_bytes // rows.shape[0]
    step = max(1, _CHUNK_VALUES // rows.shape[1])
    chunks = _read_chunks(p, f, info, step * row_bytes)
    for start, raw in zip(range(0, rows.shape[0], step), chunks, strict=True):
        raw_rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, row_bytes)
        rows[start : start + len(raw_rows)] = _dequantize(p, info, raw_rows)


def _read_chunks(p: Path, f: BinaryIO, info: _TensorInfo, chunk_bytes: int) -> Iterator[bytes]:
    """A tensor's stored bytes, ``chunk_bytes`` at a time (the last piece may be shorter)."""
    f.seek(info.offset)
    for start in range(0, info.n_bytes, chunk_bytes):
        want = min(chunk_bytes, info.n_bytes - start)
        chunk = f.read(want)
        if len(chunk) != want:
            raise GGUFError(f"{p} is truncated: tensor {info.name} ends past the end of the file")
        yield chunk


def _dequantize(p: Path, info: _TensorInfo, raw: np.ndarray) -> np.ndarray:
    """Whole rows of stored bytes as float values (gguf's dequantizers, bit for bit llama.cpp's
    own ``dequantize_row_*``; tests/integration/test_quantized_import.py checks that)."""
    if info.qtype in (_T.F16, _T.F64):
        return raw.view(np.float16 if info.qtype == _T.F16 else np.float64)
    try:
        return gguf_quants.dequantize(raw, info.qtype)
    except NotImplementedError as e:
        raise GGUFError(
            f"{p}: tensor {info.name} has type {info.qtype.name}, which llamatrain cannot "
            "dequantize; convert the model to a type it reads (llama.cpp's llama-quantize to "
            "Q8_0, Q6_K or Q4_K_M, or f16) and load that"
        ) from e


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Only the key/value metadata (cheap: tensors are not read)."""
    return _parse(Path(path))[0]


def read_gguf(path: str | os.PathLike[str], *, tensor_data: bool = True) -> GGUFContents:
    """Everything in a GGUF: metadata as Python values, tensors as torch tensors.

    ``tensor_data=False`` reads the header only: ``tensors`` then holds meta-device tensors of
    each stored tensor's shape and dtype, enough to check a file, and ``read_tensors_into``
    reads the data later straight into the tensors that keep it (a model's parameters), so a
    model is never held twice. Tensors are read with ordinary reads, not through a memory
    map, whose pages would count in the process's memory beside the float32 results.
    """
    p = Path(path)
    meta, infos, value_types = _parse(p)
    contents = GGUFContents(p, meta, value_types)
    device = "cpu" if tensor_data else "meta"
    for info in infos:
        contents.tensor_types[info.name] = info.qtype.name
        contents.tensor_nbytes[info.name] = info.n_bytes
        contents.tensors[info.name] = torch.empty(info.np_shape, dtype=_dtype(info), device=device)
    if tensor_data:
        _read_all_into(p, infos, contents.tensors)
    return contents


def read_tensors_into(path: str | os.PathLike[str], targets: Mapping[str, torch.Tensor]) -> None:
    """Read the named tensors of a GGUF into ``targets`` (float32, or an integer tensor's own
    dtype; each of the stored shape), e.g. ``model.state_dict()``: each is dequantized into
    place a chunk at a time, so the cost beyond the targets is a few MiB, not a copy of them."""
    p = Path(path)
    infos = {info.name: info for info in _parse(p)[1]}
    missing = [name for name in targets if name not in infos]
    if missing:
        raise GGUFError(
            f"{p} has no tensor {missing[0]} (of {len(missing)} missing); pass the model file "
            "these tensors belong to"
        )
    _read_all_into(p, [infos[name] for name in targets], targets)


def read_stored_into(path: str | os.PathLike[str], targets: Mapping[str, torch.Tensor]) -> None:
    """Copy the named tensors' stored bytes, as they are, into ``targets`` of the same byte
    size (a quantized tensor's blocks as uint8 (rows, row_bytes), an F16 one as float16…):
    a frozen base kept in the file's own type (QLoRA) is read without a float copy."""
    p = Path(path)
    infos = {info.name: info for info in _parse(p)[1]}
    with open(p, "rb") as f:
        for name, target in targets.items():
            info = infos.get(name)
            if info is None or target.nbytes != info.n_bytes or not target.is_contiguous():
                raise GGUFError(
                    f"{p} has no tensor {name} of {target.nbytes} stored bytes; pass the model "
                    "file these tensors belong to"
                )
            f.seek(info.offset)
            if f.readinto(memoryview(target.view(torch.uint8).numpy()).cast("B")) != info.n_bytes:
                raise GGUFError(f"{p} is truncated: tensor {name} ends past the end of the file")


def _read_all_into(
    p: Path, infos: Sequence[_TensorInfo], targets: Mapping[str, torch.Tensor]
) -> None:
    with open(p, "rb") as f:
        for info in infos:
            _read_into(p, f, info, targets[info.name])


_DAMAGED_FIX = "use an older checkpoint (checkpoints/step-*.gguf) or a good copy"
_HASH_CHUNK_BYTES = 1 << 24


def verify_gguf(path: str | os.PathLike[str]) -> int:
    """Check every tensor's stored bytes against the sha256 recorded when the file was written.

    Returns how many tensors were checked: 0 for a file without ``TENSOR_SHA256_KEY`` (models
    and vocabularies; only checkpoints carry it). Raises GGUFError naming the damaged tensors.
    The bytes are hashed 16 MiB at a time, so checking costs no memory however large the file.
    """
    p = Path(path)
    meta, infos, _ = _parse(p)
    if TENSOR_SHA256_KEY not in meta:
        return 0
    recorded = _recorded_digests(p, meta[TENSOR_SHA256_KEY])
    with open(p, "rb") as f:
        damaged = [
            info.name
            for info in infos
            if recorded.pop(info.name, None) != _stored_sha256(p, f, info)
        ]
    damaged += [f"{name} (missing)" for name in recorded]
    if damaged:
        more = f" and {len(damaged) - 1} more" if len(damaged) > 1 else ""
        raise GGUFError(
            f"{p} is damaged: tensor {damaged[0]}{more} does not match the sha256 recorded when "
            f"it was written; {_DAMAGED_FIX}"
        )
    return len(infos)


def _stored_sha256(p: Path, f: BinaryIO, info: _TensorInfo) -> str:
    """sha256 of a tensor's bytes in the file: equal to ``_sha256`` of what was written."""
    digest = hashlib.sha256()
    for chunk in _read_chunks(p, f, info, _HASH_CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


def _recorded_digests(p: Path, text: object) -> dict[str, str]:
    try:
        digests = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        digests = None
    if not isinstance(digests, dict):
        raise GGUFError(
            f"{p} is damaged: {TENSOR_SHA256_KEY} is not a JSON map of tensor names to sha256; "
            + _DAMAGED_FIX
        )
    return digests


_VALUE_NUMPY_TYPES = {value: numpy_type for numpy_type, value in _NUMPY_VALUE_TYPES.items()}


def typed_value(contents: GGUFContents, key: str) -> Any:
    """A key's value in the form ``write_gguf`` stores with the type it was read with.

    Copying a key from one file to another must keep its GGUF type: llama.cpp checks types
    (a token id must stay UINT32, a float FLOAT32), and plain Python values would be written
    as INT64/FLOAT64.
    """
    value = contents.metadata[key]
    value_type, item_type = contents.value_types[key]
    numpy_type = _VALUE_NUMPY_TYPES.get(item_type if value_type == _V.ARRAY else value_type)
    if numpy_type is None or numpy_type is np.bool_:
        return value  # strings, string arrays and bools are written back as they were
    return np.asarray(value, dtype=numpy_type) if value_type == _V.ARRAY else numpy_type(value)
