"""A byte-level BPE vocabulary (GGUF ``tokenizer.ggml.model = "gpt2"``) tokenized like llama.cpp.

llama.cpp's ``llm_tokenizer_bpe``: cut out special tokens (:mod:`~llamatrain.tokenizer.special`),
split the rest into words (:mod:`~llamatrain.tokenizer.pretokenizers`), write each word's UTF-8
bytes as GPT-2's printable stand-in characters, then merge adjacent symbols, always the pair
with the lowest merge rank (ties: leftmost), and look the symbols up; a symbol that is not a
token falls back to its single-byte tokens. Written in Python rather than through HF
``tokenizers``, whose pre-tokenizers split differently from llama.cpp in places; words are
cached, so the merge loop runs once per distinct word.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

from llamatrain.errors import TokenizerError
from llamatrain.tokenizer.base import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_USER_DEFINED,
    index_tokens,
)
from llamatrain.tokenizer.pretokenizers import PreTokenizer, pre_tokenizer
from llamatrain.tokenizer.special import (
    effective_types,
    find_eot,
    split_on_tokens,
    split_order,
)

__all__ = ["BYTE_TO_CHAR", "BpeTokenizer"]

_CACHE_MAX = 500_000


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the other
    bytes (controls, space, ...) for the code points from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    others = (b for b in range(256) if b not in table)
    table.update({b: chr(0x100 + n) for n, b in enumerate(others)})
    return dict(sorted(table.items()))


BYTE_TO_CHAR: dict[int, str] = _byte_to_char()
_CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
_BYTE_CHARS = [BYTE_TO_CHAR[b] for b in range(256)]


class BpeTokenizer:
    """A byte-level BPE vocabulary: tokens, token types, merges, pre-tokenizer, special ids.

    ``add_bos``/``add_eos`` are what llama.cpp adds when asked for special tokens; None takes
    llama.cpp's default for the pre-tokenizer. ``eot_id`` None looks for an end-of-turn token
    by text, as llama.cpp does. ``rstrip_ids``: tokens after which the whitespace in the text is
    dropped (:func:`~llamatrain.tokenizer.special.rstrip_ids`).
    """

    def __init__(
        self,
        tokens: Sequence[str],
        types: Sequence[int],
        merges: Sequence[str],
        *,
        pre: str | None = "default",
        bos_id: int,
        eos_id: int,
        eot_id: int | None = None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool | None = None,
        add_eos: bool = False,
        rstrip_ids: Iterable[int] = (),
    ) -> None:
        self._tokens = [str(t) for t in tokens]
        self._types = [int(t) for t in types]
        if not self._tokens or len(self._types) != len(self._tokens):
            raise TokenizerError(
                f"a BPE vocabulary needs one type per token ({len(self._tokens)} tokens, "
                f"{len(self._types)} types); the tokenizer data is corrupt — re-export it"
            )
        self._merges = [str(m) for m in merges]
        self._pre = pre_tokenizer(pre)
        self._token_to_id = index_tokens(self._tokens)
        self._ranks = _merge_ranks(self._merges)
        n = len(self._tokens)
        for name, value in (("bos", bos_id), ("eos", eos_id)):
            _check_id(name, value, n)
        for name, opt in (("eot", eot_id), ("unk", unk_id), ("pad", pad_id)):
            if opt is not None:
                _check_id(name, opt, n)
        self._bos, self._eos, self._unk, self._pad = bos_id, eos_id, unk_id, pad_id
        self._eot = find_eot(self._tokens) if eot_id is None else eot_id
        self._add_bos = self._pre.add_bos if add_bos is None else bool(add_bos)
        self._add_eos = bool(add_eos)
        self._effective = effective_types(self._tokens, self._types)
        self._order = {
            special: split_order(self._tokens, self._effective, special=special)
            for special in (False, True)
        }
        self._rstrip = frozenset(int(i) for i in rstrip_ids)
        self._cache: dict[str, list[int]] = {}
        self._fingerprint: str | None = None

    # ---------------------------------------------------------------------------- properties

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def eot_id(self) -> int | None:
        """End-of-turn id: the file's, else the token llama.cpp recognises by its text."""
        return self._eot

    @property
    def unk_id(self) -> int | None:
        """None for most byte-level vocabularies: every byte has a token, nothing is unknown."""
        return self._unk

    @property
    def pad_id(self) -> int | None:
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
    def pre(self) -> str:
        """The pre-tokenizer name (``tokenizer.ggml.pre``)."""
        return self._pre.name

    @property
    def pre_tokenizer(self) -> PreTokenizer:
        """The word splitter itself (its regexes, and their tokenizer.json form)."""
        return self._pre

    @property
    def tokens(self) -> list[str]:
        return list(self._tokens)

    @property
    def token_types(self) -> list[int]:
        """The types as the file stores them (llama.cpp retypes a few; see special.py)."""
        return list(self._types)

    @property
    def merges(self) -> list[str]:
        """Merge rules ``"left right"``, best (lowest rank) first."""
        return list(self._merges)

    @property
    def rstrip_ids(self) -> frozenset[int]:
        """Tokens after which llama.cpp drops the whitespace that follows in the text."""
        return self._rstrip

    def piece(self, token_id: int) -> str:
        """The raw vocabulary text of a token (byte-level characters, e.g. ``Ġ`` for space)."""
        return self._tokens[token_id]

    def piece_to_id(self, piece: str) -> int | None:
        return self._token_to_id.get(piece)

    def fingerprint(self) -> str:
        """sha256 over everything that decides ids: tokens, types, merges, pre, special ids and
        add_bos/add_eos and any rstrip ids (the end-of-turn id decides none, so it is left out)."""
        if self._fingerprint is None:
            h = hashlib.sha256(b"llamatrain-bpe-v1\0")
            for token, t in zip(self._tokens, self._types, strict=True):
                h.update(token.encode("utf-8") + b"\0" + struct.pack("<i", t))
            for merge in self._merges:
                h.update(merge.encode("utf-8") + b"\0")
            h.update(self._pre.name.encode("utf-8") + b"\0")
            unk, pad = (-1 if v is None else v for v in (self._unk, self._pad))
            h.update(struct.pack("<4i", self._bos, self._eos, unk, pad))
            h.update(struct.pack("<??", self._add_bos, self._add_eos))
            if self._rstrip:  # hashed only when present: older fingerprints stay valid
                h.update(struct.pack(f"<{len(self._rstrip)}i", *sorted(self._rstrip)))
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def newline_ids(self) -> list[int]:
        """Ids whose rendered text ends in a newline, where training windows may start."""
        return [i for i in range(len(self._tokens)) if self.token_bytes(i).endswith(b"\n")]

    def __getstate__(self) -> dict[str, Any]:
        """Picklable without the word cache, which can be large."""
        return {**self.__dict__, "_cache": {}}

    def __repr__(self) -> str:
        return (
            f"BpeTokenizer(vocab_size={self.vocab_size}, pre={self.pre!r}, bos={self._bos}, "
            f"eos={self._eos}, fp={self.fingerprint()[:12]})"
        )

    # ------------------------------------------------------------------------------ encoding

    def encode(
        self, text: str, bos: bool = False, eos: bool = False, special: bool = False
    ) -> list[int]:
        """Ids for ``text`` exactly as llama.cpp's ``llama_tokenize(parse_special=special)``.

        ``bos``/``eos`` frame the ids with BOS/EOS unconditionally; pass ``bos=tok.add_bos,
        eos=tok.add_eos`` for what llama.cpp's ``add_special`` does. Without ``special``,
        control tokens written in the text stay text.
        """
        ids = [self._bos] if bos else []
        for fragment in split_on_tokens(text, self._order[special], self._tokens, self._rstrip):
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids += self._text_ids(fragment)
        if eos:
            ids.append(self._eos)
        return ids

    def encode_batch(
        self, texts: Sequence[str], bos: bool = False, eos: bool = False, special: bool = False
    ) -> list[list[int]]:
        """:meth:`encode` for each text."""
        return [self.encode(t, bos, eos, special) for t in texts]

    def _text_ids(self, text: str) -> Iterator[int]:
        """Ids of text without special tokens: its words' ids, each word merged once and then
        looked up in the cache (a C-level loop over the words; see bench/README.md)."""
        words = self._pre.split(text)
        cache = self._cache
        new = set(words).difference(cache)
        if len(cache) + len(new) > _CACHE_MAX:
            cache.clear()
        for word in new:
            cache[word] = self._encode_word(_utf8(word).decode("latin-1").translate(_BYTE_CHARS))
        return chain.from_iterable(map(cache.__getitem__, words))

    def _encode_word(self, word: str) -> list[int]:
        """Ids of a byte-level word: merged symbols, else their single-byte tokens."""
        if self._pre.ignore_merges and word in self._token_to_id:
            return [self._token_to_id[word]]
        ids: list[int] = []
        for symbol in _merge_by_rank(word, self._ranks):
            tid = self._token_to_id.get(symbol)
            if tid is not None:
                ids.append(tid)
                continue
            # llama.cpp looks each UTF-8 byte up as a one-byte token: only ASCII can match.
            index = self._token_to_id
            ids.extend(index[c] for c in symbol if c.isascii() and c in index)
        return ids

    # ------------------------------------------------------------------------------ decoding

    def token_bytes(self, token_id: int) -> bytes:
        """What llama.cpp's ``llama_token_to_piece(special=False)`` renders for one token:
        nothing for control/unknown tokens, user-defined tokens as written, normal tokens with
        their byte-level characters turned back into bytes."""
        t = self._effective[token_id]
        text = self._tokens[token_id]
        if t == TOKEN_TYPE_USER_DEFINED:
            return text.encode("utf-8")
        if t == TOKEN_TYPE_NORMAL:
            return _bytes_of(text)
        if t == TOKEN_TYPE_BYTE and text in _CHAR_TO_BYTE:
            return bytes([_CHAR_TO_BYTE[text]])
        return b""  # control, unknown, unused or undefined: llama.cpp renders nothing

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Concatenated :meth:`token_bytes`."""
        out = bytearray()
        n = len(self._tokens)
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < n:
                raise TokenizerError(
                    f"Token id {tid} is outside the vocabulary (size {n}); the ids come from "
                    "a different tokenizer or model."
                )
            out += self.token_bytes(tid)
        return bytes(out)

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ids, as llama.cpp streams it token by token; invalid UTF-8 becomes U+FFFD.

        llama.cpp's ``llama_detokenize`` may also "clean up" spaces before punctuation for
        some vocabularies; that loses information (``decode(encode(s)) != s``), so it is not
        done here.
        """
        return self.decode_bytes(ids).decode("utf-8", "replace")


