"""GRPO's KL reference over a full finetune: the base the run started from, frozen beside the
trained model and held as its GGUF stores it (a LoRA run's reference is its base with the
adapters off, which costs nothing more)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from llamatrain.build import run_choices
from llamatrain.config import Config
from llamatrain.errors import ConfigError
from llamatrain.lora import ALL_TARGETS
from llamatrain.model import Llama
from llamatrain.model_path import (
    LoraBase,
    describe_base,
    is_hf_folder,
    is_lora_checkpoint,
    model_file,
)
from llamatrain.model_source import build_lora_base, read_model_source

__all__ = ["GRPO_REFERENCE_ROLE", "FrozenReference", "build_base_reference", "check_mappable"]

GRPO_REFERENCE_ROLE = "GRPO KL reference model"
"""How a resume refusing a changed ``model.init_from`` names GRPO's frozen base."""


@dataclass(frozen=True)
class FrozenReference:
    """GRPO's KL reference over a full finetune (``Config.holds_base_reference``): the base
    the run started from, frozen, and the file it was read from."""

    model: Llama
    """On the run's device, in eval mode, without gradients; its projections and vocabulary
    tables held as the file stores them (:func:`build_lora_base`, ``quantized``)."""
    source: LoraBase
    """``model.init_from`` and its sha256, which the run's checkpoints record, so a resume
    over a changed base is refused (``ObjectiveBase.check_resume``)."""


def build_base_reference(cfg: Config, device: torch.device) -> FrozenReference | None:
    """GRPO's KL reference over a full finetune, or None for a run that needs none (a LoRA
    run's is its base with the adapters off; ``beta = 0`` has no KL).

    It is ``model.init_from`` as :func:`build_lora_base` keeps a QLoRA base, every
    projection adapted: each matrix and vocabulary table a view of the GGUF's copy-on-write
    map (``gguf.file.map_stored``), the norms float32. On the CPU it costs about the file's
    size in page cache the kernel can drop, never a float32 copy; on an accelerator, the
    file's size of device memory. Each block is decoded to float32 as a forward needs it,
    so its log-probs are those of the dequantized base. An HF folder (or a LoRA run, read
    merged) has no file to map: the run's config rules refuse it first (:func:`check_mappable`),
    naming the conversion that gives one.
    """
    if not cfg.holds_base_reference:
        return None
    source = describe_base(cfg.model.init_from, "this GRPO run")
    base = read_model_source(cfg.model.init_from)
    model = build_lora_base(base, "quantized", ALL_TARGETS, **run_choices(cfg, base))
    model.requires_grad_(False).eval()
    return FrozenReference(model.to(device), source)


def check_mappable(cfg: Config) -> None:
    """Refuse a GRPO reference that would be a float copy, before anything is read:
    ``model.init_from`` is not a GGUF model file (an HF folder; a LoRA run, read merged), so
    nothing maps it."""
    path = cfg.model.init_from
    if not cfg.holds_base_reference or not path or not Path(path).exists():
        return  # nothing to map, or a missing file, which reading it refuses
    if is_hf_folder(path) or is_lora_checkpoint(model_file(path)):
        raise ConfigError(
            f"model.init_from = {cfg.model.init_from} is not a GGUF model file, which GRPO's "
            "KL reference over a full finetune is mapped from; convert it (llamatrain export "
            f"{cfg.model.init_from} -o base.gguf --type bf16) and point model.init_from at "
            "base.gguf, or set lora.rank > 0 or train.beta = 0"
        )
