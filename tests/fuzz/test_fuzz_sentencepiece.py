"""Fuzz the sentencepiece ``tokenizer.model`` reader (its own protobuf decoder), property-based.

A small valid model (special pieces, the 256 byte pieces, merged pieces, trainer and normalizer
specs) is damaged: bytes flipped, spans cut or repeated, the file truncated, and fields
appended that claim things: huge lengths, piece types and special ids, 10-byte varints, wire
types sentencepiece never writes, text that is not UTF-8. Loading the model and using it
returns or raises a LlamatrainError in one line within ``conftest.bounded``'s bounds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz_bounds import bounded
from hypothesis import given
from hypothesis import strategies as st

from llamatrain.tokenizer import load_sentencepiece
from llamatrain.tokenizer.sentencepiece_proto import (
    _bytes_field,
    _float_field,
    _int_field,
    _key,
    _varint,
    build_bpe_model_proto,
)

pytestmark = pytest.mark.fuzz

SPACE = "\u2581"
PIECES = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
PIECES += [SPACE, "h", "e", "l", "o", "he", "ll", SPACE + "he", "llo"]
TYPES = [2, 3, 3, *[6] * 256, *[1] * 9]
BASE = build_bpe_model_proto(
    PIECES,
    [-float(i) for i in range(len(PIECES))],
    TYPES,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=None,
)
TELLING = [0, 1, 2, 3, 6, 7, 255, 1 << 31, (1 << 32) - 1, 1 << 40, (1 << 63), (1 << 64) - 1, -1]


def piece(text: bytes, score: float, piece_type: int) -> bytes:
    return _bytes_field(
        1, _bytes_field(1, text) + _float_field(2, score) + _int_field(3, piece_type)
    )


claims = st.one_of(
    st.tuples(st.binary(max_size=6), st.floats(width=32), st.sampled_from(TELLING)).map(
        lambda t: piece(*t)
    ),
    st.tuples(
        st.sampled_from([2, 3]),  # a trainer or normalizer spec claiming one value
        st.sampled_from([1, 2, 3, 4, 5, 35, 40, 41, 42, 43]) | st.integers(1, 60),
        st.sampled_from(TELLING),
        st.booleans(),  # as a varint, or as bytes (the wire type each field does not have)
    ).map(
        lambda t: _bytes_field(
            t[0], _int_field(t[1], t[2]) if t[3] else _bytes_field(t[1], _varint(t[2]))
        )
    ),
    st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from(TELLING)).map(
        lambda t: _key(t[0], 2) + _varint(t[1])  # a length past the end of the file
    ),
    st.tuples(st.integers(0, 1 << 20), st.integers(0, 7)).map(lambda t: _key(*t) + b"\x01" * 10),
    st.just(b"\xff" * 11),  # a varint that never ends
    st.binary(max_size=8),
)
damages = st.tuples(
    st.sampled_from(["flip", "truncate", "delete", "repeat", "insert"]),
    st.floats(0, 1, exclude_max=True),
    st.integers(1, 255),
    claims,
)


def damage(data: bytes, what: tuple) -> bytes:
    kind, where, n, claim = what
    at = int(where * len(data))
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ n]) + data[at + 1 :] if data else data
    if kind == "truncate":
        return data[:at]
    if kind == "delete":
        return data[:at] + data[at + n :]
    if kind == "repeat":
        return data[:at] + data[at : at + n] * 2 + data[at + n :]
    return data[:at] + claim + data[at:]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_spm") / "tokenizer.model"


def use(path: Path) -> None:
    tok = load_sentencepiece(path)
    ids = tok.encode("hello <s> world \u00e9\n", bos=True, special=True)
    tok.decode(ids)
    tok.fingerprint()


@given(
    damaged=st.lists(damages, max_size=2),
    appended=st.lists(claims, max_size=3),
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_damaged_sentencepiece_model_is_read_or_refused_in_one_line(
    path: Path, damaged: list, appended: list
) -> None:
    data = BASE
    for what in damaged:
        data = damage(data, what)
    path.write_bytes(data + b"".join(appended))
    bounded(lambda: use(path), f"after {damaged}, appended {appended}")


def test_base_model_reads(path: Path) -> None:
    path.write_bytes(BASE)
    use(path)
