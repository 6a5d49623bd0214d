"""Nested state (an optimizer's ``state_dict``, RNG states) as JSON plus named tensors.

Why not ``torch.save``: a pickle runs code when it is read, and a checkpoint is a file people
share. Here the structure travels as JSON that only describes values (dicts, lists, tuples,
numbers, strings, None) and every tensor becomes a named tensor the GGUF file stores and
checksums like the weights. Reading builds nothing but those values, and anything that is not
exactly what :func:`encode_state` writes is refused.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from llamatrain.errors import shown

__all__ = ["StateFormatError", "decode_state", "encode_state"]

_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.int64, torch.int32, torch.uint8)}
"""What GGUF stores exactly (F32 and its signed integer types; uint8 travels as int8 bits)."""
_AS_STORED = {torch.uint8: torch.int8}
"""dtypes GGUF has no tensor type for, stored bit for bit as one it has."""


class StateFormatError(ValueError):
    """The described state is not what :func:`encode_state` writes (a damaged or forged file)."""


def encode_state(state: object, prefix: str) -> tuple[str, dict[str, torch.Tensor]]:
    """``state`` as (JSON text, tensors named ``{prefix}.{i}``), flattened to 1-D on the CPU.

    Raises TypeError for a value it cannot store exactly (a float64 tensor, an object).
    """
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: object) -> object:
        if isinstance(value, torch.Tensor):
            if str(value.dtype) not in _DTYPES:
                raise TypeError(f"cannot store a {value.dtype} tensor exactly in a checkpoint")
            name = f"{prefix}.{len(tensors)}"
            flat = value.detach().to("cpu").reshape(-1).contiguous()
            tensors[name] = flat.view(_AS_STORED.get(flat.dtype, flat.dtype))
            return {"tensor": name, "shape": list(value.shape), "dtype": str(value.dtype)}
        if isinstance(value, Mapping):
            return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
        if isinstance(value, list | tuple):
            return {type(value).__name__: [encode(v) for v in value]}
        if value is None or isinstance(value, bool | int | float | str):
            return {"value": value}
        raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint")

    return json.dumps(encode(state)), tensors


def decode_state(text: object, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The state :func:`encode_state` described; StateFormatError for anything else."""
    try:
        layout = json.loads(text) if isinstance(text, str) else None
    except (json.JSONDecodeError, RecursionError) as err:
        raise StateFormatError(f"its layout is not valid JSON ({err})") from None
    try:
        return _decode(layout, tensors)
    except RecursionError:
        raise StateFormatError("its layout nests too deeply") from None


def _decode(node: object, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(node, dict) and node.keys() == {"tensor", "shape", "dtype"}:
        return _tensor(node, tensors)
    if not isinstance(node, dict) or len(node) != 1:
        raise StateFormatError(f"unexpected layout entry {shown(repr(node))}")
    ((kind, body),) = node.items()
    if kind == "value" and (body is None or isinstance(body, bool | int | float | str)):
        return body
    if kind in ("list", "tuple") and isinstance(body, list):
        items = [_decode(v, tensors) for v in body]
        return items if kind == "list" else tuple(items)
    if kind == "dict" and isinstance(body, list) and all(_is_pair(p) for p in body):
        pairs = [(_decode(k, tensors), _decode(v, tensors)) for k, v in body]
        if not all(isinstance(k, str | int | float | bool | None) for k, _ in pairs):
            raise StateFormatError("a dict key is not a plain value")
        return dict(pairs)
    raise StateFormatError(f"unexpected layout entry {shown(repr(kind))}")


def _is_pair(item: object) -> bool:
    return isinstance(item, list) and len(item) == 2


def _tensor(node: dict, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The named tensor, checked against the dtype and shape its entry claims."""
    name, shape, dtype = node["tensor"], node["shape"], _DTYPES.get(node["dtype"])
    stored = tensors.get(name) if isinstance(name, str) else None
    if stored is None or dtype is None:
        raise StateFormatError(f"entry names tensor {shown(repr(name))}, which is not in the file")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise StateFormatError(
            f"tensor {shown(name)}'s shape {shown(str(shape))} is not a list of sizes"
        )
    if stored.dim() != 1 or stored.dtype != _AS_STORED.get(dtype, dtype):
        raise StateFormatError(f"tensor {shown(name)} is stored as {stored.dtype}, not as {dtype}")
    if stored.numel() != math.prod(shape):
        raise StateFormatError(
            f"tensor {shown(name)} holds {stored.numel()} values, not shape {shown(str(shape))}"
        )
    return stored.view(dtype).reshape(shape).clone()
