"""The Unicode category of a code point as llama.cpp's pre-tokenizers see it.

llama.cpp does not ask the C library: it carries its own table (``unicode-data.cpp``, generated
from Unicode 15.1). Python 3.11's :mod:`unicodedata` is Unicode 14.0, so the code points
assigned in 15.0 and 15.1 (the Kawi and Nag Mundari scripts, CJK extensions H and I, Kaktovik
numerals, a few emoji such as U+1FAE8) are unassigned, category "other", here but letters,
numbers, marks or symbols there; a word boundary then moves and the ids differ. Those ranges
are listed below with llama.cpp's categories and take precedence over :mod:`unicodedata`
(with which they agree from Python 3.13 on). Code points that a Unicode version after 15.1
assigns (Python 3.14: Unicode 16) are still unassigned to llama.cpp 0.3.36 but not to Python,
so text using them can split differently there.
"""

from __future__ import annotations

import bisect
import unicodedata

__all__ = ["UNICODE_15_ADDITIONS", "category"]

UNICODE_15_ADDITIONS: tuple[tuple[int, int, str], ...] = (
    (0x00CF3, 0x00CF3, "M"), (0x00ECE, 0x00ECE, "M"), (0x02FFC, 0x02FFF, "S"),
    (0x031EF, 0x031EF, "S"), (0x10EFD, 0x10EFF, "M"), (0x1123F, 0x11240, "L"),
    (0x11241, 0x11241, "M"), (0x11B00, 0x11B09, "P"), (0x11F00, 0x11F01, "M"),
    (0x11F02, 0x11F02, "L"), (0x11F03, 0x11F03, "M"), (0x11F04, 0x11F10, "L"),
    (0x11F12, 0x11F33, "L"), (0x11F34, 0x11F3A, "M"), (0x11F3E, 0x11F42, "M"),
    (0x11F43, 0x11F4F, "P"), (0x11F50, 0x11F59, "N"), (0x1342F, 0x1342F, "L"),
    (0x13440, 0x13440, "M"), (0x13441, 0x13446, "L"), (0x13447, 0x13455, "M"),
    (0x1B132, 0x1B132, "L"), (0x1B155, 0x1B155, "L"), (0x1D2C0, 0x1D2D3, "N"),
    (0x1DF25, 0x1DF2A, "L"), (0x1E030, 0x1E06D, "L"), (0x1E08F, 0x1E08F, "M"),
    (0x1E4D0, 0x1E4EB, "L"), (0x1E4EC, 0x1E4EF, "M"), (0x1E4F0, 0x1E4F9, "N"),
    (0x1F6DC, 0x1F6DC, "S"), (0x1F774, 0x1F776, "S"), (0x1F77B, 0x1F77F, "S"),
    (0x1F7D9, 0x1F7D9, "S"), (0x1FA75, 0x1FA77, "S"), (0x1FA87, 0x1FA88, "S"),
    (0x1FAAD, 0x1FAAF, "S"), (0x1FABB, 0x1FABD, "S"), (0x1FABF, 0x1FABF, "S"),
    (0x1FACE, 0x1FACF, "S"), (0x1FADA, 0x1FADB, "S"), (0x1FAE8, 0x1FAE8, "S"),
    (0x1FAF7, 0x1FAF8, "S"), (0x2B739, 0x2B739, "L"), (0x2EBF0, 0x2EE5D, "L"),
    (0x31350, 0x323AF, "L"),
)  # fmt: skip
"""(first, last, category) of the code points llama.cpp's table assigns and Unicode 14.0 does
not: every difference between the two for code points from U+0080 on."""

_STARTS = [first for first, _, _ in UNICODE_15_ADDITIONS]


def category(cpt: int) -> str:
    """The major category llama.cpp gives ``cpt``: ``L N P M S`` (letter, number, punctuation,
    mark, symbol) or ``O`` for everything else (separators, controls, unassigned)."""
    i = bisect.bisect_right(_STARTS, cpt) - 1
    if i >= 0 and cpt <= UNICODE_15_ADDITIONS[i][1]:
        return UNICODE_15_ADDITIONS[i][2]
    major = unicodedata.category(chr(cpt))[0]
    return major if major in "LNPMS" else "O"
