"""The preference objectives: DPO, IPO, ORPO and SimPO on rows of chosen/rejected pairs —
their losses (:mod:`.losses`), a full finetune's reference table (:mod:`.reference`), the
objective the trainer drives (:mod:`.objective`) and its config rules (:mod:`.rules`)."""

from __future__ import annotations

from llamatrain.config import Config
from llamatrain.model_path import REFERENCE_ROLE, describe_base
from llamatrain.objectives.base import ObjectiveInputs, autocast_for, check_reference
from llamatrain.objectives.preference.losses import OBJECTIVES
from llamatrain.objectives.preference.objective import PreferenceObjective
from llamatrain.objectives.preference.reference import (
    ReferenceTable,
    file_reference,
    reference_table,
)
from llamatrain.objectives.preference.rules import DEFAULT_BETA, check

__all__ = ["DEFAULT_BETA", "OBJECTIVES", "PreferenceObjective", "build", "check"]


def build(cfg: Config, inputs: ObjectiveInputs) -> PreferenceObjective:
    """The objective ``train.objective`` names, with a full finetune's DPO/IPO reference
    table built once (a LoRA run's reference is its base with the adapters off)."""
    t = cfg.train
    table = _table(cfg, inputs)
    return PreferenceObjective(t.objective, t.beta, t.label_smoothing, t.simpo_gamma, table)


def _table(cfg: Config, inputs: ObjectiveInputs) -> ReferenceTable | None:
    """DPO/IPO over a full finetune: ``model.init_from``'s log-probs of every row, from the
    cache or computed once (its file checked against a resumed checkpoint's record before
    anything is read), or, for a Trainer built by hand, the given model's."""
    table_needed = cfg.train.objective in ("dpo", "ipo") and not cfg.lora.rank
    data, model, device = inputs.data, inputs.model, inputs.device
    if not table_needed or data is None:
        return None
    autocast = autocast_for(cfg, device)
    if not inputs.reference_from_file:
        return reference_table(model, data.train, data.val, cfg.seqs_per_ubatch, device, autocast)
    source = describe_base(cfg.model.init_from, "this DPO/IPO run")
    check_reference(source, inputs.checkpoint, REFERENCE_ROLE)
    initial = inputs.checkpoint is None
    return file_reference(model, cfg, data, device, autocast, source, initial=initial)
