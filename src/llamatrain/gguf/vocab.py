"""The vocabulary mapping of GGUF: ``tokenizer.ggml.*`` keys <-> a ``Tokenizer``.

llama.cpp takes a model's vocabulary from the ``tokenizer.ggml.*`` keys alone: SPM
(``"llama"``) or byte-level BPE (``"gpt2"``) tokens, scores, token types, merges and special
ids, each with the GGUF type llama.cpp reads it as. This module is that mapping and nothing
else, so models, checkpoints and vocab-only files (``llamatrain.gguf.llama``) and HF
tokenizer files (``llamatrain.hf``) all encode a vocabulary the same way, and
``tokenizer_from_metadata(tokenizer_metadata(t))`` rebuilds ``t`` exactly. It handles keys,
not files: ``read_tokenizer`` and ``write_vocab`` in ``llamatrain.gguf.llama`` read and write
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from llamatrain.errors import TokenizerError
from llamatrain.tokenizer import (
    TOKEN_TYPE_NORMAL,
    BpeTokenizer,
    SpmTokenizer,
    Tokenizer,
    rstrip_ids,
)

__all__ = ["tokenizer_from_metadata", "tokenizer_metadata"]


def tokenizer_metadata(tokenizer: Tokenizer) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` keys, typed as llama.cpp reads them.

    ``tokenizer_from_metadata(tokenizer_metadata(t))`` rebuilds an identical tokenizer (same
    fingerprint, same ids).
    """
    if isinstance(tokenizer, BpeTokenizer):
        return _bpe_metadata(tokenizer)
    if isinstance(tokenizer, SpmTokenizer):
        return _spm_metadata(tokenizer)
    raise TokenizerError(
        f"cannot write a {type(tokenizer).__name__} to GGUF; llama.cpp reads SPM ('llama') "
        "and byte-level BPE ('gpt2') vocabularies"
    )


def _spm_metadata(tokenizer: SpmTokenizer) -> dict[str, Any]:
    u32 = np.uint32
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokenizer.pieces,
        "tokenizer.ggml.scores": np.asarray(tokenizer.scores, dtype=np.float32),
        "tokenizer.ggml.token_type": np.asarray(tokenizer.token_types, dtype=np.int32),
        "tokenizer.ggml.bos_token_id": u32(tokenizer.bos_id),
        "tokenizer.ggml.eos_token_id": u32(tokenizer.eos_id),
        "tokenizer.ggml.unknown_token_id": u32(tokenizer.unk_id),
        "tokenizer.ggml.add_bos_token": tokenizer.add_bos,
        "tokenizer.ggml.add_eos_token": tokenizer.add_eos,
        "tokenizer.ggml.add_space_prefix": tokenizer.add_space_prefix,
    }
    if tokenizer.pad_id is not None:
        metadata["tokenizer.ggml.padding_token_id"] = u32(tokenizer.pad_id)
    return metadata


def _bpe_metadata(tokenizer: BpeTokenizer) -> dict[str, Any]:
    u32 = np.uint32
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": tokenizer.pre,
        "tokenizer.ggml.tokens": tokenizer.tokens,
        "tokenizer.ggml.token_type": np.asarray(tokenizer.token_types, dtype=np.int32),
        "tokenizer.ggml.merges": tokenizer.merges,
        "tokenizer.ggml.bos_token_id": u32(tokenizer.bos_id),
        "tokenizer.ggml.eos_token_id": u32(tokenizer.eos_id),
        "tokenizer.ggml.add_bos_token": tokenizer.add_bos,
        "tokenizer.ggml.add_eos_token": tokenizer.add_eos,
    }
    optional = {
        "eot_token_id": tokenizer.eot_id,
        "unknown_token_id": tokenizer.unk_id,
        "padding_token_id": tokenizer.pad_id,
    }
    metadata.update({f"tokenizer.ggml.{k}": u32(v) for k, v in optional.items() if v is not None})
    return metadata


