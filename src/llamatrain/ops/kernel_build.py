"""Builds the C++ kernels shipped as source (``ops/kernels/*.cpp``) on first use, and loads them.

Why C++ built here, not a wheel's binary or ``torch.utils.cpp_extension``: the kernels are
worth having only compiled for the CPU they run on (``-march=native``: AVX2, VNNI, AVX-512
where present), and cpp_extension needs ninja and compiles torch's headers (about a minute);
this is one file of plain C ABI over data pointers, a few seconds of ``c++`` once per
machine, loaded with ctypes.

The library lands in a per-user cache, ``$XDG_CACHE_HOME/llamatrain/kernels/<hash>/`` (else
``~/.cache/...``), the hash over the source, the headers beside it, the flags and the
compiler's version, so a changed source, header, flag or compiler builds afresh. It is
written to a temporary name and renamed into place: two processes building at once each
load a whole library, never a half-written one.

On aarch64 GCC's ``-march=native`` gives the NEON paths (SDOT where the CPU has dotprod, else
SMULL + SADALP). A compiler that cannot take these flags fails the build, and the fallback
below applies: Apple's clang (no ``-fopenmp``), a cross compiler (no ``native``).

Environment: ``CXX`` names the compiler (default ``c++``); ``LLAMATRAIN_KERNEL_ARCH`` replaces
``-march=native`` (e.g. ``-march=haswell``: the AVX2 path on a newer CPU, for tests and
benches); ``LLAMATRAIN_KERNELS=0`` turns the kernels off. Anything that keeps the library
from loading (no compiler, a failed build, the switch) makes :func:`load_kernels` return None
after one :class:`~llamatrain.errors.LlamatrainWarning`; callers then compute as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import tempfile
import warnings
from pathlib import Path

from llamatrain.errors import LlamatrainWarning

__all__ = ["kernels_enabled", "load_kernels"]

SOURCES = Path(__file__).parent / "kernels"

BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-std=c++17")
"""-ffp-contract=off: no multiply-add fused where the source wrote two operations, so decoded
values are ggml's to the bit (explicit FMA intrinsics are unaffected)."""


def kernels_enabled() -> bool:
    """Whether the kernels may be used at all: ``LLAMATRAIN_KERNELS`` is not ``0``/``off``."""
    return os.environ.get("LLAMATRAIN_KERNELS", "1").strip().lower() not in ("0", "off", "false")


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llamatrain" / "kernels"


def _flags() -> list[str]:
    arch = os.environ.get("LLAMATRAIN_KERNEL_ARCH", "-march=native")
    return [*BASE_FLAGS, *shlex.split(arch)]


def _compiler_version(compiler: list[str]) -> str:
    done = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60)
    if done.returncode:
        raise OSError(f"{shlex.join(compiler)} --version failed: {done.stderr.strip()[:200]}")
    return done.stdout


def _build(source: Path, compiler: list[str], flags: list[str]) -> Path:
    """The library of ``source`` built with ``compiler`` and ``flags``, from the cache if there."""
    key = hashlib.sha256()
    headers = sorted(source.parent.glob("*.h"))  # what the source includes, ours
    parts = [source.read_bytes(), *(h.read_bytes() for h in headers), "\0".join(flags)]
    for part in (*parts, _compiler_version(compiler)):
        key.update(part if isinstance(part, bytes) else part.encode())
    folder = _cache_root() / key.hexdigest()[:16]
    library = folder / f"{source.stem}.so"
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(descriptor)
    try:
        done = subprocess.run(
            [*compiler, *flags, str(source), "-o", temporary],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode:
            lines = done.stderr.strip().splitlines()
            raise OSError(f"compiling {source.name} failed: {lines[0] if lines else ''}")
        os.replace(temporary, library)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return library


@functools.cache
def load_kernels(name: str = "quantized") -> ctypes.CDLL | None:
    """The kernel library ``ops/kernels/<name>.cpp``, built if needed and loaded once per
    process; None (after one warning) where it cannot be, or the kernels are switched off.
    ``load_kernels.cache_clear()`` forgets the outcome (tests that change the environment)."""
    if not kernels_enabled():
        return None
    compiler = shlex.split(os.environ.get("CXX", "c++"))
    try:
        return ctypes.CDLL(str(_build(SOURCES / f"{name}.cpp", compiler, _flags())))
    except (OSError, subprocess.SubprocessError) as e:
        warnings.warn(
            f"the quantized CPU kernels are unavailable ({e}); computing over decoded weights "
            "instead, slower. Install a C++ compiler (g++ or clang++, or set CXX), or set "
            "LLAMATRAIN_KERNELS=0 to skip the attempt",
            LlamatrainWarning,
            stacklevel=3,
        )
        return None
