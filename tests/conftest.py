"""Shared fixtures: runs of the built-in ``tiny`` config in temporary folders.

The tiny config trains on the built-in corpus ``sonnets`` (shipped inside the package), so a
run needs nothing from the repository: only a place for its outputs and its cache.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenizer/token cache for the whole session, so each run does not retrain it."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def tiny_overrides(cache_dir: Path, tmp_path: Path):
    """``--set`` items that keep a run of the tiny config inside the test's temporary folder
    (output) and the session's cache; keyword arguments add or replace items."""

    def make(**extra: object) -> list[str]:
        values = {"data.cache_dir": f'"{cache_dir}"', "output.dir": f'"{tmp_path / "run"}"'}
        values.update(extra)
        return [f"{k}={v}" for k, v in values.items()]

    return make


@dataclass
class CliRun:
    """A finished ``llamatrain fit`` process: where it ran, its run folder and what it printed."""

    cwd: Path
    run_dir: Path
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> CliRun:
    """The whole tiny config (60 steps, evaluations with samples, checkpoints, f32 export) run
    as a user would: ``llamatrain fit --config tiny`` in a fresh process, from a working
    directory unrelated to the repository, with a relative ``output.dir``.

    Shared by the CLI and llama.cpp tests, which read its files and output.
    """
    cwd = tmp_path_factory.mktemp("elsewhere")
    command = [
        sys.executable, "-m", "llamatrain", "fit", "--config", "tiny",
        "--set", "output.dir=run", "--set", f"data.cache_dir={cache_dir}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return CliRun(cwd, cwd / "run", done.stdout, done.stderr)


@pytest.fixture
def file_size_limit() -> Callable[[int], contextlib.AbstractContextManager[None]]:
    """``with file_size_limit(n):`` makes writing past ``n`` bytes of any file fail with EFBIG,
    as a full disk fails a write (ENOSPC): how the tests simulate one, since they run as root,
    for whom a read-only folder (chmod) is writable all the same.

    SIGXFSZ is ignored meanwhile, so the kernel refuses the write instead of killing pytest.
    """
    resource = pytest.importorskip("resource")
    signal = pytest.importorskip("signal")

    @contextlib.contextmanager
    def limit(n_bytes: int) -> Iterator[None]:
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)

    return limit


@contextlib.contextmanager
def _kernels_off() -> Iterator[None]:
    """The kernels of ``ops.quantized_matmul`` switched off (and forgotten before and after)."""
    from llamatrain.ops.kernel_build import load_kernels

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLAMATRAIN_KERNELS", "0")
        load_kernels.cache_clear()
        yield
    load_kernels.cache_clear()


@pytest.fixture
def decoded_products() -> Iterator[None]:
    """Quantized products by decode-then-matmul (the kernels of ``ops.quantized_matmul``
    switched off): for tests of that path's exactness, which the kernels' 8-bit activations
    would blur (they are checked in tests/unit/test_quantized_matmul.py)."""
    with _kernels_off():
        yield


@pytest.fixture(scope="module")
def decoded_products_module() -> Iterator[None]:
    """:func:`decoded_products` for a whole module (its module-scoped runs included)."""
    with _kernels_off():
        yield
