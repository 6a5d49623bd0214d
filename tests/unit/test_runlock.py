"""One process per run folder: the lock refuses a second holder by PID and is released at the
end of the block (a killed process's release by the kernel: tests/integration/test_faults.py)."""

from __future__ import annotations

import os

import pytest

from llamatrain.errors import RunInUseError
from llamatrain.runlock import LOCK_FILE, run_lock


def test_a_held_folder_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    with run_lock(run) as held:
        assert held == run and (run / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        with (
            pytest.raises(
                RunInUseError, match=rf"in use by another llamatrain fit \(PID {os.getpid()},"
            ),
            run_lock(run),
        ):
            pass
    with run_lock(run):  # released: the next run takes it
        pass
