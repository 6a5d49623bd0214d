"""An HF checkpoint folder as a whole: read one into a ``LlamaFile``, write one atomically.

A folder (what transformers' ``save_pretrained`` writes) holds ``config.json``, the weights
(``model.safetensors``, or shards listed by ``model.safetensors.index.json``), ``tokenizer.json``
and usually ``tokenizer_config.json``. Reading gives the same ``LlamaFile`` a GGUF gives:
our config, our tensor names, the tokenizer, and as ``inherited`` the GGUF keys llama.cpp's
converter would have written for it (``general.name``, ``tokenizer.chat_template``).

Writing goes into a temporary folder beside the target, which is renamed into place only when
complete, so an interrupted export leaves no half-written model. An existing target is
replaced only when it is empty or a folder we wrote (its ``model.safetensors`` says so in its
metadata and it holds nothing else of anyone's).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from llamatrain.errors import CheckpointError
from llamatrain.files import staged_folder
from llamatrain.gguf.llama import LlamaFile
from llamatrain.gguf.write import DeferredTensor, TensorData
from llamatrain.hf.config import hf_config, model_config_from_hf, read_json_object
from llamatrain.hf.inside import file_in_folder
from llamatrain.hf.rope import hf_rope_scaling, rope_freqs_from_hf
from llamatrain.hf.tokenizer_files import (
    TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    read_chat_template,
    read_folder_tokenizer,
    write_tokenizer_files,
)
from llamatrain.hf.weights import (
    INDEX_FILE,
    SINGLE_FILE,
    check_weights_fit,
    hf_names,
    hf_tensor,
    read_hf_weights,
)
from llamatrain.model_config import ModelConfig, tensor_shapes
from llamatrain.tokenizer import Tokenizer

__all__ = ["CONFIG_FILE", "read_hf_folder", "write_hf_folder"]

CONFIG_FILE = "config.json"
GENERATION_CONFIG = "generation_config.json"
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
MODEL_CARD = "README.md"
"""The model card the Hub shows for the folder (``llamatrain.model_card.readme``)."""
_PRODUCER = {"producer": "llamatrain"}
"""Recorded in the safetensors metadata: how a later export knows the folder is ours."""
_WRITTEN = frozenset(
    {
        CONFIG_FILE,
        GENERATION_CONFIG,
        SINGLE_FILE,
        INDEX_FILE,
        TOKENIZER_FILE,
        TOKENIZER_CONFIG,
        MODEL_CARD,
    }
)
"""The files of a folder we wrote (and its shards): an export replaces such a folder, and no
other."""
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
SHARD_BYTES = 2 << 30
"""float32 bytes a weight shard holds at most: what an HF export holds at once (a 7B's
merged model is 27 GB). 2 GiB, under transformers' own default of 5 GB, since the shard
is held beside the model it comes from."""


# ------------------------------------------------------------------------------------ reading


def read_hf_folder(path: str | os.PathLike[str]) -> LlamaFile:
    """An HF llama folder as a ``LlamaFile`` (float32 tensors under our names).

    Raises CheckpointError (TokenizerError for tokenizer.json itself) with one line naming
    what is missing or unsupported, checking the cheap things (files, config.json, tensor
    names) before loading any weight.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; pass an HF checkpoint folder")
    config_path = file_in_folder(folder, CONFIG_FILE)
    if not config_path.is_file():
        raise CheckpointError(
            f"{folder} has no {CONFIG_FILE}; an HF checkpoint folder holds config.json, "
            "model.safetensors and tokenizer.json"
        )
    hf = read_json_object(config_path)
    cfg = model_config_from_hf(hf, str(config_path))
    check_weights_fit(folder, cfg)  # no weights, or not these: say so before the tokenizer
    tokenizer = read_folder_tokenizer(folder, cfg.vocab_size)
    tensors = read_hf_weights(folder, cfg)
    if cfg.rope_freq_factors:
        tensors["rope_freqs.weight"] = rope_freqs_from_hf(hf, cfg, str(config_path))
    return LlamaFile(cfg, tensors, tokenizer, _inherited(folder, hf), contents=None)


def _inherited(folder: Path, hf: Mapping[str, Any]) -> dict[str, Any]:
    """The GGUF keys llama.cpp's converter derives from the folder: the model's name (from
    config.json's ``_name_or_path``, else the folder's name) and the chat template."""
    name = str(hf.get("_name_or_path") or "").rstrip("/").rpartition("/")[2] or folder.name
    inherited: dict[str, Any] = {"general.name": name}
    template = read_chat_template(folder)
    if template is not None:
        inherited[CHAT_TEMPLATE_KEY] = template
    return inherited


# ------------------------------------------------------------------------------------ writing


