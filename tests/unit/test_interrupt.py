"""SIGTERM/SIGINT become a stop request while a run trains; a second one stops at once."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from llamatrain.interrupt import STOP_SIGNALS, StopRequest


def test_a_signal_is_recorded_and_the_handlers_are_put_back():
    before = [signal.getsignal(s) for s in STOP_SIGNALS]
    stop = StopRequest()
    with stop.on_signals():
        assert not stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop and stop.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # the second signal: now, without a save
            os.kill(os.getpid(), signal.SIGINT)
    assert [signal.getsignal(s) for s in STOP_SIGNALS] == before


def test_other_threads_install_nothing():
    before = [signal.getsignal(s) for s in STOP_SIGNALS]
    seen = []

    def run() -> None:
        with StopRequest().on_signals():
            seen.append([signal.getsignal(s) for s in STOP_SIGNALS])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [before]
