"""The sandbox chat templates run in, with a budget for each render.

Jinja's immutable sandbox keeps a template away from Python's internals, but not from time and
memory: ``{% for i in range(100000) %}{% for j in range(100000) %}…`` runs for hours and
``{{ "a" * 4000000000 }}`` asks for gigabytes. Here every render is metered
(:func:`metered`), counting two things against a :class:`RenderBudget`:

- *steps*: loop iterations (a sized iterable is charged its length when the loop starts, an
  iterator per item), calls (macros, methods, globals), filters, tests and arithmetic;
- *characters made*: the length of every string and list a call, filter, operator, slice, ``~``
  or output buffer makes — charged *before* the allocation wherever one step can make a lot
  (``*``, ``**``, ``%``, ``+``, ``center``/``ljust``/``zfill``/``expandtabs``/``replace``/
  ``join``/``format``/``translate``/``to_bytes``, the ``center``, ``indent``, ``format``,
  ``replace``, ``join``, ``wordwrap``, ``batch``, ``slice``, ``sum``, ``tojson`` and
  ``pprint`` filters, ``lipsum``), and where a value is turned into text (``{{ }}``, ``~``,
  ``string``…) by an upper bound of its text's length, shared references counted each time.

Besides, nested calls (macro recursion, recursive loops) are bounded, integers are kept below
a number of bits, and a render past a wall-clock limit stops at its next step (a backstop: the
counts end every render known to run long well before it). Past a limit, a render raises
:class:`OverBudget` naming it. Constant folding at compile time, which Jinja does by calling
filters and operators on literals, is left to the metered render (``{{ "x"|center(10**10) }}``
would otherwise allocate while the template compiles).

The metering is code around what Jinja already calls per operation (the sandbox's ``call``,
``call_binop``, ``getitem``, the filters and tests), two rewrites of the parsed template (a
loop's iterable and ``~`` go through a metering filter) and a bounded ``concat`` for output
buffers, so a render of a real template costs about what it cost before.
"""

from __future__ import annotations

import functools
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import FunctionType
from typing import Any

from jinja2 import nodes
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

__all__ = ["BUDGET", "MeteredSandbox", "OverBudget", "RenderBudget", "charge", "metered"]


@dataclass(frozen=True)
class RenderBudget:
    """What one render of a template may use. The real templates of the families people
    tune (Llama 3, Qwen 2.5/3 with tools, Gemma 3, SmolLM3, ChatML) take a few hundred steps
    and a few times their conversation's length in characters."""

    steps: int = 1 << 17
    """Loop iterations, calls, filters, tests and operators."""
    chars: int = 1 << 25
    """Characters (and list items) made, the output included."""
    depth: int = 64
    """Nested calls: macro recursion, recursive loops."""
    int_bits: int = 1 << 16
    """The largest integer made, in bits."""
    seconds: float = 1.0
    """Wall-clock time, checked every few steps."""

    def describe(self, limit: str) -> str:
        """A limit in words, for the message of :class:`OverBudget`."""
        return {
            "steps": f"{self.steps:,} steps (loop iterations, calls, filters and operators)",
            "chars": f"{self.chars:,} characters made",
            "depth": f"{self.depth} nested calls (macro or loop recursion)",
            "int_bits": f"integers of {self.int_bits:,} bits",
            "seconds": f"{self.seconds:g} s",
        }[limit]


BUDGET = RenderBudget()
"""The budget of every render of a chat template."""


class OverBudget(Exception):  # noqa: N818 (what it says: over the budget)
    """A render went past a limit of its :class:`RenderBudget`; ``limit`` names the field."""

    def __init__(self, budget: RenderBudget, limit: str) -> None:
        super().__init__(f"past its budget of {budget.describe(limit)} per render")
        self.limit = limit


