"""Let CPU training reuse freed memory instead of page-faulting it in again every step.

Why: a training step allocates and frees the same activations (hundreds of tensors of a few
MB) every step. glibc's malloc serves blocks above its mmap threshold with fresh ``mmap``s
and hands freed memory at the top of the heap back to the kernel above its trim threshold,
so each step faults its activations in again, tens of thousands of minor faults per step
of a mid-sized model. Serving every block from the heap (no ``mmap`` at all: glibc's
threshold stops at 32 MiB, below a real vocabulary's (vocab, dim) gradient tables and logits)
and keeping up to 1 GiB of freed memory in it lets the next step reuse those pages (a test
counts the faults; bench/README.md has the figures). (PyTorch's CPU performance guides
recommend preloading jemalloc or tcmalloc for the same reason; this needs no extra library.)

The price is that up to ``TRIM_THRESHOLD`` of freed memory stays mapped to the process
after a step: RSS falls back more slowly, the peak is unchanged. When training is over,
:func:`release_freed_memory` hands it back, so what runs after (export, plotting) does not
stack its memory on top. Only glibc has these knobs; elsewhere both are no-ops.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4

MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit (HEAP_MAX_SIZE / 2)
MMAP_MAX = 0  # blocks above the threshold from the heap too (glibc still maps if it is full)
GLIBC_MMAP_MAX = 65536  # glibc's default count of mapped blocks
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20  # grow the heap in steps of 64 MiB rather than page by page


def retain_freed_memory() -> bool:
    """Set glibc's malloc to keep and reuse freed blocks (idempotent).

    Returns whether the settings are in effect (False where the C library is not glibc).
    """
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (_M_MMAP_MAX, MMAP_MAX),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (_M_TOP_PAD, TOP_PAD),
        )
    )


def release_freed_memory() -> bool:
    """Return the heap's free pages to the kernel now (glibc's ``malloc_trim``), and map
    blocks above the threshold again (glibc's default), until :func:`retain_freed_memory`.

    Why: the settings above keep freed memory mapped for the next training step. Once the
    last step is done that memory only raises RSS under whatever comes next; Python objects,
    for one, live in their own mmapped arenas and cannot reuse heap pages. What comes next
    (a merge, an export) allocates whole-model tensors once each: mapped, they go back to
    the kernel when freed, where on the heap they could stay behind blocks allocated after
    them (a QLoRA fit's peak RSS, which is its merge and export: 1,221-1,227 MB with every
    block on the heap to the end, 1,179-1,215 with this, 1,181-1,185 with glibc's defaults
    throughout; 3 runs each). Returns whether it ran (False where the C library is not glibc).
    """
    mallopt, trim = _glibc_function("mallopt"), _glibc_function("malloc_trim")
    if mallopt is None or trim is None:
        return False
    mallopt(_M_MMAP_MAX, GLIBC_MMAP_MAX)
    trim(0)
    return True


def _glibc_function(name: str) -> Callable[..., int] | None:
    """The C library's ``name`` where it is glibc (the only one with these knobs), else None."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
