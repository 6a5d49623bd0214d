"""GRPO, as TRL computes it: rollouts from the model being trained (:mod:`.rollout`), reward
functions with TRL's signature (:mod:`.rewards`), the advantages and the loss (:mod:`.loss`), a
full finetune's frozen KL reference (:mod:`.reference`), the objective the trainer drives
(:mod:`.objective`) and its config rules (:mod:`.rules`)."""

from __future__ import annotations

from llamatrain.config import Config
from llamatrain.errors import ConfigError, TrainingError
from llamatrain.objectives.base import ObjectiveInputs, check_reference
from llamatrain.objectives.grpo.environment import load_environment
from llamatrain.objectives.grpo.objective import GRPOObjective
from llamatrain.objectives.grpo.reference import GRPO_REFERENCE_ROLE, build_base_reference
from llamatrain.objectives.grpo.rewards import load as load_rewards
from llamatrain.objectives.grpo.rules import DEFAULT_BETA, check, check_tool_template
from llamatrain.tools.loading import load as load_tools

__all__ = ["DEFAULT_BETA", "GRPOObjective", "build", "check"]


def build(cfg: Config, inputs: ObjectiveInputs) -> GRPOObjective:
    """GRPO over the run's tokenizer and chat template, its reward functions, tools and
    environment loaded (importing the modules ``train.rewards``, ``train.tools`` and
    ``train.environment`` name: the config's code, run now) and, over a
    full finetune with a KL term, its frozen base mapped once (checked against a resumed
    checkpoint's record)."""
    t = cfg.train
    if inputs.tokenizer is None:
        raise TrainingError("train.objective = 'grpo' needs the tokenizer (Trainer's tokenizer=)")
    specs = t.rewards if inputs.rewards is None else inputs.rewards
    rewards = load_rewards(specs, t.reward_weights, t.reward_args)
    reference = build_base_reference(cfg, inputs.device)
    if reference is not None:
        check_reference(reference.source, inputs.checkpoint, GRPO_REFERENCE_ROLE)
    template = None if inputs.data is None else inputs.data.chat_template
    tool_specs = t.tools if inputs.tools is None else inputs.tools
    tools = load_tools(tool_specs) if tool_specs else []
    if tools:
        check_tool_template(template)
    environment = None if t.environment is None else load_environment(t.environment)
    if environment is not None and template is None:
        raise ConfigError(
            "train.environment needs a chat template to render its conversations with; set "
            "data.chat_template (the model's own: 'auto')"
        )
    return GRPOObjective(
        cfg, inputs.tokenizer, template, rewards, inputs.ranks, reference, tools, environment
    )