class _Meter:
    """What is left of one render's budget."""

    __slots__ = ("budget", "chars", "clock", "deadline", "depth", "shapes", "steps")

    def __init__(self, budget: RenderBudget, shapes: _Shapes | None) -> None:
        self.budget, self.shapes = budget, shapes
        self.steps, self.chars, self.depth = budget.steps, budget.chars, budget.depth
        self.deadline = time.monotonic() + budget.seconds
        self.clock = 0

    def step(self, n: int = 1) -> None:
        self.steps -= n
        self.clock += 1
        if self.steps < 0 or not self.clock & 15:
            self.check()

    def check(self) -> None:
        """Raise if past the steps or the time (what :meth:`step` does, inlined in loops)."""
        if self.steps < 0:
            raise OverBudget(self.budget, "steps")
        if time.monotonic() > self.deadline:
            raise OverBudget(self.budget, "seconds")

    def make(self, n: int) -> None:
        self.chars -= n
        if self.chars < 0:
            raise OverBudget(self.budget, "chars")


_Shapes = dict[int, tuple[Any, tuple[int, int, int]]]
""":func:`_shape` of lists and mappings of plain data, by ``id`` (with the object, which
keeps the id from being reused), for the renders of one conversation."""

_METER: ContextVar[_Meter | None] = ContextVar("llamatrain_template_meter", default=None)


class _Unmetered(Exception):  # noqa: N818
    """A metered operation outside :func:`metered`: Jinja folding constants while compiling
    (it then leaves the expression to the render), or a render that is not metered."""


def _meter() -> _Meter:
    meter = _METER.get()
    if meter is None:
        raise _Unmetered("chat templates render only inside metered()")
    return meter


class metered:  # noqa: N801 (a context manager, used as a function)
    """``with metered(budget, shapes):`` meters the render inside the block against
    ``budget``. Renders of the same data may share ``shapes`` (a dict, empty at first), which
    spares them measuring the same lists and mappings again (``tools | tojson``)."""

    __slots__ = ("budget", "shapes", "token")

    def __init__(self, budget: RenderBudget = BUDGET, shapes: _Shapes | None = None) -> None:
        self.budget, self.shapes = budget, shapes

    def __enter__(self) -> None:
        self.token = _METER.set(_Meter(self.budget, self.shapes))

    def __exit__(self, *exc: object) -> None:
        _METER.reset(self.token)


def charge(chars: int) -> None:
    """Charge the render in progress for ``chars`` characters about to be made (a helper of
    the template's own, such as ``strftime_now``)."""
    meter = _meter()
    meter.step()
    meter.make(chars)


# ----------------------------------------------------------------------------- sizes of values

_SIZED = (str, list, tuple, dict, bytes, set, frozenset)


def _size(value: Any) -> int:
    """The length of a string or container (what making it cost), else 0."""
    kind = type(value)
    if kind is str or kind is list or kind is dict:
        return len(value)
    return len(value) if isinstance(value, _SIZED) else 0


def _shape(meter: _Meter, value: Any) -> tuple[int, int, int]:
    """An upper bound of the length of ``value`` as text (``str``, ``repr``, or JSON with
    every character escaped), its number of nodes and its nesting depth; walking it is
    charged a step per node, so a shared or cyclic structure cannot make it run long."""
    if isinstance(value, str):
        return 6 * len(value) + 2, 1, 0
    memo = meter.shapes
    if memo is not None:
        known = memo.get(id(value))
        if known is not None and known[0] is value:
            meter.step(known[1][1])
            meter.make(0)
            if known[1][0] > meter.chars:
                raise OverBudget(meter.budget, "chars")
            return known[1]
    size = nodes_ = depth = 0
    plain = True
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        nodes_ += 1
        depth = max(depth, level)
        if isinstance(item, str):
            size += 6 * len(item) + 2
        elif isinstance(item, bytes):
            size += 4 * len(item) + 3
        elif isinstance(item, bool) or item is None:
            size += 5
        elif isinstance(item, int):
            size += item.bit_length() // 3 + 2
        elif isinstance(item, float):
            size += 24
        elif isinstance(item, Mapping | Namespace):
            plain = plain and type(item) is dict
            pairs = _items(item)
            meter.step(2 * len(pairs) + 1)
            size += 14 + 4 * len(pairs)
            stack.extend((x, level + 1) for pair in pairs for x in pair)
        elif isinstance(item, list | tuple | set | frozenset):
            meter.step(len(item) + 1)
            size += 2 + 2 * len(item)
            stack.extend((x, level + 1) for x in item)
        else:
            plain = False
            size += 64  # a macro, loop, cycler, undefined...: a short repr
        if size > meter.chars:
            raise OverBudget(meter.budget, "chars")
    if memo is not None and plain and type(value) in (dict, list):  # the sandbox keeps them
        memo[id(value)] = (value, (size, nodes_, depth))
    return size, nodes_, depth


