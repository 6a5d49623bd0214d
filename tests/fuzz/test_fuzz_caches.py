"""Fuzz the token cache, the example cache and the reference log-prob cache, property-based.

A real entry of each (``load_tokens`` over a text file, ``load_examples`` over chat JSONL, a
DPO run's ``cached_reference_table`` over preference rows, computed by a tiny model) is
damaged the ways a cache folder is edited or corrupted: its JSON description's fields set to
other JSON values (counts, dtype, shapes, the key, the skipped-line tallies, the sha256) or
removed, its binary arrays cut, grown (to gigabytes, sparse) or given telling values (ids past
the vocabulary, lengths that overflow when summed, flags other than 0/1, NaN log-probs) — and
half the time the sha256 is recomputed, as anyone can, so the damage reaches the checks behind
it. Reading it again must give exactly the stream / examples / log-probs a fresh computation
gives (a damaged entry is rebuilt, with a warning), or a LlamatrainError in one line, within
``fuzz_bounds.bounded``'s time and memory; a re-signed entry, which no check can tell from a
real one, must still be one the run can use (ids in the vocabulary, finite log-probs, the
rows' token counts).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from fuzz_bounds import bounded
from fuzz_models import bpe_tokenizer
from hypothesis import example, given
from hypothesis import strategies as st

from llamatrain.chat_template import resolve_chat_template
from llamatrain.data.cache import load_tokens
from llamatrain.data.example_cache import load_examples
from llamatrain.data.examples import Example, LineEncoder
from llamatrain.data.jsonl import BadLines
from llamatrain.data.preferences import Pair, pair_rows
from llamatrain.model import Llama, ModelConfig
from llamatrain.objectives.preference.reference import (
    ReferenceTable,
    cached_reference_table,
    reference_table,
)

pytestmark = pytest.mark.fuzz

TEXT = "Hello world, the theme.\nA second line \u00e9t\u00e9.\n" * 20
CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    }  # fmt: skip
    for i in range(4)
] + [{"text": "plain"}, "{oops"]
FIELDS = ["n_tokens", "n_examples", "sha256", "dtype", "tallies", "mixed", "version",
          "tokenizer", "files", "layout", "template", "paths", "chunk_chars", "eos",
          "train_shape", "val_shape", "train_rows", "val_rows", "model_sha256"]  # fmt: skip
REFERENCE_KEY = {"model_sha256": "ab" * 32, "ops": "ggml", "attention": "sdpa", "dtype": "float32"}
"""What a DPO run keys its reference cache by besides the rows (``build.reference_of``)."""
json_values = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(
        [
            0,
            1,
            -1,
            7,
            2**31,
            2**63,
            2**64,
            10**30,
            1.5,
            "uint16",
            "uint32",
            "",
            "int8",
            "float64",
            [],
            {},
            [[1, 2, "x"]],
            [[0, 0, ""]],
        ]
    ),  # fmt: skip
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
)
description_edits = st.tuples(
    st.sampled_from(["set", "set", "delete"]), st.sampled_from(FIELDS), json_values
)
TELLING = [0, 1, 255, 256, 259, 260, 65535, 2**31 - 1, 2**32 - 1, 2**62, 2**63 - 1, 2**64 - 1]
array_edits = st.tuples(
    st.sampled_from(["cut", "grow", "u64", "u16", "u8", "f32", "flip", "sparse"]),
    st.floats(0, 1, exclude_max=True),
    st.sampled_from(TELLING),
)


def damage_array(data: bytes, change: tuple) -> bytes:
    kind, where, value = change
    at, out = int(where * len(data)), bytearray(data)
    if kind == "cut":
        return bytes(out[:at])
    if kind == "grow":
        return bytes(out + out[at : at + 8])
    if kind == "flip":
        if out:
            out[min(at, len(out) - 1)] ^= 0x41
        return bytes(out)
    if kind == "sparse":  # applied to the file (edited_entry): gigabytes that take no disk
        return bytes(out)
    if kind == "f32":  # a value no log-prob is (NaN, infinity), or a count that is not the rows'
        packed, size = struct.pack("<f", [float("nan"), float("-inf"), value][value % 3]), 4
    else:
        fmt, size = {"u64": ("<Q", 8), "u16": ("<H", 2), "u8": ("<B", 1)}[kind]
        packed = struct.pack(fmt, value % (1 << (8 * size)))
    at = at // size * size
    return bytes(out[:at] + packed + out[at + size :])


def edited_entry(folder: Path, description: list, arrays: list, signed: bool, sign) -> None:
    """Damage the one entry in ``folder`` (its .json and .bin), re-signed by ``sign``."""
    (meta_path,) = folder.glob("*.json")
    bin_path = meta_path.with_suffix(".bin")
    meta = json.loads(meta_path.read_text())
    for kind, field, value in description:
        if kind == "delete":
            meta.pop(field, None)
        else:
            meta[field] = value
    data = bin_path.read_bytes()
    for change in arrays:
        data = damage_array(data, change)
    bin_path.write_bytes(data)
    if any(kind == "sparse" for kind, _, _ in arrays):
        os.truncate(bin_path, 1 << 32)  # 4 GiB: read whole, it would pass the memory bound
    if signed:
        meta["sha256"] = sign(data, meta)
    meta_path.write_text(json.dumps(meta, allow_nan=True))


def sign_tokens(data: bytes, meta: dict) -> str:
    return hashlib.sha256(data).hexdigest()


def sign_examples(data: bytes, meta: dict) -> str:
    noted = [meta.get("tallies"), meta.get("mixed")]  # what the entry warns about
    return hashlib.sha256(data + json.dumps(noted).encode()).hexdigest()


def preference_rows(seed: int, n_pairs: int, vocab: int):
    """Rows of random preference pairs (a 4-token prompt, replies of 2 to 7 tokens)."""
    rng = np.random.default_rng(seed)

    def example(reply: int) -> Example:
        ids = rng.integers(3, vocab, 4 + reply).astype(np.int64)
        return Example(ids, np.arange(4 + reply) >= 4)

    pairs = [Pair(example(int(rng.integers(2, 6))), example(int(rng.integers(2, 8))))
             for _ in range(n_pairs)]  # fmt: skip
    return pair_rows(pairs, 33, 2, packing=True)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    """The inputs, their pristine cache entries and what encoding them gives."""
    root = tmp_path_factory.mktemp("fuzz_caches")
    tokenizer = bpe_tokenizer()
    (root / "text.txt").write_text(TEXT)
    chats = root / "chats.jsonl"
    chats.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in CHATS))
    encoder = LineEncoder(
        tokenizer, resolve_chat_template("chatml", None, tokenizer), train_on="completion"
    )
    torch.manual_seed(0)
    model = Llama(ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=40, max_seq_len=32))
    train, val = preference_rows(0, 10, 40), preference_rows(1, 3, 40)

    def compute() -> ReferenceTable:
        return reference_table(model, train, val, 4, torch.device("cpu"), contextlib.nullcontext())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stream = np.array(load_tokens([root / "text.txt"], tokenizer, root / "tokens"))
        examples = load_examples([chats], encoder, BadLines("skip"), root / "examples")
        reference, _ = cached_reference_table(
            root / "reference", REFERENCE_KEY, train, val, compute
        )
    return Inputs(root=root, tokenizer=tokenizer, encoder=encoder, stream=stream, examples=examples,
                  rows=(train, val), compute=compute, reference=reference)  # fmt: skip


class Inputs(dict):
    """The fixture's values, shown short (hypothesis prints a failing case's arguments)."""

    def __repr__(self) -> str:
        return "<cache inputs>"


def tokens_again(inputs: Inputs, cache: Path, exact: bool) -> None:
    """The stream read again: exactly the true one when the damage left the recorded sha256
    standing; otherwise (a re-signed edit, which no check can tell from a real entry) at
    least a stream the model can train on."""
    stream = np.asarray(load_tokens([inputs["root"] / "text.txt"], inputs["tokenizer"], cache))
    if exact:
        assert np.array_equal(stream, inputs["stream"]), "a damaged cache was believed"
    assert stream.ndim == 1 and stream.size and int(stream.max()) < inputs["tokenizer"].vocab_size


def examples_again(inputs: Inputs, cache: Path, exact: bool) -> None:
    """As :func:`tokens_again`, for the examples (and the skipped lines they report)."""
    bad = BadLines("skip")
    got = load_examples([inputs["root"] / "chats.jsonl"], inputs["encoder"], bad, cache)
    vocab = inputs["tokenizer"].vocab_size
    for ex in got:
        assert ex.ids.dtype == np.int64 and ex.scored.dtype == bool and ex.inexact >= 0
        assert 0 < len(ex.ids) == len(ex.scored) and int(ex.ids.max()) < vocab
    if exact:
        want = inputs["examples"]
        assert len(got) == len(want) and bad.summaries(), "a damaged cache was believed"
        for a, b in zip(got, want, strict=True):
            assert np.array_equal(a.ids, b.ids) and np.array_equal(a.scored, b.scored)
            assert a.inexact == b.inexact, "a damaged cache was believed"


def reference_again(inputs: Inputs, cache: Path, exact: bool) -> None:
    """As :func:`tokens_again`, for the reference log-probs: exactly the computed ones, or
    (re-signed) finite ones with the rows' token counts, which the objective checks per batch."""
    (train, val), want = inputs["rows"], inputs["reference"]
    got, _ = cached_reference_table(cache, REFERENCE_KEY, train, val, inputs["compute"])
    for table, truth in ((got.train, want.train), (got.val, want.val)):
        assert table.shape == truth.shape and table.dtype == np.float32
        assert np.isfinite(table).all() and np.array_equal(table[..., 2:], truth[..., 2:])
        if exact:
            assert np.array_equal(table, truth), "a damaged cache was believed"


