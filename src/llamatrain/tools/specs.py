"""A function a config names as ``'path/to/file.py:name'`` or ``'package.module:name'``, imported
the one way ``train.rewards`` and ``train.tools`` (and any later setting naming code) share.

**Safety.** Importing a spec runs the module it names, as ``import`` would, or runs the file it
names. Only the config and the Python API name modules: nothing read from a checkpoint, a data
file or a model's output is ever passed to :func:`import_function`.

- ``"package.module:function"``: ``import package.module``, then its attribute (a dotted path
  such as ``Class.method`` is followed).
- ``"path/to/file.py:function"``: that file, run as a module (relative to the working
  directory). ``llamatrain`` is a console script, so its ``sys.path`` holds neither the working
  directory nor the config's folder: a file beside the config could otherwise only be named
  after editing ``PYTHONPATH``. A file named twice (by a tool and a reward alike) runs once.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from types import ModuleType
from typing import Any

from llamatrain.errors import ConfigError, shown

__all__ = ["Named", "import_function", "split_spec"]


@dataclass(frozen=True)
class Named:
    """What a kind of spec is called in messages: its setting (``train.rewards``), what one
    spec names (``reward``), the spec forms it takes and the signature its functions need."""

    setting: str
    noun: str
    forms: str
    signature: str

    @property
    def runs_code(self) -> str:
        return (
            f"{self.setting} runs the module it names, so name only code you trust; "
            "checkpoints and data files cannot name one"
        )


def split_spec(spec: str, named: Named) -> tuple[str, str]:
    """(module or file, attribute) of ``spec``, or ConfigError on a malformed one. The last
    colon splits, so a Windows path's drive letter stays in the file part."""
    target, colon, attr = spec.rpartition(":")
    if not colon or not target or not all(p.isidentifier() for p in attr.split(".")):
        raise ConfigError(f"{named.setting}: {shown(spec)!r} is not one of {named.forms}")
    if not _is_file(target) and not all(p.isidentifier() for p in target.split(".")):
        raise ConfigError(
            f"{named.setting}: {shown(spec)!r} names neither a module (dotted identifiers) "
            f"nor a .py file; use {named.forms}"
        )
    return target, attr


def import_function(spec: str, named: Named) -> Callable[..., Any]:
    """The callable ``spec`` names: its module imported, or its file run once per resolved
    path; ConfigError in one line when it is missing, fails to run, or is not callable."""
    target, attr = split_spec(spec, named)
    module = _file_module(spec, target, named) if _is_file(target) else _module(spec, target, named)
    try:
        fn = reduce(getattr, attr.split("."), module)
    except AttributeError:
        raise ConfigError(
            f"{named.noun} {shown(spec)!r}: {shown(target)} has no attribute {attr!r}; name a "
            f"function defined there ({named.runs_code})"
        ) from None
    if not callable(fn):
        raise ConfigError(
            f"{named.noun} {shown(spec)!r}: {attr} is a {type(fn).__name__}, not a function; "
            f"{named.signature}"
        )
    return fn


def _is_file(target: str) -> bool:
    return target.endswith(".py")


def _module(spec: str, target: str, named: Named) -> ModuleType:
    """``import target``, or ConfigError saying whether it is missing or failed."""
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is None or not (target == e.name or target.startswith(e.name + ".")):
            raise _import_failed(spec, target, e, named) from e
        raise ConfigError(
            f"{named.noun} {shown(spec)!r}: no module named {e.name!r} on sys.path; install "
            f"it, or name its file as 'path/to/file.py:function' ({named.runs_code})"
        ) from None
    except Exception as e:
        raise _import_failed(spec, target, e, named) from e


def _file_module(spec: str, target: str, named: Named) -> ModuleType:
    """The module the file ``target`` defines, run once per resolved path (its key in
    ``sys.modules``, so two specs naming one file share one module)."""
    path = Path(target).resolve()
    if not path.is_file():
        raise ConfigError(
            f"{named.noun} {shown(spec)!r}: no file {shown(str(path))} (a path is relative to "
            f"the working directory; {named.runs_code})"
        )
    key = str(path)
    if key in sys.modules:
        return sys.modules[key]
    loader_spec = importlib.util.spec_from_file_location(key, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ConfigError(f"{named.noun} {shown(spec)!r}: {shown(key)} cannot be loaded as Python")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[key] = module  # before running it: dataclasses look their module up there
    try:
        loader_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[key]  # never kept half run, whatever stopped it (an exit too)
        if not isinstance(e, Exception):
            raise  # an exit or interrupt: the caller's user_code guard names it
        raise _import_failed(spec, target, e, named) from e
    return module


def _import_failed(spec: str, target: str, e: Exception, named: Named) -> ConfigError:
    return ConfigError(
        f"{named.noun} {shown(spec)!r}: running {shown(target)} raised {type(e).__name__}: "
        f"{shown(str(e))} ({named.runs_code})"
    )