# ------------------------------------------------------------------------- the merge algorithm


def _merge_by_rank(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """The symbols left after merging ``word``'s characters by rank (llm_tokenizer_bpe).

    A heap holds adjacent pairs that have a merge rule, keyed by (rank, left index); a popped
    pair is stale when either side has changed since (their lengths no longer add up).
    """
    sym = list(word)
    n = len(sym)
    if n < 2:
        return sym
    nxt = [*range(1, n), -1]
    prv = list(range(-1, n - 1))
    heap: list[tuple[int, int, int, int]] = []
    for i in range(n - 1):
        rank = ranks.get((sym[i], sym[i + 1]))
        if rank is not None:
            heap.append((rank, i, i + 1, 2))
    heapq.heapify(heap)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        a, b = sym[left], sym[right]
        if not a or not b or len(a) + len(b) != size:
            continue
        sym[left], sym[right] = a + b, ""
        after = nxt[right]
        nxt[left] = after
        if after != -1:
            prv[after] = left
        for lo, hi in ((prv[left], left), (left, after)):
            if lo != -1 and hi != -1:
                rank = ranks.get((sym[lo], sym[hi]))
                if rank is not None:
                    heapq.heappush(heap, (rank, lo, hi, len(sym[lo]) + len(sym[hi])))
    return [s for s in sym if s]


# ------------------------------------------------------------------- building the vocabulary


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _bytes_of(text: str) -> bytes:
    """The bytes a normal token's byte-level characters stand for; a character outside
    GPT-2's table is rendered the way llama.cpp renders it."""
    out = bytearray()
    for c in text:
        b = _CHAR_TO_BYTE.get(c)
        if b is not None:
            out.append(b)
        else:
            out += f"[UNK_BYTE_0x{_utf8(c).hex()}{text}]".encode("utf-8", "surrogatepass")
    return bytes(out)


def _merge_ranks(merges: list[str]) -> dict[tuple[str, str], int]:
    """(left, right) -> rank (its line number); a rule splits at its first space after the
    first character, and the first of duplicate rules wins, as in llama.cpp."""
    ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
        cut = merge.find(" ", 1)
        if cut < 0:
            raise TokenizerError(f"merge rule {rank} ({merge!r}) is not 'left right'")
        ranks.setdefault((merge[:cut], merge[cut + 1 :]), rank)
    return ranks


def _check_id(name: str, value: int, n: int) -> None:
    if not 0 <= value < n:
        raise TokenizerError(f"the {name} token id {value} is outside the vocabulary (size {n})")
