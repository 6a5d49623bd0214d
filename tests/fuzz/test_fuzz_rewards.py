"""Fuzz what a reward function returns, property-based, through the run's own path: the
values are scored (``rewards.score``) and weighed into advantages (``grpo.score_rewards``).

Returns are drawn over every kind a Python function can hand back: numbers (ints past
float's range, floats with NaN and the infinities, Fractions, Decimals, complex, bools),
containers of them (lists, tuples, generators, sets, dicts, strings, bytes; too short, too
long), numpy scalars and arrays (every dtype kind, 0-d, one value, many, objects) and torch
tensors (bool, int, float, complex; of one value or many), with weights from tiny to 1e300.
Each ends with finite advantages and metrics, or a LlamatrainError in one line, within
``fuzz_bounds.bounded``'s time and memory; an accepted value is the float TRL's
``torch.tensor`` reads it as, wherever TRL reads it at all.
"""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from fuzz_bounds import bounded
from hypothesis import example, given
from hypothesis import strategies as st

from llamatrain.objectives.grpo.loss import score_rewards
from llamatrain.objectives.grpo.rewards import load, score

pytestmark = pytest.mark.fuzz

ROWS = 4  # one group of 4 completions

numbers = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.fractions(),
    st.sampled_from([Fraction(10**400, 3), Decimal("1.5"), Decimal("NaN"), 1j, 2**1024]),
)
numpy_values = st.one_of(
    st.sampled_from([np.bool_(True), np.bool_(False), np.float16(65504), np.float32("nan")]),
    st.builds(np.float64, st.floats()),
    st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
    st.sampled_from([np.complex64(1), np.str_("1"), np.array(2.5), np.array([1.0, 2.0])]),
    st.sampled_from([np.array([True]), np.array([[3]], dtype=np.int8), np.array([None])]),
)
torch_values = st.sampled_from(
    [torch.tensor(True), torch.tensor([0.5]), torch.tensor(7), torch.tensor(1j),
     torch.tensor([1.0, 2.0]), torch.tensor(float("inf")), torch.tensor([[1e38]]).half()]
)  # fmt: skip
values = st.one_of(numbers, numpy_values, torch_values, st.text(max_size=5))


def _containers(draw_values: st.SearchStrategy) -> st.SearchStrategy:
    rows = st.lists(draw_values, min_size=0, max_size=ROWS + 2)
    return st.one_of(
        rows,
        rows.map(tuple),
        rows.map(iter),
        rows.map(lambda v: {i: x for i, x in enumerate(v)}),
        draw_values,
        st.sampled_from(["1.0", b"1234", {1.0, 2.0}]),
        st.lists(st.floats(-1e300, 1e300), min_size=ROWS, max_size=ROWS).map(np.array),
        st.lists(st.floats(width=32), min_size=ROWS, max_size=ROWS).map(torch.tensor),
    )


returns = _containers(values)
weights = st.sampled_from([1.0, -1.0, 1e-300, 1e150, 1e300, 0.0])


def _scored(returned: object, weight: float) -> object:
    """The run's path for one function returning ``returned``: its table, weighed."""

    def fuzzed(prompts, completions, completion_ids, **columns):
        return returned

    prompts = [f"p{i}" for i in range(ROWS)]
    table = score(load([fuzzed], [weight]), prompts, ["a"] * ROWS, [[1]] * ROWS, {})
    weighted = torch.tensor([weight], dtype=torch.float64)
    return table, score_rewards(table, weighted, ["fuzzed"], ROWS)


@given(returned=returns, weight=weights)
@example(returned=[10**400] * ROWS, weight=1.0)
@example(returned=[1e308, -1e308, 0.0, 1.0], weight=1.0)
@example(returned=[np.bool_(True)] * ROWS, weight=1.0)
@example(returned=[1.0, 2.0, 3.0, 4.0], weight=1e300)
def test_any_return_scores_finitely_or_is_refused_in_one_line(returned, weight):
    result = bounded(lambda: _scored(returned, weight), repr(returned)[:60])
    if result is None:
        return
    table, scored = result
    assert table.shape == (ROWS, 1) and table.dtype == torch.float64
    assert all(math.isnan(v) or math.isfinite(v) for v in table.flatten().tolist())
    assert bool(torch.isfinite(scored.advantages).all())
    assert all(math.isnan(v) or math.isfinite(v) for v in scored.metrics.values())


@given(st.lists(values, min_size=ROWS, max_size=ROWS))
def test_an_accepted_value_is_the_float_trl_reads(returned):
    """Where TRL's ``torch.tensor`` reads the values at all, an accepted one is its float."""
    result = bounded(lambda: _scored(returned, 1.0), repr(returned)[:60])
    try:
        trl = torch.tensor([math.nan if v is None else v for v in returned], dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return  # TRL refuses these too (a traceback there)
    if result is not None and trl.dim() == 1:
        ours = result[0].flatten()
        assert torch.equal(ours.isnan(), trl.isnan())
        assert torch.equal(ours.nan_to_num(), trl.nan_to_num())
