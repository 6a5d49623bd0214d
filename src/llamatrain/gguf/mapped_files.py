"""Files this process maps (a QLoRA base, GRPO's frozen reference: ``file.map_stored``) that
change under it: found between reads by a stat, and inside a read by the fault it raises.

Why: a mapped tensor's pages *are* the file's, as llama.cpp holds its models (``--mmap``, its
default). A file rewritten in place shows its new bytes to the next read, so a run would go on
over other weights without a word; one truncated answers a read past its new end with SIGBUS,
which kills the process (exit 135) before Python can say anything or save anything. So:

- :func:`watch` records each mapping with the file's size and modification time when it was
  mapped, and keeps a descriptor of the mapped inode itself; :func:`check_mapped_files`
  compares them with one ``os.fstat`` a file, cheap enough for every step, and raises
  :class:`MappedFileChanged` in one line naming the file. The inode is what is watched, not
  the path: a new file renamed over the path, or the path deleted, leaves the mapping on the
  old inode, which the run goes on reading unchanged (its checkpoints record the base's sha256,
  so a resume over the new file is refused), and a run over another file in the same process
  is not stopped by it.
- :func:`faults_answered` (a ``with`` block; Linux, 64-bit) answers a read past the end of a
  watched mapping with zeros instead of death: a SIGBUS handler maps anonymous zero pages over
  the rest of that mapping and marks it faulted, the code under way finishes on zeros, and the
  next check stops the run, which discards what was computed from them. A fault at any other
  address goes to the handler that was there before (Python's faulthandler, or the default).

Why zeros and not an exit from the handler: Python cannot resume after SIGBUS (its own handler
only sets a flag, and the faulting instruction runs again), and exiting from the handler loses
every step since the last checkpoint. Patched, the run reaches its next check with its adapters
and optimizer state whole (they live in process memory, not in the mapping) and saves them.
Zeros decode to zero weights in every stored type, so the rest of the step computes finite
numbers. The handler is Python called through ctypes: it takes the GIL, which the faulting
thread either holds (numpy) or a thread of PyTorch's pool gets while the caller waits without
it, and it calls only ``mmap``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import signal
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llamatrain.errors import TrainingError, shown

__all__ = [
    "MappedFileChanged",
    "READ_AGAIN_FIX",
    "check_mapped_files",
    "faults_answered",
    "reads_checked",
    "watch",
]

RESUME_FIX = (
    "put the file back as it was (the run's checkpoints record its sha256) and continue with "
    "--resume latest"
)
READ_AGAIN_FIX = "leave the file as it is while a command reads it, and run the command again"


class MappedFileChanged(TrainingError):
    """A file the run maps changed under it; ``what`` says which and how."""

    def __init__(self, what: str, fix: str = RESUME_FIX) -> None:
        super().__init__(f"{what}; {fix}")
        self.what = what

    def saved(self, checkpoint: Path) -> MappedFileChanged:
        """This change, told after the trainer saved what it had trained before it."""
        return MappedFileChanged(
            f"{self.what}; the step that read it was not applied, and the run saved what it "
            f"had trained before it to {checkpoint}"
        )


@dataclass
class _Mapping:
    """One mapping of a file: the mapped inode (a descriptor of it), its size and mtime when
    mapped, and where the mapping lies in memory."""

    path: Path
    fd: int
    size: int
    mtime_ns: int
    start: int
    end: int
    faulted: bool = False  # a read past the file's end was answered with zeros


_MAPPINGS: dict[int, _Mapping] = {}
_KEYS = itertools.count()
_GONE_CHANGED: list[str] | None = None  # see reads_checked


def watch(path: Path, mapped: np.memmap, opened: int) -> None:
    """Watch ``mapped`` (the whole of ``path``, mapped from the open descriptor ``opened``)
    for as long as it lives, through a duplicate of that descriptor: the inode mapped, not
    whatever the path names later, and the file not opened again."""
    fd = os.dup(opened)
    stat = os.fstat(fd)
    key, start = next(_KEYS), mapped.ctypes.data
    end = start + mapped.nbytes
    _MAPPINGS[key] = _Mapping(path.absolute(), fd, stat.st_size, stat.st_mtime_ns, start, end)
    weakref.finalize(mapped, _forget, key)


def _forget(key: int) -> None:
    """A mapping is gone: stop watching it and close its descriptor; inside
    :func:`reads_checked`, a change to its file is kept to be told when the block ends."""
    mapping = _MAPPINGS.pop(key, None)
    if mapping is None:
        return
    if _GONE_CHANGED is not None and (how := _change(mapping)) is not None:
        _GONE_CHANGED.append(_told(mapping, how))
    os.close(mapping.fd)


def _change(mapping: _Mapping) -> str | None:
    """How ``mapping``'s file differs from what was mapped, or None."""
    now = os.fstat(mapping.fd)
    if now.st_size != mapping.size:
        return f"it is {now.st_size:,} bytes, {mapping.size:,} when the run mapped it"
    if now.st_mtime_ns != mapping.mtime_ns:
        return "it was rewritten in place"
    if mapping.faulted:
        return "a read of it faulted (SIGBUS)"
    return None


