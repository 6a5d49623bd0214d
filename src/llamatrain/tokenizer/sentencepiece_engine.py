"""sentencepiece as a fast encoder for an SPM vocabulary, used only where it provably agrees.

llama.cpp's SPM tokenizer greedily merges the adjacent pair of symbols whose concatenation is
a vocabulary piece with the highest score (ties: leftmost). sentencepiece's *BPE* encoder is
the same greedy bigram merge by piece score, so a BPE ``ModelProto`` built from the
vocabulary's pieces, with the identity normalizer, encodes identically — in C++, and on many
threads for a batch. The two differ only in corner cases, which rule the engine out:

* user-defined and unused pieces: llama.cpp splits out user-defined pieces before merging;
* missing byte pieces: llama.cpp falls back to single-character pieces or ``<unk>``;
* no dummy prefix, or an ``<unk>`` piece that is not of type unknown;
* a control or byte piece that some merge could produce: llama.cpp merges into *any* piece,
  sentencepiece only into normal ones.

Even when none of those applies, the engine is cross-checked against the reference algorithm
on a fixed set of tricky strings before it is trusted.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llamatrain.tokenizer.base import (
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
)
from llamatrain.tokenizer.sentencepiece_proto import build_bpe_model_proto

__all__ = ["SELF_CHECK", "build_fast_engine"]

SELF_CHECK: tuple[str, ...] = (
    "",
    " ",
    "  ",
    "Hello world",
    " Hello  world ",
    "   leading and trailing   ",
    "tab\there\t\tand\nnewline\n\n",
    "\n",
    "12345 + 678 = 9,023.5",
    "Ünïcödé: naïve café — “quotes” ‘x’ … ½",
    "中文字符 日本語 한국어",
    "emoji 🦙🦙 👩‍👩‍👧 ✓",
    "\x00\x01\x7f control \u200b zero-width",
    "\u2581 literal escape \u2581\u2581",  # sentencepiece's escaped space, typed in
    "<s> </s> <unk> <0x0A> not special",
)
"""Strings the engine must encode exactly like the reference before it is used."""


def build_fast_engine(
    pieces: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    piece_to_id: Mapping[str, int],
    *,
    unk_id: int,
    bos_id: int,
    eos_id: int,
    pad_id: int | None,
    add_space_prefix: bool,
    reference: Callable[[str], list[int]],
) -> Any | None:
    """A ``SentencePieceProcessor`` that encodes this vocabulary like ``reference``, or None.

    None means the caller must encode with the reference algorithm: the vocabulary has a
    feature sentencepiece treats differently, sentencepiece could not load the model, or the
    engine disagreed with ``reference`` on :data:`SELF_CHECK` (which also warns, since that
    means a difference nobody has explained yet).
    """
    if not add_space_prefix or types[unk_id] != TOKEN_TYPE_UNKNOWN:
        return None
    if not _has_only_mergeable_types(types) or not _has_all_byte_pieces(piece_to_id):
        return None
    if _non_normal_piece_can_be_merged(pieces, types, piece_to_id):
        return None
    model = build_bpe_model_proto(
        pieces, scores, types, unk_id=unk_id, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id
    )
    engine = _load_processor(model)
    if engine is None:
        return None
    if any(engine.encode(s) != reference(s) for s in SELF_CHECK):
        warnings.warn(
            "sentencepiece disagrees with llama.cpp's algorithm on this vocabulary; "
            "using the (slower) Python tokenizer.",
            stacklevel=4,  # past SpmTokenizer's __init__: the line that built the tokenizer
        )
        return None
    return engine


def _has_only_mergeable_types(types: Sequence[int]) -> bool:
    """False when a piece is user-defined or unused, which sentencepiece never merges into."""
    return not any(t in (TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED) for t in types)


def _has_all_byte_pieces(piece_to_id: Mapping[str, int]) -> bool:
    """True when every byte has its ``<0xNN>`` piece, so both fall back to the same ids."""
    return all(f"<0x{b:02X}>" in piece_to_id for b in range(256))


def _non_normal_piece_can_be_merged(
    pieces: Sequence[str], types: Sequence[int], piece_to_id: Mapping[str, int]
) -> bool:
    """True when a control/byte piece's text splits into two symbols (pieces or characters).

    llama.cpp would merge those two symbols into that piece; sentencepiece would not.
    """

    def is_symbol(text: str) -> bool:
        return len(text) == 1 or text in piece_to_id

    return any(
        is_symbol(piece[:k]) and is_symbol(piece[k:])
        for piece, piece_type in zip(pieces, types, strict=True)
        if piece_type != TOKEN_TYPE_NORMAL
        for k in range(1, len(piece))
    )


def _load_processor(model: bytes) -> Any | None:
    """sentencepiece's processor for ``model``, or None if sentencepiece cannot load it."""
    try:
        # Imported here so that importing llamatrain does not pay for sentencepiece.
        import sentencepiece as spm

        processor = spm.SentencePieceProcessor()
        processor.LoadFromSerializedProto(model)
    except Exception:  # noqa: BLE001 - any failure just means "use the Python path"
        return None
    return processor
