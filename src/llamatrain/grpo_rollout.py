"""GRPO on a model being trained: rollouts, their rewards and advantages, and each micro-batch's
loss, as the trainer asks for them (``train.objective = "grpo"``).

A step (TRL's generation batch with its default ``steps_per_generation``) draws
``n_batch / n_ctx / num_generations`` prompt rows (``llamatrain.data.prompts``) and samples
G = ``num_generations`` completions of each from the model being trained — our own KV-cache
decoder (``llamatrain.generate``) on the very weights, LoRA adapters on: no second copy, no
weight sync. Sampling is temperature only (top-k, top-p and min-p off), so a sampled token's
log-prob is the training forward's ``log_softmax(logits / temperature)`` (TRL's convention).
A completion ends at its first stop token (EOS, or the chat template's end-of-turn token),
included; one without is truncated at ``max_completion_length``.

A step's rows (this rank's share) decode as one batch, prompts of every length and their
groups together: the prompts are left-padded to the longest, each row's rope positions are its
own and the padding is masked out of every attention (``generate_stream``), so each row's
logits are its unpadded decode's, to float rounding. Each row's sampler is seeded by
``(train.seed, step, its index in the step)``: a row draws what it would in any batch, so a
resumed run draws what the uninterrupted run drew, with no generator state to store, and a row
draws alike on any number of ranks.

Under DDP (``train.parallel = "ddp"``) each rank samples, scores and trains on its contiguous
share of the step's prompts, whole groups (TRL splits a generation batch's rows across its
processes and gathers them for the advantages; whole groups keep a prompt's G completions in
one rank and need no exchange before the rewards). The ranks' reward tables, completion
lengths and texts are gathered, so the advantages are over each whole group (and, with
``scale_rewards = "batch"``, the whole step), the reward and length metrics are the whole
step's, and dapo divides by the step's counted tokens over all ranks (TRL's
``num_items_in_batch``). Each rank's grpo, bnpo and dr_grpo losses are divided by its own
micro-batches' count (TRL's per-process gradient accumulation), so with the same micro-batches
DDP's average of the ranks' gradients is one process's. The loss's metrics are means over every
rank's micro-batches. The held-out prompts are shared out and gathered alike.

The rewards (``llamatrain.rewards.score``, TRL's signature) and the advantages
(``llamatrain.grpo.score_rewards``) are the whole step's; the loss is ``llamatrain.grpo.GRPOLoss``
on log-probs of the chunked head (``model(…, logps_of=, temperature=)``, no B×T×V logits).
With ``num_iterations`` μ > 1 a rollout serves μ steps and its log-probs, taken once after
sampling, are the old policy's; with β > 0 the reference is the base, scored once per rollout
with the same micro-batches, autocast and temperature: a LoRA run's model with its adapters
switched off (``lora.adapters_disabled``), a full finetune's frozen base held as its GGUF
stores it (``build.build_base_reference``), no gradient either way.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from llamatrain import parallel
from llamatrain.chat_template import ChatTemplate
from llamatrain.config import Config, rollout_params
from llamatrain.data.prompts import PromptRow
from llamatrain.errors import ConfigError, DataError
from llamatrain.generate import generate_stream
from llamatrain.grpo import GRPOLoss, score_rewards
from llamatrain.lora import adapters_disabled, decoded_base
from llamatrain.memory import available_memory
from llamatrain.model import Llama
from llamatrain.ops.sets import IGNORE_INDEX
from llamatrain.rewards import Reward, TrainerState, score, trl_completions
from llamatrain.sampling import SamplingParams
from llamatrain.tokenizer import Tokenizer

__all__ = ["GRPOObjective", "Rollout", "sample_completions", "stop_ids"]


@dataclass(frozen=True)
class Rollout:
    """One step's completions laid into rows for the loss, this rank's: ``inputs`` and
    ``targets`` (N, L) (a row is prompt + completion, targets the completion's tokens, -100
    elsewhere), ``mask`` (N, L) the targets that count, ``advantages`` (N,), the old policy's
    and the reference's log-probs of the targets when used. The whole step's, over every
    rank: ``batch_tokens`` (the counted targets, dapo's divisor), ``completion_tokens`` (every
    completion's, its throughput), the metrics (TRL's names) and the table (prompt,
    completion, rewards, advantage), a row each completion."""

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    batch_tokens: float
    completion_tokens: int
    metrics: dict[str, float]
    table: list[dict[str, Any]]


@dataclass(frozen=True)
class _Scored:
    """What one rank sampled and scored, as the ranks exchange it: (n, F) rewards (NaN:
    None), the prompts as the reward functions got them, the completions' texts, lengths
    (tokens, the stop token counted) and whether each was truncated, and the targets it
    counts for the loss."""

    table: torch.Tensor
    prompts: list[Any]
    texts: list[str]
    lengths: list[int]
    truncated: list[bool]
    counted: float

    @staticmethod
    def gathered(mine: _Scored) -> _Scored:
        """Every rank's, in rank order (the rows' order on one process)."""
        parts = parallel.each_rank(mine)
        return _Scored(
            torch.cat([p.table for p in parts]),
            [prompt for p in parts for prompt in p.prompts],
            [text for p in parts for text in p.texts],
            [n for p in parts for n in p.lengths],
            [t for p in parts for t in p.truncated],
            sum(p.counted for p in parts),
        )


def stop_ids(tokenizer: Tokenizer, template: ChatTemplate | None) -> frozenset[int]:
    """What ends a completion: EOS, and the template's end-of-turn marker when it is one
    token (``<|im_end|>``), as ``llamatrain chat`` stops."""
    ids = {tokenizer.eos_id}
    if template is not None:
        with contextlib.suppress(DataError):  # a template ending turns with EOS alone
            marker = tokenizer.encode(template.end_of_turn, special=True)
            ids |= set(marker) if len(marker) == 1 else set()
    return frozenset(ids)


@contextlib.contextmanager
def _evaluating(model: Llama) -> Iterator[None]:
    """The model in eval mode (no adapter dropout) for sampling; its mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def sample_completions(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams,
    stops: frozenset[int],
    seeds: Callable[[int], int],
    *,
    autocast: contextlib.AbstractContextManager | None = None,
    progress: bool = False,
) -> list[list[int]]:
    """Each prompt's completion: its sampled tokens up to and including its first stop token
    (all ``max_new_tokens`` when none came). The prompts, of any lengths, decode as one batch
    (``generate_stream``'s ragged prompts), prompt i's sampler seeded by ``seeds(i)``; a
    progress bar counts finished completions.

    One batch, not batches of a bounded size: it holds every row's KV cache at once (rows x
    (longest prompt + ``max_new_tokens``) positions) and its prompt pass the (rows, longest
    prompt, vocab) logits, as a step whose prompts share one length always did; the training
    step that follows holds the same rows' activations."""
    if not prompts:
        return []
    bar = tqdm(
        total=len(prompts), desc="rollout", unit="completion", leave=False, disable=not progress
    )
    device = next(model.parameters()).device
    stop_tensor = torch.tensor(sorted(stops), device=device)
    row_seeds = [seeds(i) for i in range(len(prompts))]
    decoded = decoded_base(model, _decoding_budget(device))
    with _evaluating(model), decoded, autocast or contextlib.nullcontext(), bar:
        stream = generate_stream(model, prompts, max_new_tokens, params, row_seeds, stops)
        done, new = 0, []
        for token in stream:
            new.append(token)
            finished = int(torch.isin(token, stop_tensor).sum())  # stopped rows repeat it
            bar.update(max(finished - done, 0))
            done = max(done, finished)
        bar.update(len(prompts) - done)
    sampled = torch.stack(new, dim=1).tolist() if new else [[] for _ in prompts]
    return [_until_stop(ids, stops) for ids in sampled]


