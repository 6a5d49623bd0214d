"""The numbers of GRPO's rewards, each checked where it is used.

- :func:`reward_value`: what a reward function returned for one row as the float the run
  uses, converted *inside* the check. ``10**400``, a huge ``Fraction`` or a float subclass
  whose ``__float__`` raises would otherwise pass ``isinstance(value, Real)`` and fail later
  as a traceback. Bools count as 1.0 / 0.0, numpy's too (TRL reads rewards with
  ``torch.tensor``, which takes them so); so does a one-value tensor or array.
- :func:`check_scale`: a step's rewards, each function's and the weighted ones, small enough
  that every statistic GRPO makes of them is finite: the weighted sums, the group means, the
  spreads (standard deviations), the advantages and the logged means and stds. Finite rewards
  whose sum or spread overflows float64 (1e308-ish values, or huge ``reward_weights``) would
  log ``reward: Infinity``, zero every advantage and train nothing while the run reports
  success.

Why one bound covers them all: for values ``x`` with ``4·Σx²`` finite, each ``|x|`` and
their mean are below ``sqrt(Σx²)``, every squared deviation ``(x − mean)²`` is at most
``4·max x²``, and the sum of squared deviations is at most ``Σx²`` (it is ``Σx² − n·mean²``);
Bessel's factor is at most 2. An advantage is a deviation over ``std + 1e-4``: below
``2·sqrt(Σx²)·1e4``, finite too.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from numbers import Real
from typing import Any

import numpy as np
import torch

from llamatrain.errors import TrainingError, shown

__all__ = ["NotAReward", "check_scale", "reward_value"]

SQUARES_LIMIT = sys.float_info.max / 4
"""The bound on a batch's sum of squared rewards (see the module docstring): |r| ≲ 1e153."""


class NotAReward(ValueError):
    """A returned value that is no reward: its text says what it is, as a message quotes it."""


def reward_value(value: Any) -> float:
    """``value`` as a reward: None → NaN (the row does not apply), a bool → 1.0 / 0.0, a real
    number → its float, which must be finite. NotAReward saying what ``value`` is otherwise."""
    if value is None:
        return math.nan
    if _one_valued(value):
        value = _one_value(value)
    if isinstance(value, np.bool_):
        value = bool(value)
    if not isinstance(value, Real):
        raise NotAReward(f"a {type(value).__name__} ({shown(repr(value), 40)})")
    number = _float(value)
    if not math.isfinite(number):
        raise NotAReward(f"{number} (None, not NaN, says a row does not apply)")
    return number


def _one_valued(value: Any) -> bool:
    """Whether ``value`` is a tensor or an array of one value (any shape: TRL flattens)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, np.ndarray) and value.size == 1


def _one_value(value: torch.Tensor | np.ndarray) -> Any:
    """A one-value tensor or array's value, unless it is complex (then itself, refused)."""
    complex_ = value.is_complex() if isinstance(value, torch.Tensor) else value.dtype.kind == "c"
    return value if complex_ else value.item()


def _float(value: Real) -> float:
    """``float(value)``; NotAReward naming the value when the conversion raises (an int past
    float's range, a float subclass whose ``__float__`` fails)."""
    try:
        return float(value)
    except Exception as e:
        raise NotAReward(
            f"a {type(value).__name__} that is not a float ({shown(repr(value), 40)}: "
            f"{type(e).__name__}: {shown(str(e), 80)})"
        ) from None


def check_scale(
    per_function: torch.Tensor, weights: torch.Tensor, rewards: torch.Tensor, names: Sequence[str]
) -> None:
    """TrainingError in one line unless a step's rewards are small enough for every statistic
    made of them to be finite (module docstring): ``per_function`` (N, F) as returned (NaN:
    None), weighed by ``weights`` (F,) into ``rewards`` (N,). It names a function at fault,
    its largest value, that value's row and its weight."""
    terms = per_function * weights.to(per_function).unsqueeze(0)
    columns = [*per_function.unbind(dim=1), *terms.unbind(dim=1)]
    failing = [k % len(names) for k, column in enumerate(columns) if not _squares_fit(column)]
    if not failing and _squares_fit(rewards):
        return
    k = failing[0] if failing else int(_magnitude(terms).max(dim=0).values.argmax())
    row = int(_magnitude(terms[:, k]).argmax())
    value, weight = float(per_function[row, k]), float(weights[k])
    weighed = "" if weight == 1.0 else f" (weight {weight:g})"
    raise TrainingError(
        f"reward function {shown(names[k])!r} returned {value:g} at row {row}{weighed}: the "
        "step's rewards are too large for their sums and spreads to be finite in float64, so "
        "its advantages would be lost; return rewards of a sane scale, with "
        "train.reward_weights (|reward x weight| well below 1e150)"
    )


def _magnitude(values: torch.Tensor) -> torch.Tensor:
    """``|values|``, NaN (a row a function does not score) as -1 so it is never the largest."""
    return values.abs().nan_to_num(nan=-1.0, posinf=math.inf)


def _squares_fit(values: torch.Tensor) -> bool:
    """Whether ``4·Σx²`` over the values that are not NaN is finite (float64)."""
    x = values.double()
    x = x[~x.isnan()]
    return bool(torch.isfinite(x).all()) and float((x * x).sum()) <= SQUARES_LIMIT
