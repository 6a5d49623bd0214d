"""Seeded random text for tokenizer parity tests, and tests that it covers what it claims.

Tokenizers disagree in the corners: scripts whose letters a regex class misses, combining
marks, emoji sequences, long digit runs, unusual whitespace (tabs, CRLF, a lone CR, NBSP,
ideographic space), contractions, punctuation runs, code, and code points newer than the
running Python's Unicode tables. :func:`varied_texts` strings mix all of them, reproducibly
from a seed, so a mismatch found once is found again. The parity tests (against llama.cpp in
tests/integration/test_tokenizer_parity.py, against HF ``tokenizers`` in the unit tests)
import it from here.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

from llamatrain.tokenizer.unicode_categories import UNICODE_15_ADDITIONS

SCRIPTS = {
    "latin": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZéèêëàâäôöûüçñßÆøåÉÀ",
    "greek": "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΣΩάέή",
    "cyrillic": "абвгдежзийклмнопрстуфхцчшщъыьэюяАБВГДЖЗЯЁё",
    "cjk": "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去",
    "kana": "あいうえおかきくけこさしすせそアイウエオカキクケコンーッ",
    "hangul": "가나다라마바사아자차카타파하한국어글",
    "arabic": "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
    "hebrew": "אבגדהוזחטיכלמנסעפצקרשת",
    "devanagari": "कखगघचछजझटठडढणतथदधनपफबभमयरलवशषसह",
    "thai": "กขคงจฉชซญดตถทธนบปผพฟภมยรลวศษสหอฮ",
}
COMBINING = "\u0300\u0301\u0302\u0303\u0308\u0327\u0331\u064b\u05b7\u093f\u0e31"
EMOJI = ("🦙", "😀", "👍🏽", "👩\u200d👩\u200d👧", "🇫🇷", "❤️", "✓", "🤖", "🎉🎉", "⚡", "🫨")
WHITESPACE = (
    " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", "\r", "\xa0", " \xa0 ",
    "\u3000", " \t \n", "    \n    ", "\u2009", "\v", "\f", "\u2028",
)  # fmt: skip
CODE = (
    "def f(x):\n    return x**2",
    "for (int i = 0; i < n; ++i) { a[i] += 1; }",
    "if x != None and y >= 3:",
    'print(f"{x!r:>10}")',
    '<div class="a">&amp;</div>',
    "SELECT * FROM t WHERE id = 42;",
    "x->y = *p++;",
    "#include <stdio.h>",
    "$var = @list[0..9];",
    "fn main() -> Result<(), Box<dyn Error>> {}",
    "0x1F 0b1010 1e-9 3.14159",
    "a_b_c __init__ ::",
)
CONTRACTIONS = ("'s", "'S", "'t", "'T", "'re", "'RE", "'ve", "'m", "'ll", "'LL", "'d", "’s", "n't")
PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~¡¿«»—–…“”‘’・、。，！？；：（）【】"
NEWER_CODE_POINTS = tuple(chr(first) for first, _, _ in UNICODE_15_ADDITIONS)
"""One code point from each range Unicode 15.0/15.1 assigned (llama.cpp knows them)."""


def _word(rng: random.Random) -> str:
    script = rng.choice(list(SCRIPTS))
    word = "".join(rng.choice(SCRIPTS[script]) for _ in range(rng.randint(1, 9)))
    if script == "latin" and rng.random() < 0.3:
        word = rng.choice([word.upper(), word.title(), word.swapcase()])
    if rng.random() < 0.15:
        at = rng.randint(0, len(word))
        word = word[:at] + rng.choice(COMBINING) + word[at:]
    if rng.random() < 0.2:
        word += rng.choice(CONTRACTIONS)
    return word


def _any_code_point(rng: random.Random) -> str:
    """A code point from anywhere (assigned or not, no surrogates), often a Unicode 15 one."""
    while True:
        if rng.random() < 0.3:
            return rng.choice(NEWER_CODE_POINTS)
        cpt = rng.choice([rng.randint(0x80, 0x2FFF), rng.randint(0x80, 0xFFFF)])
        cpt = cpt if rng.random() < 0.7 else rng.randint(0x10000, 0x10FFFF)
        if not 0xD800 <= cpt < 0xE000:
            return chr(cpt)


_FRAGMENTS: tuple[Callable[[random.Random], str], ...] = (
    _word,
    _word,
    _word,
    lambda rng: "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12))),
    lambda rng: rng.choice(WHITESPACE),
    lambda rng: rng.choice(EMOJI),
    lambda rng: rng.choice(CODE),
    lambda rng: "".join(rng.choice(PUNCTUATION) for _ in range(rng.randint(1, 6))),
    lambda rng: rng.choice(COMBINING),
    lambda rng: _any_code_point(rng) * rng.randint(1, 3),
)


def varied_text(rng: random.Random) -> str:
    """One string of 1-12 fragments of every kind above, with or without spaces between."""
    parts = []
    if rng.random() < 0.2:
        parts.append(rng.choice(WHITESPACE))
    for _ in range(rng.randint(1, 12)):
        parts.append(rng.choice(_FRAGMENTS)(rng))
        parts.append(rng.choice(["", "", " ", " ", " ", "\n"]))
    return "".join(parts)


def varied_texts(seed: int, n: int) -> list[str]:
    """``n`` strings from :func:`varied_text`, the same for the same seed."""
    rng = random.Random(seed)
    return [varied_text(rng) for _ in range(n)]


def ascii_texts(seed: int, n: int) -> list[str]:
    """:func:`varied_texts` with everything outside ASCII dropped (non-empty ones only): the
    text fast paths take, which most of English training text is."""
    texts = ("".join(c for c in text if c.isascii()) for text in varied_texts(seed, n))
    return [text for text in texts if text]


def with_tokens(texts: Sequence[str], tokens: Sequence[str], seed: int) -> list[str]:
    """``texts`` with 1-3 of ``tokens`` (e.g. a vocabulary's control tokens) inserted at random
    places each, sometimes followed by whitespace (which some tokens strip)."""
    rng = random.Random(seed)
    out = []
    for text in texts:
        for _ in range(rng.randint(1, 3)):
            at = rng.randint(0, len(text))
            token = rng.choice(tokens) + rng.choice(["", "", " ", "\n ", " \t"])
            text = text[:at] + token + text[at:]
        out.append(text)
    return out


# ------------------------------------------------------------------------------------ tests


def test_the_same_seed_gives_the_same_texts() -> None:
    assert varied_texts(7, 50) == varied_texts(7, 50)
    assert varied_texts(7, 50) != varied_texts(8, 50)


def test_a_few_hundred_texts_hold_every_kind_of_fragment() -> None:
    joined = "".join(varied_texts(0, 300))
    for name, letters in SCRIPTS.items():
        assert any(c in joined for c in letters), name
    assert any(c in joined for c in COMBINING)
    assert any(e in joined for e in EMOJI)
    for needle in ("\r\n", "\t", "\xa0", "\u3000", "'LL", "'s", "def f(x)"):
        assert needle in joined, repr(needle)
    assert any(c in joined for c in NEWER_CODE_POINTS)
    assert any(ord(c) >= 0x10000 for c in joined)
    assert re.search("[0-9]{10,}", joined)


def test_ascii_texts_are_ascii_and_varied() -> None:
    texts = ascii_texts(3, 100)
    assert len(texts) >= 90 and all(t.isascii() for t in texts)
    joined = "".join(texts)
    assert all(needle in joined for needle in ("\r\n", "\t", "'LL", "  ", "def f(x)"))


def test_with_tokens_embeds_the_tokens() -> None:
    texts = with_tokens(varied_texts(1, 20), ["<|x|>"], seed=2)
    assert all("<|x|>" in t for t in texts)
