"""GRPO's arithmetic as TRL 1.16's ``GRPOTrainer`` computes it: rewards, advantages, the loss.

Pure tensor functions, no model and no rollout: the trainer samples G = ``num_generations``
completions per prompt, asks the reward functions for their scores, hands them to
:func:`score_rewards` for the advantages, and each micro-batch's per-token log-probs (B, T)
to :class:`GRPOLoss` — log-probs from the chunked head (``model(…, logps_of=targets)``), so no
B×T×V logits exist here. The layout of T is the caller's (a completion's tokens may sit anywhere
in its row): only the log-probs, the mask and, per row, the advantage matter.

Why each step is TRL's (``trl/trainer/grpo_trainer.py``, ``_generate_and_score_completions``
and ``_compute_loss``), so a TRL user's settings and curves carry over:

- Rewards: function k's score of completion i, ``None`` (not applicable) read as NaN;
  ``R_i = nansum_k w_k·r_ik``, and a completion no function scored (all NaN) is NaN —
  "unscorable": left out of the group mean and given advantage 0. (Older TRL, before this
  rule, summed such a row to 0, which both pulled the group mean and handed the row an
  advantage; we follow 1.16.)
- Advantages: ``A_i = R_i − nanmean of its group`` (G consecutive rows a prompt), divided by
  ``std + 1e-4`` with ``scale_rewards`` "group" (the std over the group) or "batch" (over the
  whole generation batch), not divided with "none". std is ``trl.trainer.utils.nanstd``:
  Bessel-corrected, NaN with fewer than two values (whose advantages then become 0).
  1.16's GRPOConfig maps ``True`` → "group" and ``False`` → "none" (older TRL's option was
  a bool); :func:`scale_rewards_mode` does the same. Only TRL's default ``sum_then_normalize``
  aggregation of several functions is here.
- Loss per token: ``r = exp(ℓ − ℓ_old)`` (ℓ_old = ℓ detached when ``num_iterations`` = 1: a
  value of 1 whose gradient is ∇ℓ), ``−min(r·A, clip(r, 1 − ε, 1 + ε_high)·A)`` with r capped
  at ``delta`` (INTELLECT-2's two-sided clip) in the first term when given, plus β·k3 with
  ``k3 = exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1`` — multiplied by r (``use_bias_correction_kl``,
  DeepSeek-V3.2's unbiased KL gradient), which TRL 1.16 does by default (its default was off
  in earlier 1.x, e.g. 1.10); False gives the plain k3.
- Aggregation (``loss_type``): grpo = mean over rows of each row's token mean; bnpo = the
  micro-batch's token mean; dr_grpo = sum / (rows × ``max_completion_length``); the three
  divided by the gradient accumulation steps. dapo (TRL's default) = sum / the active tokens
  of the whole generation batch (TRL's ``num_items_in_batch``, after masking truncated
  completions, over its processes, times accumulation steps / ``steps_per_generation``: 1 by
  default), which the caller passes: the micro-batches' losses add up to the batch's mean.
- ``mask_truncated_completions``: a completion whose last token is not a stop token (TRL:
  an EOS id or the pad id) is left out of the loss and of the dapo token count.
- Metrics (TRL's names): reward, reward_std, rewards/<name>/mean and /std,
  frac_reward_zero_std (groups whose std ``isclose`` 0, counted per row); from the loss kl
  (β > 0), entropy (the token mean of each counted token's entropy of softmax(logits /
  temperature), which the chunked head gives beside the log-probs:
  ``model(…, logps_of=, with_entropy=True)``), clip_ratio/low_mean, high_mean, region_mean
  (token means over the micro-batch: r below 1 − ε with A < 0, above 1 + ε_high with A > 0,
  either), clip_ratio/low_min and high_max (extremes over rows of each row's share).

With ``num_iterations`` = 1 and β = 0 every ratio is 1, so the loss's value is minus a
token-weighted mean of advantages that sum to 0 over each group — near 0 — while its gradient
is −A·∇ℓ: a flat loss curve is expected, the reward is what to watch.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from llamatrain.reward_values import check_scale

__all__ = [
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "GRPOLoss",
    "LossTerms",
    "ScoredRewards",
    "group_advantages",
    "k3_kl",
    "mask_truncated",
    "nanstd",
    "reward_metrics",
    "scale_rewards_mode",
    "score_rewards",
    "truncated_completions",
    "weighted_rewards",
]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""TRL's clipped-ratio loss types (its default: dapo)."""

