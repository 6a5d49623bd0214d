"""llama.cpp's rules around special tokens and Unicode categories, pinned on small cases.

The parity tests against llama.cpp itself (tests/integration/test_tokenizer_parity.py) find
these on real vocabularies; here each rule is checked directly.
"""

from __future__ import annotations

from llamatrain.tokenizer import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_USER_DEFINED,
    SpmTokenizer,
    rstrip_ids,
)
from llamatrain.tokenizer.pretokenizers import pre_tokenizer
from llamatrain.tokenizer.special import split_on_tokens
from llamatrain.tokenizer.unicode_categories import category

PHI3_PIECES = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|end|>", "a"]
PHI3_TYPES = [
    TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL,
]  # fmt: skip


def test_categories_are_llama_cpps_unicode_15_1_ones() -> None:
    assert [category(ord(c)) for c in "a1,\u0301+ \x00"] == list("LNPMSOO")
    # Assigned in Unicode 15.0/15.1, unassigned in Python 3.11's tables:
    assert category(0x1FAE8) == "S"  # 🫨 shaking face
    assert category(0x11F50) == "N"  # Kawi digit zero
    assert category(0x1E4D0) == "L"  # Nag Mundari letter
    assert category(0x2EBF0) == "L"  # CJK extension I
    assert category(0x0CF3) == "M"
    assert category(0x50000) == "O"  # unassigned everywhere


def test_a_unicode_15_letter_joins_a_contraction_like_llama_cpp() -> None:
    # llama.cpp (tests/integration/test_tokenizer_parity.py found it): U+11F02 is a letter, so
    # "'L" after it is not the contraction "'l" but the start of a word.
    assert pre_tokenizer("llama-bpe").split("\U00011f02'L") == ["\U00011f02", "'L"]
    assert pre_tokenizer("llama-bpe").split(" \U0001d2c0") == [" ", "\U0001d2c0"]


def test_phi3_tokens_strip_the_whitespace_after_them() -> None:
    ids = rstrip_ids("Phi3", PHI3_PIECES, PHI3_TYPES)
    assert ids == {2, 4, 5}  # not <unk>, <s>, <|endoftext|>; </s> although user-defined
    assert rstrip_ids("microsoft/Phi-3-mini", PHI3_PIECES, PHI3_TYPES) == ids
    assert rstrip_ids("llama", PHI3_PIECES, PHI3_TYPES) == frozenset()
    assert rstrip_ids(None, PHI3_PIECES, PHI3_TYPES) == frozenset()
    order = [4, 2]
    text = "x<|user|> \n\ty</s>  z<|user|>"
    assert split_on_tokens(text, order, PHI3_PIECES, ids) == ["x", 4, "y", 2, "z", 4]
    assert split_on_tokens(text, order, PHI3_PIECES) == ["x", 4, " \n\ty", 2, "  z", 4]


def test_spm_with_rstrip_ids_restarts_the_space_prefix_after_the_token() -> None:
    pieces = [*PHI3_PIECES[:6], "▁", "▁a", "a", "▁▁"]
    types = [*PHI3_TYPES[:6], *[TOKEN_TYPE_NORMAL] * 4]
    scores = [0.0] * len(pieces)
    plain = SpmTokenizer(pieces, scores, types)
    phi3 = SpmTokenizer(pieces, scores, types, rstrip_ids=rstrip_ids("phi3", pieces, types))
    text = "<|user|>  a"
    assert plain.encode(text, special=True) == [4, 9, 7]  # "▁" prefix + "  a" = "▁▁", "▁a"
    assert phi3.encode(text, special=True) == [4, 7]  # spaces dropped, "▁" prefix + "a"
    assert phi3.fingerprint() != plain.fingerprint()
