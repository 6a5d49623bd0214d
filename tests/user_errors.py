"""Errors a user can act on, for any test module: ``from user_errors import error_of``.

A module beside the top ``conftest.py``, whose folder pytest puts on ``sys.path`` (as for
``random_models`` and ``llama_cpp_files``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llamatrain.errors import LlamatrainError


def error_of(fn: Callable[..., object], *args: object, **kwargs: object) -> str:
    """The message of the :class:`LlamatrainError` that ``fn(*args, **kwargs)`` raises; it must
    be one line, as the CLI prints it."""
    with pytest.raises(LlamatrainError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, f"a message of more than one line: {message!r}"
    return message