def _told(mapping: _Mapping, how: str) -> str:
    return f"{shown(str(mapping.path), None)}, which this run maps, changed ({how})"


def changed_mapping() -> str | None:
    """What changed in the first watched file that did (its path and how), or None."""
    for mapping in tuple(_MAPPINGS.values()):
        how = _change(mapping)
        if how is not None:
            return _told(mapping, how)
    return None


def check_mapped_files(agree: Callable[[bool], bool] = bool, fix: str = RESUME_FIX) -> None:
    """Raise :class:`MappedFileChanged` if a watched file changed since it was mapped.
    ``agree``: whether any process of the run saw a change (``parallel.any_rank``), so that all
    of them stop at the same point."""
    if not _MAPPINGS:  # every rank maps the same files, or none: no collective needed
        return
    what = changed_mapping()
    if agree(what is not None):
        raise MappedFileChanged(what or "a file another rank maps changed under it", fix)


# ---- a read past the end of a truncated file (SIGBUS) ---------------------------------------

_SUPPORTED = sys.platform == "linux" and ctypes.sizeof(ctypes.c_void_p) == 8
_SA_SIGINFO = 4
_MAP_FIXED = 0x10
_SI_ADDR_OFFSET = 16  # siginfo_t: three ints, then the (8-aligned) union whose first is si_addr
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Sigaction(ctypes.Structure):
    """glibc's (and musl's) ``struct sigaction`` on 64-bit Linux."""

    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * (128 // ctypes.sizeof(ctypes.c_ulong))),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


_HANDLER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_previous = _Sigaction()
_installed = False


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    return libc


def _zero_fill(address: int, end: int) -> bool:
    """Map zero pages over ``[the page of address, end)``: reads there see zeros from now on."""
    page = address - address % mmap.PAGESIZE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
    done = _LIBC.mmap(page, end - page, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    return done not in (None, _MAP_FAILED)


def _on_bus(signum: int, info: int, context: int) -> None:
    """SIGBUS: zeros over the rest of the watched mapping the address lies in; any other
    fault goes back to the previous handler (returning makes the instruction fault again)."""
    try:
        address = ctypes.c_void_p.from_address(info + _SI_ADDR_OFFSET).value or 0
        for mapping in tuple(_MAPPINGS.values()):
            if mapping.start <= address < mapping.end and _zero_fill(address, mapping.end):
                mapping.faulted = True
                return
    except BaseException:  # nothing may escape a signal handler
        pass
    _LIBC.sigaction(signal.SIGBUS, ctypes.byref(_previous), None)


if _SUPPORTED:
    _LIBC = _libc()
    _HANDLER = _HANDLER_TYPE(_on_bus)  # kept here: the C side holds no reference to it


@contextlib.contextmanager
def faults_answered() -> Iterator[None]:
    """Within the block, a read past the end of a watched file gives zeros and marks it
    faulted, so the next :func:`check_mapped_files` stops the run in one line, instead of
    SIGBUS ending the process. The handler that was installed before is put back after."""
    global _installed
    if not _SUPPORTED or _installed:
        yield
        return
    ours = _Sigaction(handler=ctypes.cast(_HANDLER, ctypes.c_void_p).value, flags=_SA_SIGINFO)
    if _LIBC.sigaction(signal.SIGBUS, ctypes.byref(ours), ctypes.byref(_previous)) != 0:
        yield
        return
    _installed = True
    try:
        yield
    finally:
        _LIBC.sigaction(signal.SIGBUS, ctypes.byref(_previous), None)
        _installed = False


@contextlib.contextmanager
def reads_checked(fix: str = READ_AGAIN_FIX) -> Iterator[None]:
    """A command that reads mapped weights (generate, chat, eval, export) ends in one line
    naming the file when it changed under the command, not in SIGBUS: reads past a truncated
    end give zeros (:func:`faults_answered`) and the change is told when the block ends, or in
    place of whatever error computing over those zeros raised. A mapping dropped within the
    block (the command's model freed) is told as well: its file's change is kept when it goes.
    """
    global _GONE_CHANGED
    outer, _GONE_CHANGED = _GONE_CHANGED, []
    try:
        with faults_answered():
            try:
                yield
            except Exception:
                _check_read(fix)
                raise
        _check_read(fix)
    finally:
        _GONE_CHANGED = outer


def _check_read(fix: str) -> None:
    """Raise :class:`MappedFileChanged` for the first change seen inside :func:`reads_checked`."""
    if _GONE_CHANGED:
        raise MappedFileChanged(_GONE_CHANGED[0], fix)
    check_mapped_files(fix=fix)
