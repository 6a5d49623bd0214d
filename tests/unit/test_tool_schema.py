"""A tool's JSON schema equals transformers' ``get_json_schema`` of the same function, byte for
byte once dumped (templates render it with ``tojson``, so key order is part of the prompt)."""

from __future__ import annotations

import enum
import json
import typing
from typing import Any, Literal, Optional, Union

import pytest
from transformers.utils import get_json_schema

from llamatrain.errors import ConfigError
from llamatrain.tools.schema import json_schema


class Color(enum.Enum):
    RED = "red"
    GREEN = 2


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 9


def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b (float): The second factor,
            described over two lines.

    Returns:
        The product.
    """
    return a * b


async def search(
    query: str,
    limit: int = 5,
    tags: list[str] | None = None,
    mode: Literal["fast", "exact", 3] = "fast",
    color: Color = Color.RED,
) -> dict[str, int]:
    """Search the index. It Returns: nothing useful here.

    Args:
        query: What to look for (choices: ["cats ", "dogs"])
        limit: How many results.
        tags: Tags to filter by.
        mode: How hard to look.
        color: A color.

    Raises:
        ValueError: never.
    """
    return {}


def mixed(
    a: Union[int, str, None],  # noqa: UP007 — typing.Union is what is tested
    b: tuple[int, str],
    c: dict,
    d: Any,
    e: Optional[list[dict[str, float]]] = None,  # noqa: UP045 — so is typing.Optional
    f: int | list[int] = 1,
):
    """Unions, tuples, bare containers.

    Args:
        a:
            the next line is a's, though it looks like b: an argument
        b: A pair.
        c: A mapping.
        d: Anything at all.
        e: Nested containers.
        f: A number or numbers.
    """


def now() -> str:
    """The time, no arguments and no Args block."""
    return ""


def typing_aliases(
    xs: typing.List[int],  # noqa: UP006 — typing's aliases are what is tested
    m: typing.Dict[str, bool],  # noqa: UP006
    flag: bool = False,
    nothing: None = None,
    bare: list = None,  # type: ignore[assignment]
) -> None:
    """Old-style aliases.

    Args:
        xs: Integers.
        m: Flags by name.
        flag: A flag.
        nothing: Always None.
        bare: A bare list.
    """


def choices_of_numbers(level: Level, n: int = 1, kind: str = "a") -> Level:
    """Enums and numeric choices.

        Indented description lines.

    Args:
        level: How much.
        n: A count (Choices: [1, 2, 3])
        kind: A kind
          continued deeper,
        and back at the argument's indent (choices: ["a", "b"])

    Returns:
        The level, with
        a two-line description.
    """
    return level


def unions_to_any_of(
    a: Literal["x"] | int,
    b: list | tuple,
    c: Optional[Any] = None,  # noqa: UP045
    d: Union[list[int], dict[str, int]] = None,  # type: ignore[assignment]  # noqa: UP007
) -> Unknown:  # a custom class: the return is left out
    """Unions that need anyOf.

    Args:
        a: A literal or an int.
        b: An array either way.
        c: Anything or null.
        d: A list or a mapping.
    """


class Unknown:
    pass


def custom_return(x: int) -> Unknown:
    """A return type with no schema is left out.

    Args:
        x(int): An integer, type in parentheses without a space.
    """
    return Unknown()


class Calculator:
    def add(self, x: int, y: int = 0) -> int:
        """Add.

        Args:
            x: First.
            y: Second.
        """
        return x + y

    @classmethod
    def build(cls, size: int) -> None:
        """Build one.

        Args:
            size: How big.
        """


def sections_anywhere(text: str, count: int = 2) -> list[str]:
    """Split text.
    Args:
    text: Unindented arguments.
    count: Pieces. Raises: cut here, as transformers cuts
    Returns:
    The pieces.
    """
    return []


FUNCTIONS = [
    multiply,
    search,
    mixed,
    now,
    typing_aliases,
    choices_of_numbers,
    unions_to_any_of,
    custom_return,
    Calculator.add,
    Calculator().add,
    Calculator.build,
    sections_anywhere,
]


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda fn: fn.__qualname__)
def test_the_schema_is_transformers_own(fn):
    assert json.dumps(json_schema(fn)) == json.dumps(get_json_schema(fn))


def test_the_schema_reads_as_documented():
    """One schema spelled out, so the equality above is known to compare something real."""
    assert json_schema(multiply) == {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "number", "description": "The first factor."},
                    "b": {
                        "type": "number",
                        "description": "The second factor, described over two lines.",
                    },
                },
                "required": ["a", "b"],
            },
            "return": {"type": "number", "description": "The product."},
        },
    }


def no_doc(x: int):
    return x


def no_hint(x, y: int):
    """Add.

    Args:
        x: one
        y: two
    """


def undocumented(x: int, y: int):
    """Add.

    Args:
        x: one
    """


def custom_hint(x: Unknown):
    """Take one.

    Args:
        x: a thing
    """


def one_tuple(x: tuple[int]):
    """Take one.

    Args:
        x: a tuple
    """


def open_tuple(x: tuple[int, ...]):
    """Take some.

    Args:
        x: a tuple
    """


def set_hint(x: set[int]):
    """Take a set.

    Args:
        x: a set
    """


def bad_choices(x: str):
    """Take one.

    Args:
        x: a choice (choices: [tea, coffee])
    """


def unresolvable(x: NoSuchType):  # noqa: F821 — a hint Python cannot resolve
    """Take one.

    Args:
        x: a thing
    """


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (no_doc, r"'no_doc' has no docstring; describe it and each argument"),
        (no_hint, r"'no_hint' has no type hint on argument 'x'; annotate it"),
        (undocumented, r"'undocumented' has no description of argument 'y'.*under 'Args:'"),
        (custom_hint, r"'custom_hint' types argument 'x' as .*Unknown.*, which has no JSON schema"),
        (one_tuple, r"as a one-item tuple; use list"),
        (open_tuple, r"as a variable tuple; use list"),
        (set_hint, r"types argument 'x' as set\[int\], which has no JSON schema"),
        (bad_choices, r"'\(choices: \[tea, coffee\]\)', which is not a JSON list"),
        (unresolvable, r"'unresolvable' has type hints Python cannot read \(NameError"),
    ],
)
def test_what_transformers_refuses_is_one_line_naming_the_function(fn, message):
    with pytest.raises(Exception):  # noqa: B017 — transformers' own exception types vary
        get_json_schema(fn)
    with pytest.raises(ConfigError, match=message) as caught:
        json_schema(fn)
    assert "\n" not in str(caught.value)
    assert "get_json_schema" in str(caught.value)
