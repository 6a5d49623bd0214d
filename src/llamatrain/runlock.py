"""One training process per run folder: ``<output.dir>/.lock``, held with ``flock``.

Two runs writing the same folder would interleave metrics lines and overwrite each other's
checkpoints and ``config.toml``. The lock is an advisory ``flock`` on a file that holds the
holder's PID (for the refusal message): the kernel releases it when the process ends however
it ends, SIGKILL included, so a crashed run never leaves the folder stuck and there is no stale
lock to clean up. The file itself stays behind on purpose: deleting a locked file lets a
third process lock a new file of the same name while a second still holds the old one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from llamatrain.errors import RunInUseError

__all__ = ["LOCK_FILE", "run_lock"]

LOCK_FILE = ".lock"


@contextlib.contextmanager
def run_lock(run_dir: str | Path) -> Iterator[Path]:
    """Hold ``run_dir``'s lock for the ``with`` block (creating the folder); yields the folder.

    Raises RunInUseError naming the holder's PID when another process holds it.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _take(fd, path)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield run_dir
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _take(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        raise RunInUseError(
            f"{path.parent} is in use by another llamatrain fit (PID {holder}, lock "
            f"{path}); wait for it to end or stop it, or choose another output.dir"
        ) from None
