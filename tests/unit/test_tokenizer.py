"""SpmTokenizer: llama.cpp's SPM algorithm, sentencepiece as a verified fast engine, round trips.

The agreement with real llama.cpp is proven in test_llama_cpp.py; here we pin the algorithm's
semantics on hand-made vocabularies (score order, leftmost ties, byte fallback, user-defined
tokens, merges into control tokens) and check that the fast sentencepiece engine
(``fast=True``) and the Python reference (``fast=False``) never disagree on a trained
vocabulary.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm

from llamatrain.tokenizer import (
    SPACE,
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NAMES,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
    SpmTokenizer,
    Tokenizer,
    TokenizerError,
    load_sentencepiece,
    spm_from_model_proto,
    train_spm,
)

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "I",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "one",
    "all",
    "we",
    "their",
    "can",
    "has",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "if",
    "out",
    "time",
    "up",
    "about",
    "into",
    "than",
    "them",
    "its",
    "only",
    "some",
    "could",
    "new",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "through",
    "back",
    "years",
    "where",
    "much",
    "your",
    "way",
    "well",
    "down",
    "should",
    "because",
    "each",
    "just",
    "those",
    "people",
    "how",
    "too",
    "little",
    "state",
    "good",
    "very",
    "make",
    "world",
    "still",
    "own",
    "see",
    "men",
    "work",
    "long",
    "get",
    "here",
    "between",
    "both",
    "life",
    "being",
    "under",
    "never",
    "day",
    "same",
    "another",
    "know",
    "while",
    "last",
    "might",
    "us",
    "great",
    "old",
    "year",
    "off",
    "come",
    "since",
    "against",
    "go",
    "came",
    "right",
    "used",
    "take",
    "three",
    "llama",
    "model",
    "token",
]


def english_text(n_lines: int = 1500, seed: int = 0) -> str:
    """Deterministic English-like text: enough structure for BPE merges, no data files."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2024)))
        line = " ".join(words) + rng.choice([".", ".", "!", "?", ","])
        if rng.random() < 0.1:
            line = "    " + line  # indented lines: whitespace-only pieces
        lines.append(line)
    return "\n".join(lines) + "\n"


def random_strings(tok: SpmTokenizer, n: int, seed: int = 1) -> list[str]:
    """Adversarial strings: vocabulary fragments glued to spaces, tabs, newlines, Unicode."""
    rng = random.Random(seed)
    alphabet = list("abcdefghijklmnopqrstuvwxyz ETAOIN,.;:'!?\n\t   0123456789") + [
        "é",
        "ß",
        "中",
        "文",
        "🦙",
        SPACE,
        "\x00",
        "\u200b",
        "—",
        "’",
        "\r",
        "<",
        ">",
        "s",
    ]
    pieces = [p.replace(SPACE, " ") for p in tok.pieces[259:]]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 10)):
            if rng.random() < 0.5:
                parts.append(rng.choice(pieces))
            else:
                parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))))
        out.append("".join(parts))
    return out


