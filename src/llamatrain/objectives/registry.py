"""The one registry of objectives: which ``train.objective`` is which class, its config rules
and its defaults. A new objective is its module plus one line in :data:`OBJECTIVES`.

``check`` runs each run's objective rules once (api.fit before anything is built, or the
Trainer when it builds the objective itself); ``objective_for`` builds the objective with what
it scores against (a DPO/IPO table, GRPO's frozen base and reward functions), each reference
built here once and its identity checked against a resumed checkpoint's record once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from llamatrain.config import Config, set_in
from llamatrain.errors import ConfigError
from llamatrain.objectives import grpo, preference, sft
from llamatrain.objectives.base import Objective, ObjectiveInputs
from llamatrain.objectives.grpo.rewards import RewardFunction

__all__ = ["OBJECTIVES", "ObjectiveInputs", "check", "objective_for"]


class Kind(NamedTuple):
    """One objective as the registry knows it."""

    build: Callable[[Config, ObjectiveInputs], Objective]
    check: Callable[[Config, Sequence[str | RewardFunction] | None], None]
    default_beta: float


OBJECTIVES: dict[str, Kind] = {
    "sft": Kind(sft.build, sft.check, sft.DEFAULT_BETA),
    **dict.fromkeys(
        preference.OBJECTIVES, Kind(preference.build, preference.check, preference.DEFAULT_BETA)
    ),
    "grpo": Kind(grpo.build, grpo.check, grpo.DEFAULT_BETA),
}
"""``train.objective`` → its objective."""

_BETA_DERIVED = "the objective's default"


def _kind(cfg: Config) -> Kind:
    try:
        return OBJECTIVES[cfg.train.objective]
    except KeyError:
        raise ConfigError(
            f"train.objective = {cfg.train.objective!r} {set_in(cfg, 'train.objective')} is "
            f"not an objective; choose one of {', '.join(OBJECTIVES)}"
        ) from None


def check(cfg: Config, rewards: Sequence[str | RewardFunction] | None = None) -> Config:
    """The run's objective rules, once: ``train.beta`` unset takes the objective's default
    (TRL's: 0.1 for DPOConfig, 0.0 for GRPOConfig; followed again when an earlier check
    filled it and the objective changed), then the objective's own checks. ``rewards``:
    GRPO's reward functions given in Python, in place of train.rewards. Returns ``cfg``."""
    kind, t = _kind(cfg), cfg.train
    if t.beta is None or cfg.origins.get("train.beta") == _BETA_DERIVED:
        t.beta = kind.default_beta
        cfg.origins["train.beta"] = _BETA_DERIVED
    kind.check(cfg, rewards)
    return cfg


def objective_for(cfg: Config, inputs: ObjectiveInputs) -> Objective:
    """The objective ``train.objective`` names, built over ``inputs`` (its config rules
    checked by :func:`check` before)."""
    return _kind(cfg).build(cfg, inputs)
