"""The one GGUF reader/writer: model files, training checkpoints and vocab-only files.

Why one module: a model file llama.cpp runs, a checkpoint we resume and a vocabulary are all
"llama keys + tokenizer keys + tensors"; writing them through one path means a checkpoint is
guaranteed to carry exactly what an exported model carries, and it keeps the ``gguf`` package
(and its API churn) behind a single door. Nothing else in llamatrain imports ``gguf``.

What llama.cpp expects (NOTES §1): ``general.architecture = "llama"``, the ``llama.*``
hyper-parameter keys, ``tokenizer.ggml.*`` keys, and *exactly* the model's tensors (an extra
tensor makes it refuse the file). Norms and other 1-D tensors stay F32 as llama.cpp's own
converter leaves them; matrices take the requested type, falling back to F16 when a row is
not a whole number of 32-wide quantization blocks. Writes are atomic (temp file in the same
directory, fsync, rename), so an interrupted save never leaves a half-written file behind.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from gguf import quants as gguf_quants

from llamatrain.errors import ConfigError, GGUFError
from llamatrain.model import Llama, ModelConfig, tensor_shapes
from llamatrain.tokenizer import Tokenizer

__all__ = [
    "FILE_TYPES",
    "GGUFContents",
    "export_gguf",
    "load_gguf",
    "model_from_contents",
    "read_gguf",
    "read_gguf_metadata",
    "stored_nbytes",
    "write_gguf",
    "write_vocab_gguf",
]

ARCH = "llama"
QUANT_BLOCK = 32  # Q8_0 / Q4_0 block size

# file_type name -> (tensor type for matrices, general.file_type)
FILE_TYPES: dict[str, tuple[GGMLQuantizationType, int]] = {
    "f32": (GGMLQuantizationType.F32, int(LlamaFileType.ALL_F32)),
    "f16": (GGMLQuantizationType.F16, int(LlamaFileType.MOSTLY_F16)),
    "bf16": (GGMLQuantizationType.BF16, int(LlamaFileType.MOSTLY_BF16)),
    "q8_0": (GGMLQuantizationType.Q8_0, int(LlamaFileType.MOSTLY_Q8_0)),
    "q4_0": (GGMLQuantizationType.Q4_0, int(LlamaFileType.MOSTLY_Q4_0)),
}

# Tensors under these prefixes are training state in a checkpoint, never model weights.
CHECKPOINT_TENSOR_PREFIXES = ("optimizer.", "training.")
# Our exact ModelConfig, so a checkpoint/model reloads into the same config (llama.cpp
# ignores unknown keys); foreign files are read from the llama.* keys alone.
CONFIG_KEY = "llamatrain.model_config"

_V = GGUFValueType
# Types of the keys we write for llama.cpp, spelled as llama.cpp reads them.
_KEY_TYPES: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {
    "general.name": (_V.STRING, None),
    "general.file_type": (_V.UINT32, None),
    "llama.context_length": (_V.UINT32, None),
    "llama.embedding_length": (_V.UINT32, None),
    "llama.block_count": (_V.UINT32, None),
    "llama.feed_forward_length": (_V.UINT32, None),
    "llama.attention.head_count": (_V.UINT32, None),
    "llama.attention.head_count_kv": (_V.UINT32, None),
    "llama.attention.layer_norm_rms_epsilon": (_V.FLOAT32, None),
    "llama.rope.freq_base": (_V.FLOAT32, None),
    "llama.rope.dimension_count": (_V.UINT32, None),
    "llama.vocab_size": (_V.UINT32, None),
    CONFIG_KEY: (_V.STRING, None),
    "tokenizer.ggml.model": (_V.STRING, None),
    "tokenizer.ggml.tokens": (_V.ARRAY, _V.STRING),
    "tokenizer.ggml.scores": (_V.ARRAY, _V.FLOAT32),
    "tokenizer.ggml.token_type": (_V.ARRAY, _V.INT32),
    "tokenizer.ggml.bos_token_id": (_V.UINT32, None),
    "tokenizer.ggml.eos_token_id": (_V.UINT32, None),
    "tokenizer.ggml.unknown_token_id": (_V.UINT32, None),
    "tokenizer.ggml.padding_token_id": (_V.UINT32, None),
    "tokenizer.ggml.add_bos_token": (_V.BOOL, None),
    "tokenizer.ggml.add_eos_token": (_V.BOOL, None),
    "tokenizer.ggml.add_space_prefix": (_V.BOOL, None),
}

REQUIRED_MODEL_KEYS = (
    "llama.context_length",
    "llama.embedding_length",
    "llama.block_count",
    "llama.attention.head_count",
    "llama.attention.layer_norm_rms_epsilon",
)

# Weight types we can turn back into float32 (everything gguf.quants dequantizes).
_INT_TYPES = {
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFContents:
    """A GGUF file read into memory.

    ``metadata``: every key as a plain Python value (str, int, float, bool, list).
    ``tensors``: float tensors dequantized to float32 (integer tensors keep their dtype), in
    torch's (row-major, numpy) shape. ``tensor_types``: the stored GGML type name per tensor
    (``"F32"``, ``"Q8_0"``, ...).
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    tensor_types: dict[str, str] = field(default_factory=dict)
    tensor_nbytes: dict[str, int] = field(default_factory=dict)  # bytes stored in the file

    @property
    def is_vocab_only(self) -> bool:
        return not self.tensors


