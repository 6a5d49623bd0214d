"""``llamatrain info``: a short, complete description of a GGUF model, checkpoint or vocabulary.

Keys are printed under their full GGUF names (``llama.block_count: 2``) so that what ``info``
shows can be searched for in llama.cpp's sources and logs. The tokenizer's arrays, which are as
long as the vocabulary, are summarised in one line; a checkpoint's training counters and
optimizer state get sections of their own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from llamatrain.errors import shown
from llamatrain.gguf.file import TENSOR_SHA256_KEY, GGUFContents, read_gguf
from llamatrain.tokenizer import TOKEN_TYPE_NAMES

__all__ = ["describe_gguf"]

_HIDDEN_KEYS = (
    "training.config",
    "training.rng.layout",
    "optimizer.lbfgs.layout",
    "training.rng_state",
    "optimizer.lbfgs.state",
    TENSOR_SHA256_KEY,
)
"""Keys too bulky to print (the layouts of RNG and optimizer state, an old checkpoint's pickles,
checksums): not for reading; ``info --verify`` checks the checksums."""

_SECTIONS = ("general", "hyper-parameters", "training counters", "optimizer", "other keys")
_SPECIAL_TOKENS = ("bos", "eos", "unknown", "padding")
_TOKENIZER_FLAGS = ("add_bos_token", "add_eos_token", "add_space_prefix")


def describe_gguf(path: str | os.PathLike[str]) -> str:
    """A human-readable summary: architecture, hyper-parameters, tokenizer, tensors, counters.

    Only the header is read (a summary of a 7B model costs no 7B read). Every character a file
    supplies is shown printable (``llamatrain.errors.shown``): a file cannot clear the screen or
    forge lines of the report.
    """
    contents = read_gguf(path, tensor_data=False)
    meta = contents.metadata
    arch = meta.get("general.architecture")
    total = sum(contents.tensor_nbytes.values())
    lines = [
        f"{path}: {arch or 'no architecture'} {_kind(contents)}, {len(contents.tensors)} "
        f"tensors, {total:,} bytes of tensor data"
    ]
    sections = _key_sections(meta, arch)
    for title, entries in sections.items():
        if entries:
            lines += [f"{title}:", *entries]
            if title == "hyper-parameters":
                lines += _tokenizer_summary(meta)
    if not sections["hyper-parameters"]:
        lines += _tokenizer_summary(meta)
    lines += [
        f"  {key}: {_shown(value)}"
        for key, value in meta.items()
        if key.startswith("tokenizer.") and not key.startswith("tokenizer.ggml.")
    ]
    if contents.tensors:
        lines += _tensor_table(contents, total)
    return "\n".join(shown(line, None) for line in lines)


def _kind(contents: GGUFContents) -> str:
    meta = contents.metadata
    if not contents.tensors and "tokenizer.ggml.tokens" in meta:
        return "vocabulary only"
    is_checkpoint = any(k.startswith(("training.", "optimizer.")) for k in meta)
    return meta.get("general.type") or ("training checkpoint" if is_checkpoint else "model")


def _key_sections(meta: Mapping[str, Any], arch: str | None) -> dict[str, list[str]]:
    """Every printable key but the tokenizer's, under the section it belongs to."""
    sections: dict[str, list[str]] = {title: [] for title in _SECTIONS}
    for key, value in meta.items():
        if key in _HIDDEN_KEYS or key.startswith("tokenizer."):
            continue
        sections[_section_of(key, arch)].append(f"  {key}: {_shown(value)}")
    return sections


def _section_of(key: str, arch: str | None) -> str:
    if key.startswith("general."):
        return "general"
    if arch and key.startswith(f"{arch}."):
        return "hyper-parameters"
    if key.startswith("training."):
        return "training counters"
    if key.startswith("optimizer."):
        return "optimizer"
    return "other keys"


def _shown(value: object, width: int = 100) -> str:
    """A list by its length, anything else as text cut to one line's width."""
    if isinstance(value, list):
        return f"[{len(value)} entries]"
    text = str(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _tokenizer_summary(meta: Mapping[str, Any]) -> list[str]:
    """One line for the vocabulary (size, token kinds, special ids) instead of 3 long arrays."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if "tokenizer.ggml.model" not in meta and tokens is None:
        return ["tokenizer: none (this file cannot be run on its own)"]
    parts = [f"model {meta.get('tokenizer.ggml.model', '?')!r}"]
    if isinstance(tokens, list):
        detail = ", ".join(f"{n} {kind}" for kind, n in _token_kinds(meta).items())
        parts.append(f"{len(tokens)} tokens" + (f" ({detail})" if detail else ""))
    for special in _SPECIAL_TOKENS:
        token_id = meta.get(f"tokenizer.ggml.{special}_token_id")
        if isinstance(token_id, int):
            known = isinstance(tokens, list) and 0 <= token_id < len(tokens)
            text = tokens[token_id] if known else "?"
            parts.append(f"{special} {token_id} {text!r}")
    flags = [
        f"{flag} {str(meta[f'tokenizer.ggml.{flag}']).lower()}"
        for flag in _TOKENIZER_FLAGS
        if f"tokenizer.ggml.{flag}" in meta
    ]
    lines = ["tokenizer: " + "; ".join(parts)]
    if flags:
        lines.append("  " + ", ".join(flags))
    return lines


def _token_kinds(meta: Mapping[str, Any]) -> dict[str, int]:
    """How many tokens of each type ``tokenizer.ggml.token_type`` lists (by name when known);
    a key of another shape than a list of integers counts nothing: a summary describes any
    file, the readers refuse it."""
    token_types = meta.get("tokenizer.ggml.token_type")
    kinds: dict[str, int] = {}
    for token_type in token_types if isinstance(token_types, list) else []:
        known = type(token_type) is int and token_type in TOKEN_TYPE_NAMES
        name = TOKEN_TYPE_NAMES[token_type] if known else str(token_type)
        kinds[name] = kinds.get(name, 0) + 1
    return kinds


def _tensor_table(contents: GGUFContents, total: int) -> list[str]:
    """Name, shape, stored type and stored bytes of every tensor, and the total."""
    width = max(len(name) for name in contents.tensors)
    lines = [
        f"tensors ({len(contents.tensors)}):",
        f"  {'name':<{width}} {'shape':>14} {'type':>6} {'bytes':>12}",
    ]
    for name, tensor in contents.tensors.items():
        shape = "x".join(str(d) for d in tensor.shape)
        kind, nbytes = contents.tensor_types[name], contents.tensor_nbytes[name]
        lines.append(f"  {name:<{width}} {shape:>14} {kind:>6} {nbytes:>12,}")
    lines.append(f"  {'total':<{width}} {'':>14} {'':>6} {total:>12,}")
    return lines
