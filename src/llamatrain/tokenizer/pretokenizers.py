"""How llama.cpp splits text into words before byte-level BPE (``tokenizer.ggml.pre``).

Each pre-tokenizer is a list of regexes applied in turn: every regex splits each piece left by
the previous ones into its matches *and* the unmatched text between them. llama.cpp does not
run the regexes of the original ``tokenizer.json`` with a Unicode regex engine; it replaces
every code point outside ASCII by one stand-in character for its category (letter, number,
punctuation, mark, symbol, other; whitespace by a vertical tab) and runs an ASCII regex over
that "collapsed" text, in which ``\\p{L}`` becomes ``[<letter stand-in>A-Za-z]`` and so on.
Regexes without categories run on the code points themselves. HF ``tokenizers`` and the
``regex`` module do not split exactly like that (``\\s``, for one, differs), so the same
collapse is done here with the standard library: identical words by construction.

Categories are llama.cpp's (:mod:`~llamatrain.tokenizer.unicode_categories`: Unicode 15.1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import accumulate, pairwise

from llamatrain.errors import TokenizerError
from llamatrain.tokenizer.unicode_categories import category

__all__ = [
    "HF_BYTE_LEVEL",
    "HF_PRE_TOKENIZERS",
    "HF_PUNCTUATION",
    "PRE_TOKENIZERS",
    "PreTokenizer",
    "pre_tokenizer",
    "pre_tokenizer_for_hf",
]

# Stand-ins for non-ASCII code points, as llama.cpp's collapsed text has them.
_OTHER, _NUMBER, _LETTER, _PUNCT, _MARK, _SYMBOL = "\xd0", "\xd1", "\xd2", "\xd3", "\xd4", "\xd5"
_SPACE = "\x0b"
_STAND_IN = {"N": _NUMBER, "L": _LETTER, "P": _PUNCT, "M": _MARK, "S": _SYMBOL}
# Unicode's White_Space property: what llama.cpp counts as whitespace beyond ASCII.
_WHITESPACE = frozenset(
    [0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000]
)

# Bracket-expression contents for the categories in collapsed text: the stand-in plus the ASCII
# members (ASCII stays itself when collapsing).
L = _LETTER + "A-Za-z"
N = _NUMBER + "0-9"
P = _PUNCT + r"!-#%-*,-/:-;?-@\[-\]_{}"
M = _MARK
S = _SYMBOL + r"$+<=>^`|~"

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^\s{L}{N}]+|\s+(?!\S)"
_LLAMA3 = (
    rf"{_CONTRACTIONS}|[^\r\n{L}{N}]?[{L}]+|[{N}]{{1,3}}| ?[^\s{L}{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    rf"{_CONTRACTIONS}|[^\r\n{L}{N}]?[{L}]+|[{N}]| ?[^\s{L}{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35 = (
    rf"{_CONTRACTIONS}|[^\r\n{L}{N}]?[{L}{M}]+|[{N}]| ?[^\s{L}{M}{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_CJK = r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek's tokenizer.json spells its letters and punctuation out as code-point ranges, so
# these run on the code points themselves, not on collapsed text. (Escaped: some of these
# characters have canonical equivalents an editor may silently substitute.)
_DEEPSEEK_LETTERS = (
    r"\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    r"\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    r"\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    r"\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    r"\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    r"\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    r"\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    r"\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    r"\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    r"\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    r"\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    r"\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    r"\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCT = r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"


@dataclass(frozen=True)
class _Rule:
    """One regex of a pre-tokenizer; ``collapsed``: it runs on collapsed text (it uses
    categories), else on the code points (non-ASCII whitespace still becomes ``\\v``).

    ``splitter`` is the regex captured whole: ``re.split`` with it returns the text between
    matches and the matches, alternately, in one C call (a Python step per match was most of
    the tokenizer's time; see bench/README.md).
    """

    splitter: re.Pattern[str]
    collapsed: bool


def _rule(pattern: str, collapsed: bool = True) -> _Rule:
    # ASCII: \s is C's isspace ([ \t\n\v\f\r]), as in llama.cpp's std::regex.
    splitter = re.compile(f"({pattern})", re.ASCII)
    assert splitter.groups == 1, "a pre-tokenizer regex must not capture: re.split would return it"
    return _Rule(splitter, collapsed)


@dataclass(frozen=True)
class _Kind:
    """A family of pre-tokenizer names llama.cpp treats alike; the first name is the one
    llama.cpp's converter writes for the family's best-known model."""

    rules: tuple[_Rule, ...]
    ignore_merges: bool = False  # a word that is a whole token is taken as is
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token
    hf: tuple[str, ...] | None = None  # the splits as tokenizer.json files write them


# The splits as HF tokenizer.json files write them (HF regex syntax; ByteLevel's own regex and
# Digits written as the regexes they apply): how a tokenizer.json's pre-tokenizer is recognised.
HF_BYTE_LEVEL = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
"""The regex of HF's ByteLevel pre-tokenizer with ``use_regex`` (GPT-2's)."""
HF_PUNCTUATION = r"[\p{P}\$\+<=>\^~\|`]+"
"""HF's Punctuation pre-tokenizer (contiguous) as a regex: its punctuation includes ASCII
symbols."""
_HF_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_HF_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|" + _HF_TAIL
_HF_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|" + _HF_TAIL
_HF_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _literal(pattern: str) -> str:
    r"""``pattern`` with its ``\uXXXX`` escapes as the characters tokenizer.json holds."""
    return re.sub(
        r"\\u([0-9a-f]{4})|\\U([0-9a-f]{8})", lambda m: chr(int(m[1] or m[2], 16)), pattern
    )


_DEFAULT = _Kind(
    (_rule(rf"[{P}$+<=>^~|]+"), _rule(_GPT2), _rule(rf"[{N}]+"), _rule("[0-9]{3}", False))
)
_KINDS: dict[tuple[str, ...], _Kind] = {
    ("default",): _DEFAULT,
    ("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral"): _Kind(
        (_rule(_LLAMA3),), ignore_merges=True, add_bos=True, hf=(_HF_LLAMA3,)
    ),
    ("dbrx", "smaug-bpe"): _Kind((_rule(_LLAMA3),), hf=(_HF_LLAMA3,)),
    ("deepseek-llm",): _Kind(
        (
            _rule(r"[\r\n]", False),
            _rule(_DEEPSEEK_LETTERS, False),
            _rule(_DEEPSEEK_PUNCT, False),
            _rule(r"\s+\Z", False),
            _rule(_CJK, False),
            _rule(rf"[{N}]+"),
        ),
        hf=(
            "[\r\n]",
            _literal(_DEEPSEEK_LETTERS),
            _literal(_DEEPSEEK_PUNCT),
            r"\s+$",
            _literal(_CJK),
            r"\p{N}+",
        ),
    ),
    ("deepseek-coder",): _Kind(
        (
            _rule(r"[\r\n]", False),
            _rule(rf"\s?[{L}]+"),
            _rule(rf"\s?[{P}]+"),
            _rule(_CJK, False),
            _rule(rf"[{N}]"),
        ),
        hf=("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _literal(_CJK), r"\p{N}"),
    ),
    ("falcon",): _Kind(
        (_rule(rf"[{P}$+<=>^~|`]+"), _rule(_GPT2), _rule("[0-9]{3}", False)),
        hf=(HF_PUNCTUATION, HF_BYTE_LEVEL, r"\p{N}+", "[0-9][0-9][0-9]"),
    ),
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"): _Kind(
        (_rule(rf"[{N}]"), _rule(_GPT2)), hf=(r"\p{N}", HF_BYTE_LEVEL)
    ),
    ("gpt-2", "phi-2", "mpt", "olmo", "jais"): _Kind((_rule(_GPT2),), hf=(HF_BYTE_LEVEL,)),
    ("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez", "hunyuan"): _Kind(
        (_rule(_QWEN2),), hf=(_HF_QWEN2,)
    ),
    ("qwen35",): _Kind((_rule(_QWEN35),), hf=(_HF_QWEN35,)),
}
_BY_NAME = {name: kind for names, kind in _KINDS.items() for name in names}

PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_BY_NAME))
"""The ``tokenizer.ggml.pre`` values llamatrain splits exactly like llama.cpp."""

HF_PRE_TOKENIZERS: tuple[str, ...] = tuple(names[0] for names, k in _KINDS.items() if k.hf)
"""The pre-tokenizers :func:`pre_tokenizer_for_hf` recognises in a tokenizer.json."""


def pre_tokenizer_for_hf(splits: tuple[str, ...], ignore_merges: bool) -> str | None:
    """The ``tokenizer.ggml.pre`` name for a tokenizer.json whose pre-tokenizer applies these
    regexes in turn (HF syntax), or None if none of ours does. Two families share Llama 3's
    regex; the model's ``ignore_merges`` tells them apart, as it does for llama.cpp."""
    matches = [(names[0], k) for names, k in _KINDS.items() if k.hf == splits]
    exact = [name for name, k in matches if k.ignore_merges == ignore_merges]
    return (exact or [name for name, _ in matches] or [None])[0]


