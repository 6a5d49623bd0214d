"""Preference objectives: DPO, IPO and ORPO on rows of chosen/rejected pairs.

The data (``llamatrain.data.preferences``) lays each pair into one row as two documents:
document ``2k`` is pair ``k``'s chosen reply, ``2k + 1`` its rejected one, and only reply
tokens are scored (targets not -100). :func:`pair_logps` sums each document's scored
log-probabilities, so one forward over the rows gives every pair's
``log π(chosen)`` and ``log π(rejected)``.

The losses are the published formulas, as TRL computes them, on per-pair log-probs:

- DPO (Rafailov et al. 2023, Eq. 7), with conservative DPO's label smoothing ε (Mitchell
  2023): with h = (log π_c − log π_r) − (log π_ref,c − log π_ref,r),
  ``loss = −(1 − ε)·log σ(β·h) − ε·log σ(−β·h)``; log-probs summed over the reply.
- IPO (Azar et al. 2023, Eq. 17): ``loss = (h − 1/(2β))²`` with log-probs averaged over each
  reply's tokens (TRL's choice).
- ORPO (Hong et al. 2024): ``loss = NLL(chosen) − β·log σ(log odds(c) − log odds(r))`` with
  odds(y) = p/(1 − p) of the per-token mean log-prob p, and NLL the mean over the batch's
  chosen tokens; reference-free.

Rewards (what the metrics report) are β·(log π − log π_ref) for DPO/IPO and β·log π for ORPO;
the reward margin is chosen − rejected, the accuracy the share of pairs with margin > 0.

The reference of DPO/IPO is the model with its LoRA adapters switched off
(``llamatrain.lora.adapters_disabled``), computed without gradients on the same rows just
before the policy's forward: no second copy of the weights.

A step's loss is the mean over its pairs (ORPO's NLL: over its chosen tokens) however the
step is cut into micro-batches: :meth:`PreferenceObjective.loss` divides each micro-batch's
sums by the whole batch's counts (:meth:`PreferenceObjective.batch_counts`), so the
accumulated gradient equals the whole batch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llamatrain.lora import adapters_disabled
from llamatrain.model import IGNORE_INDEX, Llama

__all__ = [
    "METRICS",
    "PairLogps",
    "PreferenceObjective",
    "dpo_losses",
    "ipo_losses",
    "orpo_losses",
    "pair_logps",
    "token_logps",
]

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


def pair_logps(logps: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor) -> PairLogps:
    """Sum ``logps`` (B, T, from :func:`token_logps`) over each document's scored targets
    and read them as pairs: document 2k chosen, 2k + 1 rejected (padding scores nothing).

    A scored target is never its document's first token, so its input and itself share the
    input's document id (``documents`` is the inputs').
    """
    scored = (targets != IGNORE_INDEX).to(logps.dtype)
    n_rows, width = documents.shape
    sums = logps.new_zeros(n_rows, width + 1).scatter_add(1, documents, logps)
    counts = scored.new_zeros(n_rows, width + 1).scatter_add(1, documents, scored)
    chosen, rejected = sums[:, 0::2], sums[:, 1::2]
    n_c, n_r = counts[:, 0::2], counts[:, 1::2]
    k = min(chosen.shape[1], rejected.shape[1])
    real = (n_c[:, :k] > 0) & (n_r[:, :k] > 0)
    return PairLogps(chosen[:, :k][real], rejected[:, :k][real], n_c[:, :k][real], n_r[:, :k][real])


def pair_count(targets: torch.Tensor, documents: torch.Tensor) -> int:
    """Pairs in a batch: its chosen documents that score something (each has a rejected)."""
    scored = (targets != IGNORE_INDEX).to(torch.int64)
    counts = scored.new_zeros(documents.shape[0], documents.shape[1] + 1)
    counts.scatter_add_(1, documents, scored)
    return int((counts[:, 0::2] > 0).sum())


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


# ---- the objective as the trainer uses it -----------------------------------------------------


@dataclass
class _Sums:
    """Per-pair quantities summed over a step's micro-batches."""

    values: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor) -> None:
        self.values[name] = self.values.get(name, 0.0) + float(value.detach().double().sum())


