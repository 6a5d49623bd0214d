"""Building a Config from a TOML file, a dict, ``--set`` items or keywords; writing it back.

Values are type-checked as they are set and remembered with where they came from (a file, a
``--set`` item), so that :func:`~llamatrain.config.validate.validate`, which judges the whole
config once at the end, can name the source of every value it refuses.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import tomllib
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w

from llamatrain.config.fields import (
    NOT_CONVERTIBLE,
    check_type,
    config_keys,
    convert,
    type_hints,
    union_args,
)
from llamatrain.config.sections import SECTIONS, Config
from llamatrain.config.validate import validate
from llamatrain.errors import ConfigError, shown
from llamatrain.settings import show

__all__ = [
    "BUILTIN_CONFIGS",
    "apply_overrides",
    "apply_values",
    "builtin_config_names",
    "config_from_dict",
    "config_to_dict",
    "config_to_toml",
    "load_config",
]


def unknown_key(section: str, name: str, where: str) -> ConfigError:
    name = shown(name)  # a file's key: shown escaped, never as lines of its own
    derived = {f.name: f for f in dataclasses.fields(SECTIONS[section])}.get(name)
    if derived is not None:
        return ConfigError(
            f"{section}.{name} in {where} is not a config key: it is the "
            f"{derived.metadata['help']}; remove it"
        )
    for other, cls in SECTIONS.items():
        if other != section and name in config_keys(cls):
            return ConfigError(
                f"unknown key {section}.{name} in {where}: {name} belongs in [{other}] "
                f"(use {other}.{name})"
            )
    valid = list(config_keys(SECTIONS[section]))
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f"did you mean {section}.{close[0]}? " if close else ""
    return ConfigError(
        f"unknown key {section}.{name} in {where}; {hint}valid keys in [{section}]: "
        + ", ".join(valid)
    )


def unknown_section(name: str, where: str) -> ConfigError:
    name = shown(name)
    close = difflib.get_close_matches(name, list(SECTIONS), n=1, cutoff=0.5)
    hint = f"did you mean [{close[0]}]? " if close else ""
    for sec, cls in SECTIONS.items():
        if name in config_keys(cls):
            hint = f"{name} is a key of [{sec}]: put it under [{sec}] (or use {sec}.{name}); "
    return ConfigError(
        f"unknown section [{name}] in {where}; {hint}sections are: "
        + ", ".join(f"[{s}]" for s in SECTIONS)
    )


def _set(cfg: Config, sec_name: str, name: str, value: Any, where: str, *, raw: bool) -> None:
    """Type-check one value and store it, remembering where it came from.

    ``raw``: ``value`` is the text of a ``--set`` item, parsed as the field's type wants.
    """
    if sec_name not in SECTIONS:
        raise unknown_section(sec_name, where)
    section = getattr(cfg, sec_name)
    if name not in config_keys(type(section)):
        raise unknown_key(sec_name, name, where)
    hint = type_hints(type(section))[name]
    if raw:
        value = _parse_override(value, hint)
    setattr(section, name, check_type(sec_name, name, value, hint, where))
    cfg.origins[f"{sec_name}.{name}"] = where
    cfg.validated = False


def config_from_dict(d: dict[str, Any], source: str = "the config") -> Config:
    """Build a Config from ``{section: {key: value}}``, type-checking every value.

    Value rules (ranges, choices, cross-field) are left to :func:`validate`, so that
    overrides can still fix a file before it is judged. ``None`` is accepted for keys whose
    default is unset, so :func:`config_to_dict` output round-trips.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"{source} must be a table of sections, got {show(d)}")
    cfg = Config()
    for sec_name, table in d.items():
        if sec_name in SECTIONS and not isinstance(table, dict):
            raise ConfigError(
                f"{sec_name} in {source} must be a section ([{sec_name}] with keys below it), "
                f"got {show(table)}"
            )
        if sec_name not in SECTIONS:
            raise unknown_section(sec_name, source)
        for name, value in table.items():
            _set(cfg, sec_name, name, value, source, raw=False)
    return cfg


def _split_key(key: str, where: str) -> tuple[str, str]:
    sec_name, dot, name = key.partition(".")
    if not dot:
        owners = [s for s, cls in SECTIONS.items() if key in config_keys(cls)]
        hint = f"did you mean {owners[0]}.{key}?" if owners else "keys look like optim.lr"
        raise ConfigError(f"{where}: the key needs its section; {hint}")
    return sec_name, name


