"""A model card's lists (``general.base_model.*``, ``general.dataset.*``) are read from the
keys a file holds, never counted up to the count it claims."""

from __future__ import annotations

import numpy as np

from llamatrain.model_card.facts import conversion_card

CLAIMS = {
    "general.base_model.count": np.uint64(10**12),
    "general.base_model.0.name": "Grandparent",
    "general.base_model.7.name": "Seventh",
    "general.base_model.01.name": "not an index as a writer spells one",
    "general.base_model.2000000000000.name": "past the count",
    "general.dataset.count": np.uint64(10**12),
    "general.dataset.0.repo_url": "https://huggingface.co/datasets/someone/data",
}


def test_a_claimed_count_lists_only_the_entries_present_below_it():
    card = conversion_card(CLAIMS)
    assert [b.name for b in card.base_models] == ["Grandparent", "Seventh"]
    assert card.datasets == ("someone/data",)


def test_without_a_count_nothing_is_listed():
    keys = {k: v for k, v in CLAIMS.items() if not k.endswith(".count")}
    card = conversion_card(keys)
    assert card.base_models == () and card.datasets == ()
