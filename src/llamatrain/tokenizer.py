"""A llama (SentencePiece/SPM) vocabulary that tokenizes exactly like llama.cpp.

Why not just call sentencepiece? Because the file we ship is run by llama.cpp, and llama.cpp does
not run sentencepiece: for ``tokenizer.ggml.model = "llama"`` it applies no normalization,
prepends one space, escapes spaces to ``▁``, splits the text into UTF-8 characters and then
*greedily merges the adjacent pair whose concatenation is a vocabulary piece with the highest
score* (ties: leftmost), finally falling back to ``<0xNN>`` byte tokens. A model trained on ids
produced any other way sees different ids at inference time. So the reference here is that
algorithm (:meth:`Tokenizer._encode_reference`), written from llama.cpp's ``llm_tokenizer_spm``
(src/llama-vocab.cpp); sentencepiece is used only as a fast engine where it provably does the
same thing:

* sentencepiece's *BPE* encoder is the same greedy bigram merge by piece score, so a BPE
  ``ModelProto`` built from our pieces, with the identity normalizer, encodes identically.
  It is enabled only when the vocabulary has no user-defined/unused pieces, has all 256 byte
  pieces, and no control/byte piece could be produced by a merge (llama.cpp would merge into
  such a piece, sentencepiece would not), and it is cross-checked against the reference on a
  fixed set of tricky strings when the tokenizer is built.
* A sentencepiece *unigram* model is encoded by Viterbi in sentencepiece, which llama.cpp does
  not do. Its pieces still work — llama.cpp merges them greedily by score — and this class
  tokenizes them the way llama.cpp will, but the segmentation is not the one unigram training
  optimised. BPE is therefore the default and ``model_type="unigram"`` warns.

The reference path caches per whitespace-delimited chunk. That is exact only when no piece
contains a non-``▁`` character followed by ``▁`` (then no merge can cross the start of a space
run); the condition is checked per vocabulary and the cache is skipped when it fails.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import os
import re
import struct
import sys
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from llamatrain.errors import TokenizerError

__all__ = [
    "Tokenizer",
    "TokenizerError",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
]

# llama.cpp / GGUF token types (tokenizer.ggml.token_type), identical to sentencepiece's enum.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

SPACE = "\u2581"  # "▁", sentencepiece's escaped space
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_CHUNK = re.compile(SPACE + "*[^" + SPACE + "]+|" + SPACE + "+")
_CROSSES_CHUNK = re.compile("[^" + SPACE + "]" + SPACE)
_CACHE_MAX = 500_000

# Strings the fast engine must reproduce before we trust it (see module docstring).
_SELF_CHECK = [
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
    SPACE + " literal escape " + SPACE * 2,
    "<s> </s> <unk> <0x0A> not special",
]


# --------------------------------------------------------------------------------------------
# Minimal protobuf wire format for sentencepiece's ModelProto. sentencepiece ships no way to
# read or build a model without the protobuf package (not a dependency here), and we need both:
# read piece types / normalizer flags from a tokenizer.model, and build a BPE model from a GGUF
# vocabulary. Field numbers are from sentencepiece_model.proto.
# --------------------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return bytes((n,))
    if n < 0:
        n += 1 << 64  # int32/int64 negatives are 10-byte two's-complement varints
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint((field << 3) | wire)


def _len_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _int_field(field: int, value: int) -> bytes:
    return _key(field, 0) + _varint(int(value))


def _parse_proto(buf: bytes) -> list[tuple[int, int, Any]]:
    """Split one protobuf message into (field, wire type, value) triples; raises ValueError."""
    out: list[tuple[int, int, Any]] = []
    i, n = 0, len(buf)

    def read_varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            if i >= n:
                raise ValueError("truncated varint")
            b = buf[i]
            i += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 70:
                raise ValueError("varint too long")

    while i < n:
        key = read_varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            out.append((field, wire, read_varint()))
        elif wire == 1:
            out.append((field, wire, buf[i : i + 8]))
            i += 8
        elif wire == 2:
            ln = read_varint()
            if i + ln > n:
                raise ValueError("truncated field")
            out.append((field, wire, buf[i : i + ln]))
            i += ln
        elif wire == 5:
            out.append((field, wire, buf[i : i + 4]))
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if i != n:
        raise ValueError("truncated message")
    return out


def _signed32(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def _read_model_proto(data: bytes) -> dict[str, Any]:
    """Pieces, scores, types, special ids and normalizer flags of a sentencepiece model."""
    pieces: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    trainer: dict[int, Any] = {}
    normalizer: dict[int, Any] = {}
    for field, wire, value in _parse_proto(data):
        if field == 1 and wire == 2:
            piece, score, ptype = "", 0.0, TOKEN_TYPE_NORMAL
            for f, w, v in _parse_proto(value):
                if f == 1 and w == 2:
                    piece = v.decode("utf-8")
                elif f == 2 and w == 5:
                    score = struct.unpack("<f", v)[0]
                elif f == 3 and w == 0:
                    ptype = v
            pieces.append(piece)
            scores.append(score)
            types.append(ptype)
        elif field == 2 and wire == 2:
            trainer = {f: v for f, _w, v in _parse_proto(value)}
        elif field == 3 and wire == 2:
            normalizer = {f: v for f, _w, v in _parse_proto(value)}
    return {
        "pieces": pieces,
        "scores": scores,
        "types": types,
        "model_type": trainer.get(3, 1),  # 1 unigram (proto default), 2 bpe, 3 word, 4 char
        "unk_id": _signed32(trainer.get(40, 0)),
        "bos_id": _signed32(trainer.get(41, 1)),
        "eos_id": _signed32(trainer.get(42, 2)),
        "pad_id": _signed32(trainer.get(43, -1)),
        "normalizer_name": bytes(normalizer.get(1, b"nmt_nfkc")).decode("utf-8", "replace"),
        "has_charsmap": bool(normalizer.get(2, b"")),
        "add_dummy_prefix": bool(normalizer.get(3, 1)),
        "remove_extra_whitespaces": bool(normalizer.get(4, 1)),
        "escape_whitespaces": bool(normalizer.get(5, 1)),
    }


def _build_bpe_proto(
    pieces: Sequence[str], scores: Sequence[float], types: Sequence[int], special: Mapping[str, int]
) -> bytes:
    """A sentencepiece BPE ModelProto, identity normalizer, dummy prefix, no space collapsing."""
    out = bytearray()
    pack = struct.Struct("<f").pack
    for piece, score, ptype in zip(pieces, scores, types, strict=True):
        raw = piece.encode("utf-8")
        # piece (1: bytes), score (2: fixed32 float), type (3: varint), then wrapped as field 1
        body = b"\x0a" + _varint(len(raw)) + raw + b"\x15" + pack(score) + b"\x18" + bytes((ptype,))
        out += b"\x0a" + _varint(len(body)) + body
    trainer = _int_field(3, 2) + _int_field(4, len(pieces)) + _int_field(35, 1)
    trainer += _int_field(40, special["unk"]) + _int_field(41, special["bos"])
    trainer += _int_field(42, special["eos"]) + _int_field(43, special["pad"])
    out += _len_field(2, trainer)
    norm = _len_field(1, b"identity") + _int_field(3, 1) + _int_field(4, 0) + _int_field(5, 1)
    out += _len_field(3, norm)
    return bytes(out)


# --------------------------------------------------------------------------------------------


def _quiet_stream(devnull: io.TextIOBase) -> io.TextIOBase | None:
    """Where sentencepiece's training log goes: /dev/null when stderr is a real file.

    sentencepiece redirects by file descriptor, and Jupyter's stderr has none (``fileno()``
    raises), so in a notebook the log is left alone rather than failing the training.
    """
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
    return devnull


class Tokenizer:
    """A llama SPM vocabulary: pieces, scores, token types and special ids.

    Build one with :meth:`train`, :meth:`from_file` (a sentencepiece ``tokenizer.model``),
    :meth:`from_gguf` / :meth:`from_gguf_fields` (any llama GGUF, vocab-only or full). Every
    constructor ends up here, so ids never depend on where the vocabulary came from.
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
        add_space_prefix: bool = True,
        fast: bool = True,
    ) -> None:
        n = len(pieces)
        if n == 0:
            raise TokenizerError("The vocabulary is empty; train or load a tokenizer first.")
        if len(scores) != n or len(types) != n:
            raise TokenizerError(
                f"The vocabulary has {n} pieces but {len(scores)} scores and {len(types)} "
                "token types; the tokenizer data is corrupt — re-export it."
            )
        # Scores are float32 in both GGUF and sentencepiece: compare them as llama.cpp does.
        self._pieces: list[str] = [str(p) for p in pieces]
        self._scores: list[float] = [
            struct.unpack("<f", struct.pack("<f", float(s)))[0] for s in scores
        ]
        self._types: list[int] = [int(t) for t in types]
        self._piece_to_id: dict[str, int] = {}
        for i, p in enumerate(self._pieces):
            if p == "":
                raise TokenizerError(f"Token {i} is the empty string; the vocabulary is corrupt.")
            if p in self._piece_to_id:
                raise TokenizerError(
                    f"Duplicate token {p!r} (ids {self._piece_to_id[p]} and {i}); llama.cpp "
                    "refuses such a vocabulary — rebuild the tokenizer."
                )
            self._piece_to_id[p] = i
        for name, value in (("bos", bos_id), ("eos", eos_id), ("unk", unk_id)):
            if not 0 <= value < n:
                raise TokenizerError(
                    f"The {name} token id {value} is outside the vocabulary (size {n}); llama "
                    "models need <unk>, <s> and </s> — retrain with unk_id=0, bos_id=1, eos_id=2."
                )
        if pad_id is not None and not 0 <= pad_id < n:
            raise TokenizerError(f"The pad token id {pad_id} is outside the vocabulary ({n}).")
        self._bos, self._eos, self._unk, self._pad = bos_id, eos_id, unk_id, pad_id
        self.add_space_prefix = bool(add_space_prefix)

        # byte -> token id, as llama.cpp's byte_to_token: "<0xNN>", else the 1-byte piece.
        self._byte_ids: list[int | None] = []
        for b in range(256):
            tid = self._piece_to_id.get(f"<0x{b:02X}>")
            if tid is None and b < 0x80:
                tid = self._piece_to_id.get(chr(b))
            self._byte_ids.append(tid)
        # Pieces that render as raw bytes when decoding (type BYTE, "<0xNN>").
        self._byte_value: dict[int, int] = {}
        for i, (p, t) in enumerate(zip(self._pieces, self._types, strict=True)):
            m = _BYTE_PIECE.match(p)
            if t == TOKEN_TYPE_BYTE and m:
                self._byte_value[i] = int(m.group(1), 16)

        # llama.cpp pre-splits only user-defined tokens when parse_special is false.
        self._user_defined = sorted(
            (i for i, t in enumerate(self._types) if t == TOKEN_TYPE_USER_DEFINED),
            key=lambda i: -len(self._pieces[i].encode("utf-8")),
        )
        self._chunkable = not any(_CROSSES_CHUNK.search(p) for p in self._pieces)
        self._cache: dict[str, list[int]] = {}
        self._sp: Any = None
        self._fingerprint: str | None = None
        if fast:
            self._sp = self._make_fast_engine()

    # ----------------------------------------------------------------------------- builders

    @classmethod
    def train(
        cls,
        files: Sequence[str | os.PathLike[str]],
        vocab_size: int,
        model_type: str = "bpe",
        *,
        character_coverage: float = 0.9995,
        max_sentence_length: int = 16384,
        input_sentence_size: int = 2_000_000,
        max_piece_length: int = 16,
        seed: int = 0,
        num_threads: int | None = None,
        user_defined_symbols: Sequence[str] = (),
    ) -> Tokenizer:
        """Train a llama-style SPM vocabulary on text files with sentencepiece.

        The settings are the ones Meta used for llama's tokenizer.model, because they are the
        ones under which llama.cpp's tokenizer reproduces sentencepiece's: identity
        normalization (llama.cpp normalizes nothing), a dummy prefix (llama.cpp prepends a
        space), no whitespace collapsing (llama.cpp keeps runs of spaces), byte fallback (so
        every string, newlines included, is encodable), split digits, ids unk=0 bos=1 eos=2.
        Each line of each file is one training sentence; lines longer than
        ``max_sentence_length`` bytes are skipped and at most ``input_sentence_size`` lines
        are sampled (with ``seed``), which bounds training time on large corpora.
        """
        import sentencepiece as spm

        if model_type not in ("bpe", "unigram"):
            raise TokenizerError(
                f"model_type {model_type!r} is not supported; use 'bpe' (matches llama.cpp "
                "exactly) or 'unigram'."
            )
        if model_type == "unigram":
            warnings.warn(
                "A unigram vocabulary is encoded by llama.cpp with greedy merges by piece "
                "score, not sentencepiece's Viterbi: llamatrain tokenizes it the llama.cpp way "
                "(consistent ids), but the segmentation is not the one unigram training "
                "optimised. Use model_type='bpe' unless you know you want this.",
                stacklevel=2,
            )
        paths = [Path(f) for f in files]
        if not paths:
            raise TokenizerError("No training files given; pass at least one text file.")
        for p in paths:
            if not p.is_file():
                raise TokenizerError(f"Tokenizer training file {str(p)!r} does not exist.")
            if p.stat().st_size == 0:
                raise TokenizerError(f"Tokenizer training file {str(p)!r} is empty.")
        if vocab_size < 259 + 1:
            raise TokenizerError(
                f"vocab_size {vocab_size} is too small: 3 special + 256 byte pieces take 259 "
                "ids; use at least 260 (a few hundred or more is sensible)."
            )
        writer = io.BytesIO()
        kwargs: dict[str, Any] = dict(
            input=",".join(str(p) for p in paths),
            model_writer=writer,
            model_type=model_type,
            vocab_size=vocab_size,
            normalization_rule_name="identity",
            add_dummy_prefix=True,
            remove_extra_whitespaces=False,
            byte_fallback=True,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            character_coverage=character_coverage,
            max_sentence_length=max_sentence_length,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            max_sentencepiece_length=max_piece_length,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            num_threads=num_threads or min(os.cpu_count() or 1, 8),
            user_defined_symbols=",".join(user_defined_symbols) if user_defined_symbols else "",
            minloglevel=2,  # sentencepiece logs every piece to stderr otherwise
        )
        spm.set_random_generator_seed(seed)
        try:
            with open(os.devnull, "w") as devnull:
                spm.SentencePieceTrainer.train(logstream=_quiet_stream(devnull), **kwargs)
        except RuntimeError as e:
            msg = str(e).strip()
            if "required_chars" in msg:
                raise TokenizerError(
                    f"vocab_size={vocab_size} cannot hold the 259 special/byte pieces plus the "
                    f"text's distinct characters (sentencepiece: {msg}); raise vocab_size or "
                    "lower character_coverage."
                ) from e
            if "Vocabulary size" in msg or "vocab_size" in msg:
                raise TokenizerError(
                    f"The training text is too small for vocab_size={vocab_size} "
                    f"(sentencepiece: {msg}); lower vocab_size or add more text."
                ) from e
            raise TokenizerError(f"sentencepiece could not train the tokenizer: {msg}") from e
        return cls.from_model_proto(writer.getvalue())

    @classmethod
    def from_model_proto(cls, data: bytes) -> Tokenizer:
        """Build from the bytes of a sentencepiece ``tokenizer.model``."""
        try:
            m = _read_model_proto(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise TokenizerError(
                f"Not a sentencepiece model ({e}); pass a tokenizer.model file or a GGUF."
            ) from e
        if not m["pieces"]:
            raise TokenizerError("The sentencepiece model has no pieces; it is not a tokenizer.")
        if m["normalizer_name"] != "identity" or m["has_charsmap"] or m["remove_extra_whitespaces"]:
            warnings.warn(
                f"This sentencepiece model normalizes text ({m['normalizer_name']}, "
                f"remove_extra_whitespaces={m['remove_extra_whitespaces']}); llama.cpp applies "
                "no normalization, so llamatrain tokenizes un-normalized text as llama.cpp "
                "will, which differs from sentencepiece's own ids on such text.",
                stacklevel=2,
            )
        if m["model_type"] not in (1, 2):
            raise TokenizerError(
                "Only sentencepiece BPE and unigram models can be used as llama vocabularies; "
                "retrain with model_type='bpe'."
            )

        def opt(i: int) -> int | None:
            return i if 0 <= i < len(m["pieces"]) else None

        unk = opt(m["unk_id"])
        bos = opt(m["bos_id"])
        eos = opt(m["eos_id"])
        if unk is None or bos is None or eos is None:
            raise TokenizerError(
                "The sentencepiece model lacks <unk>, <s> or </s>; llama needs all three — "
                "retrain with unk_id=0, bos_id=1, eos_id=2."
            )
        return cls(
            m["pieces"],
            m["scores"],
            m["types"],
            bos_id=bos,
            eos_id=eos,
            unk_id=unk,
            pad_id=opt(m["pad_id"]),
            add_space_prefix=m["add_dummy_prefix"],
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a sentencepiece ``tokenizer.model`` (or a GGUF, recognised by its magic)."""
        p = Path(path)
        if not p.is_file():
            raise TokenizerError(f"Tokenizer file {str(p)!r} does not exist.")
        data = p.read_bytes()
        if data[:4] == b"GGUF":
            return cls.from_gguf(p)
        try:
            return cls.from_model_proto(data)
        except TokenizerError as e:
            raise TokenizerError(f"{str(p)!r}: {e}") from e

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The vocabulary of a llama GGUF: a model, a checkpoint or a vocab-only file."""
        from llamatrain import gguf_io

        return cls.from_gguf_fields(gguf_io.read_gguf_metadata(path), source=str(path))

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], *, source: str = "GGUF") -> Tokenizer:
        """Build from GGUF metadata (plain Python values keyed by GGUF key names)."""
        model = fields.get("tokenizer.ggml.model")
        if model is None or "tokenizer.ggml.tokens" not in fields:
            raise TokenizerError(
                f"{source} has no tokenizer (tokenizer.ggml.model / tokens missing); use a GGUF "
                "exported by llamatrain or llama.cpp's convert script."
            )
        if model != "llama":
            raise TokenizerError(
                f"{source} has a {model!r} tokenizer; llamatrain supports llama's SPM "
                "tokenizer ('llama') only — train a tokenizer with llamatrain instead."
            )
        tokens = list(fields["tokenizer.ggml.tokens"])
        n = len(tokens)
        scores = list(fields.get("tokenizer.ggml.scores", [0.0] * n))
        types = list(fields.get("tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * n))
        if len(scores) < n or len(types) < n:
            raise TokenizerError(
                f"{source}: {n} tokens but {len(scores)} scores / {len(types)} token types; "
                "the file is corrupt — re-export it."
            )

        def special(key: str, default: int | None) -> int | None:
            v = fields.get(f"tokenizer.ggml.{key}", default)
            if v is None or not 0 <= int(v) < n:
                return default if default is not None and default < n else None
            return int(v)

        bos = special("bos_token_id", 1)
        eos = special("eos_token_id", 2)
        unk = special("unknown_token_id", 0)
        if bos is None or eos is None or unk is None:
            raise TokenizerError(f"{source}: the vocabulary is too small for <unk>/<s>/</s>.")
        return cls(
            tokens,
            scores[:n],
            types[:n],
            bos_id=bos,
            eos_id=eos,
            unk_id=unk,
            pad_id=special("padding_token_id", None),
            add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", True)),
        )

    def gguf_fields(self) -> dict[str, Any]:
        """The tokenizer keys gguf_io writes, as plain Python values keyed by GGUF key name.

        ``from_gguf_fields(t.gguf_fields())`` rebuilds an identical tokenizer (same
        fingerprint, same ids).
        """
        fields: dict[str, Any] = {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": list(self._pieces),
            "tokenizer.ggml.scores": list(self._scores),
            "tokenizer.ggml.token_type": list(self._types),
            "tokenizer.ggml.bos_token_id": self._bos,
            "tokenizer.ggml.eos_token_id": self._eos,
            "tokenizer.ggml.unknown_token_id": self._unk,
            "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_eos_token": False,
            "tokenizer.ggml.add_space_prefix": self.add_space_prefix,
        }
        if self._pad is not None:
            fields["tokenizer.ggml.padding_token_id"] = self._pad
        return fields

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
    def unk_id(self) -> int:
        return self._unk

    @property
    def pad_id(self) -> int | None:
        """The padding id, or None: llama vocabularies usually have none."""
        return self._pad

    @property
    def pieces(self) -> list[str]:
        return list(self._pieces)

    @property
    def scores(self) -> list[float]:
        return list(self._scores)

    @property
    def token_types(self) -> list[int]:
        return list(self._types)

    @property
    def uses_fast_engine(self) -> bool:
        """True when encoding runs in sentencepiece's C++ (verified identical), else Python."""
        return self._sp is not None

    def piece(self, token_id: int) -> str:
        """The raw vocabulary text of a token (``▁`` for spaces, ``<0x0A>`` for bytes)."""
        return self._pieces[token_id]

    def piece_to_id(self, piece: str) -> int | None:
        return self._piece_to_id.get(piece)

    def token_type(self, token_id: int) -> int:
        return self._types[token_id]

    def fingerprint(self) -> str:
        """sha256 over everything that decides ids: pieces, float32 scores, types, specials."""
        if self._fingerprint is None:
            h = hashlib.sha256(b"llamatrain-spm-v1\0")
            for p, s, t in zip(self._pieces, self._scores, self._types, strict=True):
                h.update(p.encode("utf-8") + b"\0" + struct.pack("<fi", s, t))
            h.update(
                struct.pack(
                    "<4i?",
                    self._bos,
                    self._eos,
                    self._unk,
                    -1 if self._pad is None else self._pad,
                    self.add_space_prefix,
                )
            )
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def newline_ids(self) -> list[int]:
        """Ids whose rendered text ends in a newline (``<0x0A>`` and pieces ending in "\\n").

        Used to start training windows after a newline, as llama.cpp's trainer can.
        """
        return [i for i in range(len(self._pieces)) if self.token_bytes(i).endswith(b"\n")]

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (e.g. for DataLoader workers): the C++ engine is rebuilt on unpickling."""
        state = self.__dict__.copy()
        state["_sp"] = state["_sp"] is not None
        state["_cache"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        fast = state.pop("_sp")
        self.__dict__.update(state)
        self._sp = self._make_fast_engine() if fast else None

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self._bos}, eos={self._eos}, "
            f"unk={self._unk}, fast={self.uses_fast_engine}, fp={self.fingerprint()[:12]})"
        )

    # ------------------------------------------------------------------------------ encoding

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids for ``text`` exactly as llama.cpp's ``llama_tokenize`` gives them
        (``add_special=bos``, ``parse_special=False``)."""
        ids = self._sp.encode(text) if self._sp is not None else self._encode_reference(text)
        if bos:
            ids.insert(0, self._bos)
        if eos:
            ids.append(self._eos)
        return ids

    def encode_batch(
        self,
        texts: Sequence[str],
        bos: bool = False,
        eos: bool = False,
        num_threads: int | None = None,
    ) -> list[list[int]]:
        """Encode many strings; multi-threaded in sentencepiece when the fast engine is on."""
        if self._sp is not None:
            out = self._sp.encode(list(texts), num_threads=num_threads or (os.cpu_count() or 1))
        else:
            out = [self._encode_reference(t) for t in texts]
        if bos or eos:
            for ids in out:
                if bos:
                    ids.insert(0, self._bos)
                if eos:
                    ids.append(self._eos)
        return out

    def _encode_reference(self, text: str) -> list[int]:
        """llama.cpp's SPM tokenization in Python: the definition the fast engine must match."""
        out: list[int] = []
        prev_special = True  # llama.cpp prefixes a space at the start and after special tokens
        for frag in self._partition(text):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            prev_special = False
            s = frag.replace(" ", SPACE)
            if not self._chunkable:
                out.extend(self._merge(s))
                continue
            cache = self._cache
            for chunk in _CHUNK.findall(s):
                ids = cache.get(chunk)
                if ids is None:
                    ids = self._merge(chunk)
                    if len(cache) >= _CACHE_MAX:
                        cache.clear()
                    cache[chunk] = ids
                out.extend(ids)
        return out

    def _partition(self, text: str) -> list[str | int]:
        """Split out user-defined tokens (longest first), as llama.cpp does before tokenizing."""
        if not text:
            return []
        frags: list[str | int] = [text]
        for tid in self._user_defined:
            piece = self._pieces[tid]
            new: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or piece not in f:
                    new.append(f)
                    continue
                parts = f.split(piece)
                for j, part in enumerate(parts):
                    if j:
                        new.append(tid)
                    if part:
                        new.append(part)
            frags = new
        return frags

    def _merge(self, s: str) -> list[int]:
        """Greedy bigram merge by piece score (ties: leftmost), then byte fallback.

        Mirrors llm_tokenizer_spm: symbols are characters in a linked list; a heap holds
        candidate pairs whose concatenation is a token, keyed by (-score, left index). A popped
        pair is stale if either side was merged since (their lengths no longer add up).
        """
        p2i = self._piece_to_id
        scores = self._scores
        sym = list(s)
        n = len(sym)
        if n > 1:
            nxt = list(range(1, n + 1))
            nxt[-1] = -1
            prv = list(range(-1, n - 1))
            heap: list[tuple[float, int, int, int]] = []
            for i in range(n - 1):
                tid = p2i.get(sym[i] + sym[i + 1])
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
                r2 = nxt[right]
                nxt[left] = r2
                if r2 != -1:
                    prv[r2] = left
                l0 = prv[left]
                if l0 != -1:
                    t = sym[l0] + merged
                    tid = p2i.get(t)
                    if tid is not None:
                        push(heap, (-scores[tid], l0, left, len(t)))
                if r2 != -1:
                    t = merged + sym[r2]
                    tid = p2i.get(t)
                    if tid is not None:
                        push(heap, (-scores[tid], left, r2, len(t)))
            symbols = [x for x in sym if x]
        else:
            symbols = sym
        out: list[int] = []
        for x in symbols:
            tid = p2i.get(x)
            if tid is not None:
                out.append(tid)
                continue
            for byte in x.encode("utf-8", "surrogatepass"):
                bid = self._byte_ids[byte]
                # llama.cpp aborts without a byte token; <unk> is the sentencepiece behaviour.
                out.append(self._unk if bid is None else bid)
        return out

    def _make_fast_engine(self) -> Any:
        """A sentencepiece BPE processor over our pieces, if it provably encodes like llama.cpp."""
        if any(t in (TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED) for t in self._types):
            return None
        if not all(f"<0x{b:02X}>" in self._piece_to_id for b in range(256)):
            return None
        if not self.add_space_prefix:
            return None
        if self._types[self._unk] != TOKEN_TYPE_UNKNOWN:
            return None
        # llama.cpp merges into *any* token, sentencepiece only into normal pieces: bail out if
        # a non-normal token's text could be formed from two symbols (tokens or characters).
        for piece, t in zip(self._pieces, self._types, strict=True):
            if t == TOKEN_TYPE_NORMAL:
                continue
            for k in range(1, len(piece)):
                a, b = piece[:k], piece[k:]
                if (len(a) == 1 or a in self._piece_to_id) and (
                    len(b) == 1 or b in self._piece_to_id
                ):
                    return None
        try:
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor()
            special = {
                "unk": self._unk,
                "bos": self._bos,
                "eos": self._eos,
                "pad": -1 if self._pad is None else self._pad,
            }
            sp.LoadFromSerializedProto(
                _build_bpe_proto(self._pieces, self._scores, self._types, special)
            )
        except Exception:  # noqa: BLE001 - any failure just means "use the Python path"
            return None
        for s in _SELF_CHECK:
            if sp.encode(s) != self._encode_reference(s):
                warnings.warn(
                    "sentencepiece disagrees with llama.cpp's algorithm on this vocabulary; "
                    "using the (slower) Python tokenizer.",
                    stacklevel=3,
                )
                return None
        return sp

    # ------------------------------------------------------------------------------ decoding

    def token_bytes(self, token_id: int) -> bytes:
        """What llama.cpp's ``llama_token_to_piece(special=False)`` renders for one token:
        nothing for control/unknown tokens, the byte for ``<0xNN>``, else the text with
        ``▁`` unescaped. Use it to stream generated text."""
        t = self._types[token_id]
        if t == TOKEN_TYPE_NORMAL:
            return self._pieces[token_id].replace(SPACE, " ").encode("utf-8")
        if t == TOKEN_TYPE_USER_DEFINED:
            return self._pieces[token_id].encode("utf-8")
        bv = self._byte_value.get(token_id)
        if bv is not None:
            return bytes([bv])
        return b""  # control, unknown, unused or undefined: llama.cpp renders nothing

    def decode_bytes(self, ids: Iterable[int], strip_space_prefix: bool = True) -> bytes:
        """Concatenated :meth:`token_bytes`; drops the dummy-prefix space of the first text token.

        The space is the one ``encode`` added, so ``decode(encode(s)) == s`` with or without
        BOS. llama.cpp agrees token by token; it differs only in *which* leading space it
        strips: ``llama_detokenize`` strips it unless the first token is BOS, llama-cpp-python's
        ``Llama.detokenize`` only when it is. We strip it after any leading control tokens.
        """
        out = bytearray()
        strip = strip_space_prefix and self.add_space_prefix
        for tid in ids:
            tid = int(tid)
            if not 0 <= tid < len(self._pieces):
                raise TokenizerError(
                    f"Token id {tid} is outside the vocabulary (size {len(self._pieces)}); the "
                    "ids come from a different tokenizer or model."
                )
            b = self.token_bytes(tid)
            if strip and self._types[tid] not in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
                if b.startswith(b" "):
                    b = b[1:]
                strip = False
            out += b
        return bytes(out)

    def decode(self, ids: Iterable[int], strip_space_prefix: bool = True) -> str:
        """Text for ids; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids, strip_space_prefix).decode("utf-8", "replace")
