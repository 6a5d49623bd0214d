"""Calling code a user's config names (reward functions, the modules that hold them; later
tools): whatever it does, it can neither end the run nor move it.

- ``SystemExit`` and ``KeyboardInterrupt`` (any ``BaseException`` that is not an
  ``Exception``) raised inside become one error naming the code: a ``sys.exit(0)`` in a
  reward function would otherwise end the run with exit 0 and nothing said or saved, which a
  script or CI reads as success. The second Ctrl-C of a run (``interrupt.StopNow``, "stop
  now") passes through: it is the user's, not the code's.
- The working directory is put back after each call. Every path the run writes is absolute
  by then (``config.paths``), so a ``chdir`` could not redirect an output anyway; this keeps
  the relative paths of the user's own code, and the next call's, meaning what they meant.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from llamatrain.errors import LlamatrainError, TrainingError, shown
from llamatrain.interrupt import StopNow

__all__ = ["user_code"]


@contextlib.contextmanager
def user_code(who: str, error: type[LlamatrainError] = TrainingError) -> Iterator[None]:
    """Run the block's user code as the module docstring says; ``who`` names it in the
    ``error`` raised for an exit or interrupt it raises (e.g. "reward function 'f.py:f'")."""
    cwd = _working_directory()
    try:
        yield
    except BaseException as e:
        if isinstance(e, Exception | StopNow):
            raise
        raise error(
            f"{who} raised {_described(e)}, which would end the run; user code must return "
            "(raise an Exception to report a problem)"
        ) from None
    finally:
        if cwd is not None:
            with contextlib.suppress(OSError):  # gone: the run's paths are absolute anyway
                os.chdir(cwd)


def _working_directory() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # deleted under the process
        return None


def _described(e: BaseException) -> str:
    """``SystemExit(0) (sys.exit)``, ``KeyboardInterrupt``, ``CancelledError: why``."""
    if isinstance(e, SystemExit):
        return f"SystemExit({shown(repr(e.code), 40)}) (sys.exit)"
    return type(e).__name__ + (f": {shown(str(e), 80)}" if str(e) else "")
