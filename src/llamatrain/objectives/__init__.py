"""The training objectives, each behind one interface (:class:`~.base.Objective`): SFT
(:mod:`.sft`), preference tuning (:mod:`.preference`: DPO, IPO, ORPO, SimPO) and GRPO
(:mod:`.grpo`). :func:`~.registry.objective_for` is the one place a ``train.objective`` becomes
an objective, :func:`~.registry.check` the one place its config rules are checked."""

from llamatrain.objectives.base import Objective, ObjectiveBase, StepContext, StepResult
from llamatrain.objectives.registry import OBJECTIVES, ObjectiveInputs, check, objective_for

__all__ = [
    "OBJECTIVES",
    "Objective",
    "ObjectiveBase",
    "ObjectiveInputs",
    "StepContext",
    "StepResult",
    "check",
    "objective_for",
]