SCALE_REWARDS = ("group", "batch", "none")
"""What an advantage is divided by: its group's reward std, the batch's, or nothing."""

STD_EPS = 1e-4
"""TRL's guard added to the std before dividing."""


# ---- rewards and advantages ----------------------------------------------------------------


def weighted_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N,) ``Σ_k w_k·r_ik`` over the functions that scored row i (NaN ignored); NaN where
    none did (TRL 1.16's unscorable completion, kept out of the baselines)."""
    rewards = (per_function * weights.to(per_function).unsqueeze(0)).nansum(dim=1)
    unscorable = per_function.isnan().all(dim=1)
    return rewards.masked_fill(unscorable, float("nan"))


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation ignoring NaN, Bessel-corrected, NaN where fewer than two values are
    (``trl.trainer.utils.nanstd``; its factor n/(n − 1) is taken in the default dtype, float32,
    ours in ``x``'s)."""
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~x.isnan()).sum(dim=dim).to(x.dtype)
    bessel = torch.where(count > 1, count / (count - 1), float("nan"))
    return (variance * bessel).sqrt()


def scale_rewards_mode(scale_rewards: str | bool) -> str:
    """``scale_rewards`` as TRL 1.16's GRPOConfig reads it: True = "group", False = "none"."""
    mode = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    if mode not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS} (or a bool), not {mode!r}")
    return mode


def _reward_std(rewards: torch.Tensor, num_generations: int, mode: str) -> torch.Tensor:
    """(N,) the std each reward is scaled by: its group's ("group"; also computed for "none",
    where it only counts zero-std groups) or the batch's; 0 where there is one value (TRL's
    evaluation with a single generation)."""
    if mode == "batch":
        if rewards.numel() == 1:
            return torch.zeros_like(rewards)
        return nanstd(rewards).expand_as(rewards)
    if num_generations == 1:
        return torch.zeros_like(rewards)
    std = nanstd(rewards.view(-1, num_generations), dim=1)
    return std.repeat_interleave(num_generations)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str | bool = "group"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) advantages of ``rewards`` (G = ``num_generations`` consecutive rows a prompt):
    reward − group mean, over std + 1e-4 unless "none"; 0 where NaN (unscorable, or a group
    of one scored row). Also (N,) whether each row's std is (close to) 0."""
    mode = scale_rewards_mode(scale_rewards)
    baseline = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    advantages = rewards - baseline.repeat_interleave(num_generations)
    std = _reward_std(rewards, num_generations, mode)
    if mode != "none":
        advantages = advantages / (std + STD_EPS)
    return advantages.nan_to_num(nan=0.0), torch.isclose(std, torch.zeros_like(std))


def reward_metrics(
    per_function: torch.Tensor,
    rewards: torch.Tensor,
    std_is_zero: torch.Tensor,
    names: Sequence[str],
) -> dict[str, float]:
    """What TRL logs about a generation batch's rewards: each function's mean and std over
    the rows it scored, the weighted reward's mean and std over scorable rows, and the share
    of rows whose group (or batch) std is zero — groups that teach nothing."""
    metrics = {}
    for name, column in zip(names, per_function.unbind(dim=1), strict=True):
        metrics[f"rewards/{name}/mean"] = float(torch.nanmean(column))
        metrics[f"rewards/{name}/std"] = float(nanstd(column))
    metrics["reward"] = float(torch.nanmean(rewards))
    metrics["reward_std"] = float(nanstd(rewards))
    metrics["frac_reward_zero_std"] = float(std_is_zero.double().mean())
    return metrics


