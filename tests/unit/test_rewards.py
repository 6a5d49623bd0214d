"""Reward functions: TRL's signature carries over, specs load or fail in one line, every bad
answer stops in one line naming the function and the row, and the built-ins score as
documented."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from llamatrain.errors import ConfigError, DataError, TrainingError
from llamatrain.objectives.grpo.rewards import (
    Reward,
    TrainerState,
    check,
    load,
    score,
    trl_completions,
)

# ---- functions exactly as TRL's GRPO docs write them ---------------------------------------


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth, strict=True)]


def progress_reward(completions, trainer_state, **kwargs):
    return [trainer_state.global_step / trainer_state.max_steps for _ in completions]


def only_positive(completions, **kwargs):
    return [None if c.startswith("-") else 1.0 for c in completions]


def _batch(completions, **columns):
    """score()'s arguments for text completions of one plain prompt each (one char a token)."""
    prompts = [f"p{i}" for i in range(len(completions))]
    ids = [list(range(len(c))) for c in completions]
    return prompts, completions, ids, columns


def _score(functions, completions, **columns):
    return score(load(functions), *_batch(completions, **columns))


# ---- TRL compatibility ---------------------------------------------------------------------


def test_trl_docs_functions_score_unchanged():
    out = _score(
        [reward_len, reward_func],
        [r"x \boxed{4}", r"\boxed{5}", "twenty characters..."],
        ground_truth=["4", "4", "4"],
    )
    assert out.dtype == torch.float64 and out.shape == (3, 2)
    assert out[:, 0].tolist() == [-9.0, -11.0, 0.0]
    assert out[:, 1].tolist() == [1.0, 0.0, 0.0]


def test_conversational_completions_are_trl_messages():
    prompts = [[{"role": "user", "content": "q"}], "plain"]
    completions = trl_completions(prompts, ["<think>a</think><answer>b</answer>", "no"])
    assert completions[0] == [
        {"role": "assistant", "content": "<think>a</think><answer>b</answer>"}
    ]
    assert completions[1] == "no"
    out = score(load([format_reward_func]), prompts[:1], completions[:1], [[1, 2]], {})
    assert out.tolist() == [[1.0]]


def test_trl_own_reward_functions_load_by_spec_and_by_object():
    other = pytest.importorskip("trl.rewards.other_rewards")
    overlong = other.get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    rewards = load(["trl.rewards.format_rewards:think_format_reward", overlong])
    assert [r.name for r in rewards] == ["think_format_reward", "soft_overlong_punishment_reward"]
    prompts = [[{"role": "user", "content": "q"}]] * 2
    completions = trl_completions(prompts, ["<think>r</think> a", "a"])
    out = score(rewards, prompts, completions, [[0] * 6, [0] * 8], {})
    assert out.tolist() == [[1.0, 0.0], [0.0, -0.5]]


def test_trainer_hooks_are_passed_only_when_given():
    logged = []
    state = TrainerState(global_step=3, max_steps=12)
    args = _batch(["a", "b"])
    out = score(load([progress_reward]), *args, trainer_state=state, log_metric=logged.append)
    assert out[:, 0].tolist() == [0.25, 0.25]

    def metric_logger(completions, log_metric=None, **kwargs):
        assert set(kwargs) == {"prompts", "completion_ids", "answer"}
        log_metric("seen", float(len(completions)))
        return [0.0] * len(completions)

    score(
        load([metric_logger]), *_batch(["a"], answer=["1"]), log_metric=lambda *a: logged.append(a)
    )
    assert logged == [("seen", 1.0)]


def test_none_is_nan_and_other_containers_are_accepted():
    def as_tensor(completions, **kwargs):
        return torch.tensor([1.0] * len(completions))

    def as_array(completions, **kwargs):
        return np.arange(len(completions))

    def as_bools(completions, **kwargs):
        return (c == "1" for c in completions)

    out = _score([only_positive, as_tensor, as_array, as_bools], ["1", "-1"])
    assert math.isnan(out[1, 0]) and out[0, 0] == 1.0
    assert out[:, 1:].tolist() == [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]


# ---- errors while scoring: one line, the function and the row ------------------------------


def _fails_at_row_two(completions, **kwargs):
    return [1.0 / (len(c) - 2) for c in completions]


