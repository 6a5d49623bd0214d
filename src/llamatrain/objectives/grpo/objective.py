"""GRPO as the trainer drives it (``train.objective = "grpo"``): each step's rollout
(:mod:`.rollout`), its micro-batches' losses (:mod:`.loss`), the step's metrics with TRL's
names, the held-out greedy reward, and the last steps' completions kept in
``completions.jsonl`` beside ``metrics.jsonl`` (each logged step's also go to the trackers).

A step (TRL's generation batch with its default ``steps_per_generation``) draws
``n_batch / n_ctx / num_generations`` prompt rows (``llamatrain.data.prompts``) and samples
G = ``num_generations`` completions of each from the model being trained. Under DDP
(``train.parallel = "ddp"``) each rank samples, scores and trains on its contiguous share of the
step's prompts, whole groups (TRL splits a generation batch's rows across its processes and
gathers them for the advantages; whole groups keep a prompt's G completions in one rank and
need no exchange before the rewards). The ranks' reward tables, completion lengths and texts
are gathered, so the advantages are over each whole group (and, with ``scale_rewards =
"batch"``, the whole step), the reward and length metrics are the whole step's, and dapo
divides by the step's counted tokens over all ranks (TRL's ``num_items_in_batch``). Each
rank's grpo, bnpo and dr_grpo losses are divided by its own micro-batches' count (TRL's
per-process gradient accumulation), so with the same micro-batches DDP's average of the ranks'
gradients is one process's. The loss's metrics are means over every rank's micro-batches. The
held-out prompts are shared out and gathered alike.

With ``num_iterations`` μ > 1 a rollout serves μ steps and its log-probs, taken once after
sampling, are the old policy's; with β > 0 the reference is the base, scored once per rollout
with the same micro-batches, autocast and temperature: a LoRA run's model with its adapters
switched off (``lora.adapters_disabled``), a full finetune's frozen base held as its GGUF
stores it (:mod:`.reference`), no gradient either way.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from llamatrain import parallel
from llamatrain.chat_template import ChatTemplate
from llamatrain.config import Config
from llamatrain.data.prompts import PromptRow
from llamatrain.errors import ConfigError
from llamatrain.files import check_target, write_text_atomically
from llamatrain.lora import adapters_disabled
from llamatrain.model import Llama
from llamatrain.objectives.base import ObjectiveBase, StepContext, StepResult
from llamatrain.objectives.grpo.environment import REWARD_NAME, Environment
from llamatrain.objectives.grpo.loss import GRPOLoss, score_rewards, truncated_completions
from llamatrain.objectives.grpo.multi_turn import MultiTurn, Turns
from llamatrain.objectives.grpo.reference import GRPO_REFERENCE_ROLE, FrozenReference
from llamatrain.objectives.grpo.rewards import Reward, TrainerState, score
from llamatrain.objectives.grpo.rollout import (
    Rollout,
    Scored,
    completion_metrics,
    loss_mask,
    sample_completions,
    scored_logps,
    stop_ids,
    training_rows,
)
from llamatrain.objectives.grpo.rules import rollout_params
from llamatrain.objectives.grpo.tool_turns import ToolSettings
from llamatrain.objectives.grpo.turns import Completion
from llamatrain.plot import read_records
from llamatrain.sampling import SamplingParams
from llamatrain.tokenizer import Tokenizer
from llamatrain.tools.loading import Tool

__all__ = ["COMPLETIONS_FILE", "COMPLETION_STEPS", "GRPOObjective"]

COMPLETIONS_FILE, COMPLETIONS_KIND = "completions.jsonl", "completions table"
"""GRPO's table of the last steps' completions in the run folder, and how a refusal names it."""

COMPLETION_STEPS = 5
"""Steps whose completions ``completions.jsonl`` keeps (the last ones)."""


class GRPOObjective(ObjectiveBase):
    """``train.objective = "grpo"`` over one model: each step's :class:`Rollout`, its
    micro-batches' losses and the step's metrics, the held-out greedy reward, and the
    completions table of the last steps (``completions.jsonl``)."""

    name = "grpo"
    watches = None  # the held-out reward, which no convergence test watches
    reference_role = GRPO_REFERENCE_ROLE

    def __init__(
        self,
        cfg: Config,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        rewards: Sequence[Reward],
        ranks: int = 1,
        reference: FrozenReference | None = None,
        tools: Sequence[Tool] = (),
        environment: Environment | None = None,
    ) -> None:
        """``ranks``: how many DDP ranks share each step (each its whole groups).
        ``reference``: the frozen base the KL term scores against (a full finetune's, and
        the file the checkpoints record); None: the trained model with its adapters off.
        ``tools``: what the model may call in its rollouts (``train.tools``, loaded);
        ``environment``: what replies to its turns (``train.environment``, loaded)."""
        t = cfg.train
        self.cfg, self.tokenizer, self.rewards = cfg, tokenizer, list(rewards)
        settings = ToolSettings(
            t.max_tool_calls if t.max_tool_calls is not None else t.max_completion_length,
            t.tool_timeout,
            t.tool_output_chars,
        )
        self.turns = MultiTurn(tools, settings, environment, template, tokenizer)
        self.environment_reward = environment is not None and environment.owns_reward
        self.loss_fn = GRPOLoss(t.loss_type, t.beta, t.epsilon, t.epsilon_high)
        self.stops = stop_ids(tokenizer, template)
        self.micro_batch = cfg.seqs_per_ubatch
        self.ranks = _checked_ranks(cfg, ranks)
        # TRL's per-process gradient accumulation steps: this rank's micro-batches
        self.accumulation = math.ceil(cfg.seqs_per_batch // ranks / cfg.seqs_per_ubatch)
        self.held = None if reference is None else reference.model
        self.reference = None if reference is None else reference.source
        self.completions: list[dict] = []  # the last COMPLETION_STEPS steps' table
        weights = [r.weight for r in self.rewards] + [1.0] * self.environment_reward
        self.weights = torch.tensor(weights, dtype=torch.float64)
        self.names = [r.name for r in self.rewards] + [REWARD_NAME] * self.environment_reward
        self._rollout: Rollout | None = None
        self._metrics: dict[str, list[torch.Tensor]] = {}

    # ---- rollouts ----------------------------------------------------------------------

    def rollout_for(
        self,
        step: int,
        draw: Callable[[], list[PromptRow]],
        model: Llama,
        autocast: contextlib.AbstractContextManager,
        progress: bool,
    ) -> Rollout:
        """The rollout step ``step`` (0-based) trains on: a new one every ``num_iterations``
        steps (``draw`` gives its prompts), else the last one again. A run resumed inside a
        cycle no longer holds its rollout and starts a new one (with a warning)."""
        mu = self.cfg.train.num_iterations
        if self._rollout is None or step % mu == 0:
            if step % mu:
                warnings.warn(
                    f"resumed at step {step}, inside a train.num_iterations = {mu} cycle whose "
                    "rollout is not in the checkpoint; a new rollout starts here",
                    stacklevel=2,
                )
            self._rollout = self.rollout(draw(), step, model, autocast, progress)
        return self._rollout

    def rollout(
        self,
        prompts: Sequence[PromptRow],
        step: int,
        model: Llama,
        autocast: contextlib.AbstractContextManager,
        progress: bool = False,
    ) -> Rollout:
        """G completions of each of ``prompts`` (the step's, every rank's) sampled, scored
        and laid into rows: this rank's share of them, advantages over the whole step."""
        t = self.cfg.train
        first, mine = self._share(prompts)
        rows = [p for p in mine for _ in range(t.num_generations)]
        offset = first * t.num_generations  # this rank's first row in the step

        def seeds(i: int) -> int:  # row i's sampler: the same in any batch, on any rank
            return abs(hash((t.seed, step, offset + i))) % 2**63

        turns, completions = self._sample(model, rows, rollout_params(t), seeds, autocast, progress)
        ids = [c.tokens for c in completions]
        truncated = truncated_completions(ids, self.stops)
        texts = [self.tokenizer.decode(c.tokens) for c in completions]
        inputs, targets = training_rows(turns.prompt_ids, ids, self.tokenizer.eos_id)
        mask = loss_mask(targets, completions, truncated, t.mask_truncated_completions)
        step_scored = Scored.gathered(
            Scored(
                self._score(rows, texts, completions, step, turns),
                turns.prompts,
                texts,
                [sum(c.mask) for c in completions],
                truncated.tolist(),
                float(mask.sum()),
                turns.counts(),
            )
        )
        scored = score_rewards(
            step_scored.table, self.weights, self.names, t.num_generations, t.scale_rewards
        )
        old = ref = None
        if t.num_iterations > 1:
            old = scored_logps(model, inputs, targets, t.temperature, self.micro_batch, autocast)
        if t.beta > 0:
            ref = self._reference_logps(model, inputs, targets, autocast)
        metrics = scored.metrics | completion_metrics(step_scored.lengths, step_scored.truncated)
        metrics |= self.turns.metrics(step_scored.turns)
        return Rollout(
            inputs,
            targets,
            mask,
            scored.advantages[offset : offset + len(rows)].float(),
            old,
            ref,
            batch_tokens=step_scored.counted,
            completion_tokens=sum(step_scored.lengths),
            metrics=metrics,
            table=self._records(step_scored, scored.rewards, scored.advantages, step),
        )

    def _reference_logps(
        self,
        model: Llama,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        autocast: contextlib.AbstractContextManager,
    ) -> torch.Tensor:
        """The reference's log-probs of the targets: the frozen base's when one was given,
        else ``model``'s with its adapters off (the same weights, no second copy)."""
        t = self.cfg.train
        if self.held is not None:
            scorer, switch = self.held, contextlib.nullcontext()
        else:
            scorer, switch = model, adapters_disabled(model)
        with switch:
            return scored_logps(scorer, inputs, targets, t.temperature, self.micro_batch, autocast)

    def _share(self, prompts: Sequence[PromptRow]) -> tuple[int, Sequence[PromptRow]]:
        """This rank's contiguous share of ``prompts`` (equal for a step's, within one for
        the held-out ones) and the index of its first."""
        n, rank = len(prompts), parallel.rank() if self.ranks > 1 else 0
        first, end = rank * n // self.ranks, (rank + 1) * n // self.ranks
        return first, prompts[first:end]

    def _sample(
        self,
        model: Llama,
        rows: Sequence[PromptRow],
        params: SamplingParams,
        seeds: Callable[[int], int],
        autocast: contextlib.AbstractContextManager,
        progress: bool = False,
    ) -> tuple[Turns, list[Completion]]:
        """Each row's completion, and how its turns were answered (tools, an environment)."""
        turns = self.turns.start(rows)
        completions = sample_completions(
            model,
            turns.prompt_ids,
            self.cfg.train.max_completion_length,
            params,
            self.stops,
            seeds,
            autocast=autocast,
            progress=progress,
            responder=turns.responder,
        )
        return turns, completions

    def _score(
        self,
        rows: Sequence[PromptRow],
        texts: list[str],
        completions: list[Completion],
        step: int,
        turns: Turns,
    ) -> torch.Tensor:
        """(N, F) each function's reward of each completion (NaN: None), TRL's arguments:
        the prompts as given, the completions (messages for a conversation: with tools its
        calls, their results and the last reply, as TRL passes them), their ids, every other
        column (None where a row has none) and the trainer's state; then the environment's
        own reward, when it has one."""
        names = dict.fromkeys(key for r in rows for key in r.columns)
        columns = {name: [r.columns.get(name) for r in rows] for name in names}
        state = TrainerState(global_step=step, max_steps=self.cfg.train.steps)
        table = score(
            self.rewards,
            turns.prompts,
            turns.completions(completions, texts, self.stops),
            [c.tokens for c in completions],
            columns,
            trainer_state=state,
        )
        if not self.environment_reward:
            return table
        own = torch.tensor(turns.rewards(), dtype=torch.float64)
        return torch.cat([table, own[:, None]], dim=1)

    def _records(
        self, scored: Scored, rewards: torch.Tensor, advantages: torch.Tensor, step: int
    ) -> list[dict[str, Any]]:
        """The completions table's rows (TRL's: prompt, completion, each reward, advantage);
        with tools (or an environment) the completion's text holds its calls and their results
        (the environment's replies) as the model read them, and ``tools`` its calls, rounds
        and failed calls (``environment`` its replies)."""
        records = [
            {
                "step": step + 1,
                "prompt": prompt,
                "completion": text,
                "rewards": {
                    n: _number(v) for n, v in zip(self.names, scores.tolist(), strict=True)
                },
                "reward": _number(float(reward)),
                "advantage": float(advantage),
            }
            for prompt, text, scores, reward, advantage in zip(
                scored.prompts, scored.texts, scored.table, rewards, advantages, strict=True
            )
        ]
        if scored.turns is not None:
            for record, row in zip(records, scored.turns, strict=True):
                record[self.turns.key] = self.turns.record(row)
        return records

    # ---- the loss ----------------------------------------------------------------------

    def start_step(self) -> None:
        """Forget the last step's loss metrics."""
        self._metrics = {}

    def micro_batch_loss(
        self,
        logps: torch.Tensor,
        entropies: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        old_logps: torch.Tensor | None,
        ref_logps: torch.Tensor | None,
        rollout: Rollout,
    ) -> torch.Tensor:
        """This micro-batch's share of the step's loss from the policy's log-probs ``logps``
        of its targets and their entropies (its rows of ``rollout``'s mask, advantages, old and
        reference log-probs); its metrics kept for :meth:`metrics`."""
        device = logps.device
        terms = self.loss_fn(
            logps,
            mask.to(device),
            advantages.to(device),
            old_logps=None if old_logps is None else old_logps.to(device),
            ref_logps=None if ref_logps is None else ref_logps.to(device),
            entropies=entropies,
            batch_tokens=rollout.batch_tokens / self.ranks,  # TRL: num_items / num_processes
            max_completion_length=self.cfg.train.max_completion_length,
            accumulation_steps=self.accumulation,
        )
        for name, value in terms.metrics.items():
            self._metrics.setdefault(name, []).append(value.detach())
        return terms.loss

    def metrics(self, rollout: Rollout) -> dict[str, float]:
        """The step's metrics: the rollout's and the loss's (each the mean over every rank's
        micro-batches, NaN ones skipped: what one process holding them all logs)."""
        names = sorted(self._metrics)
        mine = torch.stack([torch.stack(self._metrics[n]).double().cpu() for n in names], dim=1)
        means = torch.cat(parallel.each_rank(mine)).nanmean(dim=0)
        return rollout.metrics | dict(zip(names, means.tolist(), strict=True))

    # ---- evaluation --------------------------------------------------------------------

    def evaluate_prompts(
        self,
        model: Llama,
        prompts: Sequence[PromptRow],
        step: int,
        autocast: contextlib.AbstractContextManager,
    ) -> dict[str, float]:
        """The held-out prompts' greedy completions scored after ``step`` steps: ``reward``
        (their weighted mean) and each function's mean and std, TRL's names; each rank
        decodes and scores its share, the metrics are over them all."""
        t = self.cfg.train
        _, mine = self._share(prompts)
        greedy = SamplingParams(temperature=0.0)
        turns, completions = self._sample(model, mine, greedy, lambda i: t.seed, autocast)
        texts = [self.tokenizer.decode(c.tokens) for c in completions]
        truncated = [c.tokens[-1] not in self.stops for c in completions]
        table = self._score(mine, texts, completions, step, turns)
        lengths = [sum(c.mask) for c in completions]
        mine_scored = Scored(table, [], [], lengths, truncated, 0.0, turns.counts())
        held_out = Scored.gathered(mine_scored)
        scored = score_rewards(held_out.table, self.weights, self.names, 1, "none")
        metrics = scored.metrics | completion_metrics(held_out.lengths, held_out.truncated)
        metrics |= self.turns.metrics(held_out.turns)
        metrics.pop("frac_reward_zero_std")
        return metrics

    # ---- as the trainer drives it ----------------------------------------------------------

    def step(self, ctx: StepContext, step: int) -> StepResult:
        """The rollout (new, or the last one again within ``num_iterations``), then the
        update; its throughput counts the completions' tokens (every rank's), and the
        rollout's share of the time is logged as ``rollout_s``."""
        started = time.perf_counter()

        def draw() -> list[PromptRow]:
            return ctx.data.train.batch(ctx.data.sampler.next_indices())

        rollout = self.rollout_for(step, draw, ctx.model, ctx.autocast(), ctx.progress)
        rolled = time.perf_counter()
        loss = ctx.train_step(rollout)
        metrics = self.metrics(rollout) | {"rollout_s": rolled - started}
        self._keep_completions(ctx, rollout, step + 1)
        rows, scored = len(rollout.table), int(rollout.batch_tokens)
        return StepResult(loss, rows, scored, rollout.completion_tokens, metrics)

    def accumulate(self, ctx: StepContext, rollout: Rollout) -> float:
        """The rollout's rows (this rank's share; the loss returned is the mean over the
        ranks, as DDP's gradients) in micro-batches, each loss the objective's share of the
        step's (its ``loss_type`` says how); the policy's log-probs of the completions (and
        their entropies, a metric) come through the wrapper at the rollout's temperature."""
        self.start_step()
        parts = (rollout.mask, rollout.advantages, rollout.old_logps, rollout.ref_logps)
        total = 0.0
        for last, (x, y, *rows) in ctx.split(rollout.inputs, rollout.targets, *parts):
            with ctx.parallel.gradient_sync(last):
                with ctx.autocast():
                    logps, entropies = ctx.logits_fn(
                        x.to(ctx.device),
                        logps_of=y.to(ctx.device),
                        temperature=self.cfg.train.temperature,
                        with_entropy=True,
                    )
                loss = self.micro_batch_loss(logps.float(), entropies, *rows, rollout)
                loss.backward()
            total += loss.item()
        return parallel.average(total)

    def evaluate(self, ctx: StepContext, step: int) -> dict[str, float]:
        """The held-out prompts' greedy reward (the first ``eval_batches`` steps' worth)."""
        prompts = list(ctx.data.val)
        if ctx.cfg.train.eval_batches:
            prompts = prompts[: ctx.cfg.train.eval_batches * ctx.data.n_seq]
        metrics = self.evaluate_prompts(ctx.model, prompts, step, ctx.autocast())
        return {f"val_{k}": v for k, v in metrics.items()}

    def describe(self, record: dict[str, Any]) -> str:
        return (
            f"step {record['step']}: val_reward {record['val_reward']:.4f} completion "
            f"length {record['val_completions/mean_length']:.1f}"
        )

    def postfix(self, record: dict[str, Any]) -> dict[str, str]:
        return {"reward": f"{record['reward']:.3f}"}

    # ---- the completions table ---------------------------------------------------------

    def start(self, ctx: StepContext, step: int) -> None:
        """A resume keeps the table's rows up to its step (later ones are about to be
        redone); the file is never read or written through a link."""
        path = ctx.run_dir / COMPLETIONS_FILE
        check_target(path, COMPLETIONS_KIND)
        if ctx.main and path.exists():
            self.completions = [r for r in read_records(path) if r["step"] <= step]

    def _keep_completions(self, ctx: StepContext, rollout: Rollout, step: int) -> None:
        """Rewrite ``completions.jsonl`` with the last :data:`COMPLETION_STEPS` steps' tables
        (prompt, completion, each reward, the reward and the advantage), step ``step``'s
        (1-based) last."""
        if not ctx.main:
            return
        kept = [r for r in self.completions if r["step"] > step - COMPLETION_STEPS]
        self.completions = [*kept, *(r | {"step": step} for r in rollout.table)]
        text = "".join(json.dumps(r, default=str) + "\n" for r in self.completions)
        write_text_atomically(ctx.run_dir / COMPLETIONS_FILE, text, COMPLETIONS_KIND)

    def logged(self, ctx: StepContext, step: int) -> None:
        """This step's completions table (as ``completions.jsonl`` keeps it) to the trackers,
        at the steps whose metrics they receive."""
        if ctx.trackers is not None:
            ctx.trackers.completions(step, [r for r in self.completions if r["step"] == step])


def _checked_ranks(cfg: Config, ranks: int) -> int:
    """``ranks``, when they can share each step's prompts as whole groups, equally; else
    ConfigError with the n_batch that can."""
    t = cfg.train
    prompts = cfg.seqs_per_batch // t.num_generations
    if prompts % ranks:
        unit = t.num_generations * ranks * cfg.data.n_ctx
        raise ConfigError(
            f"train.n_batch = {t.n_batch} holds {prompts} prompts a step (their groups of "
            f"train.num_generations = {t.num_generations}), which {ranks} ranks cannot share "
            f"equally as whole groups; make n_batch a multiple of {unit} (num_generations x "
            f"ranks x data.n_ctx)"
        )
    return ranks


def _number(value: float) -> float | None:
    """A reward as JSON holds it: NaN (a None, or no function scored it) as null."""
    return None if math.isnan(value) else value
