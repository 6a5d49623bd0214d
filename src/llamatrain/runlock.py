"""One training process per run folder (``<output.dir>/.lock``, held with ``flock``), and a
new run never over an old one.

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
from collections.abc import Iterator, Sequence
from pathlib import Path

from llamatrain.errors import OutputError, RunInUseError
from llamatrain.files import open_owned

__all__ = ["LOCK_FILE", "run_lock", "set_aside_previous_run"]

LOCK_FILE = ".lock"


@contextlib.contextmanager
def run_lock(run_dir: str | Path) -> Iterator[Path]:
    """Hold ``run_dir``'s lock for the ``with`` block (creating the folder); yields the folder.

    Raises RunInUseError naming the holder's PID when another process holds it.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = _open_lock_file(path)
    try:
        _take(fd, path)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield run_dir
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _open_lock_file(path: Path) -> int:
    """Create the lock file exclusively, or open the one an earlier run left; either way never
    through a link and only a regular file, so a planted ``.lock`` cannot redirect the PID
    written into it."""
    try:
        return open_owned(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, "run lock")
    except FileExistsError:
        return open_owned(path, os.O_RDWR, "run lock")


def _take(fd: int, path: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        raise RunInUseError(
            f"{path.parent} is in use by another llamatrain fit (PID {holder}, lock "
            f"{path}); wait for it to end or stop it, or choose another output.dir"
        ) from None


def set_aside_previous_run(
    run_dir: Path, markers: Sequence[str], *, overwrite: bool
) -> Path | None:
    """Make sure a new run does not write over one already in ``run_dir`` (which holds a run
    when any of ``markers`` is there): refuse in one line naming the choices, or with
    ``overwrite`` move everything but the lock into a new sibling ``<name>.old-<n>`` and return
    it. Nothing is ever deleted. Call it while holding the folder's lock."""
    present = [name for name in markers if os.path.lexists(run_dir / name)]
    if not present:
        return None
    aside = _free_sibling(run_dir)
    if not overwrite:
        raise OutputError(
            f"{run_dir} already holds a run ({', '.join(present)}); continue it with --resume "
            f"latest, choose a new output.dir, or pass --overwrite to move it aside to {aside} "
            "(nothing is deleted)"
        )
    aside.mkdir()
    for entry in sorted(run_dir.iterdir()):
        if entry.name != LOCK_FILE:
            os.rename(entry, aside / entry.name)
    return aside


def _free_sibling(run_dir: Path) -> Path:
    """The first ``<name>.old-<n>`` beside ``run_dir`` that does not exist."""
    n, run_dir = 1, run_dir.absolute()
    while os.path.lexists(aside := run_dir.with_name(f"{run_dir.name}.old-{n}")):
        n += 1
    return aside
