"""A Python function → the JSON schema a chat template renders for it as a tool.

The schema is the one ``transformers.utils.get_json_schema`` makes (TRL's ``GRPOTrainer(tools=…)``
passes functions through it), key for key and in the same order — templates render it with
``tojson``, so the order is part of the prompt's bytes — so a tool written for TRL carries over::

    def multiply(a: float, b: float) -> float:
        '''Multiply two numbers.

        Args:
            a: The first factor.
            b: The second factor.
        '''

    {"type": "function", "function": {"name": "multiply", "description": "Multiply two numbers.",
     "parameters": {"type": "object", "properties": {
         "a": {"type": "number", "description": "The first factor."},
         "b": {"type": "number", "description": "The second factor."}},
      "required": ["a", "b"]},
     "return": {"type": "number"}}}

What is read, as transformers reads it:

- Every argument needs a type hint: ``int`` ``float`` ``str`` ``bool`` ``None`` ``Any``, ``list``
  / ``tuple`` / ``dict`` (bare or with their element types), ``Optional`` and unions,
  ``Literal`` and ``Enum`` classes (their values become an ``enum``). An argument without a
  default is ``required``. A first argument ``self`` or ``cls`` without a hint is left out.
- The docstring, Google style: the text before ``Args:`` / ``Returns:`` / ``Raises:`` is the
  description; under ``Args:`` each ``name:`` (or ``name (type):``) starts an argument's
  description, which runs on over lines indented deeper or not shaped like ``name:``, and
  lines are joined with single spaces. A description ending in ``(choices: [...])`` (a JSON
  list) becomes the argument's ``enum``. ``Returns:`` describes the return hint's schema.

Where transformers differs: it maps PIL images and torch tensors (``"image"``, ``"audio"``),
which no text tool takes, and raises its own exceptions; here each problem is a
:class:`~llamatrain.errors.ConfigError` in one line naming the function and the fix.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from llamatrain.errors import ConfigError, shown

__all__ = ["json_schema"]

_JSON_TYPES: dict[Any, dict[str, Any]] = {
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
    list: {"type": "array"},
    tuple: {"type": "array"},
    dict: {"type": "object"},
    Any: {},
}
"""The schema of each bare type a hint may name."""

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
"""The Python types a JSON value of an ``enum`` may have, and their JSON names."""

_ARGS_HEADING = re.compile(r"\n\s*Args:\n")
"""Where the arguments start: ``Args:`` alone on a line (blank lines before it allowed)."""

_RETURNS_HEADING = re.compile(r"\n\s*Returns:\n\s*")
"""Where the return value's description starts, as ``Args:`` does for the arguments."""

_ARGUMENT = re.compile(r"([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:")
"""A line that starts an argument's description: its indentation, then ``name:`` or
``name (type):``."""

_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)
"""The ``(choices: [...])`` ending of an argument's description."""

_RECEIVERS = ("self", "cls")