# ------------------------------------------------------------------------------------ writing


def _value_type(key: str, value: Any) -> tuple[GGUFValueType, GGUFValueType | None, Any]:
    """GGUF type of an ``extra_kv`` value: numpy scalars keep their width, Python ints are
    INT64 (UINT64 when too large), floats FLOAT64, lists take their first element's type."""
    np_map = {
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

    def scalar(v: Any) -> tuple[GGUFValueType, Any]:
        if isinstance(v, np.generic) and type(v) in np_map:
            return np_map[type(v)], v.item()
        if isinstance(v, bool):
            return _V.BOOL, v
        if isinstance(v, int):
            return (_V.UINT64 if v >= 1 << 63 else _V.INT64), v
        if isinstance(v, float):
            return _V.FLOAT64, v
        if isinstance(v, str):
            return _V.STRING, v
        raise TypeError(
            f"GGUF key {key!r}: cannot store a {type(v).__name__}; use str/int/float/bool, "
            "a numpy scalar or a list of those"
        )

    if isinstance(value, (list, tuple)):
        if not value:
            return _V.ARRAY, _V.INT32, []
        sub, _ = scalar(value[0])
        items = [scalar(v)[1] for v in value]
        return _V.ARRAY, sub, items
    vtype, v = scalar(value)
    return vtype, None, v


def _model_kv(cfg: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """The llama.* keys, the complete set llama.cpp's own model saver writes for llama."""
    return {
        "llama.context_length": cfg.max_seq_len,
        "llama.embedding_length": cfg.dim,
        "llama.block_count": cfg.n_layers,
        "llama.feed_forward_length": cfg.hidden_dim,
        "llama.attention.head_count": cfg.n_heads,
        "llama.attention.head_count_kv": cfg.kv_heads,
        "llama.attention.layer_norm_rms_epsilon": float(cfg.norm_eps),
        "llama.rope.freq_base": float(cfg.rope_theta),
        "llama.rope.dimension_count": cfg.head_dim,
        "llama.vocab_size": vocab_size,
        CONFIG_KEY: json.dumps(cfg.to_dict(), sort_keys=True),
    }


def _to_numpy(t: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t)
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16, torch.float64):
        t = t.float()
    return np.ascontiguousarray(t.numpy())


def _encode_tensor(
    name: str, arr: np.ndarray, qtype: GGMLQuantizationType
) -> tuple[np.ndarray, GGMLQuantizationType]:
    """Matrices take ``qtype``; 1-D tensors stay F32; rows not divisible by the block size
    fall back to F16 (with a warning) because llama.cpp cannot hold a partial block."""
    arr = arr.astype(np.float32, copy=False)
    if arr.ndim < 2 or qtype == GGMLQuantizationType.F32:
        return arr, GGMLQuantizationType.F32
    quantized = qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0)
    if quantized and arr.shape[-1] % QUANT_BLOCK:
        warnings.warn(
            f"{name}: row length {arr.shape[-1]} is not a multiple of {QUANT_BLOCK}, so it "
            f"cannot be {qtype.name}; writing it as F16 instead",
            stacklevel=3,
        )
        qtype = GGMLQuantizationType.F16
    if qtype == GGMLQuantizationType.F16:
        return arr.astype(np.float16), qtype
    return gguf_quants.quantize(arr, qtype), qtype