def _decoding_budget(device: torch.device) -> int | None:
    """What a rollout may spend holding its model's stored weights decoded
    (``lora.decoded_base``): half the memory this process may still take, on the CPU, where a
    decode per token costs most of a rollout; elsewhere none (a GPU decodes at its bandwidth,
    and its memory is the training step's)."""
    if device.type != "cpu":
        return None
    available = available_memory()
    return None if available is None else available // 2


def _until_stop(ids: list[int], stops: frozenset[int]) -> list[int]:
    """``ids`` up to and including the first stop token (a stopped row repeats it after)."""
    for n, token in enumerate(ids):
        if token in stops:
            return ids[: n + 1]
    return ids


def training_rows(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) (N, L), L the longest row less one: row i is prompt + completion
    shifted by one, its targets the completion's tokens (-100 on the prompt and padding)."""
    rows = [[*p, *c] for p, c in zip(prompts, completions, strict=True)]
    width = max(len(r) for r in rows) - 1
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        inputs[i, : len(row) - 1] = torch.tensor(row[:-1])
        targets[i, len(prompt) - 1 : len(row) - 1] = torch.tensor(row[len(prompt) :])
    return inputs, targets


@torch.no_grad()
def scored_logps(
    model: Llama,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    micro_batch: int,
    autocast: contextlib.AbstractContextManager,
) -> torch.Tensor:
    """(N, L) the targets' log-probs at ``temperature``, ``micro_batch`` rows at a time,
    without gradients (the old policy's, or with the adapters off the reference's)."""
    device = next(model.parameters()).device
    parts = []
    for x, y in zip(inputs.split(micro_batch), targets.split(micro_batch), strict=True):
        with autocast:
            logps = model(x.to(device), logps_of=y.to(device), temperature=temperature)
        parts.append(logps.float())
    return torch.cat(parts)


