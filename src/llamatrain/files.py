"""Every file llamatrain writes goes through here: whole or not at all, and only where it is owned.

Whole: a new file is written under a hidden temporary name beside its target, fsynced and
renamed over it, and the folder is fsynced, so after a crash or a full disk the target is the
old file or the new one, never a stub.

Owned: a target is replaced only when it is nothing yet or a regular file of the kind being
written (a GGUF is replaced only by a GGUF). A symbolic link, a folder, a named pipe, a device or
a socket is refused in one line, never written through: ``export -o /dev/null`` as root, or a
``config.toml`` someone made a link inside a run folder, cannot reach anything else. Appends and
the lock open with ``O_NOFOLLOW`` and check what they opened.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from llamatrain.errors import OutputError

__all__ = [
    "append_text",
    "check_folder",
    "check_target",
    "is_gguf",
    "open_owned",
    "replace_durably",
    "staged_folder",
    "temporary_path",
    "written_atomically",
    "write_text_atomically",
]

_NOT_FOLLOWED = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""Flags for opening a file in place: a link is refused (ELOOP), a pipe does not block."""


def is_gguf(path: Path) -> bool:
    """Whether a regular file starts with GGUF's magic (or is empty: nothing to lose)."""
    fd = os.open(path, os.O_RDONLY | _NOT_FOLLOWED)
    try:
        head = os.read(fd, 4)
    finally:
        os.close(fd)
    return head in (b"", b"GGUF")


def _what(mode: int) -> str | None:
    """How a non-regular file is named in a refusal (None for a regular file)."""
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def check_target(
    path: str | os.PathLike[str], kind: str, is_ours: Callable[[Path], bool] | None = None
) -> Path:
    """Refuse (OutputError) to replace ``path`` unless it is missing or a regular file that
    ``is_ours`` accepts (any regular file without it); ``kind`` names what is being written."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    what = _what(mode)
    if what is not None:
        raise OutputError(
            f"{path} is {what}; llamatrain writes a {kind} only as a new file or over one it "
            "wrote, never through links or into pipes and devices — choose another path"
        )
    if is_ours is not None and not is_ours(path):
        raise OutputError(
            f"{path} exists and is not a {kind}; llamatrain does not overwrite other files — "
            "choose another path or remove it first"
        )
    return path


def check_folder(path: str | os.PathLike[str], kind: str) -> Path:
    """Refuse (OutputError) to write into ``path`` unless it is missing or a folder itself —
    never a link to one, which would carry what is written (a tracker's files) elsewhere."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(mode):
        raise OutputError(
            f"{path} is {_what(mode) or 'a file'}; a {kind} is written only as a folder of "
            "its own, never through a link — remove it or choose another path"
        )
    return path


def temporary_path(path: Path) -> Path:
    """A hidden, unique name in ``path``'s folder: a rename from there onto ``path`` stays on
    one file system, so it is atomic."""
    return path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (a no-op where folders cannot be opened or synced)."""
    with contextlib.suppress(OSError):
        _fsync(directory)


def replace_durably(
    tmp: Path, path: Path, kind: str = "file", is_ours: Callable[[Path], bool] | None = None
) -> None:
    """fsync the finished ``tmp``, rename it over ``path`` (checked again just before) and fsync
    the folder. The fsync is for files another program wrote, such as llama.cpp's quantizer;
    ours are synced already, and a second fsync of clean pages costs nothing."""
    _fsync(tmp)
    check_target(path, kind, is_ours)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def point_link_at(link: Path, target_name: str) -> None:
    """Swap the symlink ``link`` to ``target_name`` (a name in its folder) atomically: a new
    link under a temporary name, renamed over the old one, so a reader always finds one."""
    tmp = temporary_path(link)
    try:
        os.symlink(target_name, tmp)
        os.replace(tmp, link)
    finally:
        tmp.unlink(missing_ok=True)  # gone after the rename; left over if it failed


@contextlib.contextmanager
def written_atomically(
    path: str | os.PathLike[str], kind: str, is_ours: Callable[[Path], bool] | None = None
) -> Iterator[Path]:
    """``with written_atomically(p, "GGUF model", is_gguf) as tmp:`` write ``tmp`` whole; it
    then replaces ``p`` (see :func:`replace_durably`). The target is checked before anything is
    written; on any failure the temporary file is removed and ``p`` is as it was."""
    path = check_target(path, kind, is_ours)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOT_FOLLOWED, 0o644))
    try:
        yield tmp
        replace_durably(tmp, path, kind, is_ours)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _named(err, path) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _named(err: OSError, path: Path) -> OSError:
    """``err`` with the file it was writing named: a write that fails (a full disk: ENOSPC,
    EFBIG, EDQUOT) carries no file name, so the message would name no path."""
    if err.filename is not None or not err.errno:  # numpy's short writes: errno 0, the text
        return err
    return OSError(err.errno, err.strerror, str(path))


def write_text_atomically(path: str | os.PathLike[str], text: str, kind: str) -> Path:
    """A UTF-8 text file written whole (:func:`written_atomically`)."""
    with written_atomically(path, kind) as tmp, tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    return Path(path)


def open_owned(path: str | os.PathLike[str], flags: int, kind: str) -> int:
    """``os.open`` that follows no link and accepts only a regular file (creating it with
    ``os.O_CREAT``): the descriptor of the file that was checked, never of another."""
    try:
        fd = os.open(path, flags | _NOT_FOLLOWED, 0o644)
    except OSError as err:
        if err.errno == getattr(os, "ELOOP", 40):
            check_target(path, kind)  # names the link
        raise
    what = _what(os.fstat(fd).st_mode)
    if what is not None:
        os.close(fd)
        raise OutputError(f"{path} is {what}; llamatrain writes a {kind} only as a regular file")
    return fd


def append_text(path: str | os.PathLike[str], text: str, kind: str) -> None:
    """Append to a regular file (created if missing), never through a link."""
    fd = open_owned(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, kind)
    try:
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        raise _named(err, Path(path)) from err


@contextlib.contextmanager
def staged_folder(target: Path, kind: str) -> Iterator[Path]:
    """``with staged_folder(t, "HF folder") as staging:`` fill ``staging``; its files are then
    fsynced and it is renamed onto ``t``. An old ``t`` (the caller has checked that it may go)
    is renamed aside first and removed only after the new one is in place, so a failure at any
    point leaves ``t`` as it was and no staging folder behind."""
    check_folder(target, kind)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = temporary_path(target)
    staging.mkdir()
    try:
        yield staging
        for path in [*staging.iterdir(), staging]:
            _fsync(path)
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync_dir(target.parent)


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename the finished folder onto ``target``; an old one goes only afterwards."""
    if not target.exists():
        os.replace(staging, target)
        return
    retired = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.old"
    os.replace(target, retired)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(retired, target)
        raise
    shutil.rmtree(retired, ignore_errors=True)
