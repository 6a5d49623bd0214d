"""What an operation of a chat template may make, charged before it is made.

One Jinja step can make far more than it is given: ``"a" * 10**9``, ``"%*d" % (10**9, 1)``,
``s.center(10**9)``, ``xs | join`` of one long string many times, ``tools | tojson(indent=…)``.
The sandbox (``sandbox``) calls these checks with the operation's arguments before it runs
the operation; each charges the render's :class:`~.budget.Meter` an upper bound of what will
be made, so an operation past the budget raises before it allocates. Here
too: the sizes of values (:func:`size_of`, and :func:`text_size` for the text of a list or
mapping, walked at a step per node so shared or cyclic structures stay cheap).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping
from typing import Any

from jinja2.utils import Namespace

from llamatrain.chat_template.budget import Meter, OverBudget

__all__ = [
    "FILTER_CHECKS",
    "READING_STR_METHODS",
    "SIZED",
    "TEXT_FILTERS",
    "arg_at",
    "check_method",
    "check_mul",
    "check_pow",
    "int_arg",
    "percent_cost",
    "read_size",
    "size_of",
    "text_size",
]

# ----------------------------------------------------------------------------- sizes of values

SIZED = (str, list, tuple, dict, bytes, set, frozenset)


def size_of(value: Any) -> int:
    """The length of a string or container (what making it cost), else 0."""
    kind = type(value)
    if kind is str or kind is list or kind is dict:
        return len(value)
    return len(value) if isinstance(value, SIZED) else 0


def _shape(meter: Meter, value: Any) -> tuple[int, int, int]:
    """An upper bound of the length of ``value`` as text (``str``, ``repr``, or JSON with
    every character escaped), its number of nodes and its nesting depth; walking it is
    charged a step per node, so a shared or cyclic structure cannot make it run long. Walked a
    level at a time, the plain types first: ``tools | tojson`` of every render takes it."""
    if type(value) is str:
        return 6 * len(value) + 2, 1, 0
    memo = meter.shapes
    if memo is not None:
        known = memo.get(id(value))
        if known is not None and known[0] is value:
            meter.step(known[1][1])
            if known[1][0] > meter.chars:
                raise OverBudget(meter.budget, "chars")
            return known[1]
    size = nodes_ = depth = 0
    plain = True
    level = [value]
    while True:
        below: list[Any] = []
        spent = len(level)
        for item in level:
            kind = type(item)
            if kind is str:
                size += 6 * len(item) + 2
            elif kind is dict or kind is list or kind is tuple:
                spent += len(item)
                if spent > meter.steps:
                    raise OverBudget(meter.budget, "steps")
                if kind is dict:
                    size += 14 + 4 * len(item)
                    below += item.keys()
                    below += item.values()
                else:
                    size += 2 + 2 * len(item)
                    below += item
            elif kind is int or kind is bool:
                size += item.bit_length() // 3 + 5  # "false" is 5 characters
            elif kind is float or item is None:
                size += 24
            else:
                found = len(below)
                plain = _is_plain(item, below) and plain
                spent += len(below) - found
                if spent > meter.steps:
                    raise OverBudget(meter.budget, "steps")
                size += _other_size(item)
        nodes_ += len(level)
        meter.step(spent)
        if size > meter.chars:
            raise OverBudget(meter.budget, "chars")
        if not below:
            break
        depth += 1
        level = below
    if memo is not None and plain and type(value) in (dict, list):  # the sandbox keeps them
        memo[id(value)] = (value, (size, nodes_, depth))
    return size, nodes_, depth


def _is_plain(item: Any, below: list[Any]) -> bool:
    """Put the items of a container other than a dict, list or tuple ``below``; whether it is
    plain data (not a macro, a loop, a namespace, a mapping other than a dict...)."""
    if isinstance(item, Mapping | Namespace):
        below.extend(x for pair in _items(item) for x in pair)
        return type(item) is dict
    if isinstance(item, list | tuple | set | frozenset):
        below.extend(item)
        return True
    return item is None or isinstance(item, str | bytes | int | float)


def _other_size(item: Any) -> int:
    """The text length bound of a value that is not a str, dict, list or tuple."""
    if isinstance(item, str):
        return 6 * len(item) + 2
    if isinstance(item, bytes):
        return 4 * len(item) + 3
    if isinstance(item, bool) or item is None:
        return 5
    if isinstance(item, int):
        return item.bit_length() // 3 + 2
    if isinstance(item, float):
        return 24
    if isinstance(item, Mapping | Namespace):
        return 14 + 4 * len(_items(item))
    if isinstance(item, list | tuple | set | frozenset):
        return 2 + 2 * len(item)
    return 64  # a macro, loop, cycler, undefined...: a short repr


def _items(mapping: Mapping | Namespace) -> list[tuple[Any, Any]]:
    if isinstance(mapping, Namespace):
        mapping = object.__getattribute__(mapping, "_Namespace__attrs")
    return list(mapping.items())


def text_size(meter: Meter, value: Any) -> int:
    return len(value) if isinstance(value, str) else _shape(meter, value)[0]


def int_arg(value: Any, default: int = 0) -> int:
    """An argument that sets a size, as a number (0 if it is not an integer)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def arg_at(args: tuple, kwargs: Mapping[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)


def percent_cost(meter: Meter, fmt: str, values: Any) -> None:
    """``fmt % values``: widths and precisions of its conversions (``*`` ones read from the
    values) and the text of the values."""
    given = list(values) if isinstance(values, tuple) else [values]
    total = len(fmt) + text_size(meter, values)
    for width, precision, _ in _PERCENT.findall(fmt):
        for number in (width, precision):
            if number == "*":
                total += max(int_arg(given.pop(0) if given else 0), 0)
            elif number:
                total += int(number)
    meter.make(total)


_FORMATTER = string.Formatter()


def _format_cost(meter: Meter, fmt: str, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """``fmt.format(*args, **kwargs)``: the numbers in its format specs (widths, precisions,
    nested fields too) and the text of the values."""
    total = len(fmt) + sum(text_size(meter, v) for v in (*args, *kwargs.values()))
    try:
        fields = list(_FORMATTER.parse(fmt))
    except ValueError:
        fields = []  # format() itself says what is wrong
    for _, _, spec, _ in fields:
        total += sum(int(n) for n in re.findall(r"\d+", spec or ""))
    meter.make(total)


# --------------------------------------------------------- calls: methods with a size argument


def _width(meter: Meter, s: Any, args: tuple, kwargs: dict) -> None:
    meter.make(int_arg(arg_at(args, kwargs, 0, "width", 0)))


def _expandtabs(meter: Meter, s: Any, args: tuple, kwargs: dict) -> None:
    tabs = s.count("\t" if isinstance(s, str) else b"\t")
    meter.make(tabs * int_arg(arg_at(args, kwargs, 0, "tabsize", 8)))


def _replace_cost(s: Any, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, type(s)) or not isinstance(new, type(s)):
        return 0  # replace() itself refuses them
    found = s.count(old) if old else len(s) + 1
    count = int_arg(count, -1)
    return (min(found, count) if count >= 0 else found) * len(new)


def _replace(meter: Meter, s: Any, args: tuple, kwargs: dict) -> None:
    old, new = arg_at(args, kwargs, 0, "old", ""), arg_at(args, kwargs, 1, "new", "")
    meter.make(_replace_cost(s, old, new, arg_at(args, kwargs, 2, "count", -1)))


def _join(meter: Meter, s: Any, args: tuple, kwargs: dict) -> tuple:
    items = _listed(meter, args[0]) if args else []
    meter.make(sum(size_of(x) for x in items) + len(s) * len(items))
    return (items, *args[1:])


def _format(meter: Meter, s: Any, args: tuple, kwargs: dict) -> None:
    if isinstance(s, str):
        _format_cost(meter, s, args, kwargs)


def _format_map(meter: Meter, s: Any, args: tuple, kwargs: dict) -> None:
    mapping = args[0] if args else {}
    if isinstance(s, str) and isinstance(mapping, Mapping):
        _format_cost(meter, s, (), mapping)


def _translate(meter: Meter, s: Any, args: tuple, kwargs: dict) -> None:
    table = args[0] if args else None
    if isinstance(table, Mapping):
        longest = max((size_of(v) for v in table.values()), default=1)
        meter.make(len(s) * max(longest, 1))


_METHOD_CHECKS: dict[str, Callable[[Meter, Any, tuple, dict], tuple | None]] = {
    "center": _width,
    "ljust": _width,
    "rjust": _width,
    "zfill": _width,
    "expandtabs": _expandtabs,
    "replace": _replace,
    "join": _join,
    "format": _format,
    "format_map": _format_map,
    "translate": _translate,
}
"""Methods of ``str`` and ``bytes`` that can make much more than they are given."""


READING_STR_METHODS = frozenset(
    {
        *("capitalize", "casefold", "count", "endswith", "find", "index", "isalnum"),
        *("isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower"),
        *("isnumeric", "isprintable", "isspace", "istitle", "isupper", "lower", "lstrip"),
        *("partition", "removeprefix", "removesuffix", "rfind", "rindex", "rpartition"),
        *("rsplit", "rstrip", "split", "splitlines", "startswith", "strip", "swapcase"),
        *("title", "upper"),
    }
)
"""Methods of ``str`` that make at most a few times what they read (the string and their
arguments), in time linear in it: charged that, without the checks of
:data:`_METHOD_CHECKS`."""


def read_size(args: tuple, kwargs: Mapping[str, Any]) -> int:
    """What a call reads of its arguments: their lengths (a tuple of a million prefixes
    given to ``startswith`` is read whole)."""
    total = 0
    for value in args:
        total += len(value) if type(value) is str else size_of(value)
    for name, value in kwargs.items():
        if name not in _JINJA_KEYWORDS:
            total += size_of(value)
    return total


_JINJA_KEYWORDS = ("_loop_vars", "_block_vars")
"""Keyword arguments Jinja adds to a call (for a function that takes the context)."""


def check_method(meter: Meter, method: Any, args: tuple, kwargs: dict) -> tuple:
    """Charge a call of a method of a string, list…: the length of what it reads (its
    receiver and arguments), and first what the methods of :data:`_METHOD_CHECKS` may make.
    The arguments to call it with."""
    method = getattr(method, "__wrapped__", method)
    receiver = getattr(method, "__self__", None)
    if isinstance(receiver, SIZED):
        meter.make(len(receiver) + read_size(args, kwargs))
        check = _METHOD_CHECKS.get(getattr(method, "__name__", ""))
        if check is not None and isinstance(receiver, str | bytes):
            args = check(meter, receiver, args, kwargs) or args
    elif isinstance(receiver, int) and getattr(method, "__name__", "") == "to_bytes":
        meter.make(int_arg(arg_at(args, kwargs, 0, "length", 1)))
    return args


def _listed(meter: Meter, iterable: Any) -> list:
    """An iterable as a list, its length charged first where it has one (an iterator from a
    filter is metered per item already)."""
    meter.make(size_of(iterable))
    return list(iterable)


# ------------------------------------------------------------------------------------- filters


def _filter_center(meter: Meter, args: tuple, kwargs: dict) -> None:
    meter.make(int_arg(arg_at(args, kwargs, 1, "width", 80)))


def _filter_indent(meter: Meter, args: tuple, kwargs: dict) -> None:
    s, width = args[0], arg_at(args, kwargs, 1, "width", 4)
    lines = (s.count("\n") if isinstance(s, str) else 0) + 1
    meter.make(lines * (len(width) if isinstance(width, str) else int_arg(width)))


def _filter_format(meter: Meter, args: tuple, kwargs: dict) -> None:
    fmt, values = args[0], args[1:]
    if isinstance(fmt, str):
        percent_cost(meter, fmt, kwargs if kwargs else values)


def _filter_replace(meter: Meter, args: tuple, kwargs: dict) -> None:
    s = args[0]
    old, new = arg_at(args, kwargs, 1, "old", ""), arg_at(args, kwargs, 2, "new", "")
    if isinstance(s, str):
        meter.make(_replace_cost(s, str(old), str(new), arg_at(args, kwargs, 3, "count", None)))


def _filter_join(meter: Meter, args: tuple, kwargs: dict) -> tuple:
    items = _listed(meter, args[0])
    glue = arg_at(args, kwargs, 1, "d", "")
    meter.make(sum(text_size(meter, x) for x in items) + size_of(glue) * len(items))
    return (items, *args[1:])


def _filter_wordwrap(meter: Meter, args: tuple, kwargs: dict) -> None:
    s, wrap = args[0], arg_at(args, kwargs, 4, "wrapstring", None)
    if isinstance(wrap, str) and isinstance(s, str):
        meter.make((len(s) + 1) * len(wrap))


def _filter_fill(position: int, name: str) -> Callable[[Meter, tuple, dict], None]:
    """``batch(n, fill_with)``, ``slice(n, fill_with)``: ``n`` items may be made."""

    def check(meter: Meter, args: tuple, kwargs: dict) -> None:
        meter.step(max(int_arg(arg_at(args, kwargs, position, name, 0)), 0))

    return check


def _filter_sum(meter: Meter, args: tuple, kwargs: dict) -> tuple:
    items = _listed(meter, args[0])
    start = arg_at(args, kwargs, 2, "start", 0)
    sizes = sum(size_of(x) for x in items) + size_of(start)
    meter.make(sizes * len(items) if sizes else len(items))  # sums of lists copy as they go
    return (items, *args[1:])


def _filter_tojson(meter: Meter, args: tuple, kwargs: dict) -> None:
    size, count, depth = _shape(meter, args[0])
    indent = arg_at(args, kwargs, 2, "indent", None)
    separators = arg_at(args, kwargs, 3, "separators", None)
    per_node = 2 + depth * (len(indent) if isinstance(indent, str) else max(int_arg(indent), 0))
    if isinstance(separators, tuple | list):
        per_node += sum(size_of(s) for s in separators)
    meter.make(size + count * per_node)


def _filter_pprint(meter: Meter, args: tuple, kwargs: dict) -> None:
    size, count, depth = _shape(meter, args[0])
    meter.make(size + count * (depth + 2))


FILTER_CHECKS: dict[str, Callable[[Meter, tuple, dict], tuple | None]] = {
    "center": _filter_center,
    "indent": _filter_indent,
    "format": _filter_format,
    "replace": _filter_replace,
    "join": _filter_join,
    "wordwrap": _filter_wordwrap,
    "batch": _filter_fill(1, "linecount"),
    "slice": _filter_fill(1, "slices"),
    "sum": _filter_sum,
    "tojson": _filter_tojson,
    "pprint": _filter_pprint,
}
"""Filters that can make much more than they are given, with what they may make (checked on
the filter's arguments without the context Jinja passes some of them)."""
TEXT_FILTERS = frozenset(
    {
        *("capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower"),
        *("replace", "safe", "string", "striptags", "title", "trim", "truncate", "upper"),
        *("urlencode", "urlize", "wordcount", "wordwrap", "xmlattr"),
    }
)
"""Filters that turn their value into text: a list or mapping given to them is charged its
text's length."""


# ----------------------------------------------------------------------------------- operators


def check_mul(meter: Meter, left: Any, right: Any) -> None:
    """``left * right``: a product of integers past the bits allowed, or a string or list
    repeated, checked before it is computed."""
    if isinstance(left, int) and isinstance(right, int):
        if left.bit_length() + right.bit_length() > meter.budget.int_bits:
            raise OverBudget(meter.budget, "int_bits")
    elif isinstance(left, SIZED) or isinstance(right, SIZED):
        sized, times = (left, right) if isinstance(left, SIZED) else (right, left)
        meter.make(len(sized) * max(int_arg(times), 0))


def check_pow(meter: Meter, base: Any, exponent: Any) -> None:
    """``base ** exponent``: a power past the bits allowed, checked before it is computed."""
    if (
        isinstance(base, int)
        and isinstance(exponent, int)
        and exponent > 0
        and (base.bit_length() - 1) * exponent > meter.budget.int_bits
    ):
        raise OverBudget(meter.budget, "int_bits")
