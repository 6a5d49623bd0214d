"""GGUF files as keys and tensors, edited at that level and written back byte for byte.

The container fuzz (``test_fuzz_gguf``) damages bytes; the readers above it (a model's keys
and tensor set, an adapter, a checkpoint's state) are reached only by files whose container
is sound and whose *contents* lie. A :class:`Layout` is a valid file read back as its typed
keys and raw tensors; :func:`edit` applies one key- or tensor-level change (delete, retype, set
a telling value, resize an array, drop / rename / duplicate / reshape / relabel a tensor) and
:func:`write` writes the result with its own small GGUF writer, which (unlike gguf's
``GGUFWriter``) lets a file hold duplicate names and shapes or types that do not fit the
bytes. :func:`resign` recomputes a checkpoint's checksums, so an edit reaches the checks
behind them (anyone can recompute a sha256: it detects damage, it does not authenticate).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFValueType
from hypothesis import strategies as st

from llamatrain.gguf.file import STATE_SHA256_KEY, TENSOR_SHA256_KEY, read_gguf, state_sha256

_V, _T = GGUFValueType, GGMLQuantizationType
_PACK = {
    _V.UINT8: "<B", _V.INT8: "<b", _V.UINT16: "<H", _V.INT16: "<h", _V.UINT32: "<I",
    _V.INT32: "<i", _V.FLOAT32: "<f", _V.BOOL: "<?", _V.UINT64: "<Q", _V.INT64: "<q",
    _V.FLOAT64: "<d",
}  # fmt: skip
_INT_BITS = {
    _V.UINT8: (8, False), _V.INT8: (8, True), _V.UINT16: (16, False), _V.INT16: (16, True),
    _V.UINT32: (32, False), _V.INT32: (32, True), _V.UINT64: (64, False), _V.INT64: (64, True),
}  # fmt: skip
ALIGN = 32


@dataclass(repr=False)
class Key:
    type: GGUFValueType
    value: Any
    item_type: GGUFValueType | None = None

    def __repr__(self) -> str:
        return f"Key({self.type.name}, {str(self.value)[:40]!r})"


@dataclass(repr=False)
class Tensor:
    name: str
    dims: list[int]  # ggml order (innermost first), as the file stores them
    qtype: int
    data: bytes

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.dims}, type {self.qtype}, {len(self.data)} bytes)"


@dataclass(repr=False)
class Layout:
    keys: dict[str, Key] = field(default_factory=dict)
    tensors: list[Tensor] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"Layout({len(self.keys)} keys, {len(self.tensors)} tensors)"

    def copy(self) -> Layout:
        return Layout(
            {k: Key(v.type, _copied(v.value), v.item_type) for k, v in self.keys.items()},
            [Tensor(t.name, list(t.dims), t.qtype, t.data) for t in self.tensors],
        )


def _copied(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


class Bases(dict):
    """Layouts by name, shown short (hypothesis prints a failing case's arguments)."""

    def __repr__(self) -> str:
        return f"<{len(self)} base files: {', '.join(self)}>"


def read_layout(path: Path) -> Layout:
    """A valid file's keys (typed as stored, ``general.architecture`` first) and raw tensors."""
    contents = read_gguf(path, tensor_data=False)
    keys = {}
    for name, value in contents.metadata.items():
        value_type, item_type = contents.value_types[name]
        keys[name] = Key(value_type, _copied(value), item_type)
    data = path.read_bytes()
    tensors = [
        Tensor(
            i.name, list(reversed(i.np_shape)), int(i.qtype), data[i.offset : i.offset + i.n_bytes]
        )
        for i in contents.infos.values()
    ]
    return Layout(keys, tensors)


# ----------------------------------------------------------------------------- writing


def _string(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _fitted(value: Any, value_type: GGUFValueType) -> Any:
    """``value`` as a ``value_type`` can hold it (a retyped key keeps what it can)."""
    if value_type == _V.STRING:
        return value if isinstance(value, str) else json.dumps(value, default=str)
    if value_type == _V.BOOL:
        return bool(value)
    if isinstance(value, (str, list)):
        value = len(value)
    if value_type in (_V.FLOAT32, _V.FLOAT64):
        number = float(value) if value != value or abs(value) < 1e300 else math.inf
        if value_type == _V.FLOAT32 and math.isfinite(number) and abs(number) > 3.4e38:
            number = math.copysign(math.inf, number)
        return number
    bits, signed = _INT_BITS[value_type]
    number = (int(value) if math.isfinite(value) else 0) % (1 << bits)
    return number - (1 << bits) if signed and number >= 1 << (bits - 1) else number


def _value(value: Any, value_type: GGUFValueType, item_type: GGUFValueType | None) -> bytes:
    if value_type == _V.STRING:
        return _string(_fitted(value, _V.STRING))
    if value_type == _V.ARRAY:
        items = value if isinstance(value, list) else [value]
        item_type = item_type if item_type is not None else _V.INT32
        return struct.pack("<IQ", int(item_type), len(items)) + b"".join(
            _value(item, item_type, _V.INT32) for item in items
        )
    return struct.pack(_PACK[value_type], _fitted(value, value_type))


def to_bytes(layout: Layout) -> bytes:
    """The GGUF v3 file of ``layout``, tensors laid out in order, each aligned."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(layout.tensors), len(layout.keys))
    for name, key in layout.keys.items():
        head += _string(name) + struct.pack("<I", int(key.type))
        head += _value(key.value, key.type, key.item_type)
    offset, infos, blobs = 0, b"", []
    for t in layout.tensors:
        infos += _string(t.name) + struct.pack("<I", len(t.dims))
        infos += b"".join(struct.pack("<Q", d % (1 << 64)) for d in t.dims)
        infos += struct.pack("<IQ", t.qtype % (1 << 32), offset)
        padded = t.data + b"\0" * (-len(t.data) % ALIGN)
        blobs.append(padded)
        offset += len(padded)
    head += infos
    return head + b"\0" * (-len(head) % ALIGN) + b"".join(blobs)


def write(layout: Layout, path: Path) -> Path:
    path.write_bytes(to_bytes(layout))
    return path


def resign(layout: Layout) -> Layout:
    """Recompute the tensor and state checksums a checkpoint records (when it records them)."""
    if TENSOR_SHA256_KEY in layout.keys:
        digests = {t.name: hashlib.sha256(t.data).hexdigest() for t in layout.tensors}
        layout.keys[TENSOR_SHA256_KEY] = Key(_V.STRING, json.dumps(digests))
    if STATE_SHA256_KEY in layout.keys:
        plain = {name: key.value for name, key in layout.keys.items()}
        layout.keys[STATE_SHA256_KEY] = Key(_V.STRING, state_sha256(plain))
    return layout


# ------------------------------------------------------------------------------- edits

TELLING_INTS = [
    0, 1, 2, 3, 5, 7, 16, 31, 32, 33, 64, 255, 257, 258, 4096, (1 << 31) - 1, 1 << 31,
    (1 << 32) - 1, 1 << 32, (1 << 63) - 1, -1, -2, -(1 << 31),
]  # fmt: skip
TELLING_FLOATS = [0.0, -1.0, 0.5, 1e-30, 1e30, 3.5e38, math.nan, math.inf, -math.inf, 1e6]
TELLING_STRINGS = [
    "", "llama", "qwen2", "gemma3", "gpt2", "llama-bpe", "linear", "yarn", "none", "adapter",
    "lora", "adam", "lbfgs", "{}", "[]", "null", '{"dim": 0}', "not json", "\ud800", "a b",
    "h e", "\u0120 t", "<s>", "x" * 300, '{"value": 1}', '{"dict": []}',
]  # fmt: skip
SCALAR_TYPES = [_V.UINT32, _V.INT32, _V.UINT64, _V.INT64, _V.FLOAT32, _V.FLOAT64, _V.BOOL,
                _V.STRING, _V.UINT8, _V.INT8, _V.UINT16, _V.INT16]  # fmt: skip
QTYPES = [
    int(_T.F32), int(_T.F16), int(_T.BF16), int(_T.Q8_0), int(_T.Q4_0), int(_T.Q4_K),
    int(_T.Q6_K), int(_T.I8), int(_T.I16), int(_T.I32), int(_T.I64), int(_T.F64), 99, 1 << 31,
]  # fmt: skip
TENSOR_NAMES = [
    "token_embd.weight", "output.weight", "output_norm.weight", "rope_freqs.weight",
    "blk.0.attn_q.weight", "blk.0.attn_q.bias", "blk.0.attn_output.bias", "blk.0.ffn_gate.bias",
    "blk.0.attn_q_norm.weight", "blk.9.attn_q.weight", "blk.-1.attn_q.weight", "blk.0.x",
    "blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b", "blk.0.attn_q.lora_a",
    "optimizer.adam.first_moments", "training.seen_tokens", "training.rng.0", "", "\ud800",
]  # fmt: skip
OPTIONAL_KEYS = [
    "{a}.rope.scaling.type", "{a}.rope.scaling.factor", "{a}.rope.scale_linear",
    "{a}.rope.freq_base", "{a}.rope.dimension_count", "{a}.attention.key_length",
    "{a}.attention.value_length", "{a}.attention.sliding_window",
    "{a}.attention.sliding_window_pattern", "{a}.expert_count", "{a}.final_logit_softcapping",
    "{a}.rope.freq_base_swa", "{a}.attention.head_count_kv", "{a}.feed_forward_length",
    "{a}.vocab_size", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.eot_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.pre",
    "tokenizer.ggml.model", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type", "tokenizer.chat_template", "general.alignment",
    "general.type", "adapter.type", "adapter.lora.alpha", "training.lora.base",
    "training.lora.base_sha256", "training.file_version", "optimizer.type",
]  # fmt: skip

KEYS_READ = OPTIONAL_KEYS + [
    "{a}.context_length", "{a}.embedding_length", "{a}.block_count",
    "{a}.attention.head_count", "{a}.attention.layer_norm_rms_epsilon", "general.architecture",
    "general.name", "tokenizer.ggml.tokens", "llamatrain.model_config",
    "training.iteration_count", "training.data_state", "training.rng.layout",
    "optimizer.adam.iteration_count", "training.seen_tokens", "training.config",
]  # fmt: skip
"""Keys a reader reads: an edit names one of them (formatted with the architecture) or
picks any key of the file by its position."""
scalar_values = st.one_of(
    st.sampled_from(TELLING_INTS),
    st.sampled_from(TELLING_FLOATS),
    st.sampled_from(TELLING_STRINGS),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.text(max_size=6),
)
array_values = st.lists(scalar_values, max_size=4)
edits = st.tuples(
    st.sampled_from(
        [
            "delete",
            "retype",
            "set",
            "set",
            "resize",
            "json_field",
            "t_drop",
            "t_rename",
            "t_duplicate",
            "t_dims",
            "t_retype",
            "t_cut",
        ]
    ),  # fmt: skip
    st.integers(0, 1 << 20) | st.sampled_from(KEYS_READ + TENSOR_NAMES),  # which key or tensor
    st.sampled_from(SCALAR_TYPES + [_V.ARRAY]),
    st.one_of(scalar_values, array_values),
    st.integers(0, 1 << 20),  # a second choice: array length, dim index, name...
)
"""One key- or tensor-level edit: (kind, which, type, value, second choice)."""


def edit(layout: Layout, change: tuple) -> Layout:
    """``layout`` with ``change`` (an :data:`edits` draw) applied, in place."""
    kind, which, value_type, value, second = change
    if kind.startswith("t_"):
        _edit_tensor(layout, kind, which, value_type, value, second)
        return layout
    arch = str(layout.keys.get("general.architecture", Key(_V.STRING, "llama")).value)
    names = list(layout.keys)
    if isinstance(which, str):
        name = which.format(a=arch)
    else:
        name = names[which % len(names)] if names else "general.architecture"
    if kind in ("retype", "resize") and name not in layout.keys:
        return layout
    if kind == "delete":
        layout.keys.pop(name, None)
    elif kind == "retype":
        key = layout.keys[name]
        if value_type == _V.ARRAY:
            key.value, key.item_type = [key.value], key.type if key.type != _V.ARRAY else _V.INT32
        elif key.type == _V.ARRAY and key.item_type == value_type:
            key.item_type = SCALAR_TYPES[second % len(SCALAR_TYPES)]
        elif key.type == _V.ARRAY:
            key.item_type = value_type
        key.type = value_type if value_type != _V.ARRAY else _V.ARRAY
    elif kind == "set":
        if second % 3 == 0:  # a key llama.cpp knows, present or not
            name = OPTIONAL_KEYS[second // 3 % len(OPTIONAL_KEYS)].format(a=arch)
        item = SCALAR_TYPES[second % len(SCALAR_TYPES)] if value_type == _V.ARRAY else None
        layout.keys[name] = Key(value_type, value, item)
    elif kind == "resize":
        _resize(layout, name, value, second)
    elif kind == "json_field":
        _edit_json(layout, name if isinstance(which, str) else None, value, second)
    return layout


def _resize(layout: Layout, name: str, value: Any, second: int) -> None:
    """An array (vocab tokens, scores, types, merges...) cut short, grown or one item changed."""
    arrays = [n for n, k in layout.keys.items() if k.type == _V.ARRAY] or [name]
    key = layout.keys.get(arrays[second % len(arrays)])
    if key is None or not isinstance(key.value, list):
        return
    items, how = key.value, second % 4
    if how == 0:
        del items[len(items) * (second % 97) // 97 :]
    elif how == 1:
        items.extend(items[: 1 + second % 5])
    elif how == 2 and items:
        items[second % len(items)] = value
    else:
        items.insert(second % (len(items) + 1), value)


def _edit_json(layout: Layout, name: str | None, value: Any, second: int) -> None:
    """A field of a JSON-string key (``name``, else one of them: our model config, a
    checkpoint's state layouts) set."""
    texts = [n for n, k in layout.keys.items() if k.type == _V.STRING and str(k.value)[:1] in "{["]
    if name not in texts:
        name = texts[second % len(texts)] if texts else None
    if name is None:
        return
    key = layout.keys[name]
    try:
        doc = json.loads(key.value)
    except ValueError:
        return
    if isinstance(doc, dict) and doc:
        fields = sorted(doc)
        doc[fields[second // 7 % len(fields)]] = value
    elif isinstance(doc, list) and doc:
        doc[second % len(doc)] = value
    key.value = json.dumps(doc)


def _edit_tensor(
    layout: Layout, kind: str, which: int, value_type: Any, value: Any, second: int
) -> None:
    if not layout.tensors:
        return
    if isinstance(which, str):
        named = [i for i, t in enumerate(layout.tensors) if t.name == which]
        which = named[0] if named else len(which)
    i = which % len(layout.tensors)
    t = layout.tensors[i]
    if kind == "t_drop":
        del layout.tensors[i]
    elif kind == "t_rename":
        others = [u.name for u in layout.tensors] + TENSOR_NAMES
        t.name = others[second % len(others)]
    elif kind == "t_duplicate":
        layout.tensors.insert(
            second % (len(layout.tensors) + 1), Tensor(t.name, list(t.dims), t.qtype, t.data)
        )
    elif kind == "t_dims":
        _edit_dims(t, second, value)
    elif kind == "t_retype":
        t.qtype = QTYPES[second % len(QTYPES)]
    elif kind == "t_cut":  # rows cut off, the dims saying so: a tensor smaller than it should be
        rows = t.dims[-1] if t.dims and t.dims[-1] else 1
        kept = rows * (second % 8) // 8
        t.data = t.data[: len(t.data) // rows * kept]
        if t.dims:
            t.dims[-1] = kept


def _edit_dims(t: Tensor, second: int, value: Any) -> None:
    how = second % 5
    if how == 0 and len(t.dims) > 1:
        t.dims[0], t.dims[1] = t.dims[1], t.dims[0]
    elif how == 1 and t.dims:
        t.dims[second // 5 % len(t.dims)] = TELLING_INTS[second // 7 % len(TELLING_INTS)] % (
            1 << 64
        )
    elif how == 2 and t.dims:
        t.dims.pop()
    elif how == 3:
        t.dims.append(1 + second // 5 % 2)
    else:  # the same element count, another shape (a transposed or flattened matrix)
        n = math.prod(t.dims)
        t.dims = (
            [n]
            if len(t.dims) > 1
            else [t.dims[0] // 2, 2]
            if t.dims and t.dims[0] % 2 == 0
            else t.dims
        )
