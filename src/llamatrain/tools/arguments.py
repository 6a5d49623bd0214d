"""Arguments a model wrote for a tool, checked against the tool's JSON schema before it runs.

The schema is the ``parameters`` object :func:`~llamatrain.tools.schema.json_schema` makes (or
one written by hand in the same vocabulary): ``type`` (a name or a list of names), ``nullable``,
``enum``, ``anyOf``, ``items``, ``prefixItems``, ``properties``, ``required`` and
``additionalProperties``; other keywords are not checked. A wrong argument is a failed call the
model is told about (as TRL returns a tool's error to the model), not an exception in the tool.

Two points are stricter than JSON Schema, as a Python function is: an ``integer`` is a number
written without a fraction or exponent (``3``, not ``3.0``: ``int`` hints expect an int), and
an object that lists its ``properties`` takes no other keys unless ``additionalProperties``
allows them (a function refuses keyword arguments it does not define).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llamatrain.errors import shown

__all__ = ["argument_problem", "json_type"]

_PYTHON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str,
    "boolean": bool,
    "object": dict,
    "array": list,
    "null": type(None),
    "integer": int,
    "number": (int, float),
}
"""What ``json.loads`` makes of a value of each JSON type (bool aside: see :func:`_is_type`)."""


def argument_problem(arguments: Mapping[str, Any], parameters: Mapping[str, Any]) -> str | None:
    """None when ``arguments`` (the parsed JSON object a call holds) fit the tool's
    ``parameters`` schema; else the first problem, in one line (what was written and what the
    schema wants), to hand back to the model."""
    return _problem(arguments, parameters, "the arguments")


def _problem(value: Any, schema: Any, where: str) -> str | None:
    """The first way ``value`` (named ``where`` in messages) breaks ``schema``, or None."""
    if not isinstance(schema, Mapping) or (value is None and schema.get("nullable") is True):
        return None
    if "anyOf" in schema and not any(_problem(value, s, where) is None for s in schema["anyOf"]):
        return f"{where} is {json_type(value)}, which none of the types allowed for it matches"
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, name) for name in names):
            return f"{where} must be {' or '.join(map(str, names))}, not {json_type(value)}"
    if "enum" in schema and not any(_same(value, choice) for choice in schema["enum"]):
        return f"{where} must be one of {_shown_json(schema['enum'])}, not {_shown_json(value)}"
    if isinstance(value, list):
        return _items_problem(value, schema, where)
    if isinstance(value, dict):
        return _object_problem(value, schema, where)
    return None


def _items_problem(value: list, schema: Mapping[str, Any], where: str) -> str | None:
    """The first item that breaks ``prefixItems`` (by position) or ``items`` (the rest)."""
    prefix = schema.get("prefixItems") or []
    for i, item in enumerate(value):
        item_schema = prefix[i] if i < len(prefix) else schema.get("items")
        problem = _problem(item, item_schema, f"{where}[{i}]")
        if problem is not None:
            return problem
    return None


def _object_problem(value: dict, schema: Mapping[str, Any], where: str) -> str | None:
    """A missing required key, a key the object does not take, or the first value that breaks
    its property's schema (``additionalProperties`` for keys not listed)."""
    properties = schema.get("properties")
    for key in schema.get("required") or []:
        if key not in value:
            return f"{_member(where, key)} is missing (it is required)"
    extra = schema.get("additionalProperties")
    for key, item in value.items():
        if isinstance(properties, Mapping) and key in properties:
            problem = _problem(item, properties[key], _member(where, key))
        elif extra is False or (extra is None and isinstance(properties, Mapping)):
            takes = ", ".join(map(repr, properties or {})) or "none"
            return f"{_member(where, key)} is not one the tool takes (it takes {takes})"
        else:
            problem = _problem(item, extra, _member(where, key))
        if problem is not None:
            return problem
    return None


def _member(where: str, key: str) -> str:
    """How messages name the value at ``key``: ``argument 'x'`` at the top, else a path."""
    if where == "the arguments":
        return f"argument {shown(key, 40)!r}"
    return f"{where}[{shown(key, 40)!r}]"


def _is_type(value: Any, name: str) -> bool:
    """Whether a parsed JSON value is of the JSON type ``name`` (true/false are booleans
    only, though Python's bool is an int); a type name the checker does not know passes."""
    if name not in _PYTHON_TYPES:
        return True
    if isinstance(value, bool):
        return name == "boolean"
    return isinstance(value, _PYTHON_TYPES[name])


def json_type(value: Any) -> str:
    """The JSON type of a parsed JSON value, as messages to the model name it."""
    for name in ("boolean", "integer", "number", "string", "null", "array", "object"):
        if _is_type(value, name):
            return name
    return type(value).__name__


def _same(value: Any, choice: Any) -> bool:
    """JSON equality: ``true`` is not ``1``, though Python's ``True == 1``."""
    return value == choice and isinstance(value, bool) == isinstance(choice, bool)


def _shown_json(value: Any) -> str:
    return shown(json.dumps(value, ensure_ascii=False), 80)
