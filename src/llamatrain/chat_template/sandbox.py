"""The sandbox chat templates run in, with a budget for each render: the Jinja environment
every template compiles in (:func:`environment`).

Jinja's immutable sandbox keeps a template away from Python's internals, but not from time and
memory: ``{% for i in range(100000) %}{% for j in range(100000) %}…`` runs for hours and
``{{ "a" * 4000000000 }}`` asks for gigabytes. Here every render is metered (:func:`render`),
counting two things against a :class:`~.budget.RenderBudget`:

- *steps*: loop iterations (a small loop over a sized iterable is charged its length when it
  starts, a large one or an iterator per item), calls (macros, methods, globals), filters
  (but ``length``, ``first``, ``last``, ``default``, which take the same short time whatever
  they are given), tests and the operators that can make more than they are given (``+`` of
  anything but strings, ``*``, ``%`` but between integers, ``**``);
- *characters made*: the length of every string and list a call, filter, operator, slice, ``~``
  or output buffer makes — charged *before* the allocation wherever one step can make a lot
  (``*``, ``**``, ``%``, ``+`` of lists, ``center``/``ljust``/``zfill``/``expandtabs``/
  ``replace``/``join``/``format``/``translate``/``to_bytes``, the ``center``, ``indent``,
  ``format``, ``replace``, ``join``, ``wordwrap``, ``batch``, ``slice``, ``sum``, ``tojson``
  and ``pprint`` filters, ``lipsum``), right after it where one step makes at most what its
  operands hold (a ``+`` or ``~`` of strings), and where a value is turned into text
  (``{{ }}``, ``~``, ``string``…) by an upper bound of its text's length, shared references
  counted each time. What a call or comparison reads (a string searched, split, compared, the
  arguments of its methods) is charged as made.

Besides, nested calls (macro recursion, recursive loops) are bounded, integers are kept below
a number of bits, and a render past a wall-clock limit stops at its next step (a backstop: the
counts end every render known to run long well before it). Past a limit, a render raises
:class:`~.budget.OverBudget` naming it. Constant folding at compile time, which Jinja
does by calling filters and operators on literals, is left to the metered render
(``{{ "x"|center(10**10) }}`` would otherwise allocate while the template compiles).

The metering is code around what Jinja already calls per operation (the sandbox's ``call``,
``call_binop``, ``getitem``, the filters and tests), rewrites of the parsed template and the
code generated for them (``codegen``: a loop's iterable, ``+``, ``~``, comparisons and
slices go through a metering filter of this module, their common case — strings, a small list
— written in line instead; a loop's body is weighed once, when the template compiles), and a
bounded ``concat`` for output buffers. What it costs a real template per render and per
example is in bench/README.md (``bench/template_budget.py``). The budget and its meter are
``budget``; what each operation may make, checked before it is made, is ``costs``; what
transformers lets a template call is ``helpers``; this module is the environment that calls
them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from types import FunctionType
from typing import Any

from jinja2 import nodes
from jinja2.environment import Template
from jinja2.exceptions import SecurityError
from jinja2.filters import FILTERS
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg, generate_lorem_ipsum

from llamatrain.chat_template import helpers
from llamatrain.chat_template.budget import (
    BUDGET,
    METER,
    Meter,
    OverBudget,
    RenderBudget,
    Shapes,
    current_meter,
)
from llamatrain.chat_template.codegen import (
    ADD,
    CHARGE_SIZE,
    CHARGED_AHEAD,
    CONCAT,
    LOOP,
    METERING_FILTERS,
    MeteredCodeGenerator,
    Rewrite,
)
from llamatrain.chat_template.costs import (
    FILTER_CHECKS,
    READING_STR_METHODS,
    SIZED,
    TEXT_FILTERS,
    arg_at,
    check_method,
    check_mul,
    check_pow,
    int_arg,
    percent_cost,
    read_size,
    size_of,
    text_size,
)

__all__ = ["MeteredSandbox", "environment", "render"]

_BUILTIN_METHOD = type("".strip)


def _metered_items(meter: Meter, iterator: Iterable[Any]) -> Iterator[Any]:
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

    def __init__(self, meter: Meter, items: Any) -> None:
        self._meter, self._items = meter, items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Any]:
        return _metered_items(self._meter, self._items)


def _loop(value: Any, body: int = 1) -> Any:
    """A loop's iterable (``body``: the nodes of the loop's body, counted when the template
    is compiled), each iteration charged a step: all before the loop starts when the loop is
    small (a list, as a real template's messages, is charged so in line by the code of
    ``codegen``; a loop that breaks early is charged in full, an upper bound), else
    as they happen."""
    meter = METER.get() or current_meter()
    try:
        n = len(value)
    except (TypeError, OverflowError):  # no length (charged per item) or a huge range
        meter.step()
        return _metered_items(meter, iter(value))
    if n * body > CHARGED_AHEAD:
        meter.step()
        return _MeteredLoop(meter, value)
    meter.step(n + 1)
    return value


def _sized(value: Any) -> Any:
    """An operand of a comparison (``in``, ``==``: comparing reads it) or a slice (made),
    charged its length."""
    meter = current_meter()
    meter.step()
    meter.make(size_of(value))
    return value


def _add(values: list[Any]) -> Any:
    """``a + b + …`` where the code of ``codegen`` does not add in line: as Python
    adds them, from the left, with what each sum makes charged before it is made (a list that
    doubles itself is stopped before it is large); a sum of strings past the budget (which
    the code in line gives here) is charged and stopped."""
    meter = METER.get() or current_meter()
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
        if isinstance(total, SIZED) and isinstance(value, SIZED):
            meter.make(len(total) + len(value))
        total = total + value
        if type(total) is int and total.bit_length() > meter.budget.int_bits:
            raise OverBudget(meter.budget, "int_bits")
    return total


def _concat(values: list[Any]) -> str:
    """``a ~ b ~ …``: as Jinja's ``str_join``, with what it makes charged first."""
    meter = current_meter()
    meter.step()
    parts = []
    for value in values:
        if not isinstance(value, str):
            meter.make(text_size(meter, value))
            value = str(value)
        parts.append(value)
    meter.make(sum(map(len, parts)))
    return "".join(parts)