def _bad(value):
    def fn(completions, **kwargs):
        return [1.0, 1.0, value][: len(completions)]

    return fn


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_fails_at_row_two, r"'.*:_fails_at_row_two' raised ZeroDivisionError: .* at row 2;"),
        (lambda completions, **k: [0.0], r"returned 1 rewards for 3 completions .*at row 1\)"),
        (lambda completions, **k: [0.0] * 4, r"returned 4 rewards for 3 completions .*at row 3\)"),
        (lambda completions, **k: 1.0, r"returned a float, not a list of 3 rewards"),
        (lambda completions, **k: "101", r"returned a str, not a list of 3 rewards"),
        (_bad("1.0"), r"returned a str \('1\.0'\) at row 2;"),
        (_bad(float("nan")), r"returned nan \(None, not NaN, says a row .*\) at row 2;"),
        (_bad(-math.inf), r"returned -inf .* at row 2;"),
        (_bad(torch.tensor([1.0, 2.0])), r"returned a Tensor .* at row 2;"),
        (lambda completions, answer, **k: [0.0] * 3, r"raised TypeError: .*'answer'.* at row 0"),
    ],
    ids=[
        "raises",
        "too-short",
        "too-long",
        "not-a-list",
        "a-string",
        "non-numeric",
        "nan",
        "inf",
        "tensor-of-two",
        "missing-column",
    ],
)
def test_bad_rewards_stop_in_one_line_naming_function_and_row(fn, message):
    with pytest.raises(TrainingError, match=message) as caught:
        _score([fn], ["abc", "abcd", "xy"], answr=["1", "2", "3"])
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("reward function '")


def test_an_exception_no_row_raises_alone_is_reported_on_the_batch():
    def one_at_a_time(completions, **kwargs):
        if len(completions) > 1:
            raise ValueError("batch of many")
        return [0.0]

    with pytest.raises(TrainingError, match=r"raised ValueError: batch of many on the batch"):
        _score([one_at_a_time], ["a", "b"])


def test_a_column_named_like_an_argument_is_refused():
    with pytest.raises(DataError, match=r"column 'completions'.*rename the column"):
        score(load([reward_len]), ["p"], ["a"], [[1]], {"completions": ["x"]})


# ---- specs, weights, settings --------------------------------------------------------------

REWARDS_FILE = """
print("ran")
VALUE = 3

class Judge:
    @staticmethod
    def strict(completions, **kwargs):
        return [1.0 for _ in completions]
"""


@pytest.fixture
def in_tmp(code_dir):
    """A working directory holding reward files (conftest's ``code_dir``)."""
    (code_dir / "my_rewards.py").write_text(REWARDS_FILE)
    return code_dir


def test_a_file_spec_loads_relative_to_the_working_directory_once(in_tmp, capsys):
    specs = ["my_rewards.py:Judge.strict", f"{in_tmp}/my_rewards.py:Judge.strict"]
    with pytest.raises(ConfigError, match="two functions called 'strict'"):
        load(specs)
    rewards = load(specs[:1], [2.0])
    assert [(r.name, r.weight) for r in rewards] == [("strict", 2.0)]
    assert load(specs[1:])[0].fn is rewards[0].fn
    assert capsys.readouterr().out == "ran\n"
    assert score(rewards, *_batch(["a", "b"])).tolist() == [[1.0], [1.0]]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", r"'no_colon' is not one of 'package\.module:function'"),
        ("pkg.mod:", r"is not one of"),
        ("pkg-x:f", r"names neither a module .* nor a \.py file"),
        ("llamatrain_no_such_pkg.mod:f", r"no module named 'llamatrain_no_such_pkg' on sys.path"),
        ("missing.py:f", r"no file .*missing\.py \(a path is relative to the working directory"),
        ("broken.py:f", r"running broken\.py raised NameError: .*undefined_name"),
        ("my_rewards.py:nope", r"my_rewards\.py has no attribute 'nope'"),
        ("my_rewards.py:VALUE", r"VALUE is a int, not a function"),
        ("builtin:nope", r"no built-in 'nope'; the built-ins are builtin:exact_answer"),
    ],
)
def test_a_bad_spec_fails_in_one_line_naming_it(spec, message, in_tmp):
    with pytest.raises(ConfigError, match=message) as caught:
        load([spec])
    assert "\n" not in str(caught.value)


def test_import_failures_say_that_a_config_runs_the_module_it_names():
    with pytest.raises(ConfigError, match=r"train\.rewards runs the module it names.*checkpoints"):
        load(["llamatrain_no_such_pkg:f"])