def _items(mapping: Mapping | Namespace) -> list[tuple[Any, Any]]:
    if isinstance(mapping, Namespace):
        mapping = object.__getattribute__(mapping, "_Namespace__attrs")
    return list(mapping.items())


def _text_size(meter: _Meter, value: Any) -> int:
    return len(value) if isinstance(value, str) else _shape(meter, value)[0]


def _int(value: Any, default: int = 0) -> int:
    """An argument that sets a size, as a number (0 if it is not an integer)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _arg(args: tuple, kwargs: Mapping[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)


def _percent_cost(meter: _Meter, fmt: str, values: Any) -> None:
    """``fmt % values``: widths and precisions of its conversions (``*`` ones read from the
    values) and the text of the values."""
    given = list(values) if isinstance(values, tuple) else [values]
    total = len(fmt) + _text_size(meter, values)
    for width, precision, _ in _PERCENT.findall(fmt):
        for number in (width, precision):
            if number == "*":
                total += max(_int(given.pop(0) if given else 0), 0)
            elif number:
                total += int(number)
    meter.make(total)


_FORMATTER = string.Formatter()


def _format_cost(meter: _Meter, fmt: str, args: tuple, kwargs: Mapping[str, Any]) -> None:
    """``fmt.format(*args, **kwargs)``: the numbers in its format specs (widths, precisions,
    nested fields too) and the text of the values."""
    total = len(fmt) + sum(_text_size(meter, v) for v in (*args, *kwargs.values()))
    try:
        fields = list(_FORMATTER.parse(fmt))
    except ValueError:
        fields = []  # format() itself says what is wrong
    for _, _, spec, _ in fields:
        total += sum(int(n) for n in re.findall(r"\d+", spec or ""))
    meter.make(total)


# --------------------------------------------------------- calls: methods with a size argument


def _width(meter: _Meter, s: Any, args: tuple, kwargs: dict) -> None:
    meter.make(_int(_arg(args, kwargs, 0, "width", 0)))


def _expandtabs(meter: _Meter, s: Any, args: tuple, kwargs: dict) -> None:
    tabs = s.count("\t" if isinstance(s, str) else b"\t")
    meter.make(tabs * _int(_arg(args, kwargs, 0, "tabsize", 8)))


def _replace_cost(s: Any, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, type(s)) or not isinstance(new, type(s)):
        return 0  # replace() itself refuses them
    found = s.count(old) if old else len(s) + 1
    count = _int(count, -1)
    return (min(found, count) if count >= 0 else found) * len(new)


def _replace(meter: _Meter, s: Any, args: tuple, kwargs: dict) -> None:
    old, new = _arg(args, kwargs, 0, "old", ""), _arg(args, kwargs, 1, "new", "")
    meter.make(_replace_cost(s, old, new, _arg(args, kwargs, 2, "count", -1)))


def _join(meter: _Meter, s: Any, args: tuple, kwargs: dict) -> tuple:
    items = _listed(meter, args[0]) if args else []
    meter.make(sum(_size(x) for x in items) + len(s) * len(items))
    return (items, *args[1:])


def _format(meter: _Meter, s: Any, args: tuple, kwargs: dict) -> None:
    if isinstance(s, str):
        _format_cost(meter, s, args, kwargs)


def _format_map(meter: _Meter, s: Any, args: tuple, kwargs: dict) -> None:
    mapping = args[0] if args else {}
    if isinstance(s, str) and isinstance(mapping, Mapping):
        _format_cost(meter, s, (), mapping)


def _translate(meter: _Meter, s: Any, args: tuple, kwargs: dict) -> None:
    table = args[0] if args else None
    if isinstance(table, Mapping):
        longest = max((_size(v) for v in table.values()), default=1)
        meter.make(len(s) * max(longest, 1))


_METHOD_CHECKS: dict[str, Callable[[_Meter, Any, tuple, dict], tuple | None]] = {
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


_BUILTIN_METHOD = type("".strip)


def _check_method(meter: _Meter, method: Any, args: tuple, kwargs: dict) -> tuple:
    """Charge a call of a method of a string, list…: the length of what it reads, and first
    what the methods of :data:`_METHOD_CHECKS` may make. The arguments to call it with."""
    method = getattr(method, "__wrapped__", method)
    receiver = getattr(method, "__self__", None)
    if isinstance(receiver, _SIZED):
        meter.make(len(receiver))
        check = _METHOD_CHECKS.get(getattr(method, "__name__", ""))
        if check is not None and isinstance(receiver, str | bytes):
            args = check(meter, receiver, args, kwargs) or args
    elif isinstance(receiver, int) and getattr(method, "__name__", "") == "to_bytes":
        meter.make(_int(_arg(args, kwargs, 0, "length", 1)))
    return args


def _listed(meter: _Meter, iterable: Any) -> list:
    """An iterable as a list, its length charged first where it has one (an iterator from a
    filter is metered per item already)."""
    meter.make(_size(iterable))
    return list(iterable)


def _metered_items(meter: _Meter, iterator: Iterable[Any]) -> Iterator[Any]:
    for item in iterator:
        meter.steps -= 1  # meter.step(), inlined
        meter.clock += 1
        if meter.steps < 0 or not meter.clock & 15:
            meter.check()
        yield item


class _MeteredLoop:
    """A sized iterable whose iterations are charged as they happen (a loop's ``length``
    and ``last`` stay what they were)."""

    __slots__ = ("_items", "_meter")

    def __init__(self, meter: _Meter, items: Any) -> None:
        self._meter, self._items = meter, items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        return _metered_items(self._meter, self._items)


def _loop(value: Any) -> Any:
    """A loop's iterable, each iteration charged a step (the time limit is checked as they
    go, so a loop whose body is slow stops too)."""
    meter = _METER.get() or _meter()
    meter.step()
    try:
        len(value)
    except TypeError:
        return _metered_items(meter, iter(value))
    return _MeteredLoop(meter, value)


def _sized(value: Any) -> Any:
    """An operand of a comparison (``in``, ``==``: comparing reads it) or a slice (made),
    charged its length."""
    meter = _meter()
    meter.step()
    meter.make(_size(value))
    return value


def _add(values: list[Any]) -> Any:
    """``a + b + …``: as Python adds them, from the left, with what each sum makes charged
    before it is made (a string that doubles itself is stopped long before it is large)."""
    meter = _METER.get() or _meter()
    made = 0
    for value in values:
        if type(value) is not str:
            break
        made += len(value)
    else:  # the common case, strings: one charge, one join
        meter.chars -= made
        meter.steps -= 1
        if meter.chars < 0 or meter.steps < 0:
            meter.make(0)
            meter.check()
        return "".join(values)
    meter.step()
    total = values[0]
    for value in values[1:]:
        meter.step()
        if isinstance(total, _SIZED) and isinstance(value, _SIZED):
            meter.make(len(total) + len(value))
        total = total + value
        if type(total) is int and total.bit_length() > meter.budget.int_bits:
            raise OverBudget(meter.budget, "int_bits")
    return total


def _concat(values: list[Any]) -> str:
    """``a ~ b ~ …``: as Jinja's ``str_join``, with what it makes charged first."""
    meter = _meter()
    meter.step()
    parts = []
    for value in values:
        if not isinstance(value, str):
            meter.make(_text_size(meter, value))
            value = str(value)
        parts.append(value)
    meter.make(sum(map(len, parts)))
    return "".join(parts)


