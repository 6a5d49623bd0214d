"""Tokenizers from Hugging Face ``tokenizer.json`` files, read the way llama.cpp converts them.

A model from the Hugging Face Hub describes its tokenizer in ``tokenizer.json`` (the HF
``tokenizers`` format), with its special tokens in ``tokenizer_config.json`` and its vocabulary
size in ``config.json``. llama.cpp never reads those files: its ``convert_hf_to_gguf.py`` turns
them into ``tokenizer.ggml.*`` keys, and llama.cpp tokenizes by the keys. So
:func:`read_hf_tokenizer` builds the vocabulary those keys describe, by the converter's rules:
ids are the ones llama.cpp gives the converted model. No HF library is needed.

* Byte-level BPE (``model.type == "BPE"`` with a ByteLevel pre-tokenizer: Llama 3, SmolLM,
  Qwen2, DeepSeek, GPT-2, Falcon, StarCoder...) becomes a :class:`BpeTokenizer`. Its
  ``tokenizer.ggml.pre`` name is recognised from the regexes the pre-tokenizer applies (the
  converter recognises it by hashing the ids of a test text, which needs the HF libraries).
* SentencePiece-style BPE (``byte_fallback`` with ``▁`` for spaces: Llama 2, TinyLlama,
  Mistral) becomes an :class:`SpmTokenizer` whose scores follow the merge order, so that
  llama.cpp's merge-by-score gives the merges in HF's order.

What llama.cpp ignores is ignored here too: the normalizer (Qwen2's NFC, say), ByteLevel's
``add_prefix_space``, and the per-token ``lstrip``/``rstrip`` flags (llama.cpp gives those by
model name; see :func:`~llamatrain.tokenizer.special.rstrip_ids`).

Every value the files give is checked before anything is built (``hf_json_checks``);
:func:`~llamatrain.tokenizer.hf_json_write.write_hf_tokenizer` goes the other way.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llamatrain.errors import TokenizerError, shown
from llamatrain.tokenizer.base import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
    Tokenizer,
)
from llamatrain.tokenizer.bpe import BYTE_TO_CHAR, BpeTokenizer
from llamatrain.tokenizer.hf_json_checks import SPECIAL_TYPES, check_files
from llamatrain.tokenizer.pretokenizers import (
    HF_BYTE_LEVEL,
    HF_PRE_TOKENIZERS,
    HF_PUNCTUATION,
    pre_tokenizer_for_hf,
)
from llamatrain.tokenizer.spm import SPACE, SpmTokenizer

__all__ = ["TOKENIZER_JSON", "read_hf_tokenizer", "tokenizer_from_hf"]

TOKENIZER_JSON = "tokenizer.json"
MAX_JSON_BYTES = 128 << 20
"""Largest tokenizer.json / tokenizer_config.json / config.json read (4x Gemma 3's 33 MB
tokenizer.json, the largest of the common models): parsing costs ~10x the file in memory, so a
larger file is refused before it is read."""
_BPE_DEFAULT_SPECIAL = 11  # llama.cpp's BOS/EOS id for a gpt2 vocabulary whose file names none
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def read_hf_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer llama.cpp will use for a Hugging Face model, from its ``tokenizer.json``.

    ``path`` is the ``tokenizer.json`` file or the model folder holding it. Files beside it are
    read when present, as llama.cpp's ``convert_hf_to_gguf.py`` reads them:
    ``tokenizer_config.json`` for the BOS/EOS/UNK/PAD tokens and ``add_bos_token`` /
    ``add_eos_token`` (else the post-processor's template decides), and ``config.json`` for
    ``vocab_size`` (ids the files leave unused become ``[PAD<id>]`` tokens) and special ids the
    tokenizer config does not name. Returns a :class:`BpeTokenizer` for byte-level BPE, an
    :class:`SpmTokenizer` for SentencePiece-style BPE; anything else (WordPiece, Unigram, an
    unrecognised pre-tokenizer) raises a one-line :class:`TokenizerError` saying what is
    supported. Writing the result with ``write_vocab``/``write_model`` gives the
    ``tokenizer.ggml.*`` keys the converter would write.
    """
    file = _tokenizer_json_path(Path(path))
    return tokenizer_from_hf(
        _read_json(file),
        _read_optional_json(file.with_name("tokenizer_config.json")),
        _read_optional_json(file.with_name("config.json")),
        source=str(file),
    )


