"""Checks of what a Hugging Face tokenizer's JSON files say, before anything is built of them.

``tokenizer.json``, ``tokenizer_config.json`` and ``config.json`` come from anywhere (a Hub
download, a hand-edited folder, a crafted file), and the reader (``hf_json``) indexes lists
by their ids and sizes its vocabulary by their claims. :func:`check_files` checks every value
the reader uses first: its JSON type, its text being UTF-8, ids not negative, and a
vocabulary the files can define, so a damaged or crafted file is one
:class:`~llamatrain.errors.TokenizerError` naming the field, never a traceback or an
allocation of what it claims.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llamatrain.errors import TokenizerError

__all__ = ["SPECIAL_TYPES", "UNUSED_ID_SLACK", "check_files"]

UNUSED_ID_SLACK = 65_536
"""How far a vocabulary may outgrow the tokens the files define (ids nobody uses become
``[PAD<id>]`` tokens, as config.json's vocab_size pads the embedding to a round number):
2x the tokens defined, plus this. Real models pad by a few thousand at most; a claim of 10^8
ids in a small file is refused before anything is allocated."""
SPECIAL_TYPES = ("bos", "eos", "unk", "pad")
"""The special tokens tokenizer_config.json and config.json may name."""

_KIND_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer"}


def _shown(value: Any) -> str:
    """A value for an error message: short, on one line."""
    text = json.dumps(value, ensure_ascii=True, default=str) if value is not ... else "absent"
    return text if len(text) <= 40 else text[:37] + "..."


def _typed(value: Any, kind: type, field: str, source: str) -> Any:
    """``value`` when it is a JSON ``kind`` (an integer is never a bool), else a TokenizerError
    naming ``field``."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TokenizerError(
            f"{source}: {field} must be {_KIND_NAMES[kind]}, got {_shown(value)}; the file is "
            "damaged or not a tokenizer file — re-download it"
        )
    return value


def _optional(container: Mapping[str, Any], key: str, kind: type, field: str, source: str) -> Any:
    """``container[key]`` checked to be a ``kind``, or None when absent or null."""
    value = container.get(key)
    return None if value is None else _typed(value, kind, field, source)


def _text(value: Any, field: str, source: str) -> str:
    """A string that is UTF-8 text (JSON can spell a lone surrogate, which no file can hold)."""
    _typed(value, str, field, source)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise TokenizerError(
            f"{source}: {field} {_shown(value)} holds a lone surrogate, which is not text; the "
            "file is damaged — re-download it"
        ) from None
    return value


def _token_id(value: Any, field: str, source: str) -> int:
    _typed(value, int, field, source)
    if value < 0:
        raise TokenizerError(f"{source}: {field} is {value}, a negative token id; re-download it")
    return value


def check_files(
    doc: Mapping[str, Any],
    config: Mapping[str, Any],
    model_config: Mapping[str, Any],
    source: str,
) -> None:
    """Every value the reader uses has the JSON type it must have, every id is in range, and the
    vocabulary the files claim is one they can define: checked before anything is built, so a
    damaged or crafted file is one line naming the field, never a traceback or an allocation
    of what it claims."""
    _typed(doc, dict, "the file", source)
    _typed(config, dict, "tokenizer_config.json", source)
    _typed(model_config, dict, "config.json", source)
    model = _typed(doc.get("model") or {}, dict, "model", source)
    vocab = _optional(model, "vocab", dict, "model.vocab", source) or {}
    largest = -1
    for token, i in vocab.items():
        _text(token, "a model.vocab token", source)
        largest = max(largest, _token_id(i, f"model.vocab[{_shown(token)}]", source))
    for n, merge in enumerate(_optional(model, "merges", list, "model.merges", source) or []):
        parts = merge if isinstance(merge, list) else [merge]
        for part in parts:
            _text(part, f"model.merges[{n}]", source)
    _optional(model, "unk_token", str, "model.unk_token", source)
    added = _optional(doc, "added_tokens", list, "added_tokens", source) or []
    for n, token in enumerate(added):
        _typed(token, dict, f"added_tokens[{n}]", source)
        largest = max(largest, _token_id(token.get("id", ...), f"added_tokens[{n}].id", source))
        _text(token.get("content", ...), f"added_tokens[{n}].content", source)
    for key in ("normalizer", "pre_tokenizer", "post_processor"):
        _check_component(doc, key, source)
    for typ in SPECIAL_TYPES:
        entry = config.get(f"{typ}_token")
        if isinstance(entry, dict):
            entry = entry.get("content")
        if entry is not None:
            _text(entry, f"tokenizer_config.json {typ}_token", source)
        special_id = model_config.get(f"{typ}_token_id")
        if isinstance(special_id, int) and not isinstance(special_id, bool):
            _token_id(special_id, f"config.json {typ}_token_id", source)
    claimed = _optional(model_config, "vocab_size", int, "config.json vocab_size", source) or 0
    defined = len(vocab) + len(added)
    most = 2 * defined + UNUSED_ID_SLACK
    for field, value in (("config.json vocab_size", claimed), ("the largest token id", largest)):
        if value >= most:
            raise TokenizerError(
                f"{source}: {field} is {value:,}, but the files define only {defined:,} tokens; "
                f"a vocabulary of more than {most - 1:,} ids cannot be built from them — the "
                "files are damaged or do not belong together"
            )


def _check_component(doc: Mapping[str, Any], key: str, source: str) -> None:
    """A normalizer / pre-tokenizer / post-processor: an object whose parts (a Sequence's
    list, a template's items) are objects, with the nested objects the reader looks into."""
    component = _optional(doc, key, dict, key, source)
    if component is None:
        return
    parts_key = {"normalizer": "normalizers", "pre_tokenizer": "pretokenizers"}.get(
        key, "processors"
    )
    parts = _optional(component, parts_key, list, f"{key}.{parts_key}", source)
    for n, part in enumerate([component] if parts is None else parts):
        field = key if parts is None else f"{key}.{parts_key}[{n}]"
        _typed(part, dict, field, source)
        pattern = _optional(part, "pattern", dict, f"{field}.pattern", source) or {}
        for name in ("Regex", "String"):
            if name in pattern:
                _text(pattern[name], f"{field}.pattern.{name}", source)
        for name in ("content", "prepend", "replacement"):
            if part.get(name) is not None:
                _text(part[name], f"{field}.{name}", source)
        for n_item, item in enumerate(_optional(part, "single", list, f"{field}.single", source)
                                      or []):  # fmt: skip
            _typed(item, dict, f"{field}.single[{n_item}]", source)
            special = _optional(item, "SpecialToken", dict, f"{field}.single[{n_item}]", source)
            if special is not None and special.get("id") is not None:
                _text(special["id"], f"{field}.single[{n_item}].SpecialToken.id", source)
