"""Let CPU runs treat floats below the normal range as zero, in every thread that computes.

Why: attention's softmax makes denormal floats (float32 below 2^-126) by the thousand: every
probability of a key scored more than ~87 below its row's best is one, and the backward
multiplies them on. An x86 CPU takes a microcode assist of ~100 cycles for each denormal an
instruction reads or writes, so a tile of them runs at a hundredth of the speed: in a QLoRA
step of Llama-3.2-1B's shape (256 tokens) attention's backward took 1.25 s of 7 s with them,
0.12 s flushed (``bench/scale.py``). What flushing loses is below 1.2e-38 absolute in a
float32 sum, far under every tolerance the tests state.

How: the setting (flush-to-zero and denormals-are-zero, in the MXCSR register) belongs to a
thread, and :func:`torch.set_flush_denormal` sets the calling thread's only; the matmuls run
on OpenMP's worker threads, which keep theirs. So the setting is also made inside one OpenMP
parallel region of PyTorch's thread count: OpenMP runs later regions on the same pool
threads. That needs the OpenMP runtime PyTorch loaded to be GNU's (``GOMP_parallel``, as
PyTorch's Linux wheels ship it); with another, the calling thread alone is set.

Scoped, not set for the process (:func:`denormals_flushed`): the register also governs
Python's own float arithmetic, and code after a run (a notebook's, a test framework's float
strategies) may rely on denormals existing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

_TEAM_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@contextlib.contextmanager
def denormals_flushed() -> Iterator[None]:
    """Flush denormals in this thread and PyTorch's pool while the block runs; the state
    before is put back after. A CPU without the setting (neither x86 with SSE3 nor arm64)
    runs the block unchanged."""
    before = flushing()
    _set_everywhere(True)
    try:
        yield
    finally:
        _set_everywhere(before)


def flushing() -> bool:
    """Whether this thread flushes denormals now. PyTorch has no getter, so ask the CPU: half
    the smallest normal float32 is a denormal, or zero when flushed."""
    return (torch.tensor(torch.finfo(torch.float32).tiny) * 0.5).item() == 0.0


def _set_everywhere(on: bool) -> None:
    torch.set_flush_denormal(on)
    parallel = _gomp_parallel()
    if parallel is not None:
        # The region's threads call back into Python (ctypes takes the GIL for each, and
        # releases it around the foreign call); the calling thread is one of the team.
        callback = _TEAM_CALLBACK(lambda _: torch.set_flush_denormal(on))
        parallel(callback, None, torch.get_num_threads(), 0)


def _gomp_parallel() -> Callable[..., None] | None:
    """GNU OpenMP's ``GOMP_parallel(fn, data, num_threads, flags)`` from the runtime PyTorch
    loaded, or None: not Linux, or PyTorch's runtime not GNU's.

    Which runtime is PyTorch's matters: other wheels bundle their own libgomp (sentencepiece
    does), whose pool is not the one PyTorch's matmuls run on. Its wheels keep theirs in the
    torch package's folder (``torch/lib``, or ``torch.libs`` beside it); a PyTorch built
    against the system's links ``libgomp.so.1`` by that name, which finds it loaded.
    """
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        return None
    package = Path(torch.__file__).resolve().parent
    folders = (package / "lib", package.parent / "torch.libs")
    for line in maps.read_text().splitlines():
        path = Path(line.split()[-1])
        if "libgomp" in path.name and path.parent in folders:
            return _parallel_in(str(path))
    try:
        return _parallel_in("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except OSError:  # not loaded: PyTorch uses another runtime
        return None


def _parallel_in(library: str, mode: int = ctypes.DEFAULT_MODE) -> Callable[..., None] | None:
    function = getattr(ctypes.CDLL(library, mode=mode), "GOMP_parallel", None)
    if function is not None:
        function.restype = None
    return function
