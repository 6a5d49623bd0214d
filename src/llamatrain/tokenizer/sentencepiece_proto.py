"""Just enough of the protobuf wire format to read and write sentencepiece's ``ModelProto``.

sentencepiece ships no way to read or build a model without the protobuf package (not a
dependency here), and llamatrain needs both: it reads the pieces, piece types and normalizer
flags of a ``tokenizer.model``, and it builds a BPE model from any vocabulary so that
sentencepiece can serve as a fast encoder for it. Field numbers are sentencepiece's, from
``sentencepiece_model.proto``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llamatrain.tokenizer.base import TOKEN_TYPE_NORMAL

__all__ = [
    "MODEL_TYPE_BPE",
    "MODEL_TYPE_UNIGRAM",
    "SentencePieceModel",
    "build_bpe_model_proto",
    "read_model_proto",
]

# TrainerSpec.model_type
MODEL_TYPE_UNIGRAM = 1
MODEL_TYPE_BPE = 2

# Wire types.
_VARINT = 0
_FIXED64 = 1
_LENGTH_DELIMITED = 2
_FIXED32 = 5

# message ModelProto
_MODEL_PIECES = 1
_MODEL_TRAINER_SPEC = 2
_MODEL_NORMALIZER_SPEC = 3
# message ModelProto.SentencePiece
_PIECE_TEXT = 1
_PIECE_SCORE = 2
_PIECE_TYPE = 3
# message TrainerSpec
_TRAINER_MODEL_TYPE = 3
_TRAINER_VOCAB_SIZE = 4
_TRAINER_BYTE_FALLBACK = 35
_TRAINER_UNK_ID = 40
_TRAINER_BOS_ID = 41
_TRAINER_EOS_ID = 42
_TRAINER_PAD_ID = 43
# message NormalizerSpec
_NORMALIZER_NAME = 1
_NORMALIZER_CHARSMAP = 2
_NORMALIZER_ADD_DUMMY_PREFIX = 3
_NORMALIZER_REMOVE_EXTRA_WHITESPACES = 4
_NORMALIZER_ESCAPE_WHITESPACES = 5

_FLOAT32 = struct.Struct("<f")
_TRAINER_WIRES = {
    field: _VARINT
    for field in (
        _TRAINER_MODEL_TYPE,
        _TRAINER_VOCAB_SIZE,
        _TRAINER_BYTE_FALLBACK,
        _TRAINER_UNK_ID,
        _TRAINER_BOS_ID,
        _TRAINER_EOS_ID,
        _TRAINER_PAD_ID,
    )
}
_NORMALIZER_WIRES = {
    _NORMALIZER_NAME: _LENGTH_DELIMITED,
    _NORMALIZER_CHARSMAP: _LENGTH_DELIMITED,
    _NORMALIZER_ADD_DUMMY_PREFIX: _VARINT,
    _NORMALIZER_REMOVE_EXTRA_WHITESPACES: _VARINT,
    _NORMALIZER_ESCAPE_WHITESPACES: _VARINT,
}


@dataclass(frozen=True)
class SentencePieceModel:
    """What llamatrain reads from a sentencepiece model; ids are -1 where the model has none."""

    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: int
    unk_id: int
    bos_id: int
    eos_id: int
    pad_id: int
    normalizer_name: str
    has_charsmap: bool
    add_dummy_prefix: bool
    remove_extra_whitespaces: bool


# ------------------------------------------------------------------------------------ reading


def read_model_proto(data: bytes) -> SentencePieceModel:
    """Decode a serialized ``ModelProto``; raises ValueError (UnicodeDecodeError included).

    Absent fields take the proto's defaults, which is how sentencepiece reads them too.
    """
    pieces: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    trainer: dict[int, Any] = {}
    normalizer: dict[int, Any] = {}
    for field, wire, value in _parse_message(data):
        if wire != _LENGTH_DELIMITED:
            continue
        if field == _MODEL_PIECES:
            piece, score, piece_type = _read_piece(value)
            pieces.append(piece)
            scores.append(score)
            types.append(piece_type)
        elif field == _MODEL_TRAINER_SPEC:
            trainer = _last_values(value, _TRAINER_WIRES, "trainer_spec")
        elif field == _MODEL_NORMALIZER_SPEC:
            normalizer = _last_values(value, _NORMALIZER_WIRES, "normalizer_spec")
    return SentencePieceModel(
        pieces=pieces,
        scores=scores,
        types=types,
        model_type=trainer.get(_TRAINER_MODEL_TYPE, MODEL_TYPE_UNIGRAM),
        unk_id=_int32(trainer.get(_TRAINER_UNK_ID, 0)),
        bos_id=_int32(trainer.get(_TRAINER_BOS_ID, 1)),
        eos_id=_int32(trainer.get(_TRAINER_EOS_ID, 2)),
        pad_id=_int32(trainer.get(_TRAINER_PAD_ID, -1)),
        normalizer_name=bytes(normalizer.get(_NORMALIZER_NAME, b"nmt_nfkc")).decode(
            "utf-8", "replace"
        ),
        has_charsmap=bool(normalizer.get(_NORMALIZER_CHARSMAP, b"")),
        add_dummy_prefix=bool(normalizer.get(_NORMALIZER_ADD_DUMMY_PREFIX, 1)),
        remove_extra_whitespaces=bool(normalizer.get(_NORMALIZER_REMOVE_EXTRA_WHITESPACES, 1)),
    )


def _read_piece(data: bytes) -> tuple[str, float, int]:
    """Text, score and type of one ``SentencePiece`` message."""
    piece, score, piece_type = "", 0.0, TOKEN_TYPE_NORMAL
    for field, wire, value in _parse_message(data):
        if field == _PIECE_TEXT and wire == _LENGTH_DELIMITED:
            piece = value.decode("utf-8")
        elif field == _PIECE_SCORE and wire == _FIXED32:
            score = _FLOAT32.unpack(value)[0]
        elif field == _PIECE_TYPE and wire == _VARINT:
            piece_type = value
    return piece, score, piece_type


def _last_values(data: bytes, wires: dict[int, int], what: str) -> dict[int, Any]:
    """Field number -> value of the fields in ``wires`` (the last one wins), each checked to
    have the wire type its field has (a varint where a string belongs would otherwise be read
    as a length, ``bytes(2**32)``); fields llamatrain does not read are skipped."""
    values: dict[int, Any] = {}
    for field, wire, value in _parse_message(data):
        expected = wires.get(field)
        if expected is not None and wire != expected:
            raise ValueError(f"{what} field {field} has wire type {wire}, not {expected}")
        if expected is not None:
            values[field] = value
    return values


def _parse_message(buf: bytes) -> list[tuple[int, int, Any]]:
    """Split one message into (field, wire type, value) triples.

    Varints come back as ints, every other value as its raw bytes.
    """
    fields: list[tuple[int, int, Any]] = []
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, i = _read_varint(buf, i)
        elif wire in (_FIXED64, _FIXED32, _LENGTH_DELIMITED):
            if wire == _LENGTH_DELIMITED:
                size, i = _read_varint(buf, i)
            else:
                size = 8 if wire == _FIXED64 else 4
            if i + size > len(buf):
                raise ValueError("truncated field")
            value, i = buf[i : i + size], i + size
        else:
            raise ValueError(f"unsupported wire type {wire}")
        fields.append((field, wire, value))
    return fields


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    """The varint starting at ``buf[i]``, and the offset just after it."""
    result = shift = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, i
        shift += 7
        if shift > 70:
            raise ValueError("varint too long")


def _int32(value: int) -> int:
    """An int32 field's value: negatives are encoded as 64-bit two's complement varints."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