@dataclass(frozen=True)
class ScoredRewards:
    """A generation batch scored: (N,) weighted rewards (NaN: unscorable), (N,) advantages,
    and the reward metrics."""

    rewards: torch.Tensor
    advantages: torch.Tensor
    metrics: dict[str, float]


def score_rewards(
    per_function: torch.Tensor,
    weights: torch.Tensor,
    names: Sequence[str],
    num_generations: int,
    scale_rewards: str | bool = "group",
) -> ScoredRewards:
    """The whole batch's (all ranks', G rows a prompt in order) rewards ``per_function``
    (N, F, NaN where a function returned None: ``rewards.score``'s table) weighed
    by ``weights`` (F,), turned into advantages, and summarised."""
    if len(per_function) % num_generations:
        raise ValueError(f"{len(per_function)} completions are not groups of {num_generations}")
    rewards = weighted_rewards(per_function, weights)
    check_scale(per_function, weights, rewards, names)  # every statistic below finite
    advantages, std_is_zero = group_advantages(rewards, num_generations, scale_rewards)
    metrics = reward_metrics(per_function, rewards, std_is_zero, names)
    return ScoredRewards(rewards, advantages, metrics)


# ---- which completions count -----------------------------------------------------------------


def truncated_completions(
    completions: Sequence[Sequence[int]], stop_ids: Collection[int]
) -> torch.Tensor:
    """(B,) bool: the completions cut by the length limit, i.e. whose last token is not one
    of ``stop_ids`` (TRL: the EOS ids and the pad id)."""
    return torch.tensor([ids[-1] not in stop_ids for ids in completions], dtype=torch.bool)


def mask_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """``mask`` (B, T) with the ``truncated`` (B,) rows zeroed (``mask_truncated_completions``:
    a cut-off completion is neither rewarded nor punished for an ending it never reached)."""
    return mask * (~truncated.to(mask.device)).unsqueeze(1).to(mask.dtype)


# ---- the loss ---------------------------------------------------------------------------------


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π ‖ π_ref) on tokens sampled from π (Schulman 2020):
    ``exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1`` ≥ 0, unbiased and low-variance."""
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the tokens ``mask`` keeps (0 tokens: 0, TRL's clamp of the count)."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass(frozen=True)
class LossTerms:
    """A micro-batch's GRPO loss (what to backpropagate) and its metrics (TRL's names, 0-dim
    detached tensors: the caller decides when to read them off the device)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


