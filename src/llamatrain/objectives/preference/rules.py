"""The preference objectives' config rules, checked once per run (``objectives.check``)."""

from __future__ import annotations

from collections.abc import Sequence

from llamatrain.config import Config, set_in
from llamatrain.errors import ConfigError
from llamatrain.objectives.base import refuse_rewards

__all__ = ["DEFAULT_BETA", "check"]

DEFAULT_BETA = 0.1
"""``train.beta`` unset: TRL's DPOConfig default."""


def check(cfg: Config, rewards: Sequence[object] | None) -> None:
    """A preference objective trains on JSONL pairs (on any train.parallel, compiled or
    not, as SFT); DPO/IPO need a reference model: a LoRA run's adapters switched off, or a
    full finetune's model.init_from (its log-probs cached before training)."""
    refuse_rewards(cfg, rewards)
    t = cfg.train
    objective = t.objective
    where = set_in(cfg, "train.objective")
    if t.beta == 0:
        raise ConfigError(
            f"train.beta = 0 {set_in(cfg, 'train.beta')} leaves train.objective = "
            f"{objective!r} nothing to scale; give a beta > 0 (unset = 0.1)"
        )
    if cfg.data.format != "jsonl":
        raise ConfigError(
            f"train.objective = {objective!r} {where} trains on preference pairs; set "
            'data.format = "jsonl" with one {"prompt", "chosen", "rejected"} object a line'
        )
    if cfg.data.train_on != "completion":
        raise ConfigError(
            f"train.objective = {objective!r} {where} scores the replies alone; "
            "data.train_on = 'all' does not apply: set it to 'completion'"
        )
    if objective in ("dpo", "ipo") and cfg.lora.rank == 0 and not cfg.model.init_from:
        raise ConfigError(
            f"train.objective = {objective!r} {where} needs a reference model: the model "
            "model.init_from names (its log-probs cached before a full finetune, or its weights "
            "under LoRA adapters with lora.rank > 0); set model.init_from, or train.objective = "
            "'orpo' or 'simpo' (reference-free)"
        )
    if t.label_smoothing and objective not in ("dpo", "simpo"):
        raise ConfigError(
            f"train.label_smoothing = {t.label_smoothing} "
            f"{set_in(cfg, 'train.label_smoothing', 'train.objective')} is conservative DPO's "
            f"(and SimPO's); train.objective = {objective!r} has none: set it to 0"
        )