def completion_metrics(lengths: Sequence[int], truncated: Sequence[bool]) -> dict:
    """TRL's completion-length metrics (lengths count the stop token)."""
    truncated = torch.tensor(truncated, dtype=torch.bool)
    lengths = torch.tensor(lengths, dtype=torch.float64)
    ended = lengths[~truncated]
    metrics = {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.double().mean()),
    }
    for name, reduce in (("mean", torch.mean), ("min", torch.min), ("max", torch.max)):
        value = float(reduce(ended)) if len(ended) else 0.0
        metrics[f"completions/{name}_terminated_length"] = value
    return metrics


class GRPOObjective:
    """``train.objective = "grpo"`` over one model: each step's :class:`Rollout`, its
    micro-batches' losses and the step's metrics, and the held-out greedy reward."""

    def __init__(
        self,
        cfg: Config,
        tokenizer: Tokenizer,
        template: ChatTemplate | None,
        rewards: Sequence[Reward],
        ranks: int = 1,
        reference: Llama | None = None,
    ) -> None:
        """``ranks``: how many DDP ranks share each step (each its whole groups).
        ``reference``: the frozen model the KL term scores against (a full finetune's base);
        None: the trained model with its LoRA adapters off."""
        t = cfg.train
        self.cfg, self.tokenizer, self.rewards = cfg, tokenizer, list(rewards)
        self.loss_fn = GRPOLoss(t.loss_type, t.beta, t.epsilon, t.epsilon_high)
        self.stops = stop_ids(tokenizer, template)
        self.micro_batch = cfg.seqs_per_ubatch
        self.ranks = _checked_ranks(cfg, ranks)
        # TRL's per-process gradient accumulation steps: this rank's micro-batches
        self.accumulation = math.ceil(cfg.seqs_per_batch // ranks / cfg.seqs_per_ubatch)
        self.reference = reference
        self.weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)
        self.names = [r.name for r in self.rewards]
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
        params = rollout_params(t)
        completions = sample_completions(
            model,
            [r.ids for r in rows],
            t.max_completion_length,
            params,
            self.stops,
            lambda i: abs(hash((t.seed, step, offset + i))) % 2**63,
            autocast=autocast,
            progress=progress,
        )
        truncated = torch.tensor([not c or c[-1] not in self.stops for c in completions])
        texts = [self.tokenizer.decode(c) for c in completions]
        inputs, targets = training_rows([r.ids for r in rows], completions, self.tokenizer.eos_id)
        mask = (targets != IGNORE_INDEX).float()
        if t.mask_truncated_completions:
            mask = mask * (~truncated).float().unsqueeze(1)
        step_scored = _Scored.gathered(
            _Scored(
                self._score(rows, texts, completions, step),
                [r.prompt for r in rows],
                texts,
                [len(c) for c in completions],
                truncated.tolist(),
                float(mask.sum()),
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
        if self.reference is not None:
            scorer, switch = self.reference, contextlib.nullcontext()
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

    def _score(
        self, rows: Sequence[PromptRow], texts: list[str], completions: list[list[int]], step: int
    ) -> torch.Tensor:
        """(N, F) each function's reward of each completion (NaN: None), TRL's arguments:
        the prompts as given, the completions (messages for a conversation), their ids, every
        other column (None where a row has none) and the trainer's state."""
        prompts = [r.prompt for r in rows]
        names = dict.fromkeys(key for r in rows for key in r.columns)
        columns = {name: [r.columns.get(name) for r in rows] for name in names}
        state = TrainerState(global_step=step, max_steps=self.cfg.train.steps)
        return score(
            self.rewards,
            prompts,
            trl_completions(prompts, texts),
            completions,
            columns,
            trainer_state=state,
        )

    def _records(
        self, scored: _Scored, rewards: torch.Tensor, advantages: torch.Tensor, step: int
    ) -> list[dict[str, Any]]:
        """The completions table's rows (TRL's: prompt, completion, each reward, advantage)."""
        return [
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

    def evaluate(
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
        completions = sample_completions(
            model,
            [p.ids for p in mine],
            t.max_completion_length,
            SamplingParams(temperature=0.0),
            self.stops,
            lambda i: t.seed,
            autocast=autocast,
        )
        texts = [self.tokenizer.decode(c) for c in completions]
        truncated = [not c or c[-1] not in self.stops for c in completions]
        table = self._score(mine, texts, completions, step)
        lengths = [len(c) for c in completions]
        held_out = _Scored.gathered(_Scored(table, [], [], lengths, truncated, 0.0))
        scored = score_rewards(held_out.table, self.weights, self.names, 1, "none")
        metrics = scored.metrics | completion_metrics(held_out.lengths, held_out.truncated)
        metrics.pop("frac_reward_zero_std")
        return metrics


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
