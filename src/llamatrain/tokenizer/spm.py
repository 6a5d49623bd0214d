"""A llama (SentencePiece/SPM) vocabulary that tokenizes exactly like llama.cpp.

Why not just call sentencepiece? Because the file we ship is run by llama.cpp, and llama.cpp
does not run sentencepiece: for a llama (SPM) vocabulary it applies no normalization, prepends
one space, escapes spaces to ``▁``, splits the text into UTF-8 characters and then *greedily
merges the adjacent pair whose concatenation is a vocabulary piece with the highest score*
(ties: leftmost), finally falling back to ``<0xNN>`` byte tokens. A model trained on ids
produced any other way sees different ids at inference time. So the reference here is that
algorithm (:meth:`SpmTokenizer._encode_reference`), written from llama.cpp's
``llm_tokenizer_spm``; sentencepiece is used only as a fast engine where it provably does the
same thing (see :mod:`llamatrain.tokenizer.sentencepiece_engine`).

The reference path caches per whitespace-delimited chunk. That is exact only when no piece
contains a non-``▁`` character followed by ``▁`` (then no merge can cross the start of a space
run); the condition is checked per vocabulary and the cache is skipped when it fails.

What is not SPM's own (special tokens in text, BOS/EOS, rendering control and user-defined
tokens, the fingerprint's frame) is :class:`~llamatrain.tokenizer.vocab.VocabTokenizer`'s,
shared with byte-level BPE.
"""

from __future__ import annotations

import heapq
import os
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from llamatrain.errors import TokenizerError
from llamatrain.tokenizer.base import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_UNKNOWN,
)
from llamatrain.tokenizer.sentencepiece_engine import build_fast_engine
from llamatrain.tokenizer.vocab import CACHE_MAX, VocabTokenizer

__all__ = ["SPACE", "SpmTokenizer"]

SPACE = "\u2581"  # "▁", sentencepiece's escaped space
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_CHUNK = re.compile(SPACE + "*[^" + SPACE + "]+|" + SPACE + "+")
_CROSSES_CHUNK = re.compile("[^" + SPACE + "]" + SPACE)
_FLOAT32 = struct.Struct("<f")


