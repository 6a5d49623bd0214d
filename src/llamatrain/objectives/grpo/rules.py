"""GRPO's config rules, checked once per run (``objectives.check``), and its rollout sampler."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from llamatrain.chat_template import ChatTemplate
from llamatrain.config import Config, TrainSection, check_sampler, set_in
from llamatrain.errors import ConfigError, LlamatrainWarning
from llamatrain.objectives.grpo.environment import ENVIRONMENT
from llamatrain.objectives.grpo.reference import check_mappable
from llamatrain.objectives.grpo.rewards import RewardFunction
from llamatrain.objectives.grpo.rewards import check as check_rewards
from llamatrain.sampling import SamplingParams
from llamatrain.tools.calls import CallFormat, call_syntax
from llamatrain.tools.loading import check as check_tools
from llamatrain.tools.specs import split_spec

__all__ = ["DEFAULT_BETA", "check", "check_given_tools", "check_tool_template", "rollout_params"]

DEFAULT_BETA = 0.0
"""``train.beta`` unset: TRL's GRPOConfig default (no KL term)."""


def check(cfg: Config, rewards: Sequence[str | RewardFunction] | None) -> None:
    """GRPO samples prompt rows (JSONL, Parquet, HF) with the reward functions named in
    train.rewards or given in Python as ``rewards`` (checked here without importing them),
    G completions a prompt, whole groups a step; on one process or under DDP, with AdamW.
    Its KL reference is the base: a LoRA run's with the adapters off, a full finetune's
    ``model.init_from`` held as its GGUF stores it, so a run from scratch has none."""
    t, where = cfg.train, set_in(cfg, "train.objective")
    if cfg.data.format == "text":
        raise ConfigError(
            f"train.objective = 'grpo' {where} samples prompt rows; set data.format = 'jsonl' "
            "(or 'parquet', 'hf') with a \"prompt\" (text or messages) in each row"
        )
    check_rewards(_reward_specs(cfg, rewards), t.reward_weights, t.reward_args)
    check_sampler(cfg, "train.", rollout_params)
    if cfg.seqs_per_batch % t.num_generations:
        raise ConfigError(
            f"train.n_batch / data.n_ctx = {cfg.seqs_per_batch} completions a step are not whole "
            f"groups of train.num_generations = {t.num_generations} "
            f"{set_in(cfg, 'train.n_batch', 'train.num_generations')}; make n_batch a multiple "
            f"of {t.num_generations * cfg.data.n_ctx}"
        )
    if t.max_completion_length >= cfg.data.n_ctx:
        raise ConfigError(
            f"train.max_completion_length = {t.max_completion_length} leaves no room for a "
            f"prompt in data.n_ctx = {cfg.data.n_ctx} "
            f"{set_in(cfg, 'train.max_completion_length', 'data.n_ctx')}; lower it or raise n_ctx"
        )
    if t.beta and not cfg.lora.rank and not cfg.model.init_from:
        raise ConfigError(
            f"train.beta = {t.beta} {set_in(cfg, 'train.beta')}: GRPO's KL reference is the "
            "base model, and a model trained from scratch has none; set model.init_from to a "
            "GGUF base or train.beta = 0"
        )
    if t.parallel == "fsdp":
        raise ConfigError(
            f"train.objective = 'grpo' {where} does not shard: a rollout decodes token by "
            "token, each rank its own completions, and a sharded forward needs every rank in "
            "each; set train.parallel = 'ddp' (or 'none')"
        )
    if cfg.optim.name != "adamw":
        raise ConfigError(
            f"train.objective = 'grpo' {where} trains with AdamW (L-BFGS's line search would "
            "score a new rollout each evaluation); set optim.name = 'adamw'"
        )
    if cfg.optim.opt_max_no_improvement and cfg.optim.opt_no_improvement_on == "val":
        raise ConfigError(
            f"optim.opt_no_improvement_on = 'val' {set_in(cfg, 'optim.opt_no_improvement_on')} "
            "watches a validation loss, which GRPO has not (it reports the held-out reward); "
            "watch the 'train' loss or set optim.opt_max_no_improvement = 0"
        )
    if t.tools is not None:
        check_tools(t.tools)
    if t.environment is not None:
        split_spec(t.environment, ENVIRONMENT)
        if t.tools:
            where = set_in(cfg, "train.tools", "train.environment")
            raise ConfigError(
                f"train.tools and train.environment {where} both answer the model's turns; "
                "give one of them (an environment can run the tools itself in step)"
            )
    check_mappable(cfg)  # before the base is read for the model