# ------------------------------------------------------------------------------------ writing


def build_bpe_model_proto(
    pieces: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    unk_id: int,
    bos_id: int,
    eos_id: int,
    pad_id: int | None,
) -> bytes:
    """A serialized BPE ``ModelProto`` over the given vocabulary.

    Its normalizer is the identity with a dummy prefix and no whitespace collapsing: the text
    processing llama.cpp applies, so that sentencepiece's encoder sees the same input.
    """
    out = bytearray()
    for piece, score, piece_type in zip(pieces, scores, types, strict=True):
        body = (
            _bytes_field(_PIECE_TEXT, piece.encode("utf-8"))
            + _float_field(_PIECE_SCORE, score)
            + _int_field(_PIECE_TYPE, piece_type)
        )
        out += _bytes_field(_MODEL_PIECES, body)
    trainer = (
        _int_field(_TRAINER_MODEL_TYPE, MODEL_TYPE_BPE)
        + _int_field(_TRAINER_VOCAB_SIZE, len(pieces))
        + _int_field(_TRAINER_BYTE_FALLBACK, 1)
        + _int_field(_TRAINER_UNK_ID, unk_id)
        + _int_field(_TRAINER_BOS_ID, bos_id)
        + _int_field(_TRAINER_EOS_ID, eos_id)
        + _int_field(_TRAINER_PAD_ID, -1 if pad_id is None else pad_id)
    )
    out += _bytes_field(_MODEL_TRAINER_SPEC, trainer)
    normalizer = (
        _bytes_field(_NORMALIZER_NAME, b"identity")
        + _int_field(_NORMALIZER_ADD_DUMMY_PREFIX, 1)
        + _int_field(_NORMALIZER_REMOVE_EXTRA_WHITESPACES, 0)
        + _int_field(_NORMALIZER_ESCAPE_WHITESPACES, 1)
    )
    out += _bytes_field(_MODEL_NORMALIZER_SPEC, normalizer)
    return bytes(out)


def _bytes_field(field: int, payload: bytes) -> bytes:
    return _key(field, _LENGTH_DELIMITED) + _varint(len(payload)) + payload


def _int_field(field: int, value: int) -> bytes:
    return _key(field, _VARINT) + _varint(value)


def _float_field(field: int, value: float) -> bytes:
    return _key(field, _FIXED32) + _FLOAT32.pack(value)


def _key(field: int, wire: int) -> bytes:
    return _varint((field << 3) | wire)


def _varint(n: int) -> bytes:
    """Protobuf's base-128 varint; negatives take 10 bytes, as int32/int64 fields store them."""
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