def tokenizer_from_hf(
    doc: Mapping[str, Any],
    config: Mapping[str, Any] | None = None,
    model_config: Mapping[str, Any] | None = None,
    source: str = TOKENIZER_JSON,
) -> Tokenizer:
    """:func:`read_hf_tokenizer` from the files' parsed contents (``doc``: tokenizer.json,
    ``config``: tokenizer_config.json, ``model_config``: config.json); ``source`` names them
    in errors."""
    config, model_config = config or {}, model_config or {}
    check_files(doc, config, model_config, source)
    model = doc.get("model") or {}
    if model.get("type") != "BPE":
        raise TokenizerError(
            f"{source}: a {model.get('type')!r} tokenizer; llamatrain reads byte-level BPE and "
            "SentencePiece-style BPE tokenizer.json files (convert others to GGUF with llama.cpp)"
        )
    splits = _pre_tokenizer_splits(doc.get("pre_tokenizer"))
    if splits is not None:
        return _byte_level_bpe(doc, config, model_config, splits, source)
    if model.get("byte_fallback") and _space_marker(doc) is not None:
        return _sentencepiece_bpe(doc, config, model_config, source)
    raise TokenizerError(
        f"{source}: a BPE tokenizer that is neither byte-level (no ByteLevel pre-tokenizer) nor "
        "SentencePiece-style (byte_fallback with '▁' for spaces); llamatrain reads only those"
    )


# ----------------------------------------------------------------------------- the files


def _tokenizer_json_path(path: Path) -> Path:
    file = path / TOKENIZER_JSON if path.is_dir() else path
    if not file.is_file():
        where = f"{path} has no {TOKENIZER_JSON}" if path.is_dir() else f"{path} does not exist"
        raise TokenizerError(f"{where}; pass a tokenizer.json or the model folder holding one")
    return file


def _read_json(file: Path) -> dict[str, Any]:
    """A JSON object from ``file``; anything else (too large, not UTF-8, not JSON, nested past
    Python's recursion limit, a number past its 4300 digits) is one TokenizerError."""
    try:
        size = file.stat().st_size
        if size > MAX_JSON_BYTES:
            raise TokenizerError(
                f"{file} is {size:,} bytes, more than the {MAX_JSON_BYTES:,} llamatrain reads "
                "from a tokenizer's JSON file; it is not a tokenizer file — re-download it"
            )
        doc = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{file} is not a readable JSON file ({e}); re-download it") from e
    except RecursionError:
        raise TokenizerError(
            f"{file} nests lists or objects too deeply to read; it is not a tokenizer file — "
            "re-download it"
        ) from None
    except ValueError as e:  # an integer past Python's limit on digits
        raise TokenizerError(
            f"{file} holds a number of more than {sys.get_int_max_str_digits()} digits; it is "
            "not a tokenizer file — re-download it"
        ) from e
    if not isinstance(doc, dict):
        raise TokenizerError(f"{file} holds no JSON object; re-download it")
    return doc


def _read_optional_json(file: Path) -> dict[str, Any]:
    return _read_json(file) if file.is_file() else {}


# ------------------------------------------------------------------------ the vocabulary


def _vocab_size(doc: Mapping[str, Any], model_config: Mapping[str, Any]) -> int:
    """``config.json``'s ``vocab_size`` (the embedding's rows), else one past the largest id."""
    ids = [*doc["model"].get("vocab", {}).values(), *(t["id"] for t in _added(doc))]
    largest = max(ids, default=-1) + 1
    return max(int(model_config.get("vocab_size") or 0), largest)


