"""Writing a GGUF: keys and tensors encoded as llama.cpp reads them, streamed into a file that
replaces its target atomically.

Writing goes through ``gguf.GGUFWriter`` (the writer llama.cpp's own converter uses, so the
bytes are laid out the way llama.cpp expects) into a temp file in the target's folder that is
fsynced and renamed over the target: an interrupted save never leaves a half-written file, and
an old file survives a failed overwrite. It streams: the header lists every tensor first, then
each tensor is produced (a :class:`DeferredTensor` only then), encoded and written before the
next, so writing a model costs one tensor beside it, whatever its size. With ``checksums`` the
sha256 of every tensor's stored bytes and of the training state's keys are recorded, which
``gguf.file.verify_gguf`` checks. Reading is ``gguf.file``'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeAlias

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

from llamatrain.errors import GGUFError, LlamatrainWarning
from llamatrain.files import is_gguf, written_atomically
from llamatrain.gguf.export_types import FILE_TYPES, check_export_type
from llamatrain.gguf.file import (
    CHUNK_VALUES,
    GGUF_KIND,
    NUMPY_VALUE_TYPES,
    QUANT_BLOCK,
    STATE_SHA256_KEY,
    TENSOR_SHA256_KEY,
    state_sha256,
)

__all__ = ["DeferredTensor", "TensorData", "TensorToWrite", "write_gguf"]

_T = GGMLQuantizationType
_V = GGUFValueType


@dataclass(frozen=True)
class DeferredTensor:
    """A tensor to write that is produced only when the writer reaches it: its shape and dtype
    now (the header lists every tensor before any data), its values from ``read()`` later.

    Why: a merged LoRA model or a model widened to float32 would otherwise be held whole beside
    the model it comes from (27 GB for a 7B); deferred, a write holds one tensor at a time, as
    llama.cpp's ``llama-export-lora`` does. ``read()`` may be called more than once (a
    checksummed write reads each tensor twice: once for the header's digests, once to write).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]
    rows: Callable[[int, int], torch.Tensor] | None = None
    """A matrix's rows ``start:stop`` alone, where they can be produced a part at a time: the
    writer then encodes it without producing it whole (a table kept in blocks is 1 GB decoded
    to float32 at a 128k vocabulary)."""

    def is_floating_point(self) -> bool:
        """As ``torch.Tensor.is_floating_point``, so checks of a model's tensors take either."""
        return self.dtype.is_floating_point


TensorData: TypeAlias = "torch.Tensor | np.ndarray | DeferredTensor"
"""What a tensor to write is given as: its values, or a :class:`DeferredTensor`."""

TensorToWrite: TypeAlias = "tuple[TensorData, str]"
"""A tensor and the export type (an ``EXPORT_TYPES`` name) its matrices are to be stored as."""

