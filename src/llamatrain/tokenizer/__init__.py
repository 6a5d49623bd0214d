"""Tokenizers whose ids are exactly the ones llama.cpp gives the exported model.

:class:`Tokenizer` is what the rest of llamatrain relies on; :class:`SpmTokenizer` is the
llama (SentencePiece) vocabulary, trained with :func:`train_spm` or loaded from a
sentencepiece model with :func:`load_sentencepiece` / :func:`spm_from_model_proto`;
:class:`BpeTokenizer` is a byte-level BPE vocabulary (GGUF model ``gpt2``) with one of the
pre-tokenizers in :data:`PRE_TOKENIZERS`, trained Llama 3-style with :func:`train_byte_bpe`.
GGUF vocabularies are read by the GGUF layer, which builds either from them; a Hugging Face
``tokenizer.json`` is read by :func:`read_hf_tokenizer` (the vocabulary llama.cpp's converter
would make of it) and written by :func:`write_hf_tokenizer`.
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
from llamatrain.tokenizer.bpe_train import train_byte_bpe
from llamatrain.tokenizer.hf_json import read_hf_tokenizer
from llamatrain.tokenizer.hf_json_write import write_hf_tokenizer
from llamatrain.tokenizer.pretokenizers import PRE_TOKENIZERS
from llamatrain.tokenizer.sentencepiece_load import load_sentencepiece, spm_from_model_proto
from llamatrain.tokenizer.sentencepiece_train import train_spm
from llamatrain.tokenizer.special import rstrip_ids
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
    "read_hf_tokenizer",
    "rstrip_ids",
    "spm_from_model_proto",
    "train_byte_bpe",
    "train_spm",
    "write_hf_tokenizer",
]