def _finalize(value: Any) -> Any:
    """What ``{{ value }}`` prints: text made from a list or mapping is charged first (a list
    may hold one long string many times)."""
    if type(value) is str:
        return value
    meter = _meter()
    meter.make(_text_size(meter, value))
    return value


# ------------------------------------------------------------------------------------- filters


def _filter_center(meter: _Meter, args: tuple, kwargs: dict) -> None:
    meter.make(_int(_arg(args, kwargs, 1, "width", 80)))


def _filter_indent(meter: _Meter, args: tuple, kwargs: dict) -> None:
    s, width = args[0], _arg(args, kwargs, 1, "width", 4)
    lines = (s.count("\n") if isinstance(s, str) else 0) + 1
    meter.make(lines * (len(width) if isinstance(width, str) else _int(width)))


def _filter_format(meter: _Meter, args: tuple, kwargs: dict) -> None:
    fmt, values = args[0], args[1:]
    if isinstance(fmt, str):
        _percent_cost(meter, fmt, kwargs if kwargs else values)


def _filter_replace(meter: _Meter, args: tuple, kwargs: dict) -> None:
    s = args[0]
    old, new = _arg(args, kwargs, 1, "old", ""), _arg(args, kwargs, 2, "new", "")
    if isinstance(s, str):
        meter.make(_replace_cost(s, str(old), str(new), _arg(args, kwargs, 3, "count", None)))