def json_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s tool schema, as ``transformers.utils.get_json_schema(fn)`` makes it; a
    ConfigError naming the function and the fix when its docstring or type hints fall short."""
    name = getattr(fn, "__name__", "operation")
    doc = inspect.getdoc(fn)
    if not doc:
        raise _unfit(name, "has no docstring; describe it and each argument (Google style)")
    description, argument_docs, return_doc = _read_docstring(doc.strip())
    parameters, returns = _signature_schema(fn, name)
    for argument, schema in parameters["properties"].items():
        if argument not in argument_docs:
            raise _unfit(
                name,
                f"has no description of argument {shown(argument)!r} in its docstring; add "
                f"'{shown(argument)}: what it is' under 'Args:'",
            )
        _describe(schema, argument_docs[argument], name, argument)
    function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if returns is not None:
        if return_doc is not None:
            returns["description"] = return_doc
        function["return"] = returns
    return {"type": "function", "function": function}


def _unfit(name: str, problem: str) -> ConfigError:
    return ConfigError(
        f"tool function {shown(name)!r} {problem} (a tool's schema comes from its type "
        "hints and docstring, as transformers' get_json_schema reads them)"
    )


# ---- type hints -----------------------------------------------------------------------------


def _signature_schema(fn: Callable[..., Any], name: str) -> tuple[dict[str, Any], dict | None]:
    """(the ``parameters`` object schema, the return hint's schema or None)."""
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an unresolvable string hint, a callable Python cannot inspect
        raise _unfit(name, f"has type hints Python cannot read ({type(e).__name__}: {e})") from e
    receiver = _receiver(signature)
    required = []
    for argument, parameter in signature.parameters.items():
        if argument == receiver:
            continue
        if parameter.annotation is inspect.Parameter.empty:
            raise _unfit(
                name,
                f"has no type hint on argument {argument!r}; annotate it (e.g. '{argument}: str')",
            )
        if parameter.default is inspect.Parameter.empty:
            required.append(argument)
    properties = {
        argument: _hint_schema(hint, name, argument)
        for argument, hint in hints.items()
        if argument != receiver and argument in signature.parameters
    }
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    returns = None
    if "return" in hints:
        try:  # the model never writes the return value: an odd return hint is left out
            returns = _hint_schema(hints["return"], name, "return")
        except ConfigError:
            returns = None
    return parameters, returns


def _receiver(signature: inspect.Signature) -> str | None:
    """The implicit first argument of a method named through its class (``self``/``cls``
    without a hint), which the model does not pass."""
    first = next(iter(signature.parameters.values()), None)
    if first is not None and first.name in _RECEIVERS:
        return first.name if first.annotation is inspect.Parameter.empty else None
    return None


def _hint_schema(hint: Any, name: str, argument: str) -> dict[str, Any]:
    """The JSON schema of one type hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum_schema([member.value for member in hint], name, argument, hint.__name__)
        try:
            return dict(_JSON_TYPES[hint])
        except (KeyError, TypeError):
            raise _unsupported(hint, name, argument) from None
    if origin is typing.Union or origin is types.UnionType:
        return _union_schema(args, name, argument)
    if origin is typing.Literal:
        return _enum_schema(list(args), name, argument, "Literal")
    if origin is list:
        if args:
            return {"type": "array", "items": _hint_schema(args[0], name, argument)}
        return {"type": "array"}
    if origin is tuple:
        return _tuple_schema(args, name, argument)
    if origin is dict:
        if len(args) == 2:
            return {"type": "object", "additionalProperties": _hint_schema(args[1], name, argument)}
        return {"type": "object"}
    raise _unsupported(hint, name, argument)


def _union_schema(args: tuple, name: str, argument: str) -> dict[str, Any]:
    """One schema for a union: the member's own when one type remains besides None, a list of
    type names when every member is a plain type, else ``anyOf``; ``nullable`` when None is
    a member."""
    members = [_hint_schema(arg, name, argument) for arg in args if arg is not type(None)]
    if len(members) == 1:
        schema = members[0]
    elif all(m.keys() == {"type"} and isinstance(m["type"], str) for m in members):
        schema = {"type": _one_or_list(sorted({m["type"] for m in members}))}
    else:
        schema = {"anyOf": members}
    if type(None) in args:
        schema["nullable"] = True
    return schema


def _tuple_schema(args: tuple, name: str, argument: str) -> dict[str, Any]:
    """``tuple[a, b, …]`` as an array of those items in order (``prefixItems``)."""
    if not args:
        return {"type": "array"}
    if len(args) == 1 or ... in args:
        raise _unfit(
            name,
            f"types argument {argument!r} as a {'one-item' if len(args) == 1 else 'variable'} "
            "tuple; use list[...] for any number of items, or name each item's type",
        )
    return {"type": "array", "prefixItems": [_hint_schema(a, name, argument) for a in args]}


def _enum_schema(values: list, name: str, argument: str, source: str) -> dict[str, Any]:
    """An ``enum`` of JSON scalars, typed by the JSON types of its values in first-seen order."""
    if not values:
        raise _unfit(name, f"types argument {argument!r} as {source} without values")
    if any(type(value) not in _SCALARS for value in values):
        raise _unfit(
            name,
            f"types argument {argument!r} as {source} with values that are not JSON scalars "
            "(int, float, str, bool or None)",
        )
    kinds = list(dict.fromkeys(_SCALARS[type(value)] for value in values))
    return {"type": _one_or_list(kinds), "enum": values}


def _one_or_list(kinds: list[str]) -> str | list[str]:
    return kinds[0] if len(kinds) == 1 else kinds


def _unsupported(hint: Any, name: str, argument: str) -> ConfigError:
    return _unfit(
        name,
        f"types {'its return' if argument == 'return' else f'argument {argument!r}'} as "
        f"{shown(repr(hint))}, which has no JSON schema; use int, float, str, bool, list, dict, "
        "Literal, an Enum or unions of them",
    )


# ---- the docstring --------------------------------------------------------------------------


def _read_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """(description, argument → its description, the return value's description or None)."""
    description = doc[: _first(doc, "Args:", "Returns:", "Raises:")].rstrip()
    heading = _ARGS_HEADING.search(doc)
    arguments: dict[str, str] = {}
    if heading is not None:
        block = doc[heading.end() :]
        block = block[: _first(block, "Returns:", "Raises:")].rstrip()
        arguments = _argument_docs([line for line in block.split("\n") if line.strip()])
    returns = _RETURNS_HEADING.search(doc)
    return_doc = None
    if returns is not None:
        tail = doc[returns.end() :]
        return_doc = tail[: _first(tail, "Raises:")].strip()
    return description.strip(), arguments, return_doc


def _first(text: str, *words: str) -> int:
    """Where the first of ``words`` occurs in ``text`` (anywhere, even mid-line, as
    transformers looks for them), or its end."""
    found = [i for i in (text.find(word) for word in words) if i >= 0]
    return min(found, default=len(text))


def _argument_docs(lines: list[str]) -> dict[str, str]:
    """Each argument's description from the (non-blank) lines under ``Args:``: a line shaped
    ``name:`` starts one unless it is indented deeper than the argument it would follow; an
    argument whose first line ends at its colon takes the next line as its first, whatever
    that line looks like."""
    docs: dict[str, list[str]] = {}
    current: list[str] | None = None
    indent = ""
    take_next = False
    for line in lines:
        start = _ARGUMENT.match(line)
        deeper = (
            current is not None and line.startswith(indent) and line[len(indent) :][:1] in " \t"
        )
        if start is not None and not deeper and not take_next:
            indent = start.group(1)
            current = docs[start.group(2)] = [line[start.end() :]]
            take_next = not current[0].strip()
        elif current is not None:
            current.append(line)
            take_next = False
    return {name: re.sub(r"\s*\n+\s*", " ", "\n".join(text).strip()) for name, text in docs.items()}


def _describe(schema: dict[str, Any], text: str, name: str, argument: str) -> None:
    """Give an argument's schema its description, and its ``enum`` when the description ends
    in ``(choices: [...])``."""
    choices = _CHOICES.search(text)
    if choices is not None:
        try:
            values = json.loads(choices.group(1))
        except ValueError:
            values = None
        if not isinstance(values, list):
            raise _unfit(
                name,
                f"ends the description of {argument!r} in '(choices: {shown(choices.group(1))})', "
                'which is not a JSON list; write e.g. (choices: ["tea", "coffee"])',
            )
        schema["enum"] = [v.strip() if isinstance(v, str) else v for v in values]
        text = text[: choices.start()].strip()
    schema["description"] = text
