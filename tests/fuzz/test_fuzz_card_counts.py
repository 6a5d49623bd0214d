"""Fuzz the counted lists of a GGUF's ``general.*`` keys, property-based: a model card reads
``general.base_model.{i}.*`` and ``general.dataset.{i}.*`` from the keys a file holds, so a
count that claims 10^12 (or 2^64-1, or -1, or a string) costs only the keys present.

Keys are drawn as a file may hold them: counts of every integer width and sign, bools and
text; entries under indices canonical and not (``01``, ``١``, ``-1``, ``1.5``, ``10^15``),
with fields of any value. ``conversion_card`` then ``readme`` and ``general_keys`` end
within ``fuzz_bounds.bounded``'s time and memory, list at most the entries present below the
count, and write a front matter YAML reads back.
"""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from fuzz_bounds import bounded
from hypothesis import example, given
from hypothesis import strategies as st

from llamatrain.model_card.facts import conversion_card
from llamatrain.model_card.general_keys import general_keys
from llamatrain.model_card.readme import readme

pytestmark = pytest.mark.fuzz

LISTS = ("general.base_model", "general.dataset")
FIELDS = ("name", "organization", "version", "repo_url")

counts = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from([10**12, 2**64 - 1, np.uint64(10**12), np.uint32(3), np.int64(-1)]),
    st.booleans(),
    st.text(max_size=4),
)
indices = st.one_of(
    st.integers(min_value=0, max_value=10**15).map(str),
    st.sampled_from(["01", "\u0661", "-1", "1.5", "", " 1", "1 "]),
)
values = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["https://huggingface.co/org/name", "https://huggingface.co/datasets/o/d"]),
    st.integers(),
    st.none(),
    st.lists(st.text(max_size=3), max_size=2),
)
entries = st.dictionaries(
    st.builds(
        lambda lst, i, f: f"{lst}.{i}.{f}", st.sampled_from(LISTS), indices, st.sampled_from(FIELDS)
    ),
    values,
    max_size=12,
)


def _present(keys: dict, prefix: str) -> set[int]:
    """Canonical indices with a key in ``keys`` (what a list may hold at most)."""
    found = set()
    for key in keys:
        index, dot, _ = key.removeprefix(f"{prefix}.").partition(".")
        if key.startswith(f"{prefix}.") and dot and index.isdecimal() and str(int(index)) == index:
            found.add(int(index))
    return found


@given(entries=entries, base_count=counts, dataset_count=counts)
@example(
    entries={"general.base_model.0.name": "a", "general.dataset.0.repo_url": "x"},
    base_count=np.uint64(10**12),
    dataset_count=2**64 - 1,
)
def test_a_card_lists_at_most_the_entries_present(entries, base_count, dataset_count):
    keys = {**entries, "general.base_model.count": base_count}
    keys["general.dataset.count"] = dataset_count

    def card_and_page():
        card = conversion_card(keys)
        return card, readme(card, "model"), general_keys(card)

    result = bounded(card_and_page, repr(keys)[:80])
    assert result is not None  # a card is always made: nothing here is the user's to fix
    card, page, _ = result
    assert len(card.base_models) <= len(_present(keys, LISTS[0]))
    assert len(card.datasets) <= len(_present(keys, LISTS[1]))
    front_matter = page.removeprefix("---\n").split("\n---\n", 1)[0]  # values are one line each
    assert isinstance(yaml.safe_load(front_matter), dict)
