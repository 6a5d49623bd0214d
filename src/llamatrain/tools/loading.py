"""The tools of ``train.tools``: Python functions the model may call during GRPO rollouts.

``train.tools = ["tools.py:calculator", "package.module:search"]`` names each as a reward is
named (:mod:`~llamatrain.tools.specs`: ``'path/to/file.py:function'`` runs that file,
``'package.module:function'`` imports that module), or the Python API passes the functions.

A tool is a function, sync or async, whose type hints and Google-style docstring make the JSON
schema its chat template renders (:func:`~llamatrain.tools.schema.json_schema`, as TRL's
``tools=`` does, so TRL's tools carry over). The model calls it by its ``__name__``, so two
tools may not share one.

**Safety.** A config naming tools runs them: loading one runs its module, and a rollout then
calls it with arguments the model wrote (parsed as JSON data and checked against the schema,
never evaluated: :mod:`~llamatrain.tools.calls`). Name only code you trust.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llamatrain.errors import ConfigError, shown
from llamatrain.tools.schema import json_schema
from llamatrain.tools.specs import Named, import_function, split_spec
from llamatrain.user_code import user_code

__all__ = ["TOOLS", "Tool", "check", "load"]

TOOLS = Named(
    setting="train.tools",
    noun="tool",
    forms="'package.module:function' or 'path/to/file.py:function'",
    signature="name a function whose type hints and docstring describe its arguments",
)
"""How messages about ``train.tools`` specs name them."""


@dataclass(frozen=True)
class Tool:
    """A loaded tool: ``spec`` as named (errors quote it), ``name`` the one the model calls
    (``fn.__name__``), ``schema`` what the chat template renders for it."""

    spec: str
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def is_async(self) -> bool:
        """Whether calling it gives an awaitable (an ``async def`` function or method)."""
        return inspect.iscoroutinefunction(self.fn)


def check(specs: Sequence[str | Callable[..., Any]]) -> None:
    """ConfigError in one line unless ``specs`` (``train.tools``) are well-formed and name
    distinct tools. Imports nothing, so config validation may call it."""
    _check_unique([_called(spec) for spec in specs])


def load(specs: Sequence[str | Callable[..., Any]]) -> list[Tool]:
    """The tools ``specs`` name (strings, or Python callables), each with its schema.
    Importing a module or file runs it: call this only with specs from a config or the
    caller's own code, never with anything a model wrote or a file held."""
    check(specs)
    tools = [_tool(spec) for spec in specs]
    _check_unique([tool.name for tool in tools])  # a decorator may have renamed a function
    return tools


def _tool(spec: str | Callable[..., Any]) -> Tool:
    if isinstance(spec, str):
        with user_code(f"tool {shown(spec)!r}: running its module", ConfigError):
            fn = import_function(spec, TOOLS)
    else:
        fn = spec
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        named = spec if isinstance(spec, str) else repr(spec)
        raise ConfigError(
            f"tool {shown(named)} is a {type(fn).__name__}, not a function or method (as TRL's "
            f"tools are); {TOOLS.signature}"
        )
    label = spec if isinstance(spec, str) else f"{fn.__module__}:{fn.__qualname__}"
    schema = json_schema(fn)
    return Tool(label, schema["function"]["name"], fn, schema)


def _called(spec: str | Callable[..., Any]) -> str:
    """The name the model would call: a spec's last attribute, a callable's ``__name__``."""
    if isinstance(spec, str):
        return split_spec(spec, TOOLS)[1].rpartition(".")[2]
    return getattr(spec, "__name__", "operation")


def _check_unique(names: list[str]) -> None:
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(
                f"train.tools names two tools called {shown(name)!r}; the model calls a tool "
                "by its name, so rename one"
            )