def _finalize(value: Any) -> Any:
    """What ``{{ value }}`` prints: text made from a list or mapping is charged first (a list
    may hold one long string many times)."""
    if type(value) is str:
        return value
    meter = current_meter()
    meter.make(text_size(meter, value))
    return value


def _call_reading_method(meter: Meter, method: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """A call of a method of :data:`READING_STR_METHODS` (``strip``, ``startswith``,
    ``split``…) from :meth:`MeteredSandbox.call`: what it reads charged before, what it makes
    after (at most what it read). It calls no template code and is safe, so the sandbox's
    ``is_safe_callable`` and ``Context.call`` (which would only drop the loop variables
    Jinja passes) are skipped."""
    kwargs.pop("_loop_vars", None)
    kwargs.pop("_block_vars", None)
    meter.make(len(method.__self__) + read_size(args, kwargs))
    result = method(*args, **kwargs)
    if type(result) is str or type(result) is list:
        meter.make(len(result))
    return result


def _metered_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    skip = 0 if _PassArg.from_obj(function) is None else 1  # the context Jinja passes first
    check = FILTER_CHECKS.get(name)
    to_text = name in TEXT_FILTERS

    @functools.wraps(function)
    def metered_filter(*args: Any, **kwargs: Any) -> Any:
        meter = METER.get() or current_meter()
        meter.step()
        if len(args) > skip:
            value = args[skip]
            meter.make(
                len(value)
                if type(value) is str
                else text_size(meter, value)
                if to_text
                else size_of(value)
            )
            if check is not None:
                checked = check(meter, args[skip:], kwargs)
                if checked is not None:
                    args = (*args[:skip], *checked)
        result = function(*args, **kwargs)
        kind = type(result)
        if kind is str or kind is list or kind is dict or isinstance(result, SIZED):
            meter.make(len(result))
        elif hasattr(result, "__next__"):  # map, select…: charged as they go
            return _metered_items(meter, result)
        return result

    return metered_filter


_FREE_FILTERS = frozenset({"count", "d", "default", "first", "last", "length"})
"""Filters that take the same short time and make nothing whatever they are given (a
length, an item, the value or its default): they run unmetered, without a wrapper's call."""

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
        meter = current_meter()
        meter.step()
        meter.make(sum(size_of(a) for a in args))  # ``in``, ``eq``: they read their values
        return function(*args, **kwargs)

    return metered_test


# ----------------------------------------------------------------------------- the environment


class MeteredSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with every render metered (see the module docstring).
    Templates of it render only by :func:`render`. Filters and tests added after it is
    made must be metered by :meth:`meter_filters`."""

    intercepted_binops = frozenset({"*", "%", "**"})
    """The operators that can make more than they are given (``+``: see ``codegen``);
    ``-``, ``/`` and ``//`` make at most one bit more than their operands."""
    code_generator_class = MeteredCodeGenerator
    current_meter = staticmethod(current_meter)
    """The meter of the render in progress, which every function of a template reads first."""

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=_finalize, **options)
        self.filters.update({LOOP: _loop, ADD: _add, CONCAT: _concat, CHARGE_SIZE: _sized})
        self.meter_filters()

    def meter_filters(self) -> None:
        """Meter every filter and test not metered yet (but Jinja's own filters of
        :data:`_FREE_FILTERS`)."""
        for name, function in self.filters.items():
            free = name in _FREE_FILTERS and function is FILTERS.get(name)
            if not (free or name in METERING_FILTERS or hasattr(function, "_llamatrain_metered")):
                self.filters[name] = _metered_filter(name, function)
                self.filters[name]._llamatrain_metered = True  # type: ignore[attr-defined]
        for name, function in self.tests.items():
            if name not in _CHEAP_TESTS and not hasattr(function, "_llamatrain_metered"):
                self.tests[name] = _metered_test(function)
                self.tests[name]._llamatrain_metered = True  # type: ignore[attr-defined]

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = Rewrite().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def concat(self, parts: Iterable[str]) -> str:  # type: ignore[override]
        """The output of a render, a macro, a block ``set`` or ``filter``: its length charged
        before it is joined."""
        pieces = parts if type(parts) is list else list(parts)
        meter = METER.get() or current_meter()
        meter.chars -= sum(map(len, pieces))
        if meter.chars < 0:
            raise OverBudget(meter.budget, "chars")
        return "".join(pieces)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        meter = current_meter()
        meter.step()
        if operator == "*":
            check_mul(meter, left, right)
        elif operator == "**":
            check_pow(meter, left, right)
        elif operator == "%" and isinstance(left, str):
            percent_cost(meter, left, right)
        result = self.binop_table[operator](left, right)
        if type(result) is int and result.bit_length() > meter.budget.int_bits:
            raise OverBudget(meter.budget, "int_bits")
        return result

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        meter = METER.get() or current_meter()
        meter.step()
        kind = type(__obj)
        if (
            kind is _BUILTIN_METHOD
            and type(__obj.__self__) is str
            and __obj.__name__ in READING_STR_METHODS
        ):
            return _call_reading_method(meter, __obj, args, kwargs)
        if kind is _BUILTIN_METHOD or (kind is FunctionType and hasattr(__obj, "__wrapped__")):
            args = check_method(meter, __obj, args, kwargs)  # the latter: str.format's wrapper
        elif kind is LoopContext and args:  # a recursive loop's next level
            args = (_loop(args[0]), *args[1:])
        elif __obj is generate_lorem_ipsum:
            n, most = arg_at(args, kwargs, 0, "n", 5), arg_at(args, kwargs, 3, "max", 100)
            meter.make(max(int_arg(n), 0) * max(int_arg(most), 0) * 16)
        meter.depth -= 1
        try:
            if meter.depth < 0:
                raise OverBudget(meter.budget, "depth")
            if not __self.is_safe_callable(__obj):  # SandboxedEnvironment.call, in line
                raise SecurityError(f"{__obj!r} is not safely callable")
            result = __context.call(__obj, *args, **kwargs)
        finally:
            meter.depth += 1
        kind = type(result)
        if kind is str or kind is list or kind is dict or isinstance(result, SIZED):
            meter.chars -= len(result)
            if meter.chars < 0:
                raise OverBudget(meter.budget, "chars")
        return result