TRICKY = [
    "",
    " ",
    "   ",
    "Hello world",
    " Hello world",
    "Hello  world   ",
    "\tTabs\tand\nnewlines\n\n",
    "line one\nline two\r\nline three",
    "Digits 1234567890 and 3.14",
    "naïve café Ünïcödé — “quoted”",
    "中文 日本語 한국어",
    "emoji 🦙🦙 👩‍👩‍👧",
    "<s> </s> <unk> <0x0A>",
    SPACE + "escaped" + SPACE,
    "\x00\x01\x1f\x7f",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "corpus.txt"
    path.write_text(english_text(), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok(corpus: Path) -> SpmTokenizer:
    return train_spm([corpus], vocab_size=400)


@pytest.fixture(scope="module")
def reference(tok: SpmTokenizer) -> SpmTokenizer:
    """The trained vocabulary, encoded by the Python reference algorithm only."""
    return rebuild(tok, fast=False)


def rebuild(t: SpmTokenizer, **changes: Any) -> SpmTokenizer:
    """A tokenizer built from ``t``'s public properties, the way the GGUF layer stores and
    restores a vocabulary; ``changes`` replaces some of the constructor's arguments."""
    args: dict[str, Any] = {
        "pieces": t.pieces,
        "scores": t.scores,
        "types": t.token_types,
        "bos_id": t.bos_id,
        "eos_id": t.eos_id,
        "unk_id": t.unk_id,
        "pad_id": t.pad_id,
        "add_bos": t.add_bos,
        "add_eos": t.add_eos,
        "add_space_prefix": t.add_space_prefix,
    }
    args.update(changes)
    return SpmTokenizer(**args)


def small_vocab(
    normal: dict[str, float], extra: list[tuple[str, int]] = (), bytes_: bool = True
) -> SpmTokenizer:
    """Specials + 256 byte pieces + the given pieces: a vocabulary whose behaviour we can
    work out by hand."""
    pieces = ["<unk>", "<s>", "</s>"]
    scores = [0.0, 0.0, 0.0]
    types = [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL]
    normal = {SPACE: -100.0, **normal}
    if bytes_:
        for b in range(256):
            pieces.append(f"<0x{b:02X}>")
            scores.append(0.0)
            types.append(TOKEN_TYPE_BYTE)
    for p, s in normal.items():
        pieces.append(p)
        scores.append(s)
        types.append(TOKEN_TYPE_NORMAL)
    for p, t in extra:
        pieces.append(p)
        scores.append(0.0)
        types.append(t)
    return SpmTokenizer(pieces, scores, types)


def encoded_pieces(t: SpmTokenizer, text: str) -> list[str]:
    """The pieces ``t`` encodes ``text`` to, after checking that the reference agrees."""
    pieces = [t.piece(i) for i in t.encode(text)]
    ref = rebuild(t, fast=False)
    assert [ref.piece(i) for i in ref.encode(text)] == pieces, repr(text)
    return pieces


# ---------------------------------------------------------------------------------- training


def test_train_layout_and_determinism(tok: SpmTokenizer, corpus: Path) -> None:
    assert tok.vocab_size == len(tok) == 400
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, None)
    assert tok.add_space_prefix
    assert tok.pieces[:3] == ["<unk>", "<s>", "</s>"]
    assert tok.token_types[:3] == [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL]
    assert tok.pieces[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(tok.token_types[3:259]) == {TOKEN_TYPE_BYTE}
    assert set(tok.token_types[259:]) == {TOKEN_TYPE_NORMAL}
    assert tok.uses_fast_engine
    # whitespace-only pieces exist (indented lines), digits stay single
    assert any(set(p) == {SPACE} and len(p) > 1 for p in tok.pieces)
    assert not any(sum(c.isdigit() for c in p) > 1 for p in tok.pieces[259:])
    again = train_spm([corpus], vocab_size=400)
    assert again.fingerprint() == tok.fingerprint()
    assert again.pieces == tok.pieces and again.scores == tok.scores


def test_spm_tokenizer_is_a_tokenizer(tok: SpmTokenizer, reference: SpmTokenizer) -> None:
    assert isinstance(tok, Tokenizer) and isinstance(reference, Tokenizer)
    assert not isinstance("not a tokenizer", Tokenizer)
    types = (
        TOKEN_TYPE_NORMAL,
        TOKEN_TYPE_UNKNOWN,
        TOKEN_TYPE_CONTROL,
        TOKEN_TYPE_USER_DEFINED,
        TOKEN_TYPE_UNUSED,
        TOKEN_TYPE_BYTE,
    )
    assert types == (1, 2, 3, 4, 5, 6)  # llama.cpp's llama_token_type
    assert TOKEN_TYPE_NAMES == {
        1: "normal",
        2: "unknown",
        3: "control",
        4: "user-defined",
        5: "unused",
        6: "byte",
    }


def test_train_errors(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        train_spm([tmp_path / "missing.txt"], 400)
    with pytest.raises(TokenizerError, match="No training files"):
        train_spm([], 400)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TokenizerError, match="empty"):
        train_spm([empty], 400)
    with pytest.raises(TokenizerError, match="at least 260"):
        train_spm([corpus], 100)
    with pytest.raises(TokenizerError, match="raise vocab_size"):
        train_spm([corpus], 280)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a b c\n")
    with pytest.raises(TokenizerError, match="lower vocab_size"):
        train_spm([tiny], 5000)
    with pytest.raises(TokenizerError, match="model_type"):
        train_spm([corpus], 400, model_type="word")


def test_unigram_warns_and_is_encoded_like_llama_cpp(corpus: Path) -> None:
    with pytest.warns(UserWarning, match="greedy merges"):
        uni = train_spm([corpus], vocab_size=400, model_type="unigram")
    ref = rebuild(uni, fast=False)
    assert uni.uses_fast_engine and not ref.uses_fast_engine
    strings = TRICKY + random_strings(uni, 200)
    assert uni.encode_batch(strings) == ref.encode_batch(strings)
    for s in strings:
        assert uni.encode(s) == ref.encode(s), repr(s)


def test_user_defined_symbols_are_kept_whole(corpus: Path) -> None:
    t = train_spm([corpus], vocab_size=400, user_defined_symbols=["<sep>"])
    sep = t.piece_to_id("<sep>")
    assert sep is not None and t.token_type(sep) == TOKEN_TYPE_USER_DEFINED
    assert not t.uses_fast_engine  # sentencepiece cannot pre-split them as llama.cpp does
    assert sep in t.encode("the<sep>model")
    assert t.decode(t.encode("the<sep>model")) == "the<sep> model"


# ------------------------------------------------------------------------ llama.cpp semantics


def test_merge_order_follows_scores_then_leftmost() -> None:
    t = small_vocab({"ab": -2.0, "bc": -1.0, SPACE + "a": -5.0})
    # "bc" outranks "ab" although "ab" comes first; then "▁a" joins.
    assert encoded_pieces(t, "abc") == [SPACE + "a", "bc"]
    t = small_vocab({"aa": -1.0})
    # equal scores everywhere: leftmost pair first, so "aaa" -> "aa" + "a" (after "▁")
    assert encoded_pieces(t, "aaa") == [SPACE, "aa", "<0x61>"]


def test_byte_fallback_and_unk() -> None:
    t = small_vocab({"x": -1.0})
    assert encoded_pieces(t, "x中") == [SPACE, "x", "<0xE4>", "<0xB8>", "<0xAD>"]
    assert encoded_pieces(t, "") == []
    no_bytes = small_vocab({"x": -1.0}, bytes_=False)
    assert not no_bytes.uses_fast_engine
    assert no_bytes.encode("x中") == [
        no_bytes.piece_to_id(SPACE),
        no_bytes.piece_to_id("x"),
        no_bytes.unk_id,
        no_bytes.unk_id,
        no_bytes.unk_id,
    ]


def test_merging_into_a_control_token_disables_the_fast_engine() -> None:
    # llama.cpp merges into *any* token text: with a normal piece "<s", the text "<s>" becomes
    # the BOS id (control tokens score 0, above every normal piece). sentencepiece would not
    # merge into a control piece, so the fast engine must be off for this vocabulary.
    t = small_vocab({"<s": -1.0})
    assert not t.uses_fast_engine
    sp, x = t.piece_to_id(SPACE), t.piece_to_id("<0x78>")
    assert t.encode("x <s>") == [sp, x, sp, t.bos_id]
    assert t.encode("x<s>") == [sp, x, t.bos_id]


def test_user_defined_tokens_split_first_and_restart_the_space_prefix() -> None:
    t = small_vocab(
        {SPACE + "a": -1.0, "a": -2.0},
        extra=[("<sep>", TOKEN_TYPE_USER_DEFINED), ("<sep><sep>", TOKEN_TYPE_USER_DEFINED)],
    )
    assert not t.uses_fast_engine
    # like llama.cpp: "<sep>" is cut out before tokenizing and the text after it gets "▁" again
    assert encoded_pieces(t, "a<sep>a") == [SPACE + "a", "<sep>", SPACE + "a"]
    assert t.decode(t.encode("a<sep>a")) == "a<sep> a"
    # the longest user-defined token is cut out first
    assert encoded_pieces(t, "<sep><sep><sep>") == ["<sep><sep>", "<sep>"]


def test_chunk_cache_is_skipped_when_a_piece_crosses_a_space_run() -> None:
    t = small_vocab({"a" + SPACE + "b": -1.0, "a" + SPACE: -2.0, SPACE + "a": -3.0})
    # per-word chunks would give ["▁a", "▁", "<0x62>"]; the true merge crosses the space
    for _ in range(2):  # the second round would come from a cache, if one were used
        assert encoded_pieces(t, "a b") == [SPACE, "a" + SPACE + "b"]
        assert encoded_pieces(t, "xa b") == [SPACE, "<0x78>", "a" + SPACE + "b"]
    chunkable = small_vocab({SPACE + "a": -1.0})
    for _ in range(2):
        assert encoded_pieces(chunkable, "a a  a") == [SPACE + "a", SPACE + "a", SPACE, SPACE + "a"]


def test_fast_engine_matches_reference(tok: SpmTokenizer, reference: SpmTokenizer) -> None:
    assert tok.uses_fast_engine and not reference.uses_fast_engine
    strings = TRICKY + random_strings(tok, 1500)
    fast = tok.encode_batch(strings)
    assert tok.encode_batch(strings, num_threads=1) == fast
    for s, ids in zip(strings, fast, strict=True):
        assert ids == reference.encode(s) == tok.encode(s), repr(s)
    assert reference.encode_batch(strings, bos=True, eos=True) == tok.encode_batch(
        strings, bos=True, eos=True
    )


def test_encode_specials_and_bytes(tok: SpmTokenizer) -> None:
    assert tok.encode("") == []
    assert tok.encode("", bos=True, eos=True) == [1, 2]
    ids = tok.encode("hello", bos=True, eos=True)
    assert ids == [1, *tok.encode("hello"), 2]
    assert tok.encode("\n") == [tok.piece_to_id(SPACE), 3 + 10]  # "▁" then <0x0A>
    assert tok.encode("中")[-3:] == [3 + 0xE4, 3 + 0xB8, 3 + 0xAD]
    assert tok.encode("<s>")[0] != tok.bos_id  # no special parsing, as llama.cpp's default
    assert 3 + 10 in tok.newline_ids()
    assert all(tok.decode([i]).endswith("\n") for i in tok.newline_ids())
    batch = tok.encode_batch(["a b", "c"], bos=True)
    assert batch == [tok.encode("a b", bos=True), tok.encode("c", bos=True)]
    assert tok.encode_batch(["a b"], eos=True) == [tok.encode("a b", eos=True)]


def test_decode_round_trip(tok: SpmTokenizer) -> None:
    for s in TRICKY + random_strings(tok, 300, seed=5):
        s = s.replace(SPACE, " ")  # "▁" in the input *is* a space for SPM
        assert tok.decode(tok.encode(s)) == s, repr(s)
        assert tok.decode(tok.encode(s, bos=True, eos=True)) == s
    ids = tok.encode(" two")
    assert tok.decode(ids) == " two"
    assert tok.decode(ids, strip_space_prefix=False) == "  two"
    assert tok.decode_bytes(ids) == b" two"
    assert tok.token_bytes(tok.bos_id) == b"" and tok.token_bytes(3 + 0xE4) == b"\xe4"
    assert tok.decode([3 + 0xE4]) == "\ufffd"  # a cut UTF-8 sequence
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


# ------------------------------------------------------------------------------ round trips


def test_pickle_round_trip(tok: SpmTokenizer, reference: SpmTokenizer) -> None:
    import pickle

    again = pickle.loads(pickle.dumps(tok))
    assert again.fingerprint() == tok.fingerprint() and again.uses_fast_engine
    assert again.encode("Hello  world\n") == tok.encode("Hello  world\n")
    ref_again = pickle.loads(pickle.dumps(reference))
    assert ref_again.fingerprint() == tok.fingerprint() and not ref_again.uses_fast_engine
    assert ref_again.encode("Hello  world\n") == tok.encode("Hello  world\n")


def test_round_trip_through_the_constructor(tok: SpmTokenizer) -> None:
    """What the GGUF layer does: store the public properties, build a tokenizer from them."""
    again = rebuild(tok)
    assert again.fingerprint() == tok.fingerprint() and again.uses_fast_engine
    assert (again.pieces, again.scores, again.token_types) == (
        tok.pieces,
        tok.scores,
        tok.token_types,
    )
    assert again.encode_batch(TRICKY, bos=True) == tok.encode_batch(TRICKY, bos=True)
    assert again.newline_ids() == tok.newline_ids()
    # scores are float32 in every vocabulary file: sub-float32 noise changes nothing
    assert rebuild(tok, scores=[s * (1 + 1e-12) for s in tok.scores]).fingerprint() == (
        tok.fingerprint()
    )


def test_fingerprint_covers_everything_that_decides_ids(tok: SpmTokenizer) -> None:
    last = tok.vocab_size - 1
    variants = {
        "scores": rebuild(tok, scores=[s - 1e-3 for s in tok.scores]),
        "pieces": rebuild(tok, pieces=[*tok.pieces[:last], "\x01unseen"]),
        "types": rebuild(tok, types=[*tok.token_types[:last], TOKEN_TYPE_UNUSED]),
        "bos_id": rebuild(tok, bos_id=tok.eos_id, eos_id=tok.bos_id),
        "unk_id": rebuild(tok, unk_id=last),
        "pad_id": rebuild(tok, pad_id=tok.unk_id),
        "add_space_prefix": rebuild(tok, add_space_prefix=False),
        "add_bos": rebuild(tok, add_bos=False),
        "add_eos": rebuild(tok, add_eos=True),
    }
    fingerprints = {name: t.fingerprint() for name, t in variants.items()}
    assert tok.fingerprint() not in fingerprints.values()
    assert len(set(fingerprints.values())) == len(variants)
    no_prefix = variants["add_space_prefix"]
    assert not no_prefix.uses_fast_engine  # sentencepiece always adds the dummy prefix here
    assert no_prefix.encode("Hello") == rebuild(no_prefix, fast=False).encode("Hello")
    assert no_prefix.encode("Hello") != tok.encode("Hello")


def test_constructor_refuses_broken_vocabularies(tok: SpmTokenizer) -> None:
    with pytest.raises(TokenizerError, match="empty"):
        SpmTokenizer([], [], [])
    with pytest.raises(TokenizerError, match="400 pieces but 399 scores"):
        rebuild(tok, scores=tok.scores[:-1])
    with pytest.raises(TokenizerError, match="399 token types"):
        rebuild(tok, types=tok.token_types[:-1])
    dup = tok.pieces
    dup[300] = dup[301]
    with pytest.raises(TokenizerError, match=r"Duplicate token .* \(ids 300 and 301\)"):
        rebuild(tok, pieces=dup)
    blank = tok.pieces
    blank[300] = ""
    with pytest.raises(TokenizerError, match="Token 300 is the empty string"):
        rebuild(tok, pieces=blank)
    for name in ("bos_id", "eos_id", "unk_id"):
        with pytest.raises(TokenizerError, match=f"{name[:3]} token id 400 is outside"):
            rebuild(tok, **{name: tok.vocab_size})
    with pytest.raises(TokenizerError, match="bos token id -1 is outside"):
        rebuild(tok, bos_id=-1)
    with pytest.raises(TokenizerError, match="pad token id 400"):
        rebuild(tok, pad_id=tok.vocab_size)


def test_from_sentencepiece_file_matches_sentencepiece(corpus: Path, tmp_path: Path) -> None:
    """A tokenizer.model trained with llama's settings: our ids == sentencepiece's own."""
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "m"),
        model_type="bpe",
        vocab_size=350,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    model = tmp_path / "m.model"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = load_sentencepiece(model)
        assert spm_from_model_proto(model.read_bytes()).fingerprint() == t.fingerprint()
    ref = rebuild(t, fast=False)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    assert t.vocab_size == sp.get_piece_size()
    assert t.pieces == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert t.scores == [sp.get_score(i) for i in range(sp.get_piece_size())]
    assert (t.unk_id, t.bos_id, t.eos_id, t.pad_id) == (0, 1, 2, None)
    for s in TRICKY + random_strings(t, 300, seed=9):
        assert t.encode(s) == sp.encode(s), repr(s)
        assert ref.encode(s) == sp.encode(s), repr(s)


def test_load_sentencepiece_errors(tmp_path: Path) -> None:
    (tmp_path / "junk.model").write_bytes(b"\xff\xff\xff not a model")
    with pytest.raises(TokenizerError, match="junk.model.*Not a sentencepiece model"):
        load_sentencepiece(tmp_path / "junk.model")
    with pytest.raises(TokenizerError, match="does not exist"):
        load_sentencepiece(tmp_path / "nope.model")
    (tmp_path / "vocab.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(16))
    with pytest.raises(TokenizerError, match="is a GGUF file.*llamatrain.load_tokenizer"):
        load_sentencepiece(tmp_path / "vocab.gguf")


def test_spm_from_model_proto_errors() -> None:
    with pytest.raises(TokenizerError, match="Not a sentencepiece model"):
        spm_from_model_proto(b"\xff\xff\xff not a model")
    with pytest.raises(TokenizerError, match="no pieces"):
        spm_from_model_proto(b"")
    one_piece = b"\x0a\x03\x0a\x01a"  # ModelProto{pieces: [{piece: "a"}]}, proto defaults
    word_model = b"\x12\x02\x18\x03"  # ModelProto{trainer_spec: {model_type: WORD}}
    with pytest.warns(UserWarning, match="normalizes text"):  # the default is nmt_nfkc
        with pytest.raises(TokenizerError, match="lacks <unk>, <s> or </s>"):
            spm_from_model_proto(one_piece)
        with pytest.raises(TokenizerError, match="Only sentencepiece BPE and unigram"):
            spm_from_model_proto(one_piece + word_model)


def test_normalizing_sentencepiece_model_warns(corpus: Path, tmp_path: Path) -> None:
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "n"),
        model_type="bpe",
        vocab_size=350,
        byte_fallback=True,
        minloglevel=2,
    )
    with pytest.warns(UserWarning, match="normalization"):
        t = load_sentencepiece(tmp_path / "n.model")
    # spaces are kept, as llama.cpp keeps them; sentencepiece itself would collapse them
    assert t.encode("a  b") == rebuild(t, fast=False).encode("a  b")
    assert t.decode(t.encode("a  b")) == "a  b"
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "n.model"))
    assert sp.decode(sp.encode("a  b")) == "a b" != t.decode(t.encode("a  b"))
