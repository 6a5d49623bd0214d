"""The sandbox chat templates run in, with a budget for each render.

Jinja's immutable sandbox keeps a template away from Python's internals, but not from time and
memory: ``{% for i in range(100000) %}{% for j in range(100000) %}…`` runs for hours and
``{{ "a" * 4000000000 }}`` asks for gigabytes. Here every render is metered
(:func:`render`), counting two things against a
:class:`~.template_budget.RenderBudget`:

- *steps*: loop iterations (a small loop over a sized iterable is charged its length when it
  starts, a large one or an iterator per item), calls (macros, methods, globals), filters,
  tests and the operators that can make more than they are given (``+``, ``*``, ``%``, ``**``);
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
:class:`~.template_budget.OverBudget` naming it. Constant folding at compile time, which Jinja
does by calling filters and operators on literals, is left to the metered render
(``{{ "x"|center(10**10) }}`` would otherwise allocate while the template compiles).

The metering is code around what Jinja already calls per operation (the sandbox's ``call``,
``call_binop``, ``getitem``, the filters and tests), rewrites of the parsed template (a loop's
iterable, ``+``, ``~``, comparisons and slices go through a metering filter; a loop's body is
weighed once, when the template compiles), what ``{{ }}`` prints checked in line
(:class:`_CodeGenerator`) and a bounded ``concat`` for output buffers. What it costs a real
template per render is in bench/README.md (``bench/template_budget.py``). The budget and its
meter are ``template_budget``; what each operation may make, checked before it is made, is
``template_costs``; this module is the environment that calls them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from types import FunctionType
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.environment import Template
from jinja2.exceptions import SecurityError
from jinja2.runtime import Context, LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

from llamatrain.data.template_budget import (
    BUDGET,
    METER,
    Meter,
    OverBudget,
    RenderBudget,
    Shapes,
    current_meter,
)
from llamatrain.data.template_costs import (
    FILTER_CHECKS,
    SIZED,
    TEXT_FILTERS,
    arg_at,
    check_method,
    check_mul,
    check_pow,
    int_arg,
    percent_cost,
    size_of,
    text_size,
)

__all__ = ["MeteredSandbox", "render"]

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


_CHARGED_AHEAD = 1 << 14
"""The most work (iterations times the nodes of the loop's body) a loop may be charged for
before it starts; a larger loop is charged as it goes, checking the clock every few
iterations, so that a long body of operations that cost no step cannot run long unseen."""


def _loop(value: Any, body: int = 1) -> Any:
    """A loop's iterable (``body``: the nodes of the loop's body, counted when the template
    is compiled), each iteration charged a step: all before the loop starts when the loop is
    small (one call, as a real template's loop over its messages; a loop that breaks early is
    charged in full, an upper bound), else as they happen."""
    meter = METER.get() or current_meter()
    try:
        n = len(value)
    except (TypeError, OverflowError):  # no length (charged per item) or a huge range
        meter.step()
        return _metered_items(meter, iter(value))
    if n * body > _CHARGED_AHEAD:
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
    """``a + b + …``: as Python adds them, from the left, with what each sum makes charged
    before it is made (a string that doubles itself is stopped long before it is large)."""
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

_LOOP, _ADD, _CONCAT, _SIZED_ = (
    "llamatrain:loop",
    "llamatrain:add",
    "llamatrain:concat",
    "llamatrain:sized",
)
"""Filters the parsed template is rewritten to call (no template can name them: a filter's
name in a template is an identifier)."""


def _filtered(node: nodes.Expr, name: str, *args: nodes.Expr) -> nodes.Filter:
    return nodes.Filter(node, name, list(args), [], None, None, lineno=node.lineno)


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
        body = sum(1 + sum(1 for _ in n.find_all(nodes.Node)) for n in node.body + node.else_)
        node.iter = _filtered(node.iter, _LOOP, nodes.Const(body, lineno=node.lineno))
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return _filtered(nodes.List(node.nodes, lineno=node.lineno), _CONCAT)


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator, with what ``{{ value }}`` prints checked in line: a string is
    printed as it is (``str()`` of a string is that string), anything else goes through
    :func:`_finalize`, which charges its text first. The most frequent operation of a chat
    template costs less than it did unmetered."""

    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super()._output_child_pre(node, frame, finalize)
        else:
            self.write("(_llamatrain_out if type(_llamatrain_out := ")

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super()._output_child_post(node, frame, finalize)
        else:
            self.write(") is str else str(environment.finalize(_llamatrain_out)))")


class MeteredSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with every render metered (see the module docstring).
    Templates of it render only by :func:`render`. Filters and tests added after it is
    made must be metered by :meth:`meter_filters`."""

    intercepted_binops = frozenset({"*", "%", "**"})
    """The operators that can make more than they are given (``+``: see :class:`_Rewrite`);
    ``-``, ``/`` and ``//`` make at most one bit more than their operands."""
    code_generator_class = _CodeGenerator

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


def render(
    template: Template,
    variables: dict[str, Any],
    shapes: Shapes | None = None,
    budget: RenderBudget = BUDGET,
) -> str:
    """One render of a template of a :class:`MeteredSandbox` within ``budget``: what
    ``template.render(**variables)`` does, from its root render function, so a render costs no
    call or copy of the variables more than an unmetered one. Renders of the same data may
    share ``shapes`` (a dict, empty at first), which spares them measuring the same lists and
    mappings again (``tools | tojson``)."""
    meter = Meter(budget, shapes)
    token = METER.set(meter)
    try:
        pieces = list(template.root_render_func(template.new_context(variables)))
        meter.chars -= sum(map(len, pieces))  # what concat() does, in line
        if meter.chars < 0:
            raise OverBudget(budget, "chars")
        return "".join(pieces)
    except Exception:
        template.environment.handle_exception()  # raises it, the template's lines in it
    finally:
        METER.reset(token)
