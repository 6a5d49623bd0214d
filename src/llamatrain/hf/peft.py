"""A PEFT LoRA adapter folder: what ``peft.PeftModel.from_pretrained`` loads onto the HF export
of the base model (``llamatrain.hf.folder``).

The folder holds ``adapter_config.json`` (PEFT's ``LoraConfig``: rank, alpha, the adapted
modules) and ``adapter_model.safetensors``, whose tensors are named after the module each
wraps inside PEFT's wrapper model, ``base_model.model.<HF module>.lora_A.weight`` (r, in) and
``.lora_B.weight`` (out, r) — the shapes A and B have in our model, so only names change.

Row order: the HF export stores the rows of q_proj and k_proj in rotate-half order
(``llamatrain.hf.weights``). The update s·B·A must be reordered alike, and its rows are B's, so
B's rows are permuted (``to_rotate_half``) and A, which acts on the input, is not; llama.cpp's
``convert_lora_to_gguf.py`` does the reverse, landing its q/k permutation on B too.

PEFT is not imported: the format is JSON and safetensors. The folder is written into a staging
folder renamed into place, so an interrupted export leaves nothing half-written; it goes into
a new or empty folder only, so no one's adapter is ever overwritten.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from llamatrain.errors import CheckpointError
from llamatrain.files import staged_folder
from llamatrain.gguf.adapter import adapter_rank, adapter_tensors, check_alpha
from llamatrain.hf.folder import MODEL_CARD
from llamatrain.hf.weights import _rope_heads, hf_tensor_name, to_rotate_half
from llamatrain.model_config import ModelConfig

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "write_peft_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_WRAPPER = "base_model.model."
"""PEFT's prefix: its ``LoraModel`` (``base_model``) around the transformers model (``model``)."""
_PEFT_FACTOR = {"lora_a": "lora_A", "lora_b": "lora_B"}


def write_peft_adapter(
    directory: str | os.PathLike[str],
    state: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    *,
    alpha: float,
    base_model_name_or_path: str | None = None,
    card: str | None = None,
) -> Path:
    """Write the LoRA tensors of ``state`` (an adapted model's state dict, or a LoRA run's
    adapter tensors, named as the model names them) as a PEFT adapter folder (float32) for the
    HF export of the base described by ``cfg``. ``alpha`` must be the one the adapters were
    applied with; ``base_model_name_or_path`` is recorded for PEFT to find the base (None: the
    user passes the base model to ``PeftModel.from_pretrained``); ``card``: the text of the
    folder's ``README.md`` model card (none written when None)."""
    target = Path(directory)
    adapter = adapter_tensors(state, target)
    rank = adapter_rank(adapter, str(target))
    check_alpha(alpha, target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(
            f"{target} exists and is not an empty folder; write the PEFT adapter into a new "
            "or empty folder"
        )
    rows = {_peft_name(name): _hf_rows(name, t, cfg) for name, t in adapter.items()}
    config = _adapter_config(rank, alpha, adapter, base_model_name_or_path)
    _write_folder(target, rows, config, card)
    return target


def _peft_name(name: str) -> str:
    """``blk.0.attn_q.lora_a`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.
    weight``."""
    module, factor = name.rsplit(".", 1)
    hf_module = hf_tensor_name(f"{module}.weight").removesuffix(".weight")
    return f"{_WRAPPER}{hf_module}.{_PEFT_FACTOR[factor]}.weight"


def _hf_rows(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """A factor as PEFT stores it for the HF export: float32, q/k B rows in rotate-half order."""
    tensor = tensor.float().cpu()
    heads = _rope_heads(name, cfg) if name.endswith(".lora_b") else None
    return (tensor if heads is None else to_rotate_half(tensor, heads)).contiguous()


def _adapter_config(
    rank: int, alpha: float, adapter: dict[str, torch.Tensor], base: str | None
) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` for plain LoRA (no DoRA, rsLoRA or trained biases) on the
    adapted modules, named as PEFT matches them (the last part of the HF module name)."""
    modules = {_peft_name(name).split(".")[-3] for name in adapter}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def _write_folder(
    target: Path, state: dict[str, torch.Tensor], config: dict[str, Any], card: str | None
) -> None:
    """The files into a staging folder beside ``target``, then renamed onto it (an empty
    ``target`` is replaced); nothing is left behind on failure."""
    with staged_folder(target, "PEFT adapter folder") as staging:
        try:
            save_file(state, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        except SafetensorError as e:
            raise CheckpointError(
                f"could not write {ADAPTER_WEIGHTS} into {target} ({e}); free some space or "
                "choose another folder"
            ) from e
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        (staging / ADAPTER_CONFIG).write_text(text, encoding="utf-8")
        if card is not None:
            (staging / MODEL_CARD).write_text(card, encoding="utf-8")