def _filter_join(meter: _Meter, args: tuple, kwargs: dict) -> tuple:
    items = _listed(meter, args[0])
    glue = _arg(args, kwargs, 1, "d", "")
    meter.make(sum(_text_size(meter, x) for x in items) + _size(glue) * len(items))
    return (items, *args[1:])


def _filter_wordwrap(meter: _Meter, args: tuple, kwargs: dict) -> None:
    s, wrap = args[0], _arg(args, kwargs, 4, "wrapstring", None)
    if isinstance(wrap, str) and isinstance(s, str):
        meter.make((len(s) + 1) * len(wrap))


def _filter_fill(position: int, name: str) -> Callable[[_Meter, tuple, dict], None]:
    """``batch(n, fill_with)``, ``slice(n, fill_with)``: ``n`` items may be made."""

    def check(meter: _Meter, args: tuple, kwargs: dict) -> None:
        meter.step(max(_int(_arg(args, kwargs, position, name, 0)), 0))

    return check


def _filter_sum(meter: _Meter, args: tuple, kwargs: dict) -> tuple:
    items = _listed(meter, args[0])
    start = _arg(args, kwargs, 2, "start", 0)
    sizes = sum(_size(x) for x in items) + _size(start)
    meter.make(sizes * len(items) if sizes else len(items))  # sums of lists copy as they go
    return (items, *args[1:])


def _filter_tojson(meter: _Meter, args: tuple, kwargs: dict) -> None:
    size, count, depth = _shape(meter, args[0])
    indent = _arg(args, kwargs, 2, "indent", None)
    separators = _arg(args, kwargs, 3, "separators", None)
    per_node = 2 + depth * (len(indent) if isinstance(indent, str) else max(_int(indent), 0))
    if isinstance(separators, tuple | list):
        per_node += sum(_size(s) for s in separators)
    meter.make(size + count * per_node)


def _filter_pprint(meter: _Meter, args: tuple, kwargs: dict) -> None:
    size, count, depth = _shape(meter, args[0])
    meter.make(size + count * (depth + 2))