_EncodedValue: TypeAlias = tuple[Any, GGUFValueType, GGUFValueType | None]


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
    Each tensor is stored as its export type (see ``_stored_layout``); integer tensors keep
    an integer type.

    The write streams: the keys and every tensor's stored type and size are settled before
    the file system is touched (a value that cannot be stored fails without leaving anything
    behind), then each tensor is produced (a :class:`DeferredTensor` read), encoded a chunk of
    rows at a time and written before the next: the peak is one tensor plus a chunk, never
    the model's encoded copy. A failure part-way leaves the target as it was.
    """
    path = Path(path)
    if "general.architecture" in metadata:
        raise GGUFError("metadata sets general.architecture; pass it as the architecture instead")
    encoded_metadata = {key: _encode_value(key, value) for key, value in metadata.items()}
    layouts = {
        name: _stored_layout(name, _shape_and_dtype(data), type_name)
        for name, (data, type_name) in tensors.items()
    }
    if checksums:
        digests = {
            name: _Encoding(tensors[name][0], layout).sha256() for name, layout in layouts.items()
        }
        encoded_metadata[TENSOR_SHA256_KEY] = _encode_value(TENSOR_SHA256_KEY, json.dumps(digests))
        state_digest = state_sha256(metadata)
        encoded_metadata[STATE_SHA256_KEY] = _encode_value(STATE_SHA256_KEY, state_digest)
    writer = GGUFWriter(None, architecture)
    for key, (value, value_type, item_type) in encoded_metadata.items():
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    for name, layout in layouts.items():
        writer.add_tensor_info(name, layout.shape, layout.dtype, layout.nbytes, layout.raw_type)
    encodings = (_Encoding(tensors[name][0], layout) for name, layout in layouts.items())
    with written_atomically(path, GGUF_KIND, is_gguf) as tmp:
        _write_and_sync(writer, tmp, encodings)
    return path


def _write_and_sync(writer: GGUFWriter, tmp: Path, encodings: Iterator[_Encoding]) -> None:
    """Write the whole file, one tensor's encoding after another, and fsync it; its handle is
    closed however this ends.

    fsync through the handle that wrote: a write-back error is reported to it for certain.
    Closing never raises: after a failed write it flushes what is still buffered and fails the
    same way, and that second error would bury the first, the one worth reporting.
    """
    try:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for encoding in encodings:
            writer.write_tensor_data(encoding)  # type: ignore[arg-type]  # see _Encoding
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
    if isinstance(value, np.generic) and type(value) in NUMPY_VALUE_TYPES:
        return value.item(), NUMPY_VALUE_TYPES[type(value)]
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


@dataclass(frozen=True)
class _StoredLayout:
    """How one tensor is stored: what gguf's ``add_tensor_info`` takes (the shape in bytes for
    a block type, as gguf's own ``add_tensor`` passes an encoded array's), and the type the
    values are encoded as (``None``: a numpy dtype, kept as ``dtype`` says)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    raw_type: GGMLQuantizationType | None

    @property
    def integer(self) -> bool:
        """An integer tensor, stored as its values are (a block type's bytes are uint8 too)."""
        return self.raw_type is None and self.dtype.kind in "biu"


def _shape_and_dtype(data: TensorData) -> tuple[tuple[int, ...], np.dtype]:
    """A tensor's shape and the numpy dtype its values reach the encoder as (float32 for any
    float), without producing a deferred tensor's values."""
    dtype = data.dtype
    if isinstance(dtype, torch.dtype):
        dtype = torch.empty(0, dtype=dtype).numpy().dtype if not dtype.is_floating_point else None
    if dtype is None or dtype.kind == "f":
        dtype = np.dtype(np.float32)
    return tuple(data.shape), np.dtype(dtype)


def _stored_layout(
    name: str, shape_and_dtype: tuple[tuple[int, ...], np.dtype], type_name: str
) -> _StoredLayout:
    """Matrices take the requested type; 1-D tensors (norms) stay F32 as llama.cpp's own
    converter leaves them; rows that are not whole quantization blocks fall back to F16 (with
    a warning) because llama.cpp cannot hold a partial block. Integer tensors keep an integer
    type."""
    check_export_type(type_name)
    shape, dtype = shape_and_dtype
    count = int(np.prod(shape, dtype=np.int64))
    if dtype.kind in "biu":
        signed = _signed(name, dtype)
        return _StoredLayout(shape, signed, count * signed.itemsize, None)
    qtype = FILE_TYPES[type_name][0]
    if len(shape) < 2 or qtype == _T.F32:
        return _StoredLayout(shape, np.dtype(np.float32), count * 4, None)
    if qtype in (_T.Q8_0, _T.Q4_0) and shape[-1] % QUANT_BLOCK:
        warnings.warn(
            f"{name}: row length {shape[-1]} is not a multiple of {QUANT_BLOCK}, so it "
            f"cannot be {qtype.name}; writing it as F16 instead",
            LlamatrainWarning,  # it quotes a tensor's name, from the file written
            stacklevel=4,
        )
        qtype = _T.F16
    if qtype == _T.F16:
        return _StoredLayout(shape, np.dtype(np.float16), count * 2, None)
    byte_shape = tuple(gguf_quants.quant_shape_to_byte_shape(shape, qtype))
    nbytes = int(np.prod(byte_shape, dtype=np.int64))
    return _StoredLayout(byte_shape, np.dtype(np.uint8), nbytes, qtype)


