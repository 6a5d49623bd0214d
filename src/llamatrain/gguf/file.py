"""The GGUF container: read any GGUF into Python values and torch tensors (writing one is
``llamatrain.gguf.write``'s).

This module knows the file format and nothing of llama: which keys and tensors a model needs is
``llamatrain.gguf.llama``'s business, and which types a model is exported as is
``llamatrain.gguf.export_types``'. It and ``llamatrain.gguf.write`` are the only modules that
use the ``gguf`` package's writer and codecs (its dequantizers here, its writer and quantizers
there), so that package's API churn stays behind one door of two rooms (the header parser and
the export types take only gguf's enums).

Reading starts with a ``struct`` parser of our own (``llamatrain.gguf.header``) that checks
every count, length, dimension and offset against the file size before using it, so a damaged
file is one ``GGUFError``, never an overflow or a huge allocation.
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
import os
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeAlias

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from gguf import quants as gguf_quants

from llamatrain.errors import GGUFError, shown
from llamatrain.gguf.header import TensorInfo, ValueType, open_gguf, parse_header
from llamatrain.gguf.mapped_files import watch

GGUF_KIND = "GGUF file"
"""How refusals name what is being written (see :func:`llamatrain.files.check_target`)."""

__all__ = [
    "CHUNK_VALUES",
    "GGUF_KIND",
    "INTEGER_TYPES",
    "NUMPY_VALUE_TYPES",
    "PICKLED_STATE_KEYS",
    "QUANT_BLOCK",
    "STATE_SHA256_KEY",
    "TENSOR_SHA256_KEY",
    "GGUFContents",
    "GGUFSource",
    "load_tensor_data",
    "map_stored",
    "nonfinite_tensors",
    "read_gguf",
    "read_gguf_metadata",
    "read_tensors_into",
    "state_sha256",
    "typed_value",
    "verify_gguf",
]

_T = GGMLQuantizationType
_V = GGUFValueType

QUANT_BLOCK = 32
"""Values per Q8_0 / Q4_0 block: a quantized row must be a whole number of blocks."""

INTEGER_TYPES: dict[GGMLQuantizationType, torch.dtype] = {
    _T.I8: torch.int8,
    _T.I16: torch.int16,
    _T.I32: torch.int32,
    _T.I64: torch.int64,
}
"""Integer tensor types: read back with their own dtype, never dequantized to float."""

STATE_SHA256_KEY = "training.state_sha256"
"""sha256 of a checkpoint's other ``training.*`` / ``optimizer.*`` keys (counters, cursors,
config, RNG and optimizer layouts), written with ``TENSOR_SHA256_KEY``: a flipped byte in the
state is refused as damage like one in a tensor, never believed or met as a traceback."""
STATE_KEY_PREFIXES = ("training.", "optimizer.")
PICKLED_STATE_KEYS = ("training.rng_state", "optimizer.lbfgs.state")
"""Where version-1 checkpoints kept pickles (before either sha256 key existed)."""
TENSOR_SHA256_KEY = "training.tensor_sha256"
"""Key of the JSON map tensor name -> sha256 (hex) of its stored bytes. A ``training.*`` key
because only checkpoints carry it: an exported model keeps exactly the keys it had."""


@dataclass
class GGUFContents:
    """A GGUF file read into memory.

    ``metadata``: every key as a plain Python value (str, int, float, bool, list).
    ``tensors``: float tensors dequantized to float32 (integer tensors keep their dtype), in
    torch's (row-major, numpy) shape; meta-device placeholders of that shape and dtype when the
    file was read with ``tensor_data=False``. ``tensor_types``: the stored GGML type name per tensor
    (``"F32"``, ``"Q8_0"``, ...). ``tensor_nbytes``: the bytes each tensor occupies in the file.
    ``value_types``: each key's stored GGUF type (and item type, for arrays), which
    :func:`typed_value` restores. ``infos``: where each tensor lies in the file, so that what
    is read later (:func:`read_tensors_into`, :func:`verify_gguf`…) needs no second parse.
    ``file``: the file the header was parsed from, kept open while these contents live (closed
    with them), through which everything read later goes: each file is opened once, however
    many of its tensors, digests and mappings are taken, and they are all of the file that was
    parsed, even if its path has since been renamed over or removed (a run's ``latest.gguf``).
    """

    path: Path
    metadata: dict[str, Any]
    value_types: dict[str, ValueType] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    tensor_types: dict[str, str] = field(default_factory=dict)
    tensor_nbytes: dict[str, int] = field(default_factory=dict)
    infos: dict[str, TensorInfo] = field(default_factory=dict, repr=False)
    file: BinaryIO | None = field(default=None, repr=False, compare=False)


GGUFSource: TypeAlias = "str | os.PathLike[str] | GGUFContents"
"""A GGUF named by its path, or already parsed (its header is then not read again)."""

NUMPY_VALUE_TYPES: dict[type, GGUFValueType] = {
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
"""The GGUF value type of each numpy scalar type (what a value written as one is stored as)."""


def state_sha256(metadata: Mapping[str, Any]) -> str:
    """sha256 of the ``STATE_KEY_PREFIXES`` keys (not the checksums) as plain values: the same
    from the values written and from the values read back."""
    state = {
        key: plain_value(value)
        for key, value in metadata.items()
        if key.startswith(STATE_KEY_PREFIXES) and key not in (TENSOR_SHA256_KEY, STATE_SHA256_KEY)
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def plain_value(value: Any) -> Any:
    """A metadata value as the reader returns it: numpy scalars and arrays as Python values."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    if isinstance(value, list | tuple):
        return [plain_value(item) for item in value]
    return value


# ------------------------------------------------------------------------------------ reading


CHUNK_VALUES = 1 << 22
"""Values dequantized at a time (16 MiB as float32). Reading a tensor then costs its float32
result plus this much: a whole-tensor dequantization holds several float copies of it (gguf's
per-group results, their concatenation, a cast), ~3x the largest tensor on top of the model."""


def _dtype(info: TensorInfo) -> torch.dtype:
    """What a stored tensor reads back as: integers as stored, anything else float32."""
    return INTEGER_TYPES.get(info.qtype, torch.float32)


def _read_into(p: Path, f: BinaryIO, info: TensorInfo, target: torch.Tensor) -> None:
    """Fill ``target`` with a stored tensor: integers and F32 read straight into it, any other
    type dequantized into it a chunk of rows at a time (see ``CHUNK_VALUES``)."""
    if tuple(target.shape) != info.np_shape or target.dtype != _dtype(info):
        raise GGUFError(
            f"{p}: tensor {shown(info.name)} is {info.qtype.name} {info.np_shape} but is read "
            f"into a {target.dtype} {tuple(target.shape)} tensor; load it into the model this file "
            "describes (its header gives the config)"
        )
    if target.device.type != "cpu" or not target.is_contiguous():
        raise ValueError(f"tensor {info.name} must be read into a contiguous CPU tensor")
    array = target.detach().numpy()  # shares the tensor's memory (a parameter's too)
    if info.qtype in INTEGER_TYPES or info.qtype == _T.F32:
        f.seek(info.offset)
        if f.readinto(memoryview(array).cast("B")) != info.n_bytes:
            raise GGUFError(
                f"{p} is truncated: tensor {shown(info.name)} ends past the end of the file"
            )
        return
    rows = array.reshape(-1, array.shape[-1] if array.ndim else 1)
    if rows.size == 0:
        return
    row_bytes = info.n_bytes // rows.shape[0]
    step = max(1, CHUNK_VALUES // rows.shape[1])
    chunks = _read_chunks(p, f, info, step * row_bytes)
    for start, raw in zip(range(0, rows.shape[0], step), chunks, strict=True):
        raw_rows = np.frombuffer(raw, dtype=np.uint8).reshape(-1, row_bytes)
        rows[start : start + len(raw_rows)] = _dequantize(p, info, raw_rows)


def _read_chunks(p: Path, f: BinaryIO, info: TensorInfo, chunk_bytes: int) -> Iterator[bytes]:
    """A tensor's stored bytes, ``chunk_bytes`` at a time (the last piece may be shorter)."""
    f.seek(info.offset)
    for start in range(0, info.n_bytes, chunk_bytes):
        want = min(chunk_bytes, info.n_bytes - start)
        chunk = f.read(want)
        if len(chunk) != want:
            raise GGUFError(
                f"{p} is truncated: tensor {shown(info.name)} ends past the end of the file"
            )
        yield chunk


def _dequantize(p: Path, info: TensorInfo, raw: np.ndarray) -> np.ndarray:
    """Whole rows of stored bytes as float values (gguf's dequantizers, bit for bit llama.cpp's
    own ``dequantize_row_*``; tests/integration/test_quantized_import.py checks that)."""
    if info.qtype in (_T.F16, _T.F64):
        return raw.view(np.float16 if info.qtype == _T.F16 else np.float64)
    try:
        return gguf_quants.dequantize(raw, info.qtype)
    except NotImplementedError as e:
        raise GGUFError(
            f"{p}: tensor {shown(info.name)} has type {info.qtype.name}, which llamatrain cannot "
            "dequantize; convert the model to a type it reads (llama.cpp's llama-quantize to "
            "Q8_0, Q6_K or Q4_K_M, or f16) and load that"
        ) from e


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Only the key/value metadata (cheap: tensors are not read)."""
    return parse_header(Path(path))[0]


def read_gguf(path: str | os.PathLike[str], *, tensor_data: bool = True) -> GGUFContents:
    """Everything in a GGUF: metadata as Python values, tensors as torch tensors.

    ``tensor_data=False`` reads the header only: ``tensors`` then holds meta-device tensors of
    each stored tensor's shape and dtype, enough to check a file, and ``read_tensors_into``
    reads the data later straight into the tensors that keep it (a model's parameters), so a
    model is never held twice. Tensors are read with ordinary reads, not through a memory
    map, whose pages would count in the process's memory beside the float32 results.
    """
    p = Path(path)
    f = open_gguf(p)
    try:
        meta, infos, value_types = parse_header(p, f)
    except BaseException:
        f.close()
        raise
    contents = GGUFContents(p, meta, value_types, file=f)
    weakref.finalize(contents, f.close)
    for info in infos:
        contents.infos[info.name] = info
        contents.tensor_types[info.name] = info.qtype.name
        contents.tensor_nbytes[info.name] = info.n_bytes
        contents.tensors[info.name] = torch.empty(info.np_shape, dtype=_dtype(info), device="meta")
    if tensor_data:
        load_tensor_data(contents)
    return contents


def load_tensor_data(contents: GGUFContents, *, skip: tuple[str, ...] = ()) -> GGUFContents:
    """Read the data of every tensor of a header-only ``contents`` still left as a meta
    placeholder (none for one read whole), in place; returns ``contents``. Tensors whose
    names start with one of ``skip`` stay placeholders (for a later call to read)."""
    missing = {
        name: t for name, t in contents.tensors.items() if t.is_meta and not name.startswith(skip)
    }
    if missing:
        data = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in missing.items()}
        with _opened(contents) as (p, _, infos, f):
            for name, target in data.items():
                _read_into(p, f, infos[name], target)
        contents.tensors.update(data)
    return contents


@contextlib.contextmanager
def _opened(
    source: GGUFSource,
) -> Iterator[tuple[Path, dict[str, Any], dict[str, TensorInfo], BinaryIO]]:
    """A file's path, keys, tensor locations and the open file to read them through: parsed
    ``source``'s own open file (:class:`GGUFContents`' ``file``), else the file opened for
    this read alone (and a path's header parsed through it)."""
    if isinstance(source, GGUFContents):
        if source.file is not None and not source.file.closed:
            yield source.path, source.metadata, source.infos, source.file
            return
        with open(source.path, "rb") as f:
            yield source.path, source.metadata, source.infos, f
        return
    p = Path(source)
    with open_gguf(p) as f:
        meta, infos, _ = parse_header(p, f)
        yield p, meta, {info.name: info for info in infos}, f


def read_tensors_into(source: GGUFSource, targets: Mapping[str, torch.Tensor]) -> None:
    """Read the named tensors of a GGUF into ``targets`` (float32, or an integer tensor's own
    dtype; each of the stored shape), e.g. ``model.state_dict()``: each is dequantized into
    place a chunk at a time, so the cost beyond the targets is a few MiB, not a copy of them."""
    with _opened(source) as (p, _, infos, f):
        missing = [name for name in targets if name not in infos]
        if missing:
            raise GGUFError(
                f"{p} has no tensor {shown(missing[0])} (of {len(missing)} missing); pass the "
                "model file these tensors belong to"
            )
        for name, target in targets.items():
            _read_into(p, f, infos[name], target)


def map_stored(source: GGUFSource, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The named tensors' stored bytes, as they are, mapped from the file rather than read:
    tensors of ``like``'s shapes and dtypes (a quantized tensor's blocks as uint8
    (rows, row_bytes), an F16 one as float16…) whose pages are the file's.

    Why: a frozen base kept in the file's own type (QLoRA) is then held as llama.cpp holds it
    (``--mmap``, its default): nothing is copied at load, and the pages are clean file pages the
    kernel can drop under pressure and read again, not anonymous memory that must be swapped
    or counted against the run. The mapping is copy-on-write, so nothing written to these
    tensors could reach the file. The file must not be truncated while it is mapped (a read
    past its end is a SIGBUS, as for llama.cpp); a file replaced by a new one (renamed over)
    leaves this mapping on the old one. The mapping is watched (``gguf.mapped_files``): a
    trainer checks between steps that the file is still the one mapped."""
    with _opened(source) as (p, _, infos, f):
        file_bytes = os.fstat(f.fileno()).st_size
        for name, t in like.items():
            info = infos.get(name)
            if info is None or t.nbytes != info.n_bytes:
                raise GGUFError(
                    f"{p} has no tensor {shown(name)} of {t.nbytes} stored bytes; pass the model "
                    "file these tensors belong to"
                )
            if info.offset + info.n_bytes > file_bytes:
                raise GGUFError(
                    f"{p} is truncated: tensor {shown(name)} ends past the end of the file"
                )
        if not like:
            return {}
        mapped = np.memmap(f, mode="c", dtype=np.uint8)
        watch(
            p, mapped, f.fileno()
        )  # a change to the file under the run is told, not a silent one or a SIGBUS
    return {
        name: torch.from_numpy(mapped[infos[name].offset :][: t.nbytes]).view(t.dtype).view(t.shape)
        for name, t in like.items()
    }


_DAMAGED_FIX = "use an older checkpoint (checkpoints/step-*.gguf) or a good copy"
_HASH_CHUNK_BYTES = 1 << 24


def _check_checksums_kept(p: Path, meta: Mapping[str, Any]) -> None:
    """A checkpoint (a file with training state keys) is written with both sha256 keys: one
    that lacks either was stripped or damaged, and is refused rather than called sound.
    A version-1 checkpoint (``PICKLED_STATE_KEYS``) predates them: its state is never read
    (``llamatrain.checkpoint`` refuses pickles), and its weights load as any model's do."""
    missing = [key for key in (TENSOR_SHA256_KEY, STATE_SHA256_KEY) if key not in meta]
    legacy = any(key in meta for key in PICKLED_STATE_KEYS)
    if missing and not legacy and any(key.startswith(STATE_KEY_PREFIXES) for key in meta):
        raise GGUFError(
            f"{p} holds a checkpoint's training state but not {missing[0]}, the sha256 it is "
            f"saved with: stripped or damaged, nothing in it can be checked; {_DAMAGED_FIX}"
        )


def verify_gguf(source: GGUFSource) -> int:
    """Check every tensor's stored bytes against the sha256 recorded when the file was written.

    Returns how many tensors were checked: 0 for a file without ``TENSOR_SHA256_KEY`` (models
    and vocabularies; only checkpoints carry it). Raises GGUFError naming the damaged tensors,
    or the training state keys when ``STATE_SHA256_KEY`` is recorded and they differ, or a
    checkpoint's missing sha256 key.
    The bytes are hashed 16 MiB at a time, so checking costs no memory however large the file.
    """
    with _opened(source) as (p, meta, located, f):
        _check_checksums_kept(p, meta)
        if STATE_SHA256_KEY in meta and meta[STATE_SHA256_KEY] != state_sha256(meta):
            raise GGUFError(
                f"{p} is damaged: its training state keys (training.*, optimizer.*) do not match "
                f"the sha256 recorded when it was written; {_DAMAGED_FIX}"
            )
        if TENSOR_SHA256_KEY not in meta:
            return 0
        infos = list(located.values())
        recorded = _recorded_digests(p, meta[TENSOR_SHA256_KEY])
        damaged = [
            info.name
            for info in infos
            if recorded.pop(info.name, None) != _stored_sha256(p, f, info)
        ]
    damaged += [f"{name} (missing)" for name in recorded]
    if damaged:
        more = f" and {len(damaged) - 1} more" if len(damaged) > 1 else ""
        raise GGUFError(
            f"{p} is damaged: tensor {shown(damaged[0])}{more} does not match the sha256 "
            f"recorded when it was written; {_DAMAGED_FIX}"
        )
    return len(infos)


def nonfinite_tensors(source: GGUFSource) -> list[str]:
    """The float tensors holding a NaN or an infinity (a diverged run saved, or damage), read
    one at a time: memory for the largest tensor, not the model."""
    bad = []
    with _opened(source) as (p, _, infos, f):
        for info in infos.values():
            target = torch.empty(info.np_shape, dtype=_dtype(info))
            if target.is_floating_point():
                _read_into(p, f, info, target)
                if not bool(torch.isfinite(target).all()):
                    bad.append(info.name)
    return bad


def _stored_sha256(p: Path, f: BinaryIO, info: TensorInfo) -> str:
    """sha256 of a tensor's bytes in the file: equal to ``_Encoding.sha256`` of what was written."""
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


_VALUE_NUMPY_TYPES = {value: numpy_type for numpy_type, value in NUMPY_VALUE_TYPES.items()}


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
