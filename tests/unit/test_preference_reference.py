"""The cached reference of a full finetune's DPO/IPO (``objectives.preference.ReferenceTable``).

What it must be: every row's per-pair reference sums and token counts, computed once by the
initial model; equal to a live reference forward over any batch of those rows (the same
float32 computation; other batch compositions change only float32 rounding); kept in the
cache keyed by the model and the rows, written atomically and checked on every use — an edited,
damaged or foreign entry is recomputed, never believed, and a table used with other rows fails
in one line.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from llamatrain.data.examples import Example
from llamatrain.data.preferences import Pair, pair_rows
from llamatrain.errors import TrainingError
from llamatrain.model import Llama, ModelConfig
from llamatrain.objectives.preference.losses import pair_logps
from llamatrain.objectives.preference.objective import PreferenceObjective
from llamatrain.objectives.preference.reference import cached_reference_table, reference_table

VOCAB = 40
CPU = torch.device("cpu")
NO_AUTOCAST = contextlib.nullcontext()


def example(rng: np.random.Generator, prompt: int, reply: int) -> Example:
    ids = rng.integers(3, VOCAB, prompt + reply)
    scored = np.arange(prompt + reply) >= prompt
    return Example(ids.astype(np.int64), scored)


def rows(seed: int = 0, n_pairs: int = 10, packing: bool = True):
    rng = np.random.default_rng(seed)
    pairs = [
        Pair(example(rng, 4, int(rng.integers(2, 6))), example(rng, 4, int(rng.integers(2, 8))))
        for _ in range(n_pairs)
    ]
    return pair_rows(pairs, 33, 2, packing=packing)


def model() -> Llama:
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=32)
    return Llama(cfg)


def live(m: Llama, batch) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        logps = m(batch.inputs, documents=batch.documents, logps_of=batch.targets)
    p = pair_logps(logps, batch.targets, batch.documents)
    return p.chosen, p.rejected, p.chosen_tokens, p.rejected_tokens


@pytest.mark.parametrize("packing", [True, False])
def test_the_table_is_a_live_reference_forward_of_any_batch(packing):
    train, val = rows(0, packing=packing), rows(1, n_pairs=3, packing=packing)
    m = model()
    table = reference_table(m, train, val, 2, CPU, NO_AUTOCAST)
    assert (table.train.shape[1] > 1) == packing  # slots: the most pairs in a row
    obj = PreferenceObjective("dpo", 0.1)
    same_cut = train.batch(np.arange(0, 2))  # the rows of one table forward: bit-equal
    cached = obj.reference_logps(m, *same_cut, NO_AUTOCAST, table.rows(np.arange(0, 2)))
    for got, want in zip(
        (cached.chosen, cached.rejected, cached.chosen_tokens, cached.rejected_tokens),
        live(m, same_cut),
        strict=True,
    ):
        assert torch.equal(got, want)
    shuffled = np.random.default_rng(3).permutation(len(train))[:3]  # another composition
    cached = obj.reference_logps(m, *train.batch(shuffled), NO_AUTOCAST, table.rows(shuffled))
    c, r, n_c, n_r = live(m, train.batch(shuffled))
    assert torch.equal(cached.chosen_tokens, n_c) and torch.equal(cached.rejected_tokens, n_r)
    # float32 sums of ≤ 8 log-probs near -ln 40: within a few ulp of ~30 (|Δ| ≤ 1e-5)
    torch.testing.assert_close(cached.chosen, c, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached.rejected, r, rtol=0, atol=1e-5)
    val_cached = next(table.batches(8))
    assert torch.equal(val_cached, torch.from_numpy(table.val))


def test_a_table_used_with_other_rows_fails_in_one_line():
    train = rows(0)
    table = reference_table(model(), train, None, 4, CPU, NO_AUTOCAST)
    obj = PreferenceObjective("ipo", 0.1)
    with pytest.raises(TrainingError) as info:
        obj.reference_logps(model(), *train.batch(np.arange(2)), NO_AUTOCAST, table.rows([1, 0]))
    assert "not this batch's pairs" in str(info.value) and "\n" not in str(info.value)


def test_the_cache_is_computed_once_then_read_and_checked(tmp_path: Path):
    train, val = rows(0), rows(1, n_pairs=3)
    calls = []

    def compute():
        calls.append(1)
        return reference_table(model(), train, val, 4, CPU, NO_AUTOCAST)

    key = {"model_sha256": "ab" * 32, "ops": "ggml", "attention": "sdpa", "dtype": "float32"}
    first, computed = cached_reference_table(tmp_path, key, train, val, compute)
    second, again = cached_reference_table(tmp_path, key, train, val, compute)
    assert computed and not again and len(calls) == 1
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    (bin_path,) = (tmp_path / "reference").glob("*.bin")
    assert not list((tmp_path / "reference").glob(".*"))  # no temporary left behind

    other_model = {**key, "model_sha256": "cd" * 32}  # another model: another entry
    cached_reference_table(tmp_path, other_model, train, val, compute)
    other_rows = rows(2)  # other data: another entry
    cached_reference_table(tmp_path, key, other_rows, val, lambda: compute_for(other_rows, val))
    assert len(calls) == 2 and len(list((tmp_path / "reference").glob("*.bin"))) == 3

    data = bytearray(bin_path.read_bytes())
    data[0] ^= 1  # a damaged entry is recomputed, with a warning naming it
    bin_path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="does not match its recorded sha256"):
        third, computed = cached_reference_table(tmp_path, key, train, val, compute)
    assert computed and np.array_equal(third.train, first.train)

    meta_path = bin_path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta["dtype"] = "bfloat16"
    meta_path.write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="other settings"):
        cached_reference_table(tmp_path, key, train, val, compute)


def compute_for(train, val):
    return reference_table(model(), train, val, 4, CPU, NO_AUTOCAST)
