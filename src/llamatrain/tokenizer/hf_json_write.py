"""Writing a byte-level BPE vocabulary as a Hugging Face ``tokenizer.json``.

A model exported for transformers ships a ``tokenizer.json``; :func:`write_hf_tokenizer` writes
one that HF ``tokenizers`` encodes with as llama.cpp encodes with the vocabulary, and that
:func:`~llamatrain.tokenizer.hf_json.read_hf_tokenizer` reads back to the same ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from llamatrain.errors import TokenizerError
from llamatrain.files import write_text_atomically
from llamatrain.tokenizer.base import TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNUSED, TOKEN_TYPE_USER_DEFINED
from llamatrain.tokenizer.bpe import BpeTokenizer
from llamatrain.tokenizer.hf_json import TOKENIZER_JSON
from llamatrain.tokenizer.pretokenizers import HF_BYTE_LEVEL, HF_PRE_TOKENIZERS, HF_PUNCTUATION

__all__ = ["write_hf_tokenizer"]


def write_hf_tokenizer(tokenizer: BpeTokenizer, path: str | os.PathLike[str]) -> Path:
    """Write ``tokenizer`` as an HF ``tokenizer.json`` (atomically); returns its path.

    ``path`` is the file or a folder (then ``folder/tokenizer.json``). Control and unknown
    tokens become special added tokens, user-defined ones plain added tokens, the
    pre-tokenizer the tokenizer.json form of its regexes, and add_bos/add_eos a template
    post-processor. HF ``tokenizers`` loads the file and encodes as llama.cpp does (special
    tokens parsed). The BOS/EOS/UNK/PAD names belong in ``tokenizer_config.json``, which this
    does not write; :func:`~.hf_json.read_hf_tokenizer` needs it to give the same ids back.
    """
    if not isinstance(tokenizer, BpeTokenizer):
        raise TokenizerError(
            f"cannot write a {type(tokenizer).__name__} as tokenizer.json; llamatrain writes "
            "byte-level BPE vocabularies only"
        )
    splits = tokenizer.pre_tokenizer.hf_splits
    if splits is None:
        raise TokenizerError(
            f"the pre-tokenizer {tokenizer.pre!r} has no tokenizer.json form; llamatrain "
            f"writes those of: {', '.join(HF_PRE_TOKENIZERS)}"
        )
    target = Path(path)
    target = target / TOKENIZER_JSON if target.is_dir() else target
    text = json.dumps(_tokenizer_json(tokenizer, splits), ensure_ascii=False)
    write_text_atomically(target, text, "tokenizer.json")
    return target


def _tokenizer_json(tokenizer: BpeTokenizer, splits: tuple[str, ...]) -> dict[str, Any]:
    tokens, types = tokenizer.tokens, tokenizer.token_types
    added = [i for i, t in enumerate(types) if t != TOKEN_TYPE_NORMAL and t != TOKEN_TYPE_UNUSED]
    # Added tokens are in the model's vocabulary too: HF renumbers those that are not.
    vocab = {
        token: i
        for i, token in enumerate(tokens)
        if not (types[i] == TOKEN_TYPE_UNUSED and token == f"[PAD{i}]")
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            _added_token(tokens[i], types[i], i in tokenizer.rstrip_ids, i) for i in added
        ],
        "normalizer": None,
        "pre_tokenizer": _hf_pre_tokenizer(splits),
        "post_processor": _hf_post_processor(tokenizer),
        "decoder": {"type": "ByteLevel", **_BYTE_LEVEL_FLAGS, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,  # every byte has a token
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": tokenizer.pre_tokenizer.ignore_merges,
            "vocab": vocab,
            "merges": tokenizer.merges,
        },
    }


_BYTE_LEVEL_FLAGS = {"add_prefix_space": False, "trim_offsets": True}


def _added_token(token: str, token_type: int, rstrip: bool, i: int) -> dict[str, Any]:
    special = token_type != TOKEN_TYPE_USER_DEFINED
    return {
        "id": i,
        "content": token,
        "single_word": False,
        "lstrip": False,
        "rstrip": rstrip,
        "normalized": not special,
        "special": special,
    }


def _hf_pre_tokenizer(splits: tuple[str, ...]) -> dict[str, Any]:
    """The pre-tokenizer steps that split by ``splits`` in turn, ending with (or, where one
    of them is GPT-2's regex, holding) the ByteLevel step that maps bytes to characters."""
    steps = [_hf_step(split) for split in splits]
    if HF_BYTE_LEVEL not in splits:
        steps.append({"type": "ByteLevel", **_BYTE_LEVEL_FLAGS, "use_regex": False})
    return steps[0] if len(steps) == 1 else {"type": "Sequence", "pretokenizers": steps}


def _hf_step(split: str) -> dict[str, Any]:
    if split == HF_BYTE_LEVEL:
        return {"type": "ByteLevel", **_BYTE_LEVEL_FLAGS, "use_regex": True}
    if split in (r"\p{N}", r"\p{N}+"):
        return {"type": "Digits", "individual_digits": split == r"\p{N}"}
    if split == HF_PUNCTUATION:
        return {"type": "Punctuation", "behavior": "Contiguous"}
    return {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}


def _hf_post_processor(tokenizer: BpeTokenizer) -> dict[str, Any] | None:
    """A template that puts BOS/EOS around the text as llama.cpp's ``add_special`` does."""
    if not (tokenizer.add_bos or tokenizer.add_eos):
        return None
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    eos = [tokenizer.eos_id] if tokenizer.add_eos else []

    def special(ids: list[int], type_id: int = 0) -> list[dict[str, Any]]:
        return [{"SpecialToken": {"id": tokenizer.tokens[i], "type_id": type_id}} for i in ids]

    sequence = {"Sequence": {"id": "A", "type_id": 0}}
    second = {"Sequence": {"id": "B", "type_id": 1}}
    return {
        "type": "TemplateProcessing",
        "single": [*special(bos), sequence, *special(eos)],
        "pair": [
            *special(bos),
            sequence,
            *special(eos),
            *special(bos, 1),
            second,
            *special(eos, 1),
        ],
        "special_tokens": {
            tokenizer.tokens[i]: {
                "id": tokenizer.tokens[i],
                "ids": [i],
                "tokens": [tokenizer.tokens[i]],
            }
            for i in {*bos, *eos}
        },
    }
