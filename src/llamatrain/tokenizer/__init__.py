"""Tokenizers whose ids are exactly the ones llama.cpp gives the exported model.

:class:`Tokenizer` is what the rest of llamatrain relies on; :class:`SpmTokenizer` is the
llama (SentencePiece) vocabulary, trained with :func:`train_spm` or loaded from a
sentencepiece model with :func:`load_sentencepiece` / :func:`spm_from_model_proto`;
:class:`BpeTokenizer` is a byte-level BPE vocabulary (GGUF model ``gpt2``) with one of the
pre-tokenizers in :data:`PRE_TOKENIZERS`. GGUF vocabularies are read by the GGUF layer, which
builds either from them.
"""

from llamatrain.errors import TokenizerError
from llamatrain.tokenizer.base import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NAMES,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
    Tokenizer,
)
from llamatrain.tokenizer.bpe import BpeTokenizer
from llamatrain.tokenizer.pretokenizers import PRE_TOKENIZERS
from llamatrain.tokenizer.sentencepiece_load import load_sentencepiece, spm_from_model_proto
from llamatrain.tokenizer.sentencepiece_train import train_spm
from llamatrain.tokenizer.spm import SPACE, SpmTokenizer

__all__ = [
    "PRE_TOKENIZERS",
    "SPACE",
    "TOKEN_TYPE_BYTE",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_NAMES",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_USER_DEFINED",
    "BpeTokenizer",
    "SpmTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_sentencepiece",
    "spm_from_model_proto",
    "train_spm",
]
