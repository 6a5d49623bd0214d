"""Stop a run at the next step boundary when SIGTERM or SIGINT arrives.

A scheduler or ``docker stop`` sends SIGTERM and, seconds later, SIGKILL; Ctrl-C sends SIGINT.
Raising in the middle of a step (what Python's default SIGINT handler does) could leave the
optimizer half-applied, so the handlers installed here only record the request; the training
loop checks it after each step and saves a checkpoint that resumes bit-exactly. A second
signal means "now": it raises :class:`StopNow` (a KeyboardInterrupt) and the run ends without
saving.

Handlers are process-wide, so they are installed only for the duration of a ``with`` block,
only from the main thread (Python allows no other), and the previous ones are put back after.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["STOP_SIGNALS", "StopNow", "StopRequest"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopNow(KeyboardInterrupt):
    """The second stop signal: the user's "now", which code that turns the interrupts user
    code raises into errors (``llamatrain.user_code``) lets through."""


class StopRequest:
    """Whether (and by which signal) the run was asked to stop; ``None`` while not."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def __bool__(self) -> bool:
        return self.signal_name is not None

    @contextlib.contextmanager
    def on_signals(self) -> Iterator[StopRequest]:
        """Record SIGTERM/SIGINT in this request while the block runs (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self:
            raise StopNow  # the second signal: stop now, without saving
        self.signal_name = signal.Signals(signum).name
        # os.write, not print: a handler may run while the main thread is inside a print
        os.write(2, f"\nllamatrain: {self.signal_name}: saving after this step\n".encode())
