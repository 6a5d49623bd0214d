"""Training a llama SPM vocabulary with sentencepiece.

BPE is the default because sentencepiece's BPE segmentation is the greedy merge by score that
llama.cpp applies. A *unigram* model is encoded by Viterbi in sentencepiece, which llama.cpp
does not do. Its pieces still work — llama.cpp merges them greedily by score, and
:class:`~llamatrain.tokenizer.SpmTokenizer` tokenizes them the way llama.cpp will — but the
segmentation is not the one unigram training optimised, so ``model_type="unigram"`` warns.
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llamatrain.errors import TokenizerError
from llamatrain.tokenizer.sentencepiece_load import spm_from_model_proto
from llamatrain.tokenizer.spm import SpmTokenizer
from llamatrain.tokenizer.training_files import check_training_files

__all__ = ["train_spm"]

_MIN_VOCAB_SIZE = 3 + 256 + 1  # <unk> <s> </s>, 256 byte pieces, and room to learn one piece


def train_spm(
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
) -> SpmTokenizer:
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
    # Imported here so that importing llamatrain does not pay for sentencepiece.
    import sentencepiece as spm

    _check_model_type(model_type)
    paths = [Path(f) for f in files]
    check_training_files(paths)
    if vocab_size < _MIN_VOCAB_SIZE:
        raise TokenizerError(
            f"vocab_size {vocab_size} is too small: 3 special + 256 byte pieces take 259 "
            f"ids; use at least {_MIN_VOCAB_SIZE} (a few hundred or more is sensible)."
        )
    writer = io.BytesIO()
    settings: dict[str, Any] = dict(
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
        user_defined_symbols=",".join(user_defined_symbols),
        minloglevel=2,  # sentencepiece logs every piece to stderr otherwise
    )
    spm.set_random_generator_seed(seed)
    try:
        with open(os.devnull, "w") as devnull:
            spm.SentencePieceTrainer.train(logstream=_quiet_stream(devnull), **settings)
    except RuntimeError as e:
        raise _training_error(str(e).strip(), vocab_size) from e
    return spm_from_model_proto(writer.getvalue())


def _check_model_type(model_type: str) -> None:
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
            stacklevel=3,  # the train_spm call
        )


def _training_error(message: str, vocab_size: int) -> TokenizerError:
    """sentencepiece's RuntimeError as a TokenizerError that says what to change."""
    if "required_chars" in message:
        return TokenizerError(
            f"vocab_size={vocab_size} cannot hold the 259 special/byte pieces plus the "
            f"text's distinct characters (sentencepiece: {message}); raise vocab_size or "
            "lower character_coverage."
        )
    if "Vocabulary size" in message or "vocab_size" in message:
        return TokenizerError(
            f"The training text is too small for vocab_size={vocab_size} "
            f"(sentencepiece: {message}); lower vocab_size or add more text."
        )
    return TokenizerError(f"sentencepiece could not train the tokenizer: {message}")


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