def write_gguf(
    path: str | os.PathLike[str],
    model_cfg: ModelConfig | None,
    tensors: Mapping[str, torch.Tensor],
    tokenizer: Tokenizer,
    *,
    file_type: str = "f32",
    name: str = "llamatrain",
    extra_kv: Mapping[str, Any] | None = None,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write a llama GGUF atomically and return its path.

    ``model_cfg=None`` with no tensors writes a vocab-only file. ``tensors`` must be exactly
    the model's (``Llama.state_dict()`` names and shapes) — anything else would make llama.cpp
    refuse the file. ``extra_kv`` / ``extra_tensors`` carry a checkpoint's ``training.*`` and
    ``optimizer.*`` state (floats are written F32, integer tensors keep their type).
    """
    path = Path(path)
    if file_type not in FILE_TYPES:
        raise ConfigError(f"unknown GGUF type {file_type!r}; choose one of {', '.join(FILE_TYPES)}")
    qtype, ftype = FILE_TYPES[file_type]
    extra_kv = dict(extra_kv or {})
    extra_tensors = dict(extra_tensors or {})

    kv: dict[str, Any] = {"general.name": name}
    if model_cfg is not None:
        if model_cfg.vocab_size != tokenizer.vocab_size:
            raise GGUFError(
                f"the model has vocab_size {model_cfg.vocab_size} but the tokenizer has "
                f"{tokenizer.vocab_size} tokens; build the model with "
                f"vocab_size={tokenizer.vocab_size}"
            )
        kv["general.file_type"] = ftype
        kv.update(_model_kv(model_cfg, tokenizer.vocab_size))
        expected = tensor_shapes(model_cfg)
        missing = [k for k in expected if k not in tensors]
        unexpected = [k for k in tensors if k not in expected]
        if missing or unexpected:
            raise GGUFError(
                f"refusing to write {path}: the tensors do not match the model config "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]}); llama.cpp would reject "
                "the file — pass model.state_dict() of a Llama built from this config"
            )
        for k, shape in expected.items():
            if tuple(tensors[k].shape) != shape:
                raise GGUFError(
                    f"refusing to write {path}: tensor {k} has shape {tuple(tensors[k].shape)}, "
                    f"the config needs {shape}"
                )
    elif tensors:
        raise GGUFError("tensors were given without a model config; pass model.cfg")
    kv.update(tokenizer.gguf_fields())
    for k in extra_kv:
        if k in kv or k == "general.architecture":
            raise GGUFError(f"extra_kv key {k!r} collides with a key llamatrain writes itself")
    for k in extra_tensors:
        if k in tensors:
            raise GGUFError(f"extra tensor {k!r} collides with a model tensor")

    # Encode everything before touching the file system: a failure here leaves no trace.
    encoded: list[tuple[str, np.ndarray, GGMLQuantizationType | None]] = []
    for k, t in tensors.items():
        arr, tt = _encode_tensor(k, _to_numpy(t), qtype)
        encoded.append((k, arr, tt))
    for k, t in extra_tensors.items():
        arr = _to_numpy(t)
        if arr.dtype.kind == "f":
            arr = arr.astype(np.float32, copy=False)
        elif arr.dtype == np.bool_ or arr.dtype == np.uint8:
            arr = arr.astype(np.int8)
        encoded.append((k, arr, None))

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    writer = GGUFWriter(tmp, ARCH)
    try:
        for k, v in kv.items():
            vtype, sub = _KEY_TYPES[k]
            writer.add_key_value(k, v, vtype, sub_type=sub)
        for k, v in extra_kv.items():
            vtype, sub, value = _value_type(k, v)
            writer.add_key_value(k, value, vtype, sub_type=sub)
        for k, arr, tt in encoded:
            if tt is None or tt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                writer.add_tensor(k, arr)
            else:
                writer.add_tensor(k, arr, raw_dtype=tt)
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.flush()
        for fout in writer.fout or []:
            os.fsync(fout.fileno())
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_vocab_gguf(path: str | os.PathLike[str], tokenizer: Tokenizer) -> Path:
    """A vocab-only GGUF (tokenizer keys, no tensors), like llama.cpp's models/ggml-vocab-*."""
    return write_gguf(path, None, {}, tokenizer, name="llamatrain-vocab")


def export_gguf(
    model: Llama, tokenizer: Tokenizer, path: str | os.PathLike[str], type: str = "f32"
) -> Path:
    """Export a model for llama.cpp (``type``: f32, f16, bf16, q8_0 or q4_0)."""
    tensors = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    return write_gguf(path, model.cfg, tensors, tokenizer, file_type=type)


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

    Why not ``gguf.GGUFReader``: it builds numpy views per array element, which takes ~3 s for
    a 32k-token vocabulary on every checkpoint or tokenizer load; this reads the same header
    with ``struct`` in milliseconds and checks every length against the file size, so a
    truncated or corrupt file is reported as such instead of surfacing as an odd exception.
    """

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

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
            sub = self.scalar("<I", 4)
            count = self.scalar("<Q", 8)
            if sub in _SCALARS:
                fmt, size = _SCALARS[sub]
                raw = self.take(count * size)
                return np.frombuffer(raw, dtype=np.dtype(fmt)).tolist()
            if count > len(self.buf) - self.pos:
                raise _Corrupt(f"an array claims {count} elements, more than the file holds")
            return [self.value(sub) for _ in range(count)]
        raise _Corrupt(f"unknown metadata value type {vtype}")


def _parse(p: Path) -> tuple[dict[str, Any], dict[str, int], list[_TensorInfo]]:
    """(metadata, metadata value types, tensor infos) of a GGUF; raises GGUFError."""
    if not p.is_file():
        raise GGUFError(f"GGUF file {str(p)!r} does not exist; check the path")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        raise GGUFError(
            f"{p} is not a GGUF file (it starts with {head!r}, a GGUF starts with b'GGUF'); "
            "pass a .gguf written by llamatrain or llama.cpp"
        )
    buf = np.memmap(p, mode="r", dtype=np.uint8)
    r = _Parser(memoryview(buf))
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
        meta: dict[str, Any] = {}
        vtypes: dict[str, int] = {}
        for _ in range(n_kv):
            key = r.string()
            vtype = r.scalar("<I", 4)
            meta[key] = r.value(vtype)
            vtypes[key] = vtype
            if vtype == int(_V.FLOAT32):
                # float32 -> the shortest decimal that round-trips, so 1e-5 reads back as 1e-5
                meta[key] = float(str(np.float32(meta[key])))
        raw_infos = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.scalar("<I", 4)
            if n_dims > 8:
                raise _Corrupt(f"tensor {name} claims {n_dims} dimensions")
            dims = [r.scalar("<Q", 8) for _ in range(n_dims)]
            raw_type = r.scalar("<I", 4)
            offset = r.scalar("<Q", 8)
            raw_infos.append((name, dims, raw_type, offset))
        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise _Corrupt(f"general.alignment {align!r} is not a power of two")
        data_start = (r.pos + align - 1) // align * align
    except _Corrupt as e:
        raise GGUFError(f"{p} is truncated or corrupt ({e}); re-export or re-download it") from e
    finally:
        del r
    infos: list[_TensorInfo] = []
    seen: set[str] = set()
    for name, dims, raw_type, offset in raw_infos:
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError as e:
            raise GGUFError(
                f"{p}: tensor {name} has unknown type id {raw_type}; the file is corrupt or "
                "from a newer llama.cpp — re-export it as f32, f16, q8_0 or q4_0"
            ) from e
        if name in seen:
            raise GGUFError(f"{p} is corrupt: tensor {name} appears twice")
        seen.add(name)
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_el = int(np.prod(dims)) if dims else 1
        if dims and dims[0] % block:
            raise GGUFError(f"{p} is corrupt: tensor {name} rows are not whole {qtype.name} blocks")
        n_bytes = n_el // block * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise GGUFError(
                f"{p} is truncated: tensor {name} ends at byte {start + n_bytes} but the file "
                f"has {size}; re-export or re-download it"
            )
        infos.append(_TensorInfo(name, tuple(reversed(dims)), qtype, start, n_bytes))
    return meta, vtypes, infos


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Only the key/value metadata (cheap: tensors are not read)."""
    return _parse(Path(path))[0]


def _tensor_array(p: Path, buf: np.ndarray, info: _TensorInfo) -> np.ndarray:
    raw = buf[info.offset : info.offset + info.n_bytes]
    qtype = info.qtype
    if qtype in _INT_TYPES:
        return np.array(raw.view(_INT_TYPES[qtype]).reshape(info.np_shape))
    if qtype == GGMLQuantizationType.F32:
        return np.array(raw.view(np.float32).reshape(info.np_shape))
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(info.np_shape).astype(np.float32)
    if qtype == GGMLQuantizationType.F64:
        return raw.view(np.float64).reshape(info.np_shape).astype(np.float32)
    block, type_size = GGML_QUANT_SIZES[qtype]
    byte_shape = (*info.np_shape[:-1], info.np_shape[-1] // block * type_size)
    try:
        out = gguf_quants.dequantize(raw.reshape(byte_shape), qtype)
    except NotImplementedError as e:
        raise GGUFError(
            f"{p}: tensor {info.name} has type {qtype.name}, which llamatrain cannot read; "
            "re-quantize the model to f32, f16, bf16, q8_0 or q4_0"
        ) from e
    return np.array(out, dtype=np.float32).reshape(info.np_shape)


def read_gguf(path: str | os.PathLike[str]) -> GGUFContents:
    """Everything in a GGUF: metadata as Python values, tensors dequantized to float32."""
    p = Path(path)
    meta, _vtypes, infos = _parse(p)
    contents = GGUFContents(p, meta)
    if not infos:
        return contents
    buf = np.memmap(p, mode="r", dtype=np.uint8)
    for info in infos:
        contents.tensor_types[info.name] = info.qtype.name
        contents.tensor_nbytes[info.name] = info.n_bytes
        contents.tensors[info.name] = torch.from_numpy(_tensor_array(p, buf, info))
    return contents


def stored_nbytes(contents: GGUFContents, name: str) -> int:
    """How many bytes tensor ``name`` occupies in the file (its quantized size)."""
    return contents.tensor_nbytes[name]


def _config_from_metadata(contents: GGUFContents) -> ModelConfig:
    meta, p, tensors = contents.metadata, contents.path, contents.tensors
    missing = [k for k in REQUIRED_MODEL_KEYS if k not in meta]
    if missing:
        raise GGUFError(
            f"{p} lacks the required key(s) {', '.join(missing)}; it is not a complete llama "
            "model — re-export it with llamatrain or llama.cpp's converter"
        )
    if int(meta.get("llama.expert_count", 0) or 0) > 0:
        raise GGUFError(f"{p} is a mixture-of-experts llama; llamatrain supports dense models only")
    # llama.cpp's own saver writes type "linear" with factor 0 (= no scaling); only a real
    # factor changes the model.
    scaling = meta.get("llama.rope.scaling.type", "none")
    factor = float(meta.get("llama.rope.scaling.factor", 0.0) or 0.0)
    linear = float(meta.get("llama.rope.scale_linear", 1.0) or 1.0)
    if not (scaling == "none" or (scaling == "linear" and factor in (0.0, 1.0))) or linear != 1.0:
        raise GGUFError(
            f"{p} uses rope scaling ({scaling!r}, factor {factor or linear}); llamatrain "
            "supports plain rope only"
        )
    dim = int(meta["llama.embedding_length"])
    n_heads = int(meta["llama.attention.head_count"])
    if n_heads < 1 or dim % n_heads:
        raise GGUFError(f"{p}: embedding_length {dim} is not divisible by head_count {n_heads}")
    head_dim = dim // n_heads
    for key in (
        "llama.rope.dimension_count",
        "llama.attention.key_length",
        "llama.attention.value_length",
    ):
        if key in meta and int(meta[key]) != head_dim:
            raise GGUFError(
                f"{p}: {key} = {meta[key]} differs from embedding_length/head_count = "
                f"{head_dim}; llamatrain supports full-width rope and equal head sizes only"
            )
    if "llama.feed_forward_length" in meta:
        ffn = int(meta["llama.feed_forward_length"])
    elif "blk.0.ffn_gate.weight" in tensors:
        ffn = int(tensors["blk.0.ffn_gate.weight"].shape[0])
    else:
        raise GGUFError(f"{p} lacks llama.feed_forward_length and blk.0.ffn_gate.weight")
    vocab = len(meta["tokenizer.ggml.tokens"])
    derived = dict(
        vocab_size=vocab,
        dim=dim,
        n_layers=int(meta["llama.block_count"]),
        n_heads=n_heads,
        n_kv_heads=int(meta.get("llama.attention.head_count_kv", n_heads)),
        ffn_dim=ffn,
        max_seq_len=int(meta["llama.context_length"]),
        norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        tie_embeddings="output.weight" not in tensors,
    )
    try:
        if CONFIG_KEY in meta:
            cfg = ModelConfig(**json.loads(meta[CONFIG_KEY]))
            ours = dict(
                vocab_size=cfg.vocab_size,
                dim=cfg.dim,
                n_layers=cfg.n_layers,
                n_heads=cfg.n_heads,
                n_kv_heads=cfg.kv_heads,
                ffn_dim=cfg.hidden_dim,
                max_seq_len=cfg.max_seq_len,
                tie_embeddings=cfg.tie_embeddings,
            )
            bad = [k for k, v in ours.items() if derived[k] != v]
            if bad:
                raise GGUFError(
                    f"{p}: {CONFIG_KEY} disagrees with the llama.* keys/tensors on {bad}; the "
                    "file was edited inconsistently — re-export it"
                )
            return cfg
        return ModelConfig(**derived)
    except (ConfigError, TypeError, ValueError) as e:
        raise GGUFError(f"{p} describes an invalid llama model: {e}") from e


def model_from_contents(contents: GGUFContents, ops: str = "ggml") -> tuple[Llama, Tokenizer]:
    """Build ``(Llama, Tokenizer)`` from a read GGUF (a model file or a checkpoint).

    Tensors under ``optimizer.`` / ``training.`` are checkpoint state and are ignored here;
    any other tensor the model does not have, or a missing one, is an error: loading a
    model that silently lacks a weight is worse than refusing it.
    """
    meta, p = contents.metadata, contents.path
    if "general.architecture" not in meta:
        raise GGUFError(f"{p} lacks the required key general.architecture; it is not a model")
    arch = meta["general.architecture"]
    if arch != ARCH:
        raise GGUFError(
            f"{p} is a {arch!r} model; llamatrain supports the 'llama' architecture only"
        )
    tokenizer = Tokenizer.from_gguf_fields(meta, source=str(p))
    model_tensors = {
        k: v for k, v in contents.tensors.items() if not k.startswith(CHECKPOINT_TENSOR_PREFIXES)
    }
    if not model_tensors:
        raise GGUFError(
            f"{p} is a vocab-only GGUF (tokenizer keys, no weights); pass a model file, or use "
            "it as a tokenizer (Tokenizer.from_gguf / tokenizer.path)"
        )
    cfg = _config_from_metadata(contents)
    expected = tensor_shapes(cfg)
    missing = sorted(k for k in expected if k not in model_tensors)
    unexpected = sorted(k for k in model_tensors if k not in expected)
    if missing or unexpected:
        raise GGUFError(
            f"{p} does not hold the tensors of the llama its keys describe "
            f"(missing: {missing[:6]}{' …' if len(missing) > 6 else ''}; unexpected: "
            f"{unexpected[:6]}{' …' if len(unexpected) > 6 else ''}); re-export the model"
        )
    for k, shape in expected.items():
        t = model_tensors[k]
        if contents.tensor_types.get(k) in {q.name for q in _INT_TYPES}:
            raise GGUFError(
                f"{p}: tensor {k} has type {contents.tensor_types[k]}; model weights must be "
                "F32, F16, BF16 or a quantized float type — re-export the model"
            )
        if tuple(t.shape) != shape:
            raise GGUFError(
                f"{p}: tensor {k} has shape {tuple(t.shape)} but the keys describe {shape}; "
                "the file is inconsistent — re-export it"
            )
    model = Llama(cfg, ops=ops)
    model.load_state_dict(model_tensors, strict=True)
    return model, tokenizer


def load_gguf(path: str | os.PathLike[str], ops: str = "ggml") -> tuple[Llama, Tokenizer]:
    """Load a llama GGUF (ours or llama.cpp's, any type gguf can dequantize) for PyTorch."""
    return model_from_contents(read_gguf(path), ops=ops)
