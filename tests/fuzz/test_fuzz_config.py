"""Fuzz TOML configs and ``--set`` overrides, property-based.

Configs are drawn over the real sections and keys with values of every TOML kind (and the
telling ones: NaN, infinities, -1, 10^9, huge integers, empty and non-UTF-8 strings, lists and
tables where scalars belong), then spliced with what breaks parsers (100,000-deep arrays or
inline tables, a 5000-digit integer, a lone-surrogate escape, bytes that are not UTF-8).
Overrides are drawn the same way as ``section.key=value`` text. ``load_config`` returns a
Config or raises a LlamatrainError in one line, within ``conftest.bounded``'s bounds.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import tomli_w
from fuzz_bounds import bounded
from hypothesis import given
from hypothesis import strategies as st

from llamatrain.config import load_config
from llamatrain.config.fields import config_keys
from llamatrain.config.sections import SECTIONS

pytestmark = pytest.mark.fuzz

KEYS = sorted(f"{section}.{key}" for section, cls in SECTIONS.items() for key in config_keys(cls))
scalars = st.one_of(
    st.booleans(),
    st.sampled_from([-1, 0, 1, 2, 3, 64, 10**9, 2**31, 2**63 - 1, -(2**63)]),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e-300, 1e300, 0.5]),
    st.text(max_size=8),
    st.sampled_from(["", "none", "adamw", "bpe", "llama", "\ud800", "a\udcffb"]),
)
toml_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=4,
)
RAW = [
    "x = " + "[" * 100_000,
    "x = " + "[" * 100_000 + "]" * 100_000,
    "x = " + "{a = " * 50_000 + "1" + "}" * 50_000,
    "x = " + "9" * 5000,
    'x = "\\ud800"',
    "x = nan\n",
    "[" * 1000 + "a" + "]" * 1000,
]
keys = st.sampled_from(KEYS) | st.text(max_size=8)
configs = st.dictionaries(keys, toml_values, max_size=6)
override_values = st.one_of(
    toml_values.map(lambda v: tomli_w.dumps({"v": v})[4:].strip() if _dumpable(v) else str(v)),
    st.sampled_from(["[" * 100_000, "9" * 5000, "nan", "-inf", "1e999", "none", "\ud800", ""]),
    st.text(max_size=10),
)


def _dumpable(value: object) -> bool:
    try:
        tomli_w.dumps({"v": value})
    except Exception:  # noqa: BLE001 - whatever tomli_w cannot write is given as text
        return False
    return True


def toml_text(table: dict) -> str:
    nested: dict = {}
    for key, value in table.items():
        section, _, name = key.partition(".")
        if name and isinstance(nested.setdefault(section, {}), dict):
            nested[section][name] = value
        else:
            nested[key] = value
    try:
        return tomli_w.dumps(nested)
    except Exception:  # noqa: BLE001 - a mix tomli_w refuses: the config is the raw text
        return "\n".join(f"{k} = {v!r}" for k, v in table.items())


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_config") / "config.toml"


@given(
    table=configs,
    splice=st.none() | st.tuples(st.floats(0, 1), st.sampled_from(RAW) | st.binary(max_size=3)),
    overrides=st.lists(st.tuples(keys, override_values).map("=".join), max_size=3),
)
def test_config_file_and_overrides_load_or_refuse_in_one_line(
    path: Path, table: dict, splice, overrides: list[str]
) -> None:
    data = toml_text(table).encode("utf-8", "surrogatepass")
    if splice is not None:
        at, raw = splice
        cut = int(at * len(data))
        raw = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
        data = data[:cut] + b"\n" + raw + b"\n" + data[cut:]
    path.write_bytes(data)
    bounded(lambda: load_config(path, overrides), f"{data[:200]!r} with {overrides!r}")


@given(overrides=st.lists(st.tuples(st.sampled_from(KEYS), override_values).map("=".join)))
def test_overrides_alone_load_or_refuse_in_one_line(overrides: list[str]) -> None:
    bounded(lambda: load_config(None, overrides), f"--set {overrides!r}")
