"""The budget of one render of a chat template, and the meter that counts it down.

A render of an untrusted template (``sandbox.render``) puts a fresh :class:`Meter` for a
:class:`RenderBudget` in a context variable. Every metered operation of the sandbox
(``sandbox``, with the size checks of ``costs``, and the code ``codegen`` writes in line,
which reads the meter once per function of the template) charges it steps and characters,
and a render past a limit raises :class:`OverBudget` naming it. Kept apart from the Jinja
machinery so that a helper the template calls (``strftime_now``, in ``helpers``) can charge
the render in progress with :func:`charge`.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUDGET",
    "METER",
    "Meter",
    "OverBudget",
    "RenderBudget",
    "Shapes",
    "charge",
    "current_meter",
]


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


class Meter:
    """What is left of one render's budget."""

    __slots__ = ("budget", "chars", "clock", "deadline", "depth", "shapes", "steps")

    def __init__(self, budget: RenderBudget, shapes: Shapes | None) -> None:
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


Shapes = dict[int, tuple[Any, tuple[int, int, int]]]
""":func:`_shape` of lists and mappings of plain data, by ``id`` (with the object, which
keeps the id from being reused), for the renders of one conversation."""

METER: ContextVar[Meter | None] = ContextVar("llamatrain_template_meter", default=None)


class _Unmetered(Exception):  # noqa: N818
    """A metered operation outside a metered render: Jinja folding constants while compiling
    (it then leaves the expression to the render), or a render that is not metered."""


def current_meter() -> Meter:
    meter = METER.get()
    if meter is None:
        raise _Unmetered("chat templates render only metered, by chat_template.sandbox.render")
    return meter


def charge(chars: int) -> None:
    """Charge the render in progress for ``chars`` characters about to be made (a helper of
    the template's own, such as ``strftime_now``)."""
    meter = current_meter()
    meter.step()
    meter.make(chars)
