"""What every llama.cpp vocabulary does the same way, whatever its merge algorithm.

llama.cpp tokenizes a llama (SPM) and a byte-level BPE (gpt2) vocabulary by one frame: cut the
special tokens out of the text (:mod:`~llamatrain.tokenizer.special`), run the vocabulary's own
algorithm on the text between them, optionally put BOS before and EOS after; and it renders a
token by its type (control tokens as nothing, user-defined ones as written, byte tokens as their
byte). :class:`VocabTokenizer` is that frame, so that it is written once and both vocabularies
stay byte-exact with llama.cpp together; :class:`~llamatrain.tokenizer.SpmTokenizer` and
:class:`~llamatrain.tokenizer.BpeTokenizer` add only their algorithm and how their normal and
byte tokens are spelled. It lives beside :mod:`~llamatrain.tokenizer.base` rather than in it
because it builds on :mod:`~llamatrain.tokenizer.special`, which imports the token types from
there. Code outside this package types against the :class:`~llamatrain.tokenizer.Tokenizer`
protocol, which this class satisfies.
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from llamatrain.errors import TokenizerError
from llamatrain.tokenizer.base import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_USER_DEFINED,
)
from llamatrain.tokenizer.special import effective_types, split_on_tokens, split_order

__all__ = ["CACHE_MAX", "VocabTokenizer"]

CACHE_MAX = 500_000
"""Most entries a tokenizer's cache of encoded words (or space-delimited chunks) holds before it
is emptied: bounded, so tokenizing a large corpus cannot exhaust memory."""


class VocabTokenizer(ABC):
    """A vocabulary of pieces (the GGUF ``tokenizer.ggml.tokens``) with token types and special
    ids, tokenized and rendered as llama.cpp does apart from the merge algorithm.

    Subclasses validate their arguments (each family words its own errors), call this
    constructor, and provide :meth:`_encode_text` (the algorithm, on text with special tokens
    still in it), :meth:`_fingerprint_parts`, :meth:`_normal_bytes` and :meth:`_byte_value`.
    ``self._cache`` is theirs to fill with encoded words; it is dropped when pickled.
    """

    def __init__(
        self,
        pieces: Sequence[str],
        types: Sequence[int],
        *,
        bos_id: int,
        eos_id: int,
        unk_id: int | None,
        pad_id: int | None,
        add_bos: bool,
        add_eos: bool,
        rstrip_ids: Iterable[int],
    ) -> None:
        self._pieces: list[str] = [str(p) for p in pieces]
        self._types: list[int] = [int(t) for t in types]
        _check_types(self._types)
        self._piece_to_id = _index_pieces(self._pieces)
        self._bos, self._eos, self._unk, self._pad = bos_id, eos_id, unk_id, pad_id
        self._add_bos, self._add_eos = bool(add_bos), bool(add_eos)
        # llama.cpp retypes control-looking tokens (e.g. a user-defined "</s>") as control.
        self._effective = effective_types(self._pieces, self._types)
        self._order = {
            special: split_order(self._pieces, self._effective, special=special)
            for special in (False, True)
        }
        self._rstrip = frozenset(int(i) for i in rstrip_ids)
        self._cache: dict[str, list[int]] = {}
        self._fingerprint: str | None = None

    # ---------------------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    def __len__(self) -> int:
        return len(self._pieces)

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def unk_id(self) -> int | None:
        """The unknown token; SPM vocabularies always have one, most byte-level ones none
        (every byte has a token, nothing is unknown)."""
        return self._unk

    @property
    def pad_id(self) -> int | None:
        """The padding id, or None: llama vocabularies usually have none."""
        return self._pad

    @property
    def add_bos(self) -> bool:
        """Whether llama.cpp puts BOS before a prompt (``tokenizer.ggml.add_bos_token``)."""
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        """Whether llama.cpp puts EOS after a prompt (``tokenizer.ggml.add_eos_token``)."""
        return self._add_eos

    @property
    def token_types(self) -> list[int]:
        """The types as the file stores them (llama.cpp retypes a few; see special.py)."""
        return list(self._types)

    @property
    def rstrip_ids(self) -> frozenset[int]:
        """Tokens after which llama.cpp drops the whitespace that follows in the text."""
        return self._rstrip

    def piece(self, token_id: int) -> str:
        """The raw vocabulary text of a token (``▁`` or ``Ġ`` for spaces, as the family
        writes them; ``<0x0A>`` for an SPM byte token)."""
        return self._pieces[token_id]

    def piece_to_id(self, piece: str) -> int | None:
        return self._piece_to_id.get(piece)

    def token_type(self, token_id: int) -> int:
        """A token's type as the file stores it."""
        return self._types[token_id]

    def fingerprint(self) -> str:
        """sha256 over everything that decides ids (:meth:`_fingerprint_parts`) and any rstrip
        ids; computed once."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for part in self._fingerprint_parts():
                h.update(part)
            if self._rstrip:  # hashed only when present: older fingerprints stay valid
                h.update(struct.pack(f"<{len(self._rstrip)}i", *sorted(self._rstrip)))
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @abstractmethod
    def _fingerprint_parts(self) -> Iterator[bytes]:
        """The bytes hashed into the fingerprint, starting with a tag naming the family; a
        change here changes every stored fingerprint, so checkpoints would refuse their own
        tokenizer."""

    def newline_ids(self) -> list[int]:
        """Ids whose rendered text ends in a newline (``<0x0A>``, pieces ending in "\\n").

        Used to start training windows after a newline, as llama.cpp's trainer can.
        """
        return [i for i in range(len(self._pieces)) if self.token_bytes(i).endswith(b"\n")]

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (e.g. for DataLoader workers) without the word cache, which can be large."""
        return {**self.__dict__, "_cache": {}}

    # ------------------------------------------------------------------------------ encoding

    def encode(
        self, text: str, bos: bool = False, eos: bool = False, special: bool = False
    ) -> list[int]:
        """Ids for ``text`` exactly as llama.cpp's ``llama_tokenize(parse_special=special)``.

        ``bos``/``eos`` frame the ids with BOS/EOS unconditionally (training data decides
        its own framing); :meth:`encode_prompt` frames them as the file says. Without
        ``special``, control tokens written in the text stay text.
        """
        return self._add_specials(self._encode_text(text, special), bos, eos)

    def encode_prompt(self, text: str, special: bool = True) -> list[int]:
        """Ids for ``text`` as llama.cpp tokenizes text it runs the model on: ``llama_tokenize``
        with ``add_special``, BOS/EOS as the file's ``add_bos_token`` / ``add_eos_token`` say
        (see the :class:`~llamatrain.tokenizer.Tokenizer` protocol)."""
        return self.encode(text, self._add_bos, self._add_eos, special)

    def encode_batch(
        self, texts: Sequence[str], bos: bool = False, eos: bool = False, special: bool = False
    ) -> list[list[int]]:
        """:meth:`encode` for each text."""
        return [self.encode(t, bos, eos, special) for t in texts]

    @abstractmethod
    def _encode_text(self, text: str, special: bool) -> list[int]:
        """The ids of ``text``, without BOS/EOS; a new list, which the caller may change."""

    def _fragments(self, text: str, special: bool) -> list[str | int]:
        """``text`` cut at the tokens llama.cpp cuts out (user-defined ones; with ``special``
        also control and unknown ones): their ids, and the text between them."""
        return split_on_tokens(text, self._order[special], self._pieces, self._rstrip)

    def _add_specials(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        """``ids`` framed in place by BOS and/or EOS."""
        if bos:
            ids.insert(0, self._bos)
        if eos:
            ids.append(self._eos)
        return ids

    # ------------------------------------------------------------------------------ decoding

    def token_bytes(self, token_id: int) -> bytes:
        """What llama.cpp's ``llama_token_to_piece(special=False)`` renders for one token:
        nothing for control/unknown tokens, user-defined tokens as written, byte tokens as their
        byte, normal tokens as the family spells them. Use it to stream generated text."""
        t = self._effective[token_id]
        if t == TOKEN_TYPE_NORMAL:
            return self._normal_bytes(self._pieces[token_id])
        if t == TOKEN_TYPE_USER_DEFINED:
            return self._pieces[token_id].encode("utf-8")
        if t == TOKEN_TYPE_BYTE:
            value = self._byte_value(token_id)
            if value is not None:
                return bytes([value])
        return b""  # control, unknown, unused or undefined: llama.cpp renders nothing

    @abstractmethod
    def _normal_bytes(self, piece: str) -> bytes:
        """The bytes a normal token's piece stands for."""

    @abstractmethod
    def _byte_value(self, token_id: int) -> int | None:
        """The byte a byte-type token stands for; None renders it as nothing."""

    def _checked_ids(self, ids: Iterable[int]) -> Iterator[int]:
        """``ids`` as ints, refusing one outside the vocabulary (ids of another tokenizer)."""
        n = len(self._pieces)
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < n:
                raise TokenizerError(
                    f"Token id {tid} is outside the vocabulary (size {n}); the ids come from "
                    "a different tokenizer or model."
                )
            yield tid

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Concatenated :meth:`token_bytes`."""
        return b"".join(map(self.token_bytes, self._checked_ids(ids)))

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ids, as llama.cpp streams it token by token; invalid UTF-8 (e.g. a cut
        multi-byte character) becomes U+FFFD.

        llama.cpp's ``llama_detokenize`` may also "clean up" spaces before punctuation for
        some vocabularies; that loses information (``decode(encode(s)) != s``), so it is not
        done here.
        """
        return self.decode_bytes(ids).decode("utf-8", "replace")


def _check_types(types: list[int]) -> None:
    """Token types are llama.cpp's (0 = undefined .. 6 = byte): anything else is damage."""
    if types and not 0 <= min(types) <= max(types) <= TOKEN_TYPE_BYTE:
        i = next(i for i, t in enumerate(types) if not 0 <= t <= TOKEN_TYPE_BYTE)
        raise TokenizerError(
            f"Token {i} has type {types[i]}, not one of llama.cpp's token types (0-6); the "
            "vocabulary is corrupt — rebuild the tokenizer."
        )


def _index_pieces(tokens: Sequence[str]) -> dict[str, int]:
    """token text -> id, for any vocabulary; refuses empty and duplicate tokens, which
    llama.cpp cannot load either, and text that is not UTF-8 (a lone surrogate)."""
    try:
        "\0".join(tokens).encode("utf-8")
    except UnicodeEncodeError:
        i = next(i for i, t in enumerate(tokens) if not _is_text(t))
        raise TokenizerError(
            f"Token {i} ({tokens[i]!r}) holds a lone surrogate, which is not text; the "
            "vocabulary is corrupt — rebuild the tokenizer."
        ) from None
    index: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token == "":
            raise TokenizerError(f"Token {i} is the empty string; the vocabulary is corrupt.")
        if token in index:
            raise TokenizerError(
                f"Duplicate token {token!r} (ids {index[token]} and {i}); llama.cpp "
                "refuses such a vocabulary — rebuild the tokenizer."
            )
        index[token] = i
    return index


def _is_text(token: str) -> bool:
    try:
        token.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