@dataclass(frozen=True)
class GRPOLoss:
    """The clipped-ratio GRPO loss with TRL 1.16's knobs and defaults (``epsilon_high`` None
    = ``epsilon``; ``delta`` None = no cap on the unclipped ratio)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    use_bias_correction_kl: bool = True

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, not {self.loss_type!r}")

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def __call__(
        self,
        logps: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        *,
        old_logps: torch.Tensor | None = None,
        ref_logps: torch.Tensor | None = None,
        entropies: torch.Tensor | None = None,
        batch_tokens: float | torch.Tensor | None = None,
        max_completion_length: int | None = None,
        accumulation_steps: int = 1,
    ) -> LossTerms:
        """This micro-batch's loss from its completion tokens' log-probs ``logps`` (B, T) under
        the policy being trained, ``mask`` (B, T) the tokens that count and ``advantages``
        (B,). ``old_logps``: the rollout policy's (``num_iterations`` > 1), None = ``logps``
        detached; ``ref_logps``: the reference's (β > 0); ``entropies``: per-token entropies,
        for the metric only; ``batch_tokens``: dapo's divisor, the generation batch's counted
        tokens over all ranks, divided by the ranks whose gradients are averaged (TRL:
        ``num_items_in_batch / num_processes``); ``max_completion_length``: dr_grpo's;
        ``accumulation_steps``: what grpo, bnpo and dr_grpo divide by so that accumulated
        micro-batches average."""
        mask = mask.to(logps.dtype)
        old = logps.detach() if old_logps is None else old_logps
        ratio = torch.exp(logps - old)
        advantages = advantages.to(logps.dtype).unsqueeze(1)
        per_token, capped = self._surrogate(ratio, advantages)
        kl = self._kl(logps, ref_logps, ratio)
        if kl is not None:
            per_token = per_token + self.beta * kl
        loss = self._aggregate(
            per_token, mask, batch_tokens, max_completion_length, accumulation_steps
        )
        metrics = self._clip_metrics(capped, advantages, mask)
        if kl is not None:
            metrics["kl"] = _masked_mean(kl.detach(), mask)
        if entropies is not None:
            metrics["entropy"] = _masked_mean(entropies.detach(), mask)
        return LossTerms(loss, metrics)

    def _kl(
        self, logps: torch.Tensor, ref_logps: torch.Tensor | None, ratio: torch.Tensor
    ) -> torch.Tensor | None:
        """Per-token k3 to the reference, times the ratio with ``use_bias_correction_kl``
        (whose gradient is then the reverse KL's, unbiased off-policy); None when β = 0."""
        if self.beta == 0.0:
            return None
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probs (ref_logps)")
        kl = k3_kl(logps, ref_logps)
        return kl * ratio if self.use_bias_correction_kl else kl

    def _surrogate(
        self, ratio: torch.Tensor, advantages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``−min(r·A, clip(r)·A)``, the first r capped at ``delta``; also that
        capped r (what TRL's clip metrics read)."""
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.upper_epsilon)
        capped = ratio if self.delta is None else torch.clamp(ratio, max=self.delta)
        return -torch.min(capped * advantages, clipped * advantages), capped

    def _aggregate(
        self,
        per_token: torch.Tensor,
        mask: torch.Tensor,
        batch_tokens: float | torch.Tensor | None,
        max_completion_length: int | None,
        accumulation_steps: int,
    ) -> torch.Tensor:
        """The micro-batch's share of the step's loss, by ``loss_type``."""
        kept = per_token * mask
        if self.loss_type == "dapo":
            if batch_tokens is None:
                raise ValueError("dapo needs batch_tokens: the generation batch's counted tokens")
            return kept.sum() / torch.as_tensor(batch_tokens, dtype=kept.dtype).clamp(min=1.0)
        if self.loss_type == "grpo":
            loss = (kept.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
        elif self.loss_type == "bnpo":
            loss = _masked_mean(per_token, mask)
        else:
            if max_completion_length is None:
                raise ValueError("dr_grpo needs max_completion_length")
            loss = kept.sum() / (per_token.shape[0] * max_completion_length)
        return loss / accumulation_steps

    def _clip_metrics(
        self, ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """TRL's clip metrics: the shares of counted tokens whose ratio the clip held at its
        lower bound (r < 1 − ε where A < 0), at its upper one (r > 1 + ε_high where A > 0),
        or either; and the least lower and the most upper share of a row (rows with no
        counted token skipped)."""
        ratio = ratio.detach()
        low = ((ratio < 1 - self.epsilon) & (advantages < 0)).to(mask.dtype)
        high = ((ratio > 1 + self.upper_epsilon) & (advantages > 0)).to(mask.dtype)
        region = torch.maximum(low, high)

        def row_shares(x: torch.Tensor) -> torch.Tensor:
            shares = (x * mask).sum(dim=1) / mask.sum(dim=1)
            return shares[~shares.isnan()]

        low_rows, high_rows = row_shares(low), row_shares(high)
        nan = mask.new_tensor(float("nan"))
        return {
            "clip_ratio/low_mean": _masked_mean(low, mask),
            "clip_ratio/high_mean": _masked_mean(high, mask),
            "clip_ratio/region_mean": _masked_mean(region, mask),
            "clip_ratio/low_min": low_rows.min() if low_rows.numel() else nan,
            "clip_ratio/high_max": high_rows.max() if high_rows.numel() else nan,
        }
