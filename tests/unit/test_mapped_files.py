"""A mapped file that changes under the process (``llamatrain.gguf.mapped_files``): told in one
line naming it, however it changed; a read past the end of a truncated one gives zeros inside
``faults_answered`` instead of SIGBUS, and any other fault still reaches its own handler."""

from __future__ import annotations

import ctypes
import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from user_errors import error_of

from llamatrain.gguf import mapped_files
from llamatrain.gguf.file import map_stored
from llamatrain.gguf.mapped_files import check_mapped_files, faults_answered
from llamatrain.gguf.write import write_gguf

pytestmark = pytest.mark.skipif(not mapped_files._SUPPORTED, reason="Linux 64-bit only")

ROWS, COLUMNS = 64, 256  # 64 KiB of float32: several pages past the header


def _mapped(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """A GGUF holding one random float32 matrix, and that matrix mapped from it (the only
    mapping watched: an earlier test's, no longer held, is collected first)."""
    gc.collect()
    assert not mapped_files._MAPPINGS
    path = tmp_path / "base.gguf"
    weight = np.random.default_rng(0).standard_normal((ROWS, COLUMNS), dtype=np.float32)
    write_gguf(path, "llama", {}, {"w": (weight, "f32")})
    tensor = map_stored(path, {"w": torch.empty(ROWS, COLUMNS)})["w"]
    assert torch.equal(tensor, torch.from_numpy(weight))
    return path, tensor


@pytest.fixture
def mapped(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    return _mapped(tmp_path)


def test_an_unchanged_file_passes(mapped):
    check_mapped_files()


def _rewrite_in_place(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        f.write(bytes(4096))


def _replace(path: Path) -> None:
    other = path.with_name("other.gguf")
    other.write_bytes(path.read_bytes())
    other.replace(path)


@pytest.mark.parametrize(
    "change, told",
    [
        (lambda p: os.truncate(p, 4096), r"it is 4,096 bytes, [\d,]+ when the run mapped it"),
        (_rewrite_in_place, "it was rewritten in place"),
    ],
    ids=["truncated", "rewritten"],
)
def test_a_change_to_the_mapped_file_is_one_line_naming_it(mapped, change, told):
    path, _ = mapped
    change(path)
    message = error_of(check_mapped_files)
    assert message.startswith(f"{path}, which this run maps, changed (")
    assert re.search(told, message), message
    assert message.endswith("continue with --resume latest")


@pytest.mark.parametrize("change", [_replace, Path.unlink], ids=["replaced", "deleted"])
def test_a_path_that_names_another_file_leaves_the_mapping_as_it_was(mapped, change):
    """Renamed over or deleted, the path no longer names the mapped inode, which the run goes
    on reading unchanged: nothing to stop (a resume over another file is refused by the
    checkpoints' sha256); a change to the old inode is still seen."""
    path, tensor = mapped
    change(path)
    check_mapped_files()
    assert float(tensor.abs().sum()) > 0
    os.truncate(f"/proc/self/fd/{next(iter(mapped_files._MAPPINGS.values())).fd}", 0)
    assert "it is 0 bytes" in error_of(check_mapped_files)


def test_a_mapping_no_longer_held_is_no_longer_watched(tmp_path):
    path, tensor = _mapped(tmp_path)
    del tensor
    gc.collect()
    os.truncate(path, 0)
    check_mapped_files()


def test_other_ranks_are_told_of_a_change_one_of_them_saw(mapped):
    """``agree``: every rank stops together, also one whose own stat saw nothing."""
    message = error_of(check_mapped_files, lambda changed: True)
    assert message.startswith("a file another rank maps changed under it")


def _sigbus_handler() -> int | None:
    old = mapped_files._Sigaction()
    mapped_files._LIBC.sigaction(signal.SIGBUS, None, ctypes.byref(old))
    return old.handler


def test_a_read_past_the_end_gives_zeros_and_is_told(mapped):
    """Truncated under the mapping: inside ``faults_answered`` the read that would be SIGBUS
    reads zeros, the file is marked faulted, and the previous handler is back after."""
    path, tensor = mapped
    before = _sigbus_handler()
    os.truncate(path, 4096)
    with faults_answered():
        assert _sigbus_handler() != before
        total = float(tensor[-1].abs().sum())  # the last row lies past the new end
    assert total == 0.0
    assert _sigbus_handler() == before
    assert any(m.faulted for m in mapped_files._MAPPINGS.values())
    assert "4,096 bytes" in error_of(check_mapped_files)


def test_a_fault_outside_a_watched_mapping_reaches_the_default_handler(tmp_path):
    """A SIGBUS the module did not cause (here an unwatched mapping) is not swallowed: the
    process dies of it as it would without ``faults_answered``."""
    script = textwrap.dedent(
        f"""
        import os, numpy as np
        from llamatrain.gguf.mapped_files import faults_answered
        np.ones(1 << 16, dtype=np.uint8).tofile({str(tmp_path / "f")!r})
        m = np.memmap({str(tmp_path / "f")!r}, mode="c", dtype=np.uint8)
        os.truncate({str(tmp_path / "f")!r}, 0)
        with faults_answered():
            print(int(m[-1]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stderr[-2000:])
