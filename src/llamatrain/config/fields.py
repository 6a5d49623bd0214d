"""Typing a config value for its field: what the field's type hint accepts, and how to say so.

One generic checker covers every field of every section, driven by the dataclasses' type
hints, so no section writes its own parsing.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from llamatrain.errors import ConfigError, shown
from llamatrain.settings import is_config_key, show

__all__ = [
    "NOT_CONVERTIBLE",
    "check_type",
    "config_keys",
    "convert",
    "type_hints",
    "union_args",
]


def config_keys(section_cls: type) -> dict[str, dataclasses.Field]:
    """The fields of a section that are config keys (derived ones are filled by the run)."""
    return {f.name: f for f in dataclasses.fields(section_cls) if is_config_key(f)}


def type_hints(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def union_args(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _describe(hint: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    parts = []
    for arg in union_args(hint):
        if arg is type(None):
            continue
        if typing.get_origin(arg) is list:
            parts.append(f"a list of {_describe(typing.get_args(arg)[0]).split(' ', 1)[1]}s")
        elif typing.get_origin(arg) is dict:
            parts.append("a table of tables")
        else:
            parts.append(names[arg])
    text = " or ".join(parts)
    if type(None) in union_args(hint):
        text += " (or left out for the default)"
    return text


NOT_CONVERTIBLE = object()


def convert(value: Any, hint: Any) -> Any:
    """``value`` as the type ``hint`` asks for, or ``NOT_CONVERTIBLE``. Ints pass as floats;
    bools never pass as numbers (TOML ``true`` for a size is a mistake, not a 1)."""
    for arg in union_args(hint):
        if arg is type(None):
            if value is None:
                return None
        elif arg is bool:
            if isinstance(value, bool):
                return value
        elif arg is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif arg is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif arg is str:
            if isinstance(value, str):
                return value
        elif typing.get_origin(arg) is list:
            (item,) = typing.get_args(arg)
            if isinstance(value, list):
                items = [convert(v, item) for v in value]
                if all(v is not NOT_CONVERTIBLE for v in items):
                    return items
        elif typing.get_origin(arg) is dict:  # a table of tables, e.g. train.reward_args
            if isinstance(value, dict) and all(
                isinstance(k, str) and isinstance(v, dict) for k, v in value.items()
            ):
                return value  # what the tables hold is checked by the field's own rules
        else:  # pragma: no cover - a new hint kind needs a branch here
            raise TypeError(f"config field type {arg!r} is not supported")
    return NOT_CONVERTIBLE


def check_type(section: str, name: str, value: Any, hint: Any, where: str) -> Any:
    """``value`` converted for the field, or one ConfigError naming it: the wrong type, a NaN
    (never a setting: every comparison with it is false, so no range check could refuse it),
    or a string that is not text (a lone surrogate, from bytes that are not UTF-8 on a
    command line)."""
    converted = convert(value, hint)
    if converted is NOT_CONVERTIBLE:
        raise ConfigError(
            f"{section}.{name} in {where} must be {_describe(hint)}, got {_shown(value)}"
        )
    for item in converted if isinstance(converted, list) else [converted]:
        if isinstance(item, float) and math.isnan(item):
            raise ConfigError(f"{section}.{name} in {where} is nan; give a number")
        if isinstance(item, str) and not _is_text(item):
            raise ConfigError(
                f"{section}.{name} in {where} is not text (it holds {ascii(item)[:60]}, bytes "
                "that are not UTF-8); give it as UTF-8 text"
            )
    return converted


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(value: Any) -> str:
    """``show(value)``, cut to one short line (a value may be a 100 kB string)."""
    try:
        text = show(value)
    except ValueError:  # an int past Python's digit limit
        return f"an integer of {value.bit_length()} bits"
    return shown(text)