def sign_reference(data: bytes, meta: dict) -> str:
    return hashlib.sha256(data).hexdigest()


CACHES = {
    "tokens": (tokens_again, sign_tokens),
    "examples": (examples_again, sign_examples),
    "reference": (reference_again, sign_reference),
}


@given(
    cache=st.sampled_from(sorted(CACHES)),
    description=st.lists(description_edits, max_size=3),
    arrays=st.lists(array_edits, max_size=3),
    signed=st.booleans(),
)
@example(cache="examples", description=[], arrays=[("u64", 0.0, 2**63 - 1)], signed=True)
@example(cache="reference", description=[], arrays=[("sparse", 0.0, 0)], signed=False)
@example(cache="reference", description=[], arrays=[("f32", 0.5, 0)], signed=True)
@pytest.mark.filterwarnings(
    "ignore:token cache:UserWarning",
    "ignore:example cache:UserWarning",
    "ignore:reference cache:UserWarning",
)
def test_damaged_cache_entry_is_rebuilt_or_refused_in_one_line(
    inputs: Inputs, cache: str, description: list,
    arrays: list, signed: bool,
) -> None:  # fmt: skip
    use, sign = CACHES[cache]
    folder = inputs["root"] / f"case-{cache}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(inputs["root"] / cache, folder)
    edited_entry(next(folder.iterdir()), description, arrays, signed, sign)
    bounded(
        lambda: use(inputs, folder, not signed), f"{cache}: {description} {arrays} signed={signed}"
    )


def test_example_lengths_that_wrap_around_when_summed_are_rebuilt(inputs: Inputs) -> None:
    """Lengths 2^63-1, 2^63-1, s+2 sum (in int64) to the first three examples' s: re-signed,
    such an entry passes every check but each length's own bound."""
    folder = inputs["root"] / "case-wrap"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(inputs["root"] / "examples", folder)
    entry = next(folder.iterdir())
    (bin_path,) = entry.glob("*.bin")
    data = bytearray(bin_path.read_bytes())
    lengths = struct.unpack_from("<3q", data)
    struct.pack_into("<3q", data, 0, 2**63 - 1, 2**63 - 1, sum(lengths) + 2)
    bin_path.write_bytes(bytes(data))
    edited_entry(entry, [], [], True, sign_examples)
    with pytest.warns(UserWarning, match="lengths that do not add up"):
        examples_again(inputs, folder, exact=True)