def tokenizer_from_metadata(meta: Mapping[str, Any], source: str = "GGUF") -> Tokenizer:
    """The vocabulary a GGUF's ``tokenizer.ggml.*`` keys describe; ``source`` names it in errors."""
    model = meta.get("tokenizer.ggml.model")
    if model is None or "tokenizer.ggml.tokens" not in meta:
        raise TokenizerError(
            f"{source} has no tokenizer (tokenizer.ggml.model / tokens missing); use a GGUF "
            "exported by llamatrain or llama.cpp's convert script."
        )
    if model == "llama":
        return _spm_from_metadata(meta, source)
    if model == "gpt2":
        return _bpe_from_metadata(meta, source)
    raise TokenizerError(
        f"{source} has a {model!r} tokenizer; llamatrain supports llama's SPM tokenizer "
        "('llama') and byte-level BPE ('gpt2') — train a tokenizer with llamatrain instead."
    )


def _per_token(meta: Mapping[str, Any], key: str, default: Any, n: int, source: str) -> list[Any]:
    """A per-token array (scores, token types), at least ``n`` long; ``default`` if absent."""
    values = list(meta.get(f"tokenizer.ggml.{key}", [default] * n))
    if len(values) < n:
        raise TokenizerError(
            f"{source}: {n} tokens but {len(values)} {key} values; the file is corrupt — "
            "re-export it."
        )
    return values[:n]


def _special_id(meta: Mapping[str, Any], key: str, default: int | None, n: int) -> int | None:
    """A special token id as llama.cpp reads it: an out-of-range id falls back to the
    vocabulary type's default, if that fits."""
    value = meta.get(f"tokenizer.ggml.{key}", default)
    if value is None or not 0 <= int(value) < n:
        return default if default is not None and default < n else None
    return int(value)


def _spm_from_metadata(meta: Mapping[str, Any], source: str) -> SpmTokenizer:
    tokens = list(meta["tokenizer.ggml.tokens"])
    n = len(tokens)
    scores = [float(s) for s in _per_token(meta, "scores", 0.0, n, source)]
    types = [int(t) for t in _per_token(meta, "token_type", TOKEN_TYPE_NORMAL, n, source)]
    bos = _special_id(meta, "bos_token_id", 1, n)
    eos = _special_id(meta, "eos_token_id", 2, n)
    unk = _special_id(meta, "unknown_token_id", 0, n)
    if bos is None or eos is None or unk is None:
        raise TokenizerError(f"{source}: the vocabulary is too small for <unk>/<s>/</s>.")
    return SpmTokenizer(
        tokens,
        scores,
        types,
        bos_id=bos,
        eos_id=eos,
        unk_id=unk,
        pad_id=_special_id(meta, "padding_token_id", None, n),
        # llama.cpp's defaults for a llama vocabulary: BOS before a prompt, no EOS after it
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        rstrip_ids=rstrip_ids(meta.get("general.name"), tokens, types),
    )


def _bpe_from_metadata(meta: Mapping[str, Any], source: str) -> BpeTokenizer:
    if "tokenizer.ggml.merges" not in meta:
        raise TokenizerError(
            f"{source} has a byte-level BPE ('gpt2') vocabulary without tokenizer.ggml.merges; "
            "llama.cpp refuses it too — re-convert the model with llama.cpp's convert script."
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    n = len(tokens)
    types = [int(t) for t in _per_token(meta, "token_type", TOKEN_TYPE_NORMAL, n, source)]
    # llama.cpp's defaults for a BPE vocabulary without BOS/EOS keys: id 11 for both.
    bos = _special_id(meta, "bos_token_id", 11, n)
    eos = _special_id(meta, "eos_token_id", 11, n)
    if bos is None or eos is None:
        raise TokenizerError(f"{source}: the BPE vocabulary names no BOS/EOS token.")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    try:
        return BpeTokenizer(
            tokens,
            types,
            list(meta["tokenizer.ggml.merges"]),
            pre=meta.get("tokenizer.ggml.pre"),
            bos_id=bos,
            eos_id=eos,
            eot_id=_special_id(meta, "eot_token_id", None, n),
            unk_id=_special_id(meta, "unknown_token_id", None, n),
            pad_id=_special_id(meta, "padding_token_id", None, n),
            add_bos=None if add_bos is None else bool(add_bos),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            rstrip_ids=rstrip_ids(meta.get("general.name"), tokens, types),
        )
    except TokenizerError as e:
        raise TokenizerError(f"{source}: {e}") from e