class _Encoding:
    """A tensor's stored bytes, encoded a chunk of rows at a time while they are written.

    gguf's ``write_tensor_data`` asks of the array it is given only ``nbytes`` and
    ``tofile(f)``, so this stands in for the encoded array: gguf-py's quantizers hold several
    float copies of what they encode (a 1 GB embedding would take ~4 GB at once), while rows
    are encoded independently, so chunks give the same bytes for a chunk's worth of memory.
    """

    def __init__(self, data: TensorData, layout: _StoredLayout) -> None:
        self.data, self.layout, self.nbytes = data, layout, layout.nbytes

    def chunks(self) -> Iterator[np.ndarray]:
        """The stored bytes in order, ``CHUNK_VALUES`` values at a time."""
        if self.layout.integer:
            array = _values(self.data)
            yield np.ascontiguousarray(array.astype(self.layout.dtype, copy=False))
            return
        n_rows, n_cols, rows = self._rows()
        step = max(1, CHUNK_VALUES // max(1, n_cols))
        for start in range(0, n_rows, step):
            yield self._encoded(rows(start, min(start + step, n_rows)))

    def _rows(self) -> tuple[int, int, Callable[[int, int], np.ndarray]]:
        """The values as 2-D rows: their count, their length and rows ``start:stop`` — from a
        deferred tensor's ``rows`` where it has one (produced a part at a time), else sliced
        from its values."""
        data = self.data
        if isinstance(data, DeferredTensor) and data.rows is not None:
            return *data.shape, lambda start, stop: _values(data.rows(start, stop))
        array = _values(data)
        rows = array.reshape(-1, array.shape[-1]) if array.ndim > 1 else array.reshape(1, -1)
        return *rows.shape, lambda start, stop: rows[start:stop]

    def _encoded(self, rows: np.ndarray) -> np.ndarray:
        rows = rows.astype(np.float32, copy=False)
        if self.layout.raw_type is None:
            return np.ascontiguousarray(rows.astype(self.layout.dtype, copy=False))
        return gguf_quants.quantize(rows, self.layout.raw_type)

    def tofile(self, f: BinaryIO) -> None:
        written = 0
        for chunk in self.chunks():
            chunk.tofile(f)
            written += chunk.nbytes
        if written != self.nbytes:  # the header promised this size: never write another
            raise GGUFError(f"a tensor encoded to {written} bytes where {self.nbytes} were planned")

    def sha256(self) -> str:
        """Of the stored bytes (what ``verify_gguf`` recomputes from the file)."""
        digest = hashlib.sha256()
        for chunk in self.chunks():
            digest.update(chunk)
        return digest.hexdigest()


def _values(data: TensorData) -> np.ndarray:
    """A tensor's values as a C-ordered numpy array (a deferred one's produced now); float32
    kept as it is, without a copy, other floats widened."""
    if isinstance(data, DeferredTensor):
        data = data.read()
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data)
    data = data.detach().cpu()
    if data.dtype in (torch.bfloat16, torch.float16, torch.float64):
        data = data.float()
    return np.ascontiguousarray(data.numpy())


def _signed(name: str, dtype: np.dtype) -> np.dtype:
    """GGUF's integer tensors are signed: bools and unsigned ints widen to one that holds them."""
    signed = np.promote_types(dtype, np.int8)
    if signed.kind != "i":
        raise TypeError(f"tensor {name}: GGUF cannot store {dtype}; convert it to int64")
    return signed