class SpmTokenizer(VocabTokenizer):
    """A llama SPM vocabulary: pieces, scores, token types and special ids.

    Build one with :func:`~llamatrain.tokenizer.train_spm`, from a sentencepiece
    ``tokenizer.model`` with :func:`~llamatrain.tokenizer.load_sentencepiece`, or directly from
    the arrays a GGUF file stores. Every route ends in this constructor, so ids never depend on
    where the vocabulary came from. ``fast=False`` forces the pure-Python reference algorithm.
    ``rstrip_ids``: tokens after which the whitespace in the text is dropped
    (:func:`~llamatrain.tokenizer.special.rstrip_ids`). ``add_bos``/``add_eos``: whether a
    prompt gets BOS/EOS (the file's ``tokenizer.ggml.add_bos_token`` / ``add_eos_token``); the
    defaults are llama.cpp's for a llama vocabulary whose file has neither key.
    """

    def __init__(
        self,
        pieces: Sequence[str],
        scores: Sequence[float],
        types: Sequence[int],
        *,
        bos_id: int = 1,
        eos_id: int = 2,
        unk_id: int = 0,
        pad_id: int | None = None,
        add_bos: bool = True,
        add_eos: bool = False,
        add_space_prefix: bool = True,
        fast: bool = True,
        rstrip_ids: Iterable[int] = (),
    ) -> None:
        _check_lengths(len(pieces), len(scores), len(types))
        # Scores are float32 in both GGUF and sentencepiece: compare them as llama.cpp does.
        self._scores: list[float] = [_to_float32(s) for s in scores]
        super().__init__(
            pieces,
            types,
            bos_id=bos_id,
            eos_id=eos_id,
            unk_id=unk_id,
            pad_id=pad_id,
            add_bos=add_bos,
            add_eos=add_eos,
            rstrip_ids=rstrip_ids,
        )
        _check_special_ids(len(self._pieces), bos_id, eos_id, unk_id, pad_id)
        self._add_space_prefix = bool(add_space_prefix)
        self._byte_ids = _byte_fallback_ids(self._piece_to_id)
        self._byte_values = _byte_values(self._pieces, self._types)
        self._chunkable = not any(_CROSSES_CHUNK.search(p) for p in self._pieces)
        self._engine: Any = self._build_fast_engine() if fast else None

    # ---------------------------------------------------------------------------- properties

    @property
    def add_space_prefix(self) -> bool:
        """Whether a space is prepended to text (sentencepiece's "dummy prefix")."""
        return self._add_space_prefix

    @property
    def pieces(self) -> list[str]:
        return list(self._pieces)

    @property
    def scores(self) -> list[float]:
        """Piece scores, rounded to float32 as every vocabulary file stores them."""
        return list(self._scores)

    @property
    def uses_fast_engine(self) -> bool:
        """True when encoding runs in sentencepiece's C++ (verified identical), else Python."""
        return self._engine is not None

    def _fingerprint_parts(self) -> Iterator[bytes]:
        """Pieces, float32 scores, types, specials, the dummy prefix, and add_bos/add_eos where
        they are not llama.cpp's default (BOS, no EOS): hashed only then, so the fingerprints
        stored before the file's keys were read stay valid."""
        yield b"llamatrain-spm-v1\0"
        for p, s, t in zip(self._pieces, self._scores, self._types, strict=True):
            yield p.encode("utf-8") + b"\0" + struct.pack("<fi", s, t)
        pad = -1 if self._pad is None else self._pad
        yield struct.pack("<4i?", self._bos, self._eos, self._unk, pad, self._add_space_prefix)
        if not self._add_bos or self._add_eos:
            yield struct.pack("<??", self._add_bos, self._add_eos)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (e.g. for DataLoader workers): the C++ engine is rebuilt on unpickling."""
        return {**super().__getstate__(), "_engine": self._engine is not None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        fast = state.pop("_engine")
        self.__dict__.update(state)
        self._engine = self._build_fast_engine() if fast else None

    def __repr__(self) -> str:
        return (
            f"SpmTokenizer(vocab_size={self.vocab_size}, bos={self._bos}, eos={self._eos}, "
            f"unk={self._unk}, fast={self.uses_fast_engine}, fp={self.fingerprint()[:12]})"
        )

    # ------------------------------------------------------------------------------ encoding

    def _encode_text(self, text: str, special: bool) -> list[int]:
        """The fast engine's ids, or the reference algorithm's when parsing special tokens
        (the fast engine knows no control tokens in text) or when there is no engine."""
        if self._engine is not None and not special:
            return self._engine.encode(text)
        return self._encode_reference(text, special)

    def encode_batch(
        self,
        texts: Sequence[str],
        bos: bool = False,
        eos: bool = False,
        special: bool = False,
        num_threads: int | None = None,
    ) -> list[list[int]]:
        """Encode many strings; multi-threaded in sentencepiece when the fast engine is on."""
        if self._engine is not None and not special:
            threads = num_threads or (os.cpu_count() or 1)
            batch = self._engine.encode(list(texts), num_threads=threads)
        else:
            batch = [self._encode_reference(t, special) for t in texts]
        if bos or eos:
            for ids in batch:
                self._add_specials(ids, bos, eos)
        return batch

    def _build_fast_engine(self) -> Any | None:
        return build_fast_engine(
            self._pieces,
            self._scores,
            self._types,
            self._piece_to_id,
            unk_id=self._unk,
            bos_id=self._bos,
            eos_id=self._eos,
            pad_id=self._pad,
            add_space_prefix=self._add_space_prefix,
            reference=self._encode_reference,
        )

    def _encode_reference(self, text: str, special: bool = False) -> list[int]:
        """llama.cpp's SPM tokenization in Python: the definition the fast engine must match."""
        out: list[int] = []
        prev_special = True  # llama.cpp prefixes a space at the start and after special tokens
        for fragment in self._fragments(text, special):
            if isinstance(fragment, int):
                out.append(fragment)
                prev_special = True
                continue
            if self._add_space_prefix and prev_special:
                fragment = " " + fragment
            prev_special = False
            out.extend(self._encode_escaped(fragment.replace(" ", SPACE)))
        return out

    def _encode_escaped(self, text: str) -> list[int]:
        """Ids for space-escaped text, merged per whitespace chunk through the cache when that
        is exact (see the module docstring)."""
        if not self._chunkable:
            return self._merge(text)
        out: list[int] = []
        cache = self._cache
        for chunk in _CHUNK.findall(text):
            ids = cache.get(chunk)
            if ids is None:
                ids = self._merge(chunk)
                if len(cache) >= CACHE_MAX:
                    cache.clear()
                cache[chunk] = ids
            out.extend(ids)
        return out

    def _merge(self, text: str) -> list[int]:
        """Ids for space-escaped text: greedy merges, then byte fallback for unknown symbols."""
        out: list[int] = []
        for symbol in _merge_by_score(text, self._piece_to_id, self._scores):
            tid = self._piece_to_id.get(symbol)
            if tid is not None:
                out.append(tid)
                continue
            for byte in symbol.encode("utf-8", "surrogatepass"):
                bid = self._byte_ids[byte]
                # llama.cpp aborts without a byte token; <unk> is the sentencepiece behaviour.
                out.append(self._unk if bid is None else bid)
        return out

    # ------------------------------------------------------------------------------ decoding

    def _normal_bytes(self, piece: str) -> bytes:
        """The piece with ``▁`` unescaped to a space."""
        return piece.replace(SPACE, " ").encode("utf-8")

    def _byte_value(self, token_id: int) -> int | None:
        """The byte of a ``<0xNN>`` piece."""
        return self._byte_values.get(token_id)

    def decode_bytes(self, ids: Iterable[int], strip_space_prefix: bool = True) -> bytes:
        """Concatenated :meth:`token_bytes`; drops the dummy-prefix space of the first text token.

        The space is the one ``encode`` added, so ``decode(encode(s)) == s`` with or without
        BOS. llama.cpp agrees token by token; it differs only in *which* leading space it
        strips: ``llama_detokenize`` strips it unless the first token is BOS, llama-cpp-python's
        ``Llama.detokenize`` only when it is. We strip it after any leading control tokens.
        """
        out = bytearray()
        strip = strip_space_prefix and self._add_space_prefix
        for tid in self._checked_ids(ids):
            b = self.token_bytes(tid)
            if strip and self._effective[tid] not in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
                if b.startswith(b" "):
                    b = b[1:]
                strip = False
            out += b
        return bytes(out)

    def decode(self, ids: Iterable[int], strip_space_prefix: bool = True) -> str:
        """Text for ids; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids, strip_space_prefix).decode("utf-8", "replace")


# ------------------------------------------------------------------------- the merge algorithm


def _merge_by_score(text: str, piece_to_id: dict[str, int], scores: list[float]) -> list[str]:
    """The symbols left after greedily merging ``text``'s characters (llm_tokenizer_spm).

    Symbols are characters in a linked list; a heap holds candidate pairs whose concatenation
    is a piece, keyed by (-score, left index), so the best-scoring pair merges first and ties go
    to the leftmost. A popped pair is stale if either side was merged since (their lengths no
    longer add up).
    """
    sym = list(text)
    n = len(sym)
    if n < 2:
        return sym
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap: list[tuple[float, int, int, int]] = []
    for i in range(n - 1):
        tid = piece_to_id.get(sym[i] + sym[i + 1])
        if tid is not None:
            heap.append((-scores[tid], i, i + 1, len(sym[i]) + len(sym[i + 1])))
    heapq.heapify(heap)
    push = heapq.heappush
    pop = heapq.heappop
    while heap:
        _, left, right, size = pop(heap)
        a = sym[left]
        b = sym[right]
        if not a or not b or len(a) + len(b) != size:
            continue
        merged = a + b
        sym[left] = merged
        sym[right] = ""
        after = nxt[right]
        nxt[left] = after
        if after != -1:
            prv[after] = left
        before = prv[left]
        if before != -1:
            pair = sym[before] + merged
            tid = piece_to_id.get(pair)
            if tid is not None:
                push(heap, (-scores[tid], before, left, len(pair)))
        if after != -1:
            pair = merged + sym[after]
            tid = piece_to_id.get(pair)
            if tid is not None:
                push(heap, (-scores[tid], left, after, len(pair)))
    return [s for s in sym if s]


# ------------------------------------------------------------------- building the vocabulary


def _to_float32(value: float) -> float:
    return _FLOAT32.unpack(_FLOAT32.pack(float(value)))[0]


def _check_lengths(n_pieces: int, n_scores: int, n_types: int) -> None:
    if n_pieces == 0:
        raise TokenizerError("The vocabulary is empty; train or load a tokenizer first.")
    if n_scores != n_pieces or n_types != n_pieces:
        raise TokenizerError(
            f"The vocabulary has {n_pieces} pieces but {n_scores} scores and {n_types} "
            "token types; the tokenizer data is corrupt — re-export it."
        )


def _check_special_ids(n: int, bos_id: int, eos_id: int, unk_id: int, pad_id: int | None) -> None:
    for name, value in (("bos", bos_id), ("eos", eos_id), ("unk", unk_id)):
        if not 0 <= value < n:
            raise TokenizerError(
                f"The {name} token id {value} is outside the vocabulary (size {n}); llama "
                "models need <unk>, <s> and </s> — retrain with unk_id=0, bos_id=1, eos_id=2."
            )
    if pad_id is not None and not 0 <= pad_id < n:
        raise TokenizerError(f"The pad token id {pad_id} is outside the vocabulary ({n}).")


def _byte_fallback_ids(piece_to_id: dict[str, int]) -> list[int | None]:
    """byte -> token id, as llama.cpp's byte_to_token: ``<0xNN>``, else the 1-byte piece."""
    ids: list[int | None] = []
    for b in range(256):
        tid = piece_to_id.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:
            tid = piece_to_id.get(chr(b))
        ids.append(tid)
    return ids


def _byte_values(pieces: list[str], types: list[int]) -> dict[int, int]:
    """token id -> byte for the pieces that decode to a raw byte (type BYTE, ``<0xNN>``)."""
    values: dict[int, int] = {}
    for i, (p, t) in enumerate(zip(pieces, types, strict=True)):
        m = _BYTE_PIECE.match(p)
        if t == TOKEN_TYPE_BYTE and m:
            values[i] = int(m.group(1), 16)
    return values
