"""A finite number out of a value nobody vouches for (a JSON log line, a setting a user wrote,
what user code returned): one rule for every reader, so a bool, a string, an int past float's
range or an infinity is "no number" everywhere alike."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

__all__ = ["finite_number"]


def finite_number(value: Any) -> float | None:
    """``value`` as a finite float when it is a real number other than a bool, else None
    (converted here, so 10**400, a huge Fraction or one whose ``__float__`` raises is None)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    try:
        number = float(value)
    except Exception:
        return None
    return number if math.isfinite(number) else None
