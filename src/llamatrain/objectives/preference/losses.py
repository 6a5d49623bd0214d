"""Preference objectives: DPO, IPO, ORPO and SimPO on rows of chosen/rejected pairs.

The data (``llamatrain.data.preferences``) lays each pair into one row as one document whose
prompt is computed once for both replies: (B, T, 2) ``documents`` of (document, branch) ids,
pair ``k`` of a row document ``k``, its chosen reply in branch 1 and its rejected one in
branch 2, each seeing the shared prompt (branch 0) and itself; only reply tokens are scored
(targets not -100). :func:`pair_logps` sums each branch's scored log-probabilities, so one
forward over the rows gives every pair's ``log π(chosen)`` and ``log π(rejected)`` — without
the full logits: ``model(…, logps_of=targets)`` takes the lm head a chunk of rows at a time.

The losses are the published formulas, as TRL computes them, on per-pair log-probs:

- DPO (Rafailov et al. 2023, Eq. 7), with conservative DPO's label smoothing ε (Mitchell
  2023): with h = (log π_c − log π_r) − (log π_ref,c − log π_ref,r),
  ``loss = −(1 − ε)·log σ(β·h) − ε·log σ(−β·h)``; log-probs summed over the reply.
- IPO (Azar et al. 2023, Eq. 17): ``loss = (h − 1/(2β))²`` with log-probs averaged over each
  reply's tokens (TRL's choice).
- ORPO (Hong et al. 2024): ``loss = NLL(chosen) − β·log σ(log odds(c) − log odds(r))`` with
  odds(y) = p/(1 − p) of the per-token mean log-prob p, and NLL the mean over the batch's
  chosen tokens; reference-free.
- SimPO (Meng et al. 2024, Eq. 6): ``loss = −log σ(β·(m_c − m_r) − γ)`` with m the per-token
  mean log-prob of a reply and γ the target reward margin (``train.simpo_gamma``); with label
  smoothing ε as TRL's CPO trainer applies it; reference-free.

Rewards (what the metrics report) are β·(log π − log π_ref) for DPO/IPO and β·log π for ORPO
and SimPO; the reward margin is chosen − rejected, the accuracy the share of pairs with
margin > 0.

"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llamatrain.data.preferences import CHOSEN, REJECTED
from llamatrain.ops.sets import IGNORE_INDEX

__all__ = [
    "METRICS",
    "OBJECTIVES",
    "PairLogps",
    "dpo_losses",
    "ipo_losses",
    "orpo_losses",
    "pair_count",
    "pair_logps",
    "pair_slots",
    "simpo_losses",
    "slot_pairs",
    "token_logps",
]

OBJECTIVES = ("dpo", "ipo", "orpo", "simpo")
"""The preference objectives (``train.objective`` other than sft)."""

METRICS = ("reward_margin", "reward_accuracy", "reward_chosen", "reward_rejected")
"""Per-pair means a step reports, with ``logp_chosen`` and ``logp_rejected`` (the log-probs
the loss uses: summed over the reply for DPO, per-token means for IPO and ORPO)."""


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B, T) log-probability of each target under ``logits`` (B, T, V), in float32 at least;
    0 where the target is not scored (-100)."""
    scored = targets != IGNORE_INDEX
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(scored, picked - torch.logsumexp(logits, dim=-1), 0.0)


@dataclass
class PairLogps:
    """Per-pair sums of scored log-probs and their token counts, pairs in row order."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def means(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token mean log-probs of the chosen and the rejected replies."""
        return self.chosen / self.chosen_tokens, self.rejected / self.rejected_tokens


_BRANCHES = 3
"""Branches of a pair's document: its prompt (the trunk), chosen and rejected."""