_FILTER_CHECKS: dict[str, Callable[[_Meter, tuple, dict], tuple | None]] = {
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
_TEXT_FILTERS = frozenset(
    {
        *("capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower"),
        *("replace", "safe", "string", "striptags", "title", "trim", "truncate", "upper"),
        *("urlencode", "urlize", "wordcount", "wordwrap", "xmlattr"),
    }
)
"""Filters that turn their value into text: a list or mapping given to them is charged its
text's length."""


def _metered_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    skip = 0 if _PassArg.from_obj(function) is None else 1  # the context Jinja passes first
    check = _FILTER_CHECKS.get(name)
    to_text = name in _TEXT_FILTERS

    @functools.wraps(function)
    def metered_filter(*args: Any, **kwargs: Any) -> Any:
        meter = _METER.get() or _meter()
        meter.step()
        if len(args) > skip:
            value = args[skip]
            meter.make(
                len(value)
                if type(value) is str
                else _text_size(meter, value)
                if to_text
                else _size(value)
            )
            if check is not None:
                checked = check(meter, args[skip:], kwargs)
                if checked is not None:
                    args = (*args[:skip], *checked)
        result = function(*args, **kwargs)
        kind = type(result)
        if kind is str or kind is list or kind is dict or isinstance(result, _SIZED):
            meter.make(len(result))
        elif hasattr(result, "__next__"):  # map, select…: charged as they go
            return _metered_items(meter, result)
        return result

    return metered_filter


_CHEAP_TESTS = frozenset(
    {
        *("boolean", "callable", "defined", "escaped", "false", "filter", "float", "integer"),
        *("iterable", "mapping", "none", "number", "sameas", "sequence", "string", "test"),
        *("true", "undefined"),
    }
)
"""Tests that take the same short time whatever they are given (the others compare or read
their values: ``in``, ``eq``, ``upper``…)."""


def _metered_test(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def metered_test(*args: Any, **kwargs: Any) -> Any:
        meter = _meter()
        meter.step()
        meter.make(sum(_size(a) for a in args))  # ``in``, ``eq``: they read their values
        return function(*args, **kwargs)

    return metered_test


# ----------------------------------------------------------------------------- the environment

_LOOP, _ADD, _CONCAT, _SIZED_ = (
    "llamatrain:loop",
    "llamatrain:add",
    "llamatrain:concat",
    "llamatrain:sized",
)
"""Filters the parsed template is rewritten to call (no template can name them: a filter's
name in a template is an identifier)."""


def _filtered(node: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)


class _Rewrite(NodeTransformer):
    """Every loop's iterable through :func:`_loop`, every ``+`` chain through :func:`_add`
    (one call for ``a + b + c``), every ``~`` chain through :func:`_concat`,
    every operand of a comparison but a literal through :func:`_sized`, as is every slice."""

    def visit_Compare(self, node: nodes.Compare) -> nodes.Node:
        """``x in y`` reads ``y``; ``x == y`` (``<``…) reads the shorter of the two, so a
        literal on either side bounds it."""
        node = self.generic_visit(node)
        left = node.expr
        for operand in node.ops:
            right = operand.expr
            if operand.op in ("in", "notin"):
                if not isinstance(right, nodes.Const):
                    operand.expr = _filtered(right, _SIZED_)
            elif not isinstance(left, nodes.Const) and not isinstance(right, nodes.Const):
                operand.expr = _filtered(right, _SIZED_)
            left = right
        return node

    def visit_Add(self, node: nodes.Add) -> nodes.Node:
        node = self.generic_visit(node)
        left = node.left  # a + b + c is Add(Add(a, b), c): one call for the chain
        if isinstance(left, nodes.Filter) and left.name == _ADD:
            operands = [*left.node.items, node.right]  # type: ignore[attr-defined]
        else:
            operands = [left, node.right]
        return _filtered(nodes.List(operands, lineno=node.lineno), _ADD)

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        node = self.generic_visit(node)  # Jinja slices without the sandbox's getitem
        return _filtered(node, _SIZED_) if isinstance(node.arg, nodes.Slice) else node

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = _filtered(node.iter, _LOOP)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return _filtered(nodes.List(node.nodes, lineno=node.lineno), _CONCAT)


class MeteredSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with every render metered (see the module docstring).
    Templates of it render only inside :func:`metered`. Filters and tests added after it is
    made must be metered by :meth:`meter_filters`."""

    intercepted_binops = frozenset({"-", "*", "/", "//", "%", "**"})  # "+": see _Rewrite

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=_finalize, **options)
        self.filters.update({_LOOP: _loop, _ADD: _add, _CONCAT: _concat, _SIZED_: _sized})
        self.meter_filters()

    def meter_filters(self) -> None:
        """Meter every filter and test not metered yet."""
        for name, function in self.filters.items():
            if name not in (_LOOP, _ADD, _CONCAT, _SIZED_) and not hasattr(
                function, "_llamatrain_metered"
            ):
                self.filters[name] = _metered_filter(name, function)
                self.filters[name]._llamatrain_metered = True  # type: ignore[attr-defined]
        for name, function in self.tests.items():
            if name not in _CHEAP_TESTS and not hasattr(function, "_llamatrain_metered"):
                self.tests[name] = _metered_test(function)
                self.tests[name]._llamatrain_metered = True  # type: ignore[attr-defined]

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _Rewrite().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override]
        """The output of a render, a macro, a block ``set`` or ``filter``: its length charged
        before it is joined."""
        pieces = parts if type(parts) is list else list(parts)
        _meter().make(sum(map(len, pieces)))
        return "".join(pieces)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        meter = _meter()
        meter.step()
        if operator == "*":
            self._check_mul(meter, left, right)
        elif operator == "**":
            self._check_pow(meter, left, right)
        elif operator == "%" and isinstance(left, str):
            _percent_cost(meter, left, right)
        result = self.binop_table[operator](left, right)
        if type(result) is int and result.bit_length() > meter.budget.int_bits:
            raise OverBudget(meter.budget, "int_bits")
        return result

    @staticmethod
    def _check_mul(meter: _Meter, left: Any, right: Any) -> None:
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > meter.budget.int_bits:
                raise OverBudget(meter.budget, "int_bits")
        elif isinstance(left, _SIZED) or isinstance(right, _SIZED):
            sized, times = (left, right) if isinstance(left, _SIZED) else (right, left)
            meter.make(len(sized) * max(_int(times), 0))

    @staticmethod
    def _check_pow(meter: _Meter, base: Any, exponent: Any) -> None:
        if (
            isinstance(base, int)
            and isinstance(exponent, int)
            and exponent > 0
            and (base.bit_length() - 1) * exponent > meter.budget.int_bits
        ):
            raise OverBudget(meter.budget, "int_bits")

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        meter = _METER.get() or _meter()
        meter.step()
        kind = type(__obj)
        if kind is _BUILTIN_METHOD or (kind is FunctionType and hasattr(__obj, "__wrapped__")):
            args = _check_method(meter, __obj, args, kwargs)  # the latter: str.format's wrapper
        elif kind is LoopContext and args:  # a recursive loop's next level
            args = (_loop(args[0]), *args[1:])
        elif __obj is generate_lorem_ipsum:
            n, most = _arg(args, kwargs, 0, "n", 5), _arg(args, kwargs, 3, "max", 100)
            meter.make(max(_int(n), 0) * max(_int(most), 0) * 16)
        meter.depth -= 1
        try:
            if meter.depth < 0:
                raise OverBudget(meter.budget, "depth")
            result = super().call(__context, __obj, *args, **kwargs)
        finally:
            meter.depth += 1
        kind = type(result)
        if kind is str or kind is list or kind is dict or isinstance(result, _SIZED):
            meter.chars -= len(result)
            if meter.chars < 0:
                raise OverBudget(meter.budget, "chars")
        return result
