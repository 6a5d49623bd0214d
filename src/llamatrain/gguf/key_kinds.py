"""The kind of value each GGUF key llamatrain reads must hold, checked before any is believed.

Why a table of its own: a file edited with gguf's metadata scripts, or crafted, can hold a count
as a string, token ids as floats or merges as numbers; every reader downstream assumes the kind
llama.cpp reads each key as, so one check up front keeps a wrong kind from becoming a traceback
deep inside the vocabulary or config code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llamatrain.errors import GGUFError, shown

__all__ = ["CONFIG_KEY", "check_key_kinds"]

CONFIG_KEY = "llamatrain.model_config"
"""Our exact ModelConfig as JSON, so our files reload into the same config (llama.cpp ignores
unknown keys); a foreign file's config is rebuilt from the ``<arch>.*`` keys alone."""

_KEY_KINDS = {
    "string": lambda v: isinstance(v, str),
    "bool": lambda v: isinstance(v, bool),
    "integer": lambda v: type(v) is int,
    "number": lambda v: type(v) in (int, float),
    "array of strings": lambda v: isinstance(v, list) and all(isinstance(i, str) for i in v),
    "array of integers": lambda v: isinstance(v, list) and all(type(i) is int for i in v),
    "array of numbers": lambda v: isinstance(v, list) and all(type(i) in (int, float) for i in v),
}
"""What a key's value may be (the readers go on to check its range): the GGUF types llama.cpp
reads each as, a BOOL never counting as a number (Python's bool is an int)."""
_HYPER_PARAMETER_KINDS = {
    **dict.fromkeys(
        ("context_length", "embedding_length", "block_count", "feed_forward_length",
         "attention.head_count", "attention.head_count_kv", "attention.key_length",
         "attention.value_length", "rope.dimension_count", "vocab_size",
         "attention.sliding_window", "expert_count"),
        "integer",
    ),
    **dict.fromkeys(
        ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.freq_base_swa",
         "rope.scaling.factor", "rope.scale_linear", "final_logit_softcapping"),
        "number",
    ),
    "rope.scaling.type": "string",
}  # fmt: skip
"""The ``<arch>.*`` keys llamatrain reads, by the kind of value each must hold."""
_KEY_KINDS_BY_NAME = {
    "general.architecture": "string",
    "general.name": "string",
    "tokenizer.chat_template": "string",
    CONFIG_KEY: "string",
    "tokenizer.ggml.model": "string",
    "tokenizer.ggml.pre": "string",
    "tokenizer.ggml.tokens": "array of strings",
    "tokenizer.ggml.merges": "array of strings",
    "tokenizer.ggml.scores": "array of numbers",
    "tokenizer.ggml.token_type": "array of integers",
    **{
        f"tokenizer.ggml.{name}_token_id": "integer"
        for name in ("bos", "eos", "unknown", "padding", "eot")
    },
    **{
        f"tokenizer.ggml.{flag}": "bool"
        for flag in ("add_bos_token", "add_eos_token", "add_space_prefix")
    },
}
"""The other keys llamatrain reads from a llama GGUF (its vocabulary's included)."""


def check_key_kinds(meta: Mapping[str, Any], p: Path | str) -> None:
    """Refuse, in one line naming the key, a key llamatrain reads whose value is of another
    kind than llama.cpp reads it as (a count stored as a string, token ids as floats, merges
    holding numbers...): a file edited or crafted that way is believed nowhere downstream."""
    arch = meta.get("general.architecture")
    prefix = f"{arch}." if isinstance(arch, str) else None
    for key, value in meta.items():
        if prefix is not None and key.startswith(prefix):
            kind = _HYPER_PARAMETER_KINDS.get(key.removeprefix(prefix))
        else:
            kind = _KEY_KINDS_BY_NAME.get(key)
        if kind is not None and not _KEY_KINDS[kind](value):
            raise GGUFError(
                f"{p}: key {shown(key)} must hold {'an' if kind[0] in 'ai' else 'a'} {kind}, "
                f"not {_kind_of(value)}; the file was edited or damaged — re-export it"
            )


def _kind_of(value: object) -> str:
    """A value as a message names its kind: ``a string``, ``an array of 3 items``..."""
    if isinstance(value, list):
        return f"an array of {len(value)} items"
    return {bool: "a bool", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), type(value).__name__
    )