def _parse_override(raw: str, hint: Any) -> Any:
    """A ``--set`` value: a TOML value when it parses as one the field accepts, else the bare
    string (so ``data.path=a.txt`` needs no quotes), ``none``/``null`` unsets a field whose
    default is unset."""
    accepts_none = type(None) in union_args(hint)
    if accepts_none and raw.lower() in ("none", "null", ""):
        return None
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError, ValueError):
        return raw  # not TOML (or nested / long past what Python parses): the text itself
    if convert(value, hint) is NOT_CONVERTIBLE and convert(raw, hint) is not NOT_CONVERTIBLE:
        return raw  # e.g. train.sample_prompt=1984 is the string "1984"
    return value


def apply_overrides(cfg: Config, overrides: typing.Iterable[str]) -> Config:
    """Apply ``section.key=value`` strings in order (later wins); returns ``cfg``."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        where = f"--set {shown(item)}"
        if not sep or not key.strip():
            raise ConfigError(
                f"--set expects section.key=value (like optim.lr=3e-4), got {where[6:]!r}"
            )
        sec_name, name = _split_key(key.strip(), where)
        _set(cfg, sec_name, name, raw.strip(), where, raw=True)
    return cfg


def apply_values(cfg: Config, values: typing.Mapping[str, Any], where: str) -> Config:
    """Set ``{"section.key": value}`` pairs given as Python values (the API's keywords)."""
    for key, value in values.items():
        sec_name, name = _split_key(key, f"{where} {key}")
        _set(cfg, sec_name, name, value, f"{where} {key}", raw=False)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain ``{section: {key: value}}`` (JSON-able; unset keys are ``None``), for storing
    the exact configuration in checkpoints and metrics."""
    return {
        name: {key: getattr(getattr(cfg, name), key) for key in config_keys(cls)}
        for name, cls in SECTIONS.items()
    }


def config_to_toml(cfg: Config) -> str:
    """The config as a TOML file that :func:`load_config` reads back to an equal Config
    (written into each run folder so a run can be repeated). Unset keys are commented out."""
    parts = []
    for sec_name, table in config_to_dict(cfg).items():
        values = {key: value for key, value in table.items() if value is not None}
        unset = "".join(f"# {key} = (unset)\n" for key, value in table.items() if value is None)
        parts.append(tomli_w.dumps({sec_name: values}) + unset)
    return "\n".join(parts)


BUILTIN_CONFIGS = resources.files("llamatrain") / "configs"
"""Configs shipped inside the package: ``--config shakespeare`` works from any folder."""


def builtin_config_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".toml") for p in BUILTIN_CONFIGS.iterdir() if p.name.endswith(".toml")
    )


def _config_path(spec: str | Path) -> Path:
    """A config file path: the file named, else the built-in config of that name."""
    path = Path(spec)
    if path.is_file():
        return path
    builtin = BUILTIN_CONFIGS / f"{Path(spec).name.removesuffix('.toml')}.toml"
    if not path.is_dir() and builtin.is_file():
        return Path(str(builtin))
    what = "is a folder, not a file" if path.is_dir() else "not found"
    raise ConfigError(
        f"config file {path} {what} (working directory {Path.cwd()}); built-in configs: "
        + ", ".join(builtin_config_names())
    )


def load_config(spec: str | Path | None, overrides: typing.Iterable[str] = ()) -> Config:
    """Read a TOML config (a path or a built-in name; ``None`` = all defaults), apply
    overrides, validate."""
    return validate(read_config(spec, overrides))


def read_config(spec: str | Path | None, overrides: typing.Iterable[str] = ()) -> Config:
    """:func:`load_config` without the validation, for a caller that adds more before the
    one validation of the whole (``api.fit``'s keywords and its Python reward functions)."""
    if spec is None:
        cfg = Config()
    else:
        path = _config_path(spec)
        try:
            with path.open("rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(
                f"{path} is not valid TOML: {e}. Fix the syntax (strings need quotes: "
                'key = "value"; sections look like [model])'
            ) from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text ({e}); save it as UTF-8") from None
        except RecursionError:
            raise ConfigError(
                f"{path} nests arrays or tables too deeply to read; a config is sections of "
                "plain keys — fix the file"
            ) from None
        except ValueError as e:  # tomllib's int(): a number past Python's digit limit
            raise ConfigError(
                f"{path} holds a number of more than {sys.get_int_max_str_digits()} digits "
                f"({str(e)[:60]}); fix the file"
            ) from None
        cfg = config_from_dict(data, source=str(spec))
    return apply_overrides(cfg, overrides)