def write_hf_folder(
    directory: str | os.PathLike[str],
    cfg: ModelConfig,
    tensors: Mapping[str, TensorData],
    tokenizer: Tokenizer,
    inherited: Mapping[str, Any] | None = None,
    card: str | None = None,
) -> Path:
    """Write a folder transformers loads as ``LlamaForCausalLM`` (float32 safetensors) with
    its tokenizer (``AutoTokenizer``; byte-level BPE vocabularies only) and ``card``, the
    text of its ``README.md`` model card (none written when None).

    ``tensors`` are ours (``Llama(cfg).state_dict()``; deferred ones are produced a shard at a
    time, see ``_save_shards``); ``inherited`` may carry the ``tokenizer.chat_template`` to
    keep. What config.json or tokenizer.json cannot express
    (the rope scaling, a vocabulary other than byte-level BPE) fails before any weight is
    written, and a failure leaves nothing behind.
    """
    target = Path(directory)
    if cfg.vocab_size != tokenizer.vocab_size:
        raise CheckpointError(
            f"the model has vocab_size {cfg.vocab_size} but the tokenizer has "
            f"{tokenizer.vocab_size} tokens; export a model with the tokenizer it was built for"
        )
    _check_replaceable(target)
    rope_freqs = tensors.get("rope_freqs.weight")
    if isinstance(rope_freqs, DeferredTensor):
        rope_freqs = rope_freqs.read()
    config = hf_config(cfg, tokenizer, hf_rope_scaling(cfg, rope_freqs))
    template = (inherited or {}).get(CHAT_TEMPLATE_KEY)
    with staged_folder(target, "HF folder") as staging:
        write_tokenizer_files(staging, tokenizer, template, cfg.max_seq_len)  # may refuse: first
        _write_json(staging / CONFIG_FILE, config)
        _write_json(staging / GENERATION_CONFIG, _generation_config(tokenizer))
        if card is not None:
            (staging / MODEL_CARD).write_text(card, encoding="utf-8")
        _save_shards(cfg, tensors, staging)
    return target


def _save_shards(cfg: ModelConfig, tensors: Mapping[str, TensorData], folder: Path) -> None:
    """The weights as ``model.safetensors``, or as shards of at most ``SHARD_BYTES`` with
    ``model.safetensors.index.json`` (transformers' layout for large models). Each shard's
    tensors are produced (a :class:`DeferredTensor` merged), converted and written before the
    next shard's: an export holds one shard, never the merged model."""
    shards = _shard_names(cfg)
    files = _shard_files(len(shards))
    weight_map: dict[str, str] = {}
    for names, file in zip(shards, files, strict=True):
        state = dict(hf_tensor(cfg, name, _values(tensors[name])) for name in names)
        _save_weights(state, folder / file)
        weight_map.update(dict.fromkeys(state, file))
        del state
    if len(files) > 1:
        total = sum(_float32_bytes(cfg).values())
        _write_json(
            folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map}
        )


def _float32_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Each stored tensor's float32 bytes, in order."""
    shapes = tensor_shapes(cfg)
    return {name: 4 * math.prod(shapes[name]) for name in hf_names(cfg)}


def _shard_names(cfg: ModelConfig) -> list[list[str]]:
    """Our tensor names grouped into shards of at most ``SHARD_BYTES`` of float32, in order."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in _float32_bytes(cfg).items():
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _shard_files(count: int) -> list[str]:
    """transformers' shard names, or the single file."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _values(tensor: TensorData) -> torch.Tensor:
    return tensor.read() if isinstance(tensor, DeferredTensor) else torch.as_tensor(tensor)


def _save_weights(state: Mapping[str, torch.Tensor], path: Path) -> None:
    """A safetensors file, marked as ours; a failed write (a full disk) is one line."""
    try:
        save_file(dict(state), str(path), metadata={"format": "pt", **_PRODUCER})
    except SafetensorError as e:
        raise CheckpointError(
            f"could not write {path.name} into {path.parent.parent} ({e}); free some space "
            "or choose another folder"
        ) from e


def _generation_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """What ``generate`` starts and stops on, as transformers' generation_config.json says."""
    config: dict[str, Any] = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    if tokenizer.pad_id is not None:
        config["pad_token_id"] = tokenizer.pad_id
    return config


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _check_replaceable(target: Path) -> None:
    """Refuse a target that is a file, or a folder holding anything we did not write."""
    if not target.exists() or target.is_symlink():
        return  # nothing to lose, or staged_folder refuses it
    if not target.is_dir():
        raise CheckpointError(f"{target} is a file; an HF export writes a folder — pick a new path")
    entries = {p.name for p in target.iterdir()}
    ours = {name for name in entries if name in _WRITTEN or _SHARD.fullmatch(name)}
    weights = sorted(name for name in entries if name.endswith(".safetensors"))
    if entries and not (entries == ours and weights and _written_by_us(target / weights[0])):
        raise CheckpointError(
            f"{target} is a non-empty folder llamatrain did not write; export into a new or "
            "empty folder"
        )


def _written_by_us(weights: Path) -> bool:
    try:
        with safe_open(str(weights), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError):
        return False
    return all(metadata.get(k) == v for k, v in _PRODUCER.items())
