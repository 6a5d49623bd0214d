"""Reward code cannot end or move the run (``llamatrain.user_code`` around every call and
import ``objectives.grpo.rewards`` makes): an exit or interrupt it raises is one error naming it,
the working directory is put back after each call, and each function gets its own copies of
what it could change."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import pytest
from user_errors import error_of

from llamatrain.errors import ConfigError, TrainingError
from llamatrain.interrupt import StopNow
from llamatrain.objectives.grpo.rewards import load, score


def _batch(completions):
    prompts = [f"p{i}" for i in range(len(completions))]
    return prompts, completions, [list(range(len(c))) for c in completions], {"answer": ["1"] * 2}


def exits(completions, **kwargs):
    sys.exit(0)


def exits_with_text(completions, **kwargs):
    sys.exit("done here")


def interrupts(completions, **kwargs):
    raise KeyboardInterrupt


def cancelled(completions, **kwargs):
    raise asyncio.CancelledError("task gone")


@pytest.mark.parametrize(
    "fn, told",
    [
        (exits, r"raised SystemExit\(0\) \(sys\.exit\)"),
        (exits_with_text, r"raised SystemExit\('done here'\) \(sys\.exit\)"),
        (interrupts, r"raised KeyboardInterrupt,"),
        (cancelled, r"raised CancelledError: task gone,"),
    ],
)
def test_an_exit_or_interrupt_from_a_reward_function_is_one_error_naming_it(fn, told):
    """``sys.exit(0)`` would end the run with exit 0 and nothing saved."""
    message = error_of(score, load([fn]), *_batch(["a", "b"]))
    assert message.startswith(f"reward function 'test_reward_code:{fn.__name__}' ")
    assert re.search(told + r".* which would end the run; user code must return", message)


def test_the_second_stop_signal_passes_through_reward_code():
    """The user's "stop now" (a second Ctrl-C) is theirs, not the function's."""

    def stopped(completions, **kwargs):
        raise StopNow

    with pytest.raises(StopNow):
        score(load([stopped]), *_batch(["a", "b"]))


def test_a_reward_module_that_exits_at_import_is_one_config_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ConfigError) as caught:
        load(["quits.py:f"])
    assert str(caught.value).startswith(
        "reward 'quits.py:f': running quits.py raised SystemExit(0) (sys.exit), which would end"
    )
    assert str((tmp_path / "quits.py").resolve()) not in sys.modules  # nothing half run kept


def test_the_working_directory_is_put_back_after_each_call(tmp_path, monkeypatch):
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(here)
    seen = []

    def moves(completions, **kwargs):
        seen.append(Path.cwd())
        os.chdir(elsewhere)
        return [1.0] * len(completions)

    def moves_and_fails(completions, **kwargs):
        os.chdir(elsewhere)
        raise ValueError("no")

    score(load([moves]), *_batch(["a", "b"]))
    score(load([moves]), *_batch(["a", "b"]))
    assert seen == [here, here] and Path.cwd() == here
    with pytest.raises(TrainingError):
        score(load([moves_and_fails]), *_batch(["a", "b"]))
    assert Path.cwd() == here


def test_each_function_gets_its_own_copies_of_what_it_could_change():
    """A function that edits its arguments changes neither what the caller logs nor what the
    next function receives."""
    prompts = [[{"role": "user", "content": "q"}], "plain"]
    completions, ids = ["a", "b"], [[1, 2], [3]]
    columns = {"answer": [["x"], ["y"]]}
    received = []

    def vandal(prompts, completions, completion_ids, answer, **kwargs):
        prompts[0][0]["content"] = "changed"
        completion_ids[0].append(99)
        completion_ids.append([7])
        answer[1].append("z")
        return [0.0, 0.0]

    def reader(prompts, completions, completion_ids, answer, **kwargs):
        received.append((prompts, completion_ids, answer))
        return [0.0, 0.0]

    score(load([vandal, reader]), prompts, completions, ids, columns)
    assert prompts == [[{"role": "user", "content": "q"}], "plain"]
    assert ids == [[1, 2], [3]] and columns == {"answer": [["x"], ["y"]]}
    assert received == [(prompts, ids, columns["answer"])]