def _branch_bins(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) one bin per (document, branch): ``document·3 + branch``.

    A scored target is never its branch's first token (that is the last prompt token, or the
    example's first), so its input and itself share the input's bin (``documents`` is the
    inputs').
    """
    return documents[..., 0] * _BRANCHES + documents[..., 1]


def pair_slots(logps: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """(B, k, 4): for each row's pair slot ``j`` (document j) the sums of ``logps`` over
    its chosen and its rejected branch's scored targets and their counts; a slot with no pair
    scores nothing (counts 0). k = (T + 1) // 2 for T positions."""
    scored = (targets != IGNORE_INDEX).to(logps.dtype)
    bins = _branch_bins(documents)
    n_rows, width = bins.shape
    sums = logps.new_zeros(n_rows, _BRANCHES * (width + 1)).scatter_add(1, bins, logps)
    counts = scored.new_zeros(n_rows, _BRANCHES * (width + 1)).scatter_add(1, bins, scored)
    k = (width + 1) // 2
    chosen, rejected = slice(CHOSEN, None, _BRANCHES), slice(REJECTED, None, _BRANCHES)
    parts = (sums[:, chosen], sums[:, rejected], counts[:, chosen], counts[:, rejected])
    return torch.stack([part[:, :k] for part in parts], dim=-1)


def slot_pairs(slots: torch.Tensor) -> PairLogps:
    """The pairs of ``slots`` (B, k, 4) (:func:`pair_slots`, or a :class:`ReferenceTable`'s
    rows), in row order: the slots whose chosen and rejected replies both score something."""
    real = (slots[..., 2] > 0) & (slots[..., 3] > 0)
    picked = slots[real]
    return PairLogps(picked[:, 0], picked[:, 1], picked[:, 2], picked[:, 3])


def pair_logps(logps: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor) -> PairLogps:
    """Sum ``logps`` (B, T, from :func:`token_logps`) over each branch's scored targets
    and read them as pairs: document k's chosen and rejected branch (padding scores nothing)."""
    return slot_pairs(pair_slots(logps, targets, documents))


def pair_count(targets: torch.Tensor, documents: torch.Tensor) -> int:
    """Pairs in a batch: its chosen branches that score something (each has a rejected)."""
    scored = (targets != IGNORE_INDEX).to(torch.int64)
    bins = _branch_bins(documents)
    counts = scored.new_zeros(bins.shape[0], _BRANCHES * (bins.shape[1] + 1))
    counts.scatter_add_(1, bins, scored)
    return int((counts[:, CHOSEN::_BRANCHES] > 0).sum())


# ---- the losses on log-probs (per pair) ------------------------------------------------------


def dpo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses (sigmoid; conservative with ``label_smoothing``) and the chosen
    and rejected rewards β·(log π − log π_ref)."""
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    losses = (
        -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    )
    return losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()


def ipo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair IPO losses (h − 1/(2β))² on per-token mean log-probs, and the rewards."""
    h = (chosen - rejected) - (ref_chosen - ref_rejected)
    losses = (h - 1 / (2 * beta)) ** 2
    return losses, beta * (chosen - ref_chosen).detach(), beta * (rejected - ref_rejected).detach()


def orpo_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair ORPO odds-ratio terms −β·log σ(log odds(c) − log odds(r)) on per-token mean
    log-probs (the NLL is added by the caller), and the rewards β·log π.

    log odds(p) = log p − log(1 − p), with log(1 − e^x) computed as log(−expm1(x)).
    """
    log_odds = (chosen - rejected) - (
        torch.log(-torch.expm1(chosen)) - torch.log(-torch.expm1(rejected))
    )
    losses = -beta * F.logsigmoid(log_odds)
    return losses, beta * chosen.detach(), beta * rejected.detach()


def simpo_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair SimPO losses −log σ(β·(m_c − m_r) − γ) on per-token mean log-probs m
    (label smoothing ε as TRL's CPO trainer: −(1 − ε)·log σ(z) − ε·log σ(−z)), and the
    rewards β·m."""
    z = beta * (chosen - rejected) - gamma
    losses = -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing
    return losses, beta * chosen.detach(), beta * rejected.detach()
