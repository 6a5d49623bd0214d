"""Training a byte-level BPE vocabulary like Llama 3's, for models trained from scratch.

The vocabulary is learned by HF ``tokenizers``' BPE trainer (Rust, multi-threaded: seconds on
megabytes of text) with Llama 3's settings: its split regex, GPT-2's byte alphabet (all 256
bytes are tokens, so any text encodes without an unknown token) and two control tokens,
``<|begin_of_text|>`` and ``<|end_of_text|>``, for BOS and EOS. The result is read the way
llama.cpp's converter reads a tokenizer.json (:func:`~llamatrain.tokenizer.hf_json.
tokenizer_from_hf`): a :class:`BpeTokenizer` with pre-tokenizer ``llama-bpe`` that
``write_vocab`` stores as a ``gpt2`` GGUF vocabulary and that tokenizes exactly as llama.cpp
does with it. HF's own encoder plays no part in the ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from llamatrain.errors import TokenizerError
from llamatrain.tokenizer.bpe import BpeTokenizer
from llamatrain.tokenizer.hf_json import tokenizer_from_hf
from llamatrain.tokenizer.pretokenizers import pre_tokenizer
from llamatrain.tokenizer.training_files import check_training_files

__all__ = ["BYTE_BPE_BOS", "BYTE_BPE_EOS", "BYTE_BPE_PRE", "train_byte_bpe"]

BYTE_BPE_BOS = "<|begin_of_text|>"
BYTE_BPE_EOS = "<|end_of_text|>"
BYTE_BPE_PRE = "llama-bpe"
"""The pre-tokenizer (``tokenizer.ggml.pre``) of trained vocabularies: Llama 3's."""

_MIN_VOCAB_SIZE = 2 + 256 + 1  # BOS, EOS, the 256 bytes and room to learn one merge


def train_byte_bpe(
    files: Sequence[str | os.PathLike[str]], vocab_size: int, *, min_frequency: int = 2
) -> BpeTokenizer:
    """A Llama 3-style byte-level BPE vocabulary of at most ``vocab_size`` tokens, learned from
    text files (fewer when the text has fewer pairs seen ``min_frequency`` times).

    Ids 0 and 1 are BOS and EOS (control tokens; BOS is added to prompts, as for Llama 3); then
    the 256 byte tokens and the merges in the order learned. Training is deterministic: the same
    files give the same vocabulary.
    """
    # Imported here so that importing llamatrain does not pay for tokenizers.
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    paths = [Path(f) for f in files]
    check_training_files(paths)
    if vocab_size < _MIN_VOCAB_SIZE:
        raise TokenizerError(
            f"vocab_size {vocab_size} is too small for a byte-level BPE vocabulary: BOS, EOS and "
            f"the 256 byte tokens take 258 ids; use at least {_MIN_VOCAB_SIZE}"
        )
    (split,) = pre_tokenizer(BYTE_BPE_PRE).hf_splits or ()
    hf = Tokenizer(models.BPE(ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[BYTE_BPE_BOS, BYTE_BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train([str(p) for p in paths], trainer)
    config = {"bos_token": BYTE_BPE_BOS, "eos_token": BYTE_BPE_EOS, "add_bos_token": True}
    tokenizer = tokenizer_from_hf(json.loads(hf.to_str()), config, source="the trained vocabulary")
    assert isinstance(tokenizer, BpeTokenizer) and tokenizer.pre == BYTE_BPE_PRE
    return tokenizer