class _CollapseTable(dict[int, str]):
    """``str.translate`` table from code points to llama.cpp's stand-ins, filled on demand."""

    def __missing__(self, cpt: int) -> str:
        if cpt < 0x80:
            value = chr(cpt)
        elif cpt in _WHITESPACE:
            value = _SPACE
        else:
            value = _STAND_IN.get(category(cpt), _OTHER)
        self[cpt] = value
        return value


class _SpaceTable(dict[int, str]):
    """``str.translate`` table that turns non-ASCII whitespace into ``\\v`` only."""

    def __missing__(self, cpt: int) -> str:
        value = _SPACE if cpt in _WHITESPACE else chr(cpt)
        self[cpt] = value
        return value


_COLLAPSE = _CollapseTable()
_SPACES = _SpaceTable()


class PreTokenizer:
    """The word splitter for one ``tokenizer.ggml.pre`` value."""

    def __init__(self, name: str) -> None:
        kind = _BY_NAME.get(name)
        if kind is None:
            raise TokenizerError(
                f"unknown pre-tokenizer tokenizer.ggml.pre = {name!r}; llamatrain tokenizes "
                f"byte-level BPE exactly like llama.cpp for: {', '.join(PRE_TOKENIZERS)}"
            )
        self.name = name
        self._rules = kind.rules
        self.ignore_merges = kind.ignore_merges
        self.add_bos = kind.add_bos
        self.hf_splits = kind.hf  # as a tokenizer.json writes them; None: no HF equivalent

    def split(self, text: str) -> list[str]:
        """The words of ``text``, in order; they concatenate back to ``text``."""
        words = [text] if text else []
        for rule in self._rules:
            table = _COLLAPSE if rule.collapsed else _SPACES
            words = [w for word in words for w in _cut(rule, word, table)]
        return words

    def __repr__(self) -> str:
        return f"PreTokenizer({self.name!r})"


def pre_tokenizer(name: str | None) -> PreTokenizer:
    """The splitter for ``tokenizer.ggml.pre``; a file without the key gets ``"default"``, as in
    llama.cpp (which warns that generation quality will suffer)."""
    return PreTokenizer("default" if name is None else name)


_NON_ASCII = re.compile(r"[^\x00-\x7f]+")


def _view(text: str, table: dict[int, str]) -> str:
    """``text`` as the rule sees it: ASCII as is, the rest through ``table`` (runs at a time,
    so mostly-ASCII text costs one C copy)."""
    return _NON_ASCII.sub(lambda run: run[0].translate(table), text)


def _cut(rule: _Rule, text: str, table: dict[int, str]) -> list[str]:
    """``text`` cut into the matches of ``rule`` (on its view) and the text between them."""
    if text.isascii():  # its own view
        return [part for part in rule.splitter.split(text) if part]
    parts = rule.splitter.split(_view(text, table))
    ends = accumulate(map(len, parts), initial=0)
    return [text[a:b] for a, b in pairwise(ends) if b > a]
