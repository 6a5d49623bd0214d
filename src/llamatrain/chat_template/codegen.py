"""How a chat template compiles in the metered sandbox: the parsed template rewritten so that
its operations are metered, and the Python code generated for them.

:class:`Rewrite` routes every loop's iterable, ``+`` chain, ``~`` chain, slice and compared
operand through a metering filter of ``sandbox`` (:data:`LOOP`, :data:`ADD`, :data:`CONCAT`,
:data:`CHARGE_SIZE`). :class:`MeteredCodeGenerator` then writes the common
case of each in line instead of a call, since a call costs more than the operation: a ``+``
or ``~`` of strings is made and its length charged to the render's meter (which every
function of the template reads once, from ``environment.current_meter()``); a string
compared or trimmed is charged its length; a small list looped over is charged its length in
steps; ``{{ }}`` of a string prints it as it is. So are ``s.strip('…')``, ``s.startswith(…)``
and the like on a string (charged what they read) and ``%`` between integers. Anything else
(another type, a large loop, a charge past the budget) goes to the metering filter, or the
sandbox's ``call``/``call_binop``, which charge it or raise. The code reads the meter's
``chars`` (``steps``) and writes it back with ``setattr``: an expression cannot assign an
attribute, and ``setattr`` costs far less than a call of a Python function.

A ``+`` or ``~`` makes no more than its operands hold, which exist already (charged, or the
conversation's own data), so it is charged right after it is made: memory stays within about
twice what the budget allows. Each operand is generated once (never copied into two branches,
so that nested operations cannot blow up the generated code).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.filters import do_trim
from jinja2.visitor import NodeTransformer

__all__ = [
    "ADD",
    "CHARGED_AHEAD",
    "CHARGE_SIZE",
    "CONCAT",
    "LOOP",
    "METERING_FILTERS",
    "MeteredCodeGenerator",
    "Rewrite",
]

LOOP, ADD, CONCAT, CHARGE_SIZE = (
    "llamatrain:loop",
    "llamatrain:add",
    "llamatrain:concat",
    "llamatrain:sized",
)
"""Filters the parsed template is rewritten to call (no template can name them: a filter's
name in a template is an identifier)."""
METERING_FILTERS = (LOOP, ADD, CONCAT, CHARGE_SIZE)

CHARGED_AHEAD = 1 << 14
"""The most work (iterations times the nodes of the loop's body) a loop may be charged for
before it starts; a larger loop is charged as it goes, checking the clock every few
iterations, so that a long body of operations that cost no step cannot run long unseen."""

_METER = "_llamatrain_meter"
"""The local variable of every generated function that holds the render's meter."""

_READING_METHODS = frozenset({"endswith", "lstrip", "rstrip", "startswith", "strip"})
"""Methods of ``str`` that make at most the string they are called on: a call of one with
literal arguments is charged what it reads, in line."""

_SHORT = (nodes.Const, nodes.Compare, nodes.Test, nodes.Not)
"""Expressions whose value is a literal or a bool: comparing one reads little."""


def _filtered(node: nodes.Expr, name: str, *args: nodes.Expr) -> nodes.Filter:
    return nodes.Filter(node, name, list(args), [], None, None, lineno=node.lineno)


class Rewrite(NodeTransformer):
    """Every loop's iterable through :data:`LOOP`, every ``+`` chain through :data:`ADD`
    (one node for ``a + b + c``), every ``~`` chain through :data:`CONCAT`, every compared
    operand that could be long (see :meth:`visit_Compare`) through :data:`CHARGE_SIZE`, as
    is every slice."""

    def visit_Compare(self, node: nodes.Compare) -> nodes.Node:
        """``x in y`` reads ``y``; ``x == y`` (``<``…) reads the shorter of the two, so a
        literal or a bool (a comparison, a test) on either side bounds it."""
        node = self.generic_visit(node)
        left = node.expr
        for operand in node.ops:
            right = operand.expr
            if isinstance(right, _SHORT):
                pass
            elif operand.op in ("in", "notin") or not isinstance(left, _SHORT):
                operand.expr = _filtered(right, CHARGE_SIZE)
            left = right
        return node

    def visit_Add(self, node: nodes.Add) -> nodes.Node:
        node = self.generic_visit(node)
        left = node.left  # a + b + c is Add(Add(a, b), c): one node for the chain
        if isinstance(left, nodes.Filter) and left.name == ADD:
            operands = [*left.node.items, node.right]  # type: ignore[attr-defined]
        else:
            operands = [left, node.right]
        return _filtered(nodes.List(operands, lineno=node.lineno), ADD)

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        node = self.generic_visit(node)  # Jinja slices without the sandbox's getitem
        return _filtered(node, CHARGE_SIZE) if isinstance(node.arg, nodes.Slice) else node

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        body = sum(1 + sum(1 for _ in n.find_all(nodes.Node)) for n in node.body + node.else_)
        node.iter = _filtered(node.iter, LOOP, nodes.Const(body, lineno=node.lineno))
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return _filtered(nodes.List(node.nodes, lineno=node.lineno), CONCAT)


def _is_text(node: nodes.Node) -> bool:
    return isinstance(node, nodes.Const) and type(node.value) is str


def _temporary(name: str, lineno: int) -> nodes.InternalName:
    """The node of a temporary variable of the generated code, made as Jinja's parser makes
    one (``Parser.free_identifier``: the class refuses to be called)."""
    node = object.__new__(nodes.InternalName)
    nodes.Node.__init__(node, name, lineno=lineno)
    return node


class MeteredCodeGenerator(CodeGenerator):
    """Jinja's code generator, with the metering of :class:`Rewrite`'s nodes, of ``trim``,
    of the methods of :data:`_READING_METHODS` and of ``%`` between integers written in line
    (see the module docstring)."""

    def write_commons(self) -> None:
        """The preamble of the root and block functions (macros are nested in them)."""
        super().write_commons()
        self.writeline(f"{_METER} = environment.current_meter()")

    def visit_Filter(self, node: nodes.Filter, frame: Frame) -> None:
        inline = None if frame.eval_ctx.volatile else self._inline_filter(node, frame)
        if inline is None:
            super().visit_Filter(node, frame)
        else:
            inline(node, frame)

    def _inline_filter(
        self, node: nodes.Filter, frame: Frame
    ) -> Callable[[Any, Frame], None] | None:
        if node.name == ADD:
            return self._add
        if node.name == CONCAT and not frame.eval_ctx.autoescape:
            return self._concat
        if node.name == CHARGE_SIZE:
            return self._sized
        if node.name == LOOP:
            return self._loop
        plain = not (node.args or node.kwargs or node.dyn_args or node.dyn_kwargs)
        metered = self.environment.filters.get(node.name)
        if plain and node.node is not None and getattr(metered, "__wrapped__", None) is do_trim:
            return self._trim
        return None

    def visit_Call(self, node: nodes.Call, frame: Frame, forward_caller: bool = False) -> None:
        """``s.strip('\\n')``, ``s.startswith('<tool_response>')``… (:data:`_READING_METHODS`
        with literal arguments) of a string: called in line, charged what they read; anything
        else (another value, other arguments) as Jinja's sandbox calls it."""
        method = node.node
        inline = (
            isinstance(method, nodes.Getattr)
            and method.attr in _READING_METHODS
            and all(_is_text(arg) for arg in node.args)
            and not (forward_caller or node.kwargs or node.dyn_args or node.dyn_kwargs)
        )
        if not inline:
            super().visit_Call(node, frame, forward_caller=forward_caller)
            return
        assert isinstance(method, nodes.Getattr)
        text, left = self.temporary_identifier(), self.temporary_identifier()
        literals = [arg.value for arg in node.args]  # type: ignore[attr-defined]
        self.write(f"({text}.{method.attr}({', '.join(map(repr, literals))}) if type({text} := ")
        self.visit(method.node, frame)
        self.write(
            f") is str and ({left} := {_METER}.chars - len({text}) - "
            f"{sum(map(len, literals))}) >= 0 and not setattr({_METER}, 'chars', {left}) else "
        )
        held = nodes.Getattr(
            _temporary(text, method.lineno), method.attr, method.ctx, lineno=method.lineno
        )
        super().visit_Call(nodes.Call(held, node.args, [], None, None, lineno=node.lineno), frame)
        self.write(")")

    def visit_Mod(self, node: nodes.Mod, frame: Frame) -> None:
        """``a % b``: in line between integers (the result is smaller than ``b``), else the
        sandbox's metered ``call_binop`` (string formatting)."""
        a, b = self.temporary_identifier(), self.temporary_identifier()
        self.write(f"({a} % {b} if (type({a} := ")
        self.visit(node.left, frame)
        self.write(f") is int) & (type({b} := ")
        self.visit(node.right, frame)
        self.write(f") is int) else environment.call_binop(context, '%', {a}, {b}))")

    # ------------------------------------------------------------------ the nodes of Rewrite

    def _add(self, node: nodes.Filter, frame: Frame) -> None:
        """``a + b + …``: made and charged in line when ``a`` is a string (then so is the sum,
        or Python raises as it would unmetered), else :data:`ADD`'s filter."""
        first, *rest = node.node.items  # type: ignore[attr-defined]
        if _is_text(first):
            self._charged(node, lambda: self._sum([first, *rest], frame))
            return
        names = [self.temporary_identifier() for _ in [first, *rest]]
        self.write("(")
        self._charged(node, lambda: self.write(" + ".join(names)))
        self.write(f" if (type({names[0]} := ")
        self.visit(first, frame)
        self.write(") is str)")
        for name, operand in zip(names[1:], rest, strict=True):
            self.write(f" & (({name} := ")
            self.visit(operand, frame)
            self.write(f") is {name})")  # evaluated in order, whatever the branch
        self.write(f" else {self.filters[node.name]}([{', '.join(names)}]))")

    def _concat(self, node: nodes.Filter, frame: Frame) -> None:
        """``a ~ b ~ …``: made and charged in line when every operand is a string, else
        :data:`CONCAT`'s filter (which turns the others into text, as Jinja's ``~`` does)."""
        operands = node.node.items  # type: ignore[attr-defined]
        names = [
            repr(operand.value) if _is_text(operand) else self.temporary_identifier()
            for operand in operands
        ]
        checked = [(n, o) for n, o in zip(names, operands, strict=True) if not _is_text(o)]
        if not checked:
            self._charged(node, lambda: self.write(" + ".join(names)))
            return
        self.write("(")
        self._charged(node, lambda: self.write(" + ".join(names)))
        self.write(" if ")
        for i, (name, operand) in enumerate(checked):
            self.write(f"{' & ' if i else ''}(type({name} := ")
            self.visit(operand, frame)
            self.write(") is str)")
        self.write(f" else {self.filters[node.name]}([{', '.join(names)}]))")

    def _sized(self, node: nodes.Filter, frame: Frame) -> None:
        """A compared operand or a slice: a string is charged its length in line."""
        self._if_text(node, node.node, frame, "{}")

    def _trim(self, node: nodes.Filter, frame: Frame) -> None:
        """``s | trim``: a string is charged its length (at least what ``strip`` reads and
        makes) and stripped in line, as Jinja's ``trim`` does."""
        self._if_text(node, node.node, frame, "{}.strip()")

    def _loop(self, node: nodes.Filter, frame: Frame) -> None:
        """A loop over a list small enough to be charged ahead (:func:`_loop` of the sandbox)
        is charged its length plus one in steps, in line."""
        (body,) = node.args
        assert isinstance(body, nodes.Const)
        items, left = self.temporary_identifier(), self.temporary_identifier()
        self.write(f"({items} if type({items} := ")
        self.visit(node.node, frame)
        self.write(
            f") is list and len({items}) * {body.value} <= {CHARGED_AHEAD} and "
            f"({left} := {_METER}.steps - len({items}) - 1) >= 0 and "
            f"not setattr({_METER}, 'steps', {left}) "
            f"else {self.filters[node.name]}({items}, {body.value}))"
        )

    # ----------------------------------------------------------------------------- helpers

    def _sum(self, operands: list[nodes.Expr], frame: Frame) -> None:
        for i, operand in enumerate(operands):
            self.write(" + (" if i else "(")
            self.visit(operand, frame)
            self.write(")")

    def _charged(self, node: nodes.Filter, write_value: Callable[[], None]) -> None:
        """``(r if <len(r := VALUE) charged> else FILTER([r]))``: the value, made first, is
        charged its length; past the budget, the node's filter charges it again and raises."""
        made, left = self.temporary_identifier(), self.temporary_identifier()
        self.write(f"({made} if ({left} := -len({made} := ")
        write_value()
        self.write(
            f") + {_METER}.chars) >= 0 and not setattr({_METER}, 'chars', {left}) "
            f"else {self.filters[node.name]}([{made}]))"
        )

    def _if_text(self, node: nodes.Filter, value: nodes.Expr, frame: Frame, result: str) -> None:
        """``(RESULT if type(s := VALUE) is str and <len(s) charged> else FILTER(s))``:
        ``result`` formats the expression of what a string gives."""
        text, left = self.temporary_identifier(), self.temporary_identifier()
        self.write(f"({result.format(text)} if type({text} := ")
        self.visit(value, frame)
        self.write(
            f") is str and ({left} := {_METER}.chars - len({text})) >= 0 and "
            f"not setattr({_METER}, 'chars', {left}) else {self.filters[node.name]}({text}))"
        )

    # ------------------------------------------------------------------------------ output

    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        """``{{ value }}``: a string is printed as it is (``str()`` of a string is that
        string), anything else goes through the environment's ``finalize``, which charges
        its text first."""
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super()._output_child_pre(node, frame, finalize)
        else:
            self.write("(_llamatrain_out if type(_llamatrain_out := ")

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
            super()._output_child_post(node, frame, finalize)
        else:
            self.write(") is str else str(environment.finalize(_llamatrain_out)))")
