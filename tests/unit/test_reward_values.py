"""Every number of GRPO's rewards is checked where it is used (``llamatrain.reward_values``):
a returned value becomes a float inside the check, numpy's bools count as bools, and a step
whose rewards (or weights) would overflow a sum or a spread stops in one line naming the
function, instead of logging ``reward: Infinity`` and training nothing."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from user_errors import error_of

from llamatrain.objectives.grpo.loss import score_rewards
from llamatrain.objectives.grpo.rewards import check, load, score
from llamatrain.reward_values import NotAReward, reward_value


class FloatThatFails(float):
    def __float__(self) -> float:
        raise RuntimeError("no float today")


@pytest.mark.parametrize(
    "value, expected",
    [
        (np.bool_(True), 1.0), (np.bool_(False), 0.0), (True, 1.0), (np.float32(0.5), 0.5),
        (np.int64(-3), -3.0), (np.array([2.0]), 2.0), (torch.tensor(True), 1.0),
        (torch.tensor([[0.25]]), 0.25),
    ],
)  # fmt: skip
def test_values_trl_reads_as_numbers_are_rewards_of_the_same_value(value, expected):
    """TRL turns a function's list into ``torch.tensor(values)``, which reads these so."""
    assert reward_value(value) == expected
    assert torch.tensor([value]).flatten().double().item() == expected  # as TRL reads it


@pytest.mark.parametrize("value, expected", [(Fraction(1, 4), 0.25), (np.array(1.5), 1.5)])
def test_other_real_numbers_and_one_value_arrays_are_rewards_too(value, expected):
    """Beyond TRL (whose ``torch.tensor`` refuses these): any real number, and an array of one
    value as a tensor of one is."""
    assert reward_value(value) == expected


@pytest.mark.parametrize(
    "value, told",
    [
        (10**400, r"a int that is not a float \(1000.*OverflowError: int too large"),
        (Fraction(10**400, 3), r"a Fraction that is not a float .*OverflowError"),
        (FloatThatFails(1.0), r"a FloatThatFails that is not a float .*RuntimeError: no float"),
        (Decimal("1.5"), r"a Decimal \(Decimal\('1\.5'\)\)"),
        (1j, r"a complex"),
        (np.array([1.0, 2.0]), r"a ndarray"),
        (np.complex64(1), r"a complex64"),
        (torch.tensor(1j), r"a Tensor"),
        (float("nan"), r"nan \(None, not NaN, says a row does not apply\)"),
    ],
)
def test_anything_else_is_named_without_a_traceback(value, told):
    with pytest.raises(NotAReward, match=told):
        reward_value(value)


def test_a_value_that_cannot_be_a_float_stops_the_step_in_one_line():
    def huge(completions, **kwargs):
        return [1.0, 10**400][: len(completions)]

    prompts, completions = ["p", "q"], ["a", "b"]
    message = error_of(score, load([huge]), prompts, completions, [[1], [2]], {})
    assert message.startswith("reward function 'test_reward_values:")
    assert "returned a int that is not a float" in message and "at row 1;" in message


def test_a_weight_past_float_range_is_one_config_error():
    message = error_of(check, ["builtin:format"], [10**400])
    assert message.startswith("train.reward_weights holds 1000") and "finite number" in message


def scored(table, weights=(1.0,), generations=4):
    per_function = torch.tensor(table, dtype=torch.float64)
    names = [f"f{k}" for k in range(per_function.shape[1])]
    return score_rewards(per_function, torch.tensor(weights, dtype=torch.float64), names,
                         generations)  # fmt: skip


@pytest.mark.parametrize(
    "table, weights, told",
    [
        # each finite, their weighted sum not: before, "reward: Infinity" and no update
        ([[1e308, 1e308]] * 4, (1.0, 1.0), r"'f0' returned 1e\+308 at row 0:"),
        # a group's spread overflows though its mean is 0
        ([[1e200], [-1e200], [0.0], [0.0]], (1.0,), r"'f0' returned 1e\+200 at row 0:"),
        # a huge weight over ordinary rewards
        ([[1.0], [2.0], [3.0], [4.0]], (1e300,), r"'f0' returned 4 at row 3 \(weight 1e\+300\):"),
        # the per-function metrics overflow though the weight makes the sum small
        ([[1e300, 0.0], [-1e300, 1.0], [0.0, 0.0], [1.0, 1.0]], (1e-300, 1.0), r"'f0'"),
    ],
    ids=["sum", "spread", "weight", "metric"],
)
def test_rewards_whose_statistics_overflow_stop_in_one_line(table, weights, told):
    message = error_of(scored, table, weights)
    assert re.search(told, message), message
    assert "too large for their sums and spreads to be finite" in message


def test_rewards_at_the_bound_give_finite_statistics():
    """1e150-scale rewards pass, and every advantage and metric made of them is finite."""
    out = scored([[1e150], [-1e150], [3e149], [math.nan]], generations=4)
    assert all(math.isfinite(v) for v in out.metrics.values())
    assert bool(torch.isfinite(out.advantages).all())
    assert out.advantages[0] > 0 > out.advantages[1]
