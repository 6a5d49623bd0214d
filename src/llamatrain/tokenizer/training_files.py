"""The text files a tokenizer is trained on, checked before a trainer sees them.

Both trainers (sentencepiece's and HF ``tokenizers``') fail on a missing or empty file with an
error that names neither, or not at all; checking first gives one line that does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from llamatrain.errors import TokenizerError

__all__ = ["check_training_files"]


def check_training_files(paths: Sequence[Path]) -> None:
    """Raise TokenizerError unless there is at least one file and every one exists, non-empty."""
    if not paths:
        raise TokenizerError("No training files given; pass at least one text file.")
    for p in paths:
        if not p.is_file():
            raise TokenizerError(f"Tokenizer training file {str(p)!r} does not exist.")
        if p.stat().st_size == 0:
            raise TokenizerError(f"Tokenizer training file {str(p)!r} is empty.")
