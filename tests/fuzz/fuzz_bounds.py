"""The bounds every fuzz case runs in: one-line LlamatrainError or a result, < 2 s, < 500 MB."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

from hypothesis import event as hypothesis_event
from hypothesis.control import currently_in_test_context

from llamatrain.errors import LlamatrainError

SECONDS = 2.0
"""CPU seconds each case may take (issue 30: a crafted claim fails in < 2 s of work)."""
HARD_SECONDS = 20
"""A case still running after this is interrupted (a hang must not stall the suite)."""
MEGABYTES = 500
"""Address space a case may add beyond what the process already maps (issue 30: < 500 MB)."""


def event(text: str) -> None:
    """Count an outcome in ``--hypothesis-show-statistics`` (outside hypothesis: nothing)."""
    if currently_in_test_context():
        hypothesis_event(text)


class Hang(Exception):
    """Raised into a case that ran past HARD_SECONDS."""


def _mapped_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def _address_space_cap(extra_bytes: int) -> Iterator[None]:
    """RLIMIT_AS at what the process maps now plus ``extra_bytes``: an allocation past it
    fails (MemoryError, or a library's own error), which the property then reports."""
    if not os.path.exists("/proc/self/statm"):
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _mapped_bytes() + extra_bytes
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def _alarm(seconds: int) -> Iterator[None]:
    def interrupt(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def bounded(call: Callable[[], Any], what: str) -> Any:
    """``call()``'s result, or None when it raised a LlamatrainError with a one-line message;
    fails the example on any other exception, on taking more than SECONDS of CPU time (work
    done, whatever else the machine runs), or on needing
    more than MEGABYTES of new address space."""
    started = time.process_time()  # this process's CPU: its work, not the machine's load
    try:
        with _alarm(HARD_SECONDS), _address_space_cap(MEGABYTES << 20):
            result = call()
        event("accepted")
    except LlamatrainError as err:
        message = str(err)
        assert message.strip() and "\n" not in message, f"{what}: not one line: {message!r}"
        event(f"refused ({type(err).__name__})")
        result = None
    elapsed = time.process_time() - started
    assert elapsed < SECONDS, f"{what}: took {elapsed:.2f} CPU s"
    return result
