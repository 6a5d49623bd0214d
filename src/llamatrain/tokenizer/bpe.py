"""A byte-level BPE vocabulary (GGUF ``tokenizer.ggml.model = "gpt2"``) tokenized like llama.cpp.

llama.cpp's ``llm_tokenizer_bpe``: cut out special tokens (:mod:`~llamatrain.tokenizer.special`),
split the rest into words (:mod:`~llamatrain.tokenizer.pretokenizers`), write each word's UTF-8
bytes as GPT-2's printable stand-in characters, then merge adjacent symbols, always the pair
with the lowest merge rank (ties: leftmost), and look the symbols up; a symbol that is not a
token falls back to its single-byte tokens. Written in Python rather than through HF
``tokenizers``, whose pre-tokenizers split differently from llama.cpp in places; words are
cached, so the merge loop runs once per distinct word. The steps before and after the words
(special tokens, BOS/EOS, rendering by token type) are
:class:`~llamatrain.tokenizer.vocab.VocabTokenizer`'s, shared with SPM.
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain

from llamatrain.errors import TokenizerError
from llamatrain.tokenizer.pretokenizers import PreTokenizer, pre_tokenizer
from llamatrain.tokenizer.special import find_eot
from llamatrain.tokenizer.vocab import CACHE_MAX, VocabTokenizer

__all__ = ["BYTE_TO_CHAR", "BpeTokenizer"]


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


class BpeTokenizer(VocabTokenizer):
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
        if len(tokens) == 0 or len(types) != len(tokens):
            raise TokenizerError(
                f"a BPE vocabulary needs one type per token ({len(tokens)} tokens, "
                f"{len(types)} types); the tokenizer data is corrupt — re-export it"
            )
        self._merges = [str(m) for m in merges]
        try:
            "\n".join(self._merges).encode("utf-8")
        except UnicodeEncodeError:
            raise TokenizerError(
                "a merge rule holds a lone surrogate, which is not text; the tokenizer data is "
                "corrupt — re-export it"
            ) from None
        self._pre = pre_tokenizer(pre)
        super().__init__(
            tokens,
            types,
            bos_id=bos_id,
            eos_id=eos_id,
            unk_id=unk_id,
            pad_id=pad_id,
            add_bos=self._pre.add_bos if add_bos is None else add_bos,
            add_eos=add_eos,
            rstrip_ids=rstrip_ids,
        )
        self._ranks = _merge_ranks(self._merges)
        n = len(self._pieces)
        for name, value in (("bos", bos_id), ("eos", eos_id)):
            _check_id(name, value, n)
        for name, opt in (("eot", eot_id), ("unk", unk_id), ("pad", pad_id)):
            if opt is not None:
                _check_id(name, opt, n)
        self._eot = find_eot(self._pieces) if eot_id is None else eot_id

    # ---------------------------------------------------------------------------- properties

    @property
    def eot_id(self) -> int | None:
        """End-of-turn id: the file's, else the token llama.cpp recognises by its text."""
        return self._eot

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
        return list(self._pieces)

    @property
    def merges(self) -> list[str]:
        """Merge rules ``"left right"``, best (lowest rank) first."""
        return list(self._merges)

    def _fingerprint_parts(self) -> Iterator[bytes]:
        """Tokens, types, merges, pre, special ids and add_bos/add_eos (the end-of-turn id
        decides no ids, so it is left out)."""
        yield b"llamatrain-bpe-v1\0"
        for token, t in zip(self._pieces, self._types, strict=True):
            yield token.encode("utf-8") + b"\0" + struct.pack("<i", t)
        for merge in self._merges:
            yield merge.encode("utf-8") + b"\0"
        yield self._pre.name.encode("utf-8") + b"\0"
        unk, pad = (-1 if v is None else v for v in (self._unk, self._pad))
        yield struct.pack("<4i", self._bos, self._eos, unk, pad)
        yield struct.pack("<??", self._add_bos, self._add_eos)

    def __repr__(self) -> str:
        return (
            f"BpeTokenizer(vocab_size={self.vocab_size}, pre={self.pre!r}, bos={self._bos}, "
            f"eos={self._eos}, fp={self.fingerprint()[:12]})"
        )

    # ------------------------------------------------------------------------------ encoding

    def _encode_text(self, text: str, special: bool) -> list[int]:
        ids: list[int] = []
        for fragment in self._fragments(text, special):
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids += self._text_ids(fragment)
        return ids

    def _text_ids(self, text: str) -> Iterator[int]:
        """Ids of text without special tokens: its words' ids, each word merged once and then
        looked up in the cache (a C-level loop over the words; see bench/README.md)."""
        words = self._pre.split(text)
        cache = self._cache
        new = set(words).difference(cache)
        if len(cache) + len(new) > CACHE_MAX:
            cache.clear()
        for word in new:
            cache[word] = self._encode_word(_utf8(word).decode("latin-1").translate(_BYTE_CHARS))
        return chain.from_iterable(map(cache.__getitem__, words))

    def _encode_word(self, word: str) -> list[int]:
        """Ids of a byte-level word: merged symbols, else their single-byte tokens."""
        index = self._piece_to_id
        if self._pre.ignore_merges and word in index:
            return [index[word]]
        ids: list[int] = []
        for symbol in _merge_by_rank(word, self._ranks):
            tid = index.get(symbol)
            if tid is not None:
                ids.append(tid)
                continue
            # llama.cpp looks each UTF-8 byte up as a one-byte token: only ASCII can match.
            ids.extend(index[c] for c in symbol if c.isascii() and c in index)
        return ids

    # ------------------------------------------------------------------------------ decoding

    def _normal_bytes(self, piece: str) -> bytes:
        """The bytes a normal token's byte-level characters stand for; a character outside
        GPT-2's table is rendered the way llama.cpp renders it."""
        out = bytearray()
        for c in piece:
            b = _CHAR_TO_BYTE.get(c)
            if b is not None:
                out.append(b)
            else:
                out += f"[UNK_BYTE_0x{_utf8(c).hex()}{piece}]".encode("utf-8", "surrogatepass")
        return bytes(out)

    def _byte_value(self, token_id: int) -> int | None:
        """The byte a one-character byte token stands for in GPT-2's table."""
        return _CHAR_TO_BYTE.get(self._pieces[token_id])


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