def check_given_tools(cfg: Config, tools: Sequence[str | Callable[..., Any]] | None) -> None:
    """Tools given in Python (``fit(cfg, tools=[multiply])``, as TRL's ``tools=``) stand in
    for train.tools: only in a GRPO run, not beside train.tools or train.environment; checked
    here as train.tools is (distinct names)."""
    if tools is None:
        return
    t = cfg.train
    if t.objective != "grpo":
        raise ConfigError(
            f"tools= answer turns of GRPO's rollouts; train.objective = {t.objective!r} "
            f"{set_in(cfg, 'train.objective')} samples none: set train.objective = 'grpo' or "
            "pass no tools"
        )
    for key in ("tools", "environment"):
        if getattr(t, key) is not None:
            raise ConfigError(
                f"tools= in Python and train.{key} {set_in(cfg, f'train.{key}')} both answer "
                f"the model's turns; give one of them (unset train.{key}, or pass no tools=)"
            )
    check_tools(tools)


def _reward_specs(
    cfg: Config, rewards: Sequence[str | RewardFunction] | None
) -> Sequence[str | RewardFunction]:
    """GRPO's reward functions: the config's train.rewards, or the Python API's ``rewards``
    (``api.fit(cfg, rewards=[f, ...])``, whose metrics take each function's ``__name__``);
    exactly one of them."""
    t, where = cfg.train, set_in(cfg, "train.objective")
    if t.rewards is not None and rewards is not None:
        raise ConfigError(
            f"reward functions come from train.rewards {set_in(cfg, 'train.rewards')} and "
            "from rewards= in Python; give them in one place (unset train.rewards, or pass no "
            "rewards=)"
        )
    if t.rewards is None and rewards is None:
        raise ConfigError(
            f"train.objective = 'grpo' {where} needs train.rewards, the functions that score "
            'completions, e.g. ["builtin:exact_answer"] or ["rewards.py:correct"] (or, in '
            "Python, fit(..., rewards=[my_function]))"
        )
    return t.rewards if rewards is None else rewards


def rollout_params(train: TrainSection) -> SamplingParams:
    """GRPO's rollout sampler (temperature only, so that a sampled token's log-prob is the
    training forward's): one home, checked by :func:`check` before the first step."""
    return SamplingParams(temperature=train.temperature, top_k=None, top_p=None, min_p=0.0)


def check_tool_template(template: ChatTemplate | None) -> None:
    """ConfigError unless ``template`` can show the model its tools (``train.tools``): it
    must render ``tools`` into the prompt; a template without a call format of its own
    (Hermes' ``<tool_call>``, Llama 3.x's ``ipython``) gets llama.cpp's generic JSON form,
    which is said once as a warning. Also refuses a call syntax llamatrain cannot parse."""
    if template is None or "tools" not in template.source:
        name = "no chat template" if template is None else f"the chat template {template.name}"
        raise ConfigError(
            f"train.tools needs a chat template that renders tools into the prompt, and "
            f"{name} does not; set data.chat_template to a template with tools (Qwen 2.5/3, "
            "Llama 3.1+, Hermes: e.g. the model's own from its GGUF)"
        )
    if call_syntax(template.source).format is CallFormat.GENERIC:
        warnings.warn(
            f"the chat template {template.name} has no tool-call format of its own; the "
            'rollouts read calls in llama.cpp\'s generic JSON form ({"tool_call": {"name": '
            '..., "arguments": {...}}}), which llama-server --jinja parses for it too',
            LlamatrainWarning,
            stacklevel=2,
        )
