"""Logs are data (``metrics.jsonl``, ``completions.jsonl``): a damaged line costs that line,
with a warning counting them, never a traceback; a value past float's range is no value; the
plot shows a ``$`` as a dollar and leaves out a ± band that overflows."""

from __future__ import annotations

import json

import pytest

from llamatrain.errors import LlamatrainWarning
from llamatrain.plot import can_plot, finite_value, plot_metrics, read_records

GOOD = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
DAMAGED = [
    '{"step": 3, "loss": ' + "9" * 5000 + "}",  # more digits than Python reads
    "[" * 100_000 + "]" * 100_000,  # nested past the recursion limit
    '{"step": ' + "1" * 30 + ', "loss": 1.0}',  # a step no checkpoint can hold
    '{"step": true, "loss": 1.0}',
    '{"step": -1}',
    "[1, 2]",
    '"text"',
]


def test_damaged_lines_are_skipped_and_counted_in_one_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(GOOD[0]), *DAMAGED, json.dumps(GOOD[1]), '{"step": 4, "lo']
    path.write_text("\n".join(lines))
    with pytest.warns(LlamatrainWarning, match=r"skipped 7 damaged line\(s\), the first line 2"):
        assert read_records(path) == GOOD  # the torn last line silently


def test_bytes_that_are_not_utf8_cost_their_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "note": "\xff\xfe"}\n')
    records = read_records(path)
    assert [r["step"] for r in records] == [1, 2] and records[1]["note"] == "\ufffd\ufffd"


@pytest.mark.parametrize(
    "value, expected",
    [(2, 2.0), (0.5, 0.5), (10**400, None), (float("inf"), None), (True, None), ("1", None)],
)
def test_a_value_is_a_finite_float_or_none(value, expected):
    assert finite_value({"x": value}, "x") == expected


@pytest.mark.skipif(not can_plot(), reason="matplotlib is an optional extra")
def test_the_plot_takes_dollars_big_numbers_and_overflowing_bands(tmp_path):
    """A run named like mathtext, a reward function whose name holds ``$``, values of 10^400
    and a reward ± std that overflows: before, tracebacks inside matplotlib."""
    run = tmp_path / "run $x^{$"
    run.mkdir()
    records = [
        {"step": s, "loss": 0.1, "lr": 1e-3, "reward": 1e308, "reward_std": 1e308,
         "rewards/a$b/mean": 0.5, "completions/mean_length": 10**400, "entropy": 1.0}
        for s in (1, 2)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = plot_metrics(run)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