class PreferenceObjective:
    """``train.objective`` (dpo, ipo, orpo) on a model: micro-batch losses weighted for the
    whole batch, and the step's reward metrics."""

    def __init__(self, objective: str, beta: float, label_smoothing: float = 0.0) -> None:
        self.objective, self.beta, self.label_smoothing = objective, beta, label_smoothing
        self.needs_reference = objective in ("dpo", "ipo")
        self._sums = _Sums()
        self._pairs = 0

    @staticmethod
    def batch_counts(targets: torch.Tensor, documents: torch.Tensor) -> tuple[int, int]:
        """A batch's pairs and its chosen replies' scored tokens (ORPO's NLL divisor)."""
        scored = targets != IGNORE_INDEX
        chosen_tokens = int((scored & (documents % 2 == 0)).sum())
        return pair_count(targets, documents), chosen_tokens

    def start_step(self) -> None:
        """Forget the last step's metrics."""
        self._sums, self._pairs = _Sums(), 0

    def reference_logps(
        self,
        model: Llama,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor,
        autocast: contextlib.AbstractContextManager,
    ) -> PairLogps | None:
        """The reference model's pair log-probs (the adapters off, no gradients); None for a
        reference-free objective."""
        if not self.needs_reference:
            return None
        with torch.no_grad(), adapters_disabled(model), autocast:
            logits = model(inputs, documents=documents)
        return pair_logps(token_logps(logits, targets), targets, documents)

    def loss(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor,
        reference: PairLogps | None,
        counts: tuple[int, int],
    ) -> torch.Tensor:
        """This micro-batch's share of the step's loss: its per-pair losses summed over the
        step's pair count (ORPO's NLL: its chosen tokens' over the step's); metrics summed."""
        n_pairs, n_chosen_tokens = counts
        policy = pair_logps(token_logps(logits, targets), targets, documents)
        if self.objective == "dpo":
            assert reference is not None
            chosen, rejected = policy.chosen, policy.rejected
            losses, r_c, r_r = dpo_losses(
                chosen,
                rejected,
                reference.chosen,
                reference.rejected,
                self.beta,
                self.label_smoothing,
            )
        elif self.objective == "ipo":
            assert reference is not None
            chosen, rejected = policy.means()
            losses, r_c, r_r = ipo_losses(chosen, rejected, *reference.means(), self.beta)
        else:
            chosen, rejected = policy.means()
            losses, r_c, r_r = orpo_losses(chosen, rejected, self.beta)
        loss = losses.sum() / n_pairs
        if self.objective == "orpo":  # + the NLL of the chosen replies, mean over their tokens
            nll = -policy.chosen.sum()
            loss = loss + nll / n_chosen_tokens
            self._sums.add("nll_sum", nll)
            self._sums.add("nll_tokens", policy.chosen_tokens)
            self._sums.add("odds_ratio_loss", losses)
        self._record(losses, chosen, rejected, r_c, r_r)
        return loss

    def _record(
        self,
        losses: torch.Tensor,
        chosen: torch.Tensor,
        rejected: torch.Tensor,
        r_c: torch.Tensor,
        r_r: torch.Tensor,
    ) -> None:
        s = self._sums
        margin = r_c - r_r
        s.add("reward_margin", margin)
        s.add("reward_accuracy", (margin > 0).double())
        s.add("reward_chosen", r_c)
        s.add("reward_rejected", r_r)
        s.add("logp_chosen", chosen)
        s.add("logp_rejected", rejected)
        self._pairs += len(losses)

    def metrics(self) -> dict[str, float]:
        """The step's per-pair means (since :meth:`start_step`); ORPO's also its ``nll``."""
        sums, n = dict(self._sums.values), max(self._pairs, 1)
        nll, tokens = sums.pop("nll_sum", None), sums.pop("nll_tokens", None)
        out = {name: value / n for name, value in sums.items()}
        if nll is not None and tokens:
            out["nll"] = nll / tokens
        return out

    def evaluate(
        self,
        model: Llama,
        batches: Iterable[tuple[torch.Tensor, ...]],
        device: torch.device,
        autocast: contextlib.AbstractContextManager,
    ) -> dict[str, float]:
        """The objective's loss (per pair) and reward metrics over ``batches``."""
        was_training = model.training
        model.eval()
        self.start_step()
        weighted, pairs = 0.0, 0
        try:
            for batch in batches:
                inputs, targets, documents = (t.to(device) for t in batch[:3])
                counts = self.batch_counts(targets, documents)
                reference = self.reference_logps(model, inputs, targets, documents, autocast)
                with torch.no_grad(), autocast:
                    logits = model(inputs, documents=documents)
                    loss = self.loss(logits, targets, documents, reference, counts)
                weighted += float(loss) * counts[0]  # the batch's mean, weighted by its pairs
                pairs += counts[0]
        finally:
            model.train(was_training)
        return {"loss": weighted / max(pairs, 1), **self.metrics()}
