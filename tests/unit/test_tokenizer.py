"""Tokenizer: llama.cpp's SPM algorithm, sentencepiece as a verified fast engine, round trips.

The agreement with real llama.cpp is proven in test_llama_cpp.py; here we pin the algorithm's
semantics on hand-made vocabularies (score order, leftmost ties, byte fallback, user-defined
tokens, merges into control tokens) and check that the fast sentencepiece engine and the Python
reference never disagree on a trained vocabulary.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import sentencepiece as spm

from llamatrain.tokenizer import (
    SPACE,
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_USER_DEFINED,
    Tokenizer,
    TokenizerError,
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


def random_strings(tok: Tokenizer, n: int, seed: int = 1) -> list[str]:
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
def tok(corpus: Path) -> Tokenizer:
    return Tokenizer.train([corpus], vocab_size=400)


def small_vocab(
    normal: dict[str, float], extra: list[tuple[str, int]] = (), bytes_: bool = True
) -> Tokenizer:
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
    return Tokenizer(pieces, scores, types)


def ids_to_pieces(t: Tokenizer, ids: list[int]) -> list[str]:
    return [t.piece(i) for i in ids]


# ---------------------------------------------------------------------------------- training


def test_train_layout_and_determinism(tok: Tokenizer, corpus: Path) -> None:
    assert tok.vocab_size == 400
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, None)
    assert tok.token_types[:3] == [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL]
    assert tok.pieces[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(tok.token_types[3:259]) == {TOKEN_TYPE_BYTE}
    assert set(tok.token_types[259:]) == {TOKEN_TYPE_NORMAL}
    assert tok.uses_fast_engine
    # whitespace-only pieces exist (indented lines), digits stay single
    assert any(set(p) == {SPACE} and len(p) > 1 for p in tok.pieces)
    assert not any(sum(c.isdigit() for c in p) > 1 for p in tok.pieces[259:])
    again = Tokenizer.train([corpus], vocab_size=400)
    assert again.fingerprint() == tok.fingerprint()


def test_train_errors(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.train([tmp_path / "missing.txt"], 400)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TokenizerError, match="empty"):
        Tokenizer.train([empty], 400)
    with pytest.raises(TokenizerError, match="at least 260"):
        Tokenizer.train([corpus], 100)
    with pytest.raises(TokenizerError, match="raise vocab_size"):
        Tokenizer.train([corpus], 280)
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a b c\n")
    with pytest.raises(TokenizerError, match="lower vocab_size"):
        Tokenizer.train([tiny], 5000)
    with pytest.raises(TokenizerError, match="model_type"):
        Tokenizer.train([corpus], 400, model_type="word")


def test_unigram_warns_and_is_encoded_like_llama_cpp(corpus: Path) -> None:
    with pytest.warns(UserWarning, match="greedy merges"):
        uni = Tokenizer.train([corpus], vocab_size=400, model_type="unigram")
    for s in TRICKY + random_strings(uni, 200):
        assert uni.encode(s) == uni._encode_reference(s), repr(s)


# ------------------------------------------------------------------------ llama.cpp semantics


def test_merge_order_follows_scores_then_leftmost() -> None:
    t = small_vocab({"ab": -2.0, "bc": -1.0, SPACE + "a": -5.0})
    # "bc" outranks "ab" although "ab" comes first; then "▁a" joins.
    assert ids_to_pieces(t, t.encode("abc")) == [SPACE + "a", "bc"]
    t = small_vocab({"aa": -1.0})
    # equal scores everywhere: leftmost pair first, so "aaa" -> "aa" + "a" (after "▁")
    assert ids_to_pieces(t, t.encode("aaa")) == [SPACE, "aa", "<0x61>"]


def test_byte_fallback_and_unk() -> None:
    t = small_vocab({"x": -1.0})
    assert ids_to_pieces(t, t.encode("x中")) == [SPACE, "x", "<0xE4>", "<0xB8>", "<0xAD>"]
    # without the dummy-prefix piece "▁" itself falls back to its UTF-8 bytes
    assert ids_to_pieces(t, t.encode("")) == []
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
    t = small_vocab({SPACE + "a": -1.0, "a": -2.0}, extra=[("<sep>", TOKEN_TYPE_USER_DEFINED)])
    assert not t.uses_fast_engine
    # like llama.cpp: "<sep>" is cut out before tokenizing and the text after it gets "▁" again
    assert ids_to_pieces(t, t.encode("a<sep>a")) == [SPACE + "a", "<sep>", SPACE + "a"]
    assert t.decode(t.encode("a<sep>a")) == "a<sep> a"


def test_chunk_cache_is_skipped_when_a_piece_crosses_a_space_run() -> None:
    t = small_vocab({"a" + SPACE + "b": -1.0, "a" + SPACE: -2.0, SPACE + "a": -3.0})
    assert not t._chunkable
    # per-word chunks would give ["▁a", "▁", "<0x62>"]; the true merge crosses the space
    assert ids_to_pieces(t, t.encode("a b")) == [SPACE, "a" + SPACE + "b"]
    assert ids_to_pieces(t, t.encode("xa b")) == [SPACE, "<0x78>", "a" + SPACE + "b"]
    assert small_vocab({SPACE + "a": -1.0})._chunkable


def test_fast_engine_matches_reference(tok: Tokenizer) -> None:
    strings = TRICKY + random_strings(tok, 1500)
    fast = tok.encode_batch(strings)
    for s, ids in zip(strings, fast, strict=True):
        assert ids == tok._encode_reference(s), repr(s)


def test_encode_specials_and_bytes(tok: Tokenizer) -> None:
    assert tok.encode("") == []
    assert tok.encode("", bos=True, eos=True) == [1, 2]
    ids = tok.encode("hello", bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.encode("\n") == [tok.piece_to_id(SPACE), 3 + 10]  # "▁" then <0x0A>
    assert tok.encode("中")[-3:] == [3 + 0xE4, 3 + 0xB8, 3 + 0xAD]
    assert tok.encode("<s>")[0] != tok.bos_id  # no special parsing, as llama.cpp's default
    assert 3 + 10 in tok.newline_ids()
    assert all(tok.decode([i]).endswith("\n") for i in tok.newline_ids())
    batch = tok.encode_batch(["a b", "c"], bos=True)
    assert batch == [tok.encode("a b", bos=True), tok.encode("c", bos=True)]


def test_decode_round_trip(tok: Tokenizer) -> None:
    for s in TRICKY + random_strings(tok, 300, seed=5):
        s = s.replace(SPACE, " ")  # "▁" in the input *is* a space for SPM
        assert tok.decode(tok.encode(s)) == s, repr(s)
        assert tok.decode(tok.encode(s, bos=True, eos=True)) == s
    ids = tok.encode(" two")
    assert tok.decode(ids) == " two"
    assert tok.decode(ids, strip_space_prefix=False) == "  two"
    assert tok.token_bytes(tok.bos_id) == b"" and tok.token_bytes(3 + 0xE4) == b"\xe4"
    assert tok.decode([3 + 0xE4]) == "\ufffd"  # a cut UTF-8 sequence
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


# ------------------------------------------------------------------------------ round trips


def test_pickle_round_trip(tok: Tokenizer) -> None:
    import pickle

    again = pickle.loads(pickle.dumps(tok))
    assert again.fingerprint() == tok.fingerprint() and again.uses_fast_engine
    assert again.encode("Hello  world\n") == tok.encode("Hello  world\n")


def test_gguf_fields_round_trip(tok: Tokenizer) -> None:
    fields = tok.gguf_fields()
    assert fields["tokenizer.ggml.model"] == "llama"
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert fields["tokenizer.ggml.add_eos_token"] is False
    assert len(fields["tokenizer.ggml.tokens"]) == tok.vocab_size
    again = Tokenizer.from_gguf_fields(fields)
    assert again.fingerprint() == tok.fingerprint()
    for s in TRICKY:
        assert again.encode(s) == tok.encode(s)
    changed = dict(
        fields, **{"tokenizer.ggml.scores": [s - 1e-3 for s in fields["tokenizer.ggml.scores"]]}
    )
    assert Tokenizer.from_gguf_fields(changed).fingerprint() != tok.fingerprint()


def test_from_gguf_fields_errors(tok: Tokenizer) -> None:
    fields = tok.gguf_fields()
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.from_gguf_fields({})
    with pytest.raises(TokenizerError, match="'gpt2' tokenizer"):
        Tokenizer.from_gguf_fields(dict(fields, **{"tokenizer.ggml.model": "gpt2"}))
    dup = list(fields["tokenizer.ggml.tokens"])
    dup[300] = dup[301]
    with pytest.raises(TokenizerError, match="Duplicate token"):
        Tokenizer.from_gguf_fields(dict(fields, **{"tokenizer.ggml.tokens": dup}))


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
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = Tokenizer.from_file(tmp_path / "m.model")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    assert t.vocab_size == sp.get_piece_size()
    assert t.pieces == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    for s in TRICKY + random_strings(t, 300, seed=9):
        assert t.encode(s) == sp.encode(s), repr(s)
        assert t._encode_reference(s) == sp.encode(s), repr(s)
    (tmp_path / "junk.model").write_bytes(b"\xff\xff\xff not a model")
    with pytest.raises(TokenizerError, match="junk.model"):
        Tokenizer.from_file(tmp_path / "junk.model")
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "nope.model")


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
        t = Tokenizer.from_file(tmp_path / "n.model")
    assert t.encode("a  b") == t._encode_reference("a  b")  # spaces kept, as llama.cpp does