def _added(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(doc.get("added_tokens") or [])


def _looks_special(token: str) -> bool:
    """Added tokens the converter makes control tokens although not marked special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _byte_level_tokens(doc: Mapping[str, Any], n: int) -> tuple[list[str], list[int]]:
    """Tokens and types as ``get_vocab_base`` writes them: added tokens are control tokens when
    special (or special-looking), else user-defined; ids nobody uses are ``[PAD<id>]``."""
    tokens: list[str | None] = [None] * n
    types = [TOKEN_TYPE_NORMAL] * n
    for token, i in doc["model"].get("vocab", {}).items():
        tokens[i] = token
    for added in _added(doc):
        i, text = added["id"], added["content"]
        if added.get("special") or _looks_special(text):
            tokens[i], types[i] = text, TOKEN_TYPE_CONTROL
        else:
            tokens[i], types[i] = text.replace(SPACE, " "), TOKEN_TYPE_USER_DEFINED
    return _fill_unused(tokens, types)


def _fill_unused(tokens: list[str | None], types: list[int]) -> tuple[list[str], list[int]]:
    filled = [f"[PAD{i}]" if t is None else t for i, t in enumerate(tokens)]
    return filled, [
        TOKEN_TYPE_UNUSED if t is None else k for t, k in zip(tokens, types, strict=True)
    ]


def _merges(model: Mapping[str, Any], source: str) -> list[str]:
    """``"left right"`` rules; the newer ``[left, right]`` form has spaces written as ``Ġ``."""
    merges = []
    for merge in model.get("merges") or []:
        if isinstance(merge, str):
            merges.append(merge)
        elif isinstance(merge, list) and len(merge) == 2:
            merges.append(" ".join(part.replace(" ", BYTE_TO_CHAR[0x20]) for part in merge))
        else:
            raise TokenizerError(f"{source}: merge {merge!r} is neither 'a b' nor ['a', 'b']")
    return merges


# ------------------------------------------------------------------------ special tokens


def _special_ids(
    doc: Mapping[str, Any], config: Mapping[str, Any], model_config: Mapping[str, Any]
) -> dict[str, int]:
    """bos/eos/unk/pad ids as gguf's SpecialVocab finds them: the tokenizer config's token text
    looked up among the added tokens, else ``config.json``'s ``<type>_token_id``."""
    ids: dict[str, int] = {}
    for typ in SPECIAL_TYPES:
        entry = config.get(f"{typ}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        found = next((t["id"] for t in _added(doc) if text and t["content"] == text), None)
        if found is None and isinstance(model_config.get(f"{typ}_token_id"), int):
            found = model_config[f"{typ}_token_id"]
        if found is not None:
            ids[typ] = found
    return ids


def _add_flags(doc: Mapping[str, Any], config: Mapping[str, Any]) -> dict[str, bool]:
    """add_bos/add_eos: the tokenizer config's, else whether the post-processor's template
    puts the BOS (EOS) token first (last). Absent: llama.cpp's default for the vocabulary."""
    flags: dict[str, bool] = {}
    single = _template(doc.get("post_processor"))
    if len(single) > 1:
        for typ, item in (("bos", single[0]), ("eos", single[-1])):
            token = item.get("SpecialToken", {}).get("id")
            if token:
                named = config.get(f"{typ}_token")
                named = named.get("content") if isinstance(named, dict) else named
                flags[typ] = not config or token == named
    for typ in ("bos", "eos"):
        if isinstance(config.get(f"add_{typ}_token"), bool):
            flags[typ] = config[f"add_{typ}_token"]
    return flags


def _template(post_processor: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The ``single`` template of a TemplateProcessing post-processor, if there is one."""
    if not post_processor:
        return []
    for processor in post_processor.get("processors", [post_processor]):
        if processor.get("type") == "TemplateProcessing":
            return list(processor.get("single") or [])
    return []


# ------------------------------------------------------------------------ byte-level BPE


def _pre_tokenizer_splits(pre_tokenizer: Mapping[str, Any] | None) -> tuple[str, ...] | None:
    """The regexes a byte-level pre-tokenizer applies in turn (HF syntax), or None when it has
    no ByteLevel step (not a byte-level tokenizer)."""
    steps = _steps(pre_tokenizer, "pretokenizers")
    if not any(step.get("type") == "ByteLevel" for step in steps):
        return None
    splits = (_as_regex(step) for step in steps)
    return tuple(split for split in splits if split is not None)


def _as_regex(step: Mapping[str, Any]) -> str | None:
    """One pre-tokenizer step as the regex it splits by (None: it splits nothing)."""
    kind = step.get("type")
    if kind == "ByteLevel":
        return HF_BYTE_LEVEL if step.get("use_regex", True) else None
    if kind == "Digits":
        return r"\p{N}" if step.get("individual_digits") else r"\p{N}+"
    if kind == "Punctuation" and step.get("behavior") == "Contiguous":
        return HF_PUNCTUATION
    if kind == "Split" and step.get("behavior") == "Isolated" and not step.get("invert"):
        pattern = step.get("pattern", {})
        return pattern["Regex"] if "Regex" in pattern else re.escape(pattern.get("String", ""))
    return f"<{kind} {json.dumps({k: v for k, v in step.items() if k != 'type'})}>"


def _byte_level_bpe(
    doc: Mapping[str, Any],
    config: Mapping[str, Any],
    model_config: Mapping[str, Any],
    splits: tuple[str, ...],
    source: str,
) -> BpeTokenizer:
    model = doc["model"]
    pre = pre_tokenizer_for_hf(splits, bool(model.get("ignore_merges")))
    if pre is None:
        described = " then ".join(shown(s, 60) for s in splits)
        raise TokenizerError(
            f"{source}: its pre-tokenizer (splits by {described or 'nothing'}) is none llama.cpp "
            f"tokenizes like; llamatrain knows those of: {', '.join(HF_PRE_TOKENIZERS)}"
        )
    tokens, types = _byte_level_tokens(doc, _vocab_size(doc, model_config))
    ids = _special_ids(doc, config, model_config)
    flags = _add_flags(doc, config)
    try:
        return BpeTokenizer(
            tokens,
            types,
            _merges(model, source),
            pre=pre,
            bos_id=ids.get("bos", _BPE_DEFAULT_SPECIAL),
            eos_id=ids.get("eos", _BPE_DEFAULT_SPECIAL),
            unk_id=ids.get("unk"),
            pad_id=ids.get("pad"),
            add_bos=flags.get("bos"),
            add_eos=flags.get("eos", False),
        )
    except TokenizerError as e:
        raise TokenizerError(f"{source}: {e}") from e


# ---------------------------------------------------------------- SentencePiece-style BPE


def _space_marker(doc: Mapping[str, Any]) -> bool | None:
    """For a tokenizer that writes spaces as ``▁``: whether it prepends one to the text (the
    sentencepiece dummy prefix); None when spaces are not written as ``▁``."""
    normalizers = _steps(doc.get("normalizer"), "normalizers")
    replaces = any(
        n.get("type") == "Replace" and n.get("pattern", {}).get("String") == " "
        and n.get("content") == SPACE
        for n in normalizers
    )  # fmt: skip
    if replaces:
        return any(n.get("type") == "Prepend" and n.get("prepend") == SPACE for n in normalizers)
    for step in _steps(doc.get("pre_tokenizer"), "pretokenizers"):
        if step.get("type") == "Metaspace" and step.get("replacement") == SPACE:
            return step.get("prepend_scheme", "always") != "never"
    return None


def _steps(component: Mapping[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The parts of a normalizer or pre-tokenizer: a Sequence's ``key`` list, else itself."""
    if not component:
        return []
    return list(component.get(key, [])) if component.get("type") == "Sequence" else [component]


def _sentencepiece_bpe(
    doc: Mapping[str, Any],
    config: Mapping[str, Any],
    model_config: Mapping[str, Any],
    source: str,
) -> SpmTokenizer:
    model = doc["model"]
    n = _vocab_size(doc, model_config)
    tokens: list[str | None] = [None] * n
    types = [TOKEN_TYPE_NORMAL] * n
    for token, i in model.get("vocab", {}).items():
        tokens[i] = token
        types[i] = TOKEN_TYPE_BYTE if _BYTE_PIECE.fullmatch(token) else TOKEN_TYPE_NORMAL
    for added in _added(doc):
        i = added["id"]
        tokens[i] = added["content"]
        types[i] = TOKEN_TYPE_CONTROL if added.get("special") else TOKEN_TYPE_USER_DEFINED
    ids = _special_ids(doc, config, model_config)
    unk = _unk_id(model, tokens, ids)
    if unk is not None and unk < n:  # one past the vocabulary: SpmTokenizer says so
        types[unk] = TOKEN_TYPE_UNKNOWN
    filled, types = _fill_unused(tokens, types)
    flags = _add_flags(doc, config)
    try:
        return SpmTokenizer(
            filled,
            _scores_from_merge_order(filled, types, _merges(model, source)),
            types,
            bos_id=ids.get("bos", 1),
            eos_id=ids.get("eos", 2),
            unk_id=0 if unk is None else unk,
            pad_id=ids.get("pad"),
            add_bos=flags.get("bos", True),
            add_eos=flags.get("eos", False),
            add_space_prefix=bool(_space_marker(doc)),
        )
    except TokenizerError as e:
        raise TokenizerError(f"{source}: {e}") from e


def _unk_id(
    model: Mapping[str, Any], tokens: Sequence[str | None], ids: Mapping[str, int]
) -> int | None:
    """The unknown token: the tokenizer config's, else the model's ``unk_token``."""
    if "unk" in ids:
        return ids["unk"]
    text = model.get("unk_token")
    return next((i for i, t in enumerate(tokens) if text is not None and t == text), None)


def _scores_from_merge_order(
    tokens: Sequence[str], types: Sequence[int], merges: Sequence[str]
) -> list[float]:
    """Scores under which llama.cpp's merge-by-score merges in HF's merge order: a merge's
    result scores minus its rank; normal tokens no merge makes score below every merge (in id
    order), the others 0, as in sentencepiece files."""
    rank_of: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        rank_of.setdefault(merge.replace(" ", "", 1), rank)
    scores = []
    for i, (token, t) in enumerate(zip(tokens, types, strict=True)):
        if t != TOKEN_TYPE_NORMAL:
            scores.append(0.0)
        else:
            scores.append(-float(rank_of.get(token, len(merges) + i)))
    return scores
