"""Running one tool call for a rollout: in a worker thread, cut at a timeout, its output cut to
a stated size, every fault returned to the model as TRL returns a raised one, never raised here.

TRL calls a tool in the trainer's own thread and gives the model ``str({"error": str(e)})``
when it raises; a tool that hangs stops TRL's run. Here each call runs in a daemon thread
joined for at most ``timeout`` seconds: one still running then is reported to the model as
timed out and left behind (Python cannot stop a thread; a daemon one does not hold the process
at exit), and the rollout goes on. It runs on until it returns, so a tool that may hang should
bound its own work. A process per call would be cut cleanly, but is neither cheap nor safe
here: a fork of a process holding torch's thread pools can deadlock, and a spawned one must
import the tool's module again and pickle its arguments and result for every call.

An ``async def`` tool runs to completion on its own event loop in that thread. Whatever the
call raises, ``SystemExit`` and ``KeyboardInterrupt`` included, becomes its error message: a
tool cannot end the run. Its result, as ``str`` makes it (TRL's), is cut to ``max_chars``
characters with a note of how much was left out. A working directory the call changes is put
back once it returns (``llamatrain.user_code``).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from dataclasses import dataclass
from typing import Any

from llamatrain.tools.loading import Tool
from llamatrain.user_code import user_code

__all__ = ["RAISED", "TIMED_OUT", "Outcome", "error_content", "run_call"]

RAISED = "raised"
TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class Outcome:
    """What a call gave the model (``content``, the tool message's) and, when it failed,
    how (``failure``: :data:`RAISED` or :data:`TIMED_OUT`; None when it returned)."""

    content: str
    failure: str | None = None


def error_content(message: str) -> str:
    """A failed call's tool message, as TRL writes one: ``str({"error": message})``."""
    return str({"error": message})


def run_call(tool: Tool, arguments: dict[str, Any], timeout: float, max_chars: int) -> Outcome:
    """``tool(**arguments)`` run in a worker thread for at most ``timeout`` seconds."""
    box: dict[str, Any] = {}
    worker = threading.Thread(
        target=_call_into, args=(tool, arguments, box), name=f"tool {tool.name}", daemon=True
    )
    with user_code(f"tool {tool.name!r}"):  # its chdir undone (its exits are caught inside)
        worker.start()
        worker.join(timeout)
    if worker.is_alive():
        return Outcome(error_content(f"{tool.name} timed out after {timeout:g} s"), TIMED_OUT)
    if "error" in box:
        return Outcome(_cut(error_content(box["error"]), max_chars), RAISED)
    return Outcome(_cut(str(box["result"]), max_chars))


def _call_into(tool: Tool, arguments: dict[str, Any], box: dict[str, Any]) -> None:
    """The worker's body: the result, or the error message of whatever was raised."""
    try:
        result = tool.fn(**arguments)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        box["result"] = result
    except BaseException as e:  # noqa: BLE001 - a tool's fault is the model's to read, not the run's
        box["error"] = str(e) or type(e).__name__


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _cut(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters, the cut said at its end."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... [{len(text) - max_chars} more characters cut]"
