"""How a configurable field is declared and how its value rules are checked.

Every section of a run's config (``ModelConfig`` for ``[model]``, the sections in
``llamatrain.config`` for the rest) is a dataclass whose fields carry their help line and
their value rules (``choices``, ``gt``, ``ge``, ``lt``, ``le``) in the field's metadata. One
declaration therefore feeds the validation, the error messages and the docs' config reference
table, and a class defined outside ``config`` (the model's) is checked by the same rules.
A field marked ``derived`` is filled in by the run (e.g. the vocabulary size comes from the
tokenizer) and is not a config key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

from llamatrain.errors import ConfigError


def setting(default: Any, help: str, **rules: Any) -> Any:
    """A dataclass field carrying its help line and value rules (see the module docstring)."""
    return dataclasses.field(default=default, metadata={"help": help, **rules})


def is_config_key(f: dataclasses.Field) -> bool:
    """Whether a field can be set in a config file (derived fields are filled by the run)."""
    return not f.metadata.get("derived", False)


def show(value: Any) -> str:
    """A value as the user wrote it (TOML spelling), for error messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value, default=str)
    return repr(value)


_BOUNDS: tuple[tuple[str, Callable[[Any, Any], bool], str], ...] = (
    ("gt", lambda v, b: v > b, ">"),
    ("ge", lambda v, b: v >= b, ">="),
    ("lt", lambda v, b: v < b, "<"),
    ("le", lambda v, b: v <= b, "<="),
)


def check_rules(section: Any, name: str, where: Callable[[str], str]) -> None:
    """Raise ConfigError for the first field of ``section`` that breaks its rules: its
    choices, its bounds, and for a real number being finite (no setting means infinity, and
    NaN passes no bound), whatever the source — a config, ``--set``, a GGUF's keys or an HF
    config all reach the same fields and so these same rules.

    ``name`` is the section's name in messages (``model`` gives ``model.dim``); ``where(key)``
    says where a key's value came from, with a leading space (" in configs/x.toml"), or "".
    """
    for f in dataclasses.fields(section):
        value, meta, key = getattr(section, f.name), f.metadata, f"{name}.{f.name}"
        if value is None or "help" not in meta:
            continue
        if "choices" in meta and value not in meta["choices"]:
            allowed = ", ".join(repr(c) for c in meta["choices"])
            raise ConfigError(f"{key}{where(key)} must be one of {allowed}, got {show(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(
                f"{key}{where(key)} must be a finite number, got {show(value)} ({meta['help']})"
            )
        for rule, ok, sign in _BOUNDS:
            if rule in meta and not ok(value, meta[rule]):
                raise ConfigError(
                    f"{key}{where(key)} must be {sign} {meta[rule]}, got {show(value)} "
                    f"({meta['help']})"
                )


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, for messages that suggest a valid value."""
    return [d for d in range(1, n + 1) if n % d == 0]
