"""SPM vocabularies from sentencepiece models (``tokenizer.model`` files and their bytes).

Only the vocabulary is taken from the model: pieces, scores, types, special ids and whether a
space is prepended. The model's normalizer is not applied, because llama.cpp applies none;
a model that normalizes therefore gets a warning, since its ids will differ from
sentencepiece's own on text that normalization would change.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from llamatrain.errors import LlamatrainWarning, TokenizerError
from llamatrain.tokenizer.sentencepiece_proto import (
    MODEL_TYPE_BPE,
    MODEL_TYPE_UNIGRAM,
    SentencePieceModel,
    read_model_proto,
)
from llamatrain.tokenizer.spm import SpmTokenizer

__all__ = ["MAX_MODEL_BYTES", "load_sentencepiece", "spm_from_model_proto"]

MAX_MODEL_BYTES = 64 << 20
"""Largest sentencepiece model read (Gemma 3's 256k-piece model is 4.5 MB): decoding holds
a few objects per byte, so a larger file is refused before it is read."""


def load_sentencepiece(path: str | os.PathLike[str]) -> SpmTokenizer:
    """Load a sentencepiece ``tokenizer.model`` file.

    GGUF files are refused with a pointer to the loader that reads them: the mapping between
    GGUF keys and a vocabulary belongs to the GGUF layer, not to the tokenizer.
    """
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"Tokenizer file {str(p)!r} does not exist.")
    size = p.stat().st_size
    if size > MAX_MODEL_BYTES:
        raise TokenizerError(
            f"{str(p)!r} is {size:,} bytes, more than the {MAX_MODEL_BYTES:,} of any "
            "sentencepiece model llamatrain reads; it is not a tokenizer.model — pass the "
            "model's tokenizer.model or a GGUF"
        )
    data = p.read_bytes()
    if data[:4] == b"GGUF":
        raise TokenizerError(
            f"{str(p)!r} is a GGUF file, not a sentencepiece model; use "
            "llamatrain.load_tokenizer (or tokenizer.path in a config), which reads GGUF "
            "vocabularies."
        )
    try:
        return spm_from_model_proto(data)
    except TokenizerError as e:
        raise TokenizerError(f"{str(p)!r}: {e}") from e


def spm_from_model_proto(data: bytes) -> SpmTokenizer:
    """Build from the bytes of a sentencepiece ``tokenizer.model``.

    BPE and unigram models are accepted. llama.cpp encodes a unigram vocabulary with the same
    greedy merges by score as a BPE one (not with sentencepiece's Viterbi search), and so does
    the tokenizer returned here.
    """
    try:
        model = read_model_proto(data)
    except ValueError as e:
        raise TokenizerError(
            f"Not a sentencepiece model ({e}); pass a tokenizer.model file or a GGUF."
        ) from e
    if not model.pieces:
        raise TokenizerError("The sentencepiece model has no pieces; it is not a tokenizer.")
    if _normalizes(model):
        warnings.warn(
            f"This sentencepiece model normalizes text ({model.normalizer_name}, "
            f"remove_extra_whitespaces={model.remove_extra_whitespaces}); llama.cpp applies "
            "no normalization, so llamatrain tokenizes un-normalized text as llama.cpp "
            "will, which differs from sentencepiece's own ids on such text.",
            LlamatrainWarning,  # it quotes the file's normalizer name: escaped
            stacklevel=2,
        )
    if model.model_type not in (MODEL_TYPE_UNIGRAM, MODEL_TYPE_BPE):
        raise TokenizerError(
            "Only sentencepiece BPE and unigram models can be used as llama vocabularies; "
            "retrain with model_type='bpe'."
        )
    n = len(model.pieces)
    unk, bos, eos = (_id_or_none(i, n) for i in (model.unk_id, model.bos_id, model.eos_id))
    if unk is None or bos is None or eos is None:
        raise TokenizerError(
            "The sentencepiece model lacks <unk>, <s> or </s>; llama needs all three — "
            "retrain with unk_id=0, bos_id=1, eos_id=2."
        )
    return SpmTokenizer(
        model.pieces,
        model.scores,
        model.types,
        bos_id=bos,
        eos_id=eos,
        unk_id=unk,
        pad_id=_id_or_none(model.pad_id, n),
        add_space_prefix=model.add_dummy_prefix,
    )


def _normalizes(model: SentencePieceModel) -> bool:
    """True when sentencepiece would change the text before encoding it."""
    return (
        model.normalizer_name != "identity" or model.has_charsmap or model.remove_extra_whitespaces
    )


def _id_or_none(token_id: int, vocab_size: int) -> int | None:
    """The id if it is in the vocabulary; sentencepiece marks an absent special id with -1."""
    return token_id if 0 <= token_id < vocab_size else None