@functools.cache
def environment() -> MeteredSandbox:
    """The environment every chat template compiles in: the immutable sandbox (no attribute
    access to Python internals, no mutating the messages), metered per render, with
    transformers' settings and helpers (:mod:`~.helpers`), so that a template renders as
    ``apply_chat_template`` renders it."""
    env = MeteredSandbox(**helpers.OPTIONS)
    env.filters.update(helpers.FILTERS)
    env.globals.update(helpers.GLOBALS)
    env.meter_filters()
    return env


def render(
    template: Template,
    variables: dict[str, Any],
    shapes: Shapes | None = None,
    budget: RenderBudget = BUDGET,
) -> str:
    """One render of a template of a :class:`MeteredSandbox` within ``budget``: what
    ``template.render(**variables)`` does, from its root render function and with the context
    of :func:`_new_context`. Renders of the same data may share ``shapes`` (a dict, empty at
    first), which spares them measuring the same lists and mappings again (``tools |
    tojson``)."""
    meter = Meter(budget, shapes)
    token = METER.set(meter)
    try:
        pieces = list(template.root_render_func(_new_context(template, variables)))
        meter.chars -= sum(map(len, pieces))  # what concat() does, in line
        if meter.chars < 0:
            raise OverBudget(budget, "chars")
        return "".join(pieces)
    except Exception:
        template.environment.handle_exception()  # raises it, the template's lines in it
    finally:
        METER.reset(token)


def _new_context(template: Template, variables: dict[str, Any]) -> Context:
    """``template.new_context(variables)``: the same context, made from the template's globals
    merged into a dict once. Jinja walks its ``ChainMap`` of them twice, key by key in Python,
    which took most of the fixed cost of a render (5 of 8 us)."""
    merged: dict[str, Any] = {}
    for scope in reversed(template.globals.maps):
        merged.update(scope)
    environment = template.environment
    return environment.context_class(
        environment, {**merged, **variables}, template.name, template.blocks, globals=merged
    )