def test_a_module_failing_inside_is_not_reported_as_missing(tmp_path, monkeypatch):
    (tmp_path / "inner_fail_pkg.py").write_text("import llamatrain_no_such_dep\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"running inner_fail_pkg raised ModuleNotFoundError"):
        load(["inner_fail_pkg:f"])


def test_check_imports_nothing():
    check(["llamatrain_no_such_pkg.mod:f", "builtin:format"], [1.0, 2.0])
    assert "llamatrain_no_such_pkg" not in sys.modules


@pytest.mark.parametrize(
    ("specs", "weights", "args", "message"),
    [
        ([], None, None, r"train\.rewards is empty"),
        (["a:f", "b:g"], [1.0], None, r"has 1 weights for 2 train\.rewards; give one per"),
        (["a:f"], [math.inf], None, r"reward_weights holds inf; each must be a finite number"),
        (["a:f"], [True], None, r"reward_weights holds True"),
        (["a:f", "b:f"], None, None, r"two functions called 'f'; .*rewards/f/mean"),
        (["a:f"], None, {"length": {"target": 3}}, r"reward_args\.length: no 'builtin:length'"),
        (
            ["builtin:length"],
            None,
            None,
            r"builtin:length needs train\.reward_args\.length\.target",
        ),
        (["builtin:length"], None, {"length": {"target": 0}}, r"length\.target must be a positive"),
        (["builtin:length"], None, {"length": {"target": 5, "unit": "words"}}, r"'tokens' or"),
        (
            ["builtin:format"],
            None,
            {"format": {"regex": "x"}},
            r"has no setting 'regex' \(it takes",
        ),
        (["builtin:format"], None, {"format": {"pattern": "("}}, r"is not a regular expression"),
        (["builtin:exact_answer"], None, {"exact_answer": {"pattern": "x"}}, r"has 0 groups"),
        (["builtin:exact_answer"], None, {"exact_answer": {"column": 3}}, r"column must be a name"),
    ],
)
def test_check_refuses_bad_specs_weights_and_settings(specs, weights, args, message):
    with pytest.raises(ConfigError, match=message) as caught:
        check(specs, weights, args)
    assert "\n" not in str(caught.value)


def test_weights_default_to_one():
    assert [r.weight for r in load(["builtin:format", reward_len])] == [1.0, 1.0]
    assert load([reward_len], [0.5]) == [
        Reward(f"{__name__}:reward_len", "reward_len", reward_len, 0.5)
    ]


# ---- built-ins -----------------------------------------------------------------------------


def test_exact_answer_default_compares_the_last_numbers():
    completions = ["so 3 + 4 = 7.", "it is 1,000", "answer: 8", "no number", "7", "7"]
    answers = ["Natalia sold 48/2 = 24 ... #### 7", "1000.0", "7", "7", None, 7]
    out = _score(["builtin:exact_answer"], completions, answer=answers)
    assert out[:, 0].tolist()[:4] == [1.0, 1.0, 0.0, 0.0]
    assert math.isnan(out[4, 0]) and out[5, 0] == 1.0


def test_exact_answer_with_gsm8k_pattern_and_another_column():
    args = {"exact_answer": {"pattern": r"#### (.*)", "column": "solution"}}
    rewards = load(["builtin:exact_answer"], args=args)
    completions = ["work... #### 72", "#### 71", "72", "#### Paris "]
    solutions = ["reasoning #### 72", "72", "72", "Paris"]
    out = score(rewards, *_batch(completions, solution=solutions))
    assert out[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(TrainingError, match=r"raised DataError: no column 'solution'.* at row 0"):
        score(rewards, *_batch(["#### 1"], answer=["1"]))


def test_format_default_is_trl_think_format():
    completions = ["<think>\na\n</think>\nb", "<think>a<think>b</think>", "x<think>a</think>"]
    assert _score(["builtin:format"], completions)[:, 0].tolist() == [1.0, 0.0, 0.0]
    rewards = load(["builtin:format"], args={"format": {"pattern": r"\d+$"}})
    assert score(rewards, *_batch(["a 12", "12 a"]))[:, 0].tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    ("unit", "expected"), [("tokens", [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]), ("characters", [1.0] * 6)]
)
def test_length_is_a_triangle_peaking_at_the_target(unit, expected):
    rewards = load(["builtin:length"], args={"length": {"target": 4, "unit": unit}})
    completions = ["abcd"] * 6
    ids = [[0] * n for n in (0, 2, 4, 6, 8, 12)]
    out = score(rewards, [""] * 6, completions, ids, {})
    assert out[:, 0].tolist() == expected


def test_builtins_read_conversational_completions():
    prompts = [[{"role": "user", "content": "q"}]]
    completions = trl_completions(prompts, ["<think>r</think> 7"])
    out = score(
        load(["builtin:format", "builtin:exact_answer"]),
        prompts,
        completions,
        [[1]],
        {"answer": ["7"]},
    )
    assert out.tolist() == [[1.0, 1.0]]


def test_a_path_with_a_drive_letter_splits_at_the_last_colon():
    with pytest.raises(ConfigError, match=r"no file .*rewards\.py"):
        load([str(Path("C:/nowhere/rewards.py")) + ":f"])
