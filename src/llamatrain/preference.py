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

The reference of DPO/IPO over a LoRA run is the model with its adapters switched off
(``llamatrain.lora.adapters_disabled``), computed without gradients on the same rows just
before the policy's forward: no second copy of the weights, and no cache (the base's forward
is as cheap as the policy's, a cache would only add a file and a check).

A full finetune has no frozen base to switch back to, so its reference is a
:class:`ReferenceTable`: every row's per-pair reference sums and token counts, computed once
before training by the initial model (:func:`reference_table`) and kept in the cache
(:func:`cached_reference_table`) keyed by the model file's sha256 and the rows, as the token
cache is (written atomically, checked on every use); a resume reads the same entry. The run's
checkpoints record that file and its sha256 (:attr:`ReferenceTable.model`), and a resume over a
file whose content changed is refused, as a LoRA run's over another base is.

A step's loss is the mean over its pairs (ORPO's NLL: over its chosen tokens) however the
step is cut into micro-batches: :meth:`PreferenceObjective.loss` divides each micro-batch's
sums by the whole batch's counts (:meth:`PreferenceObjective.batch_counts`), so the
accumulated gradient equals the whole batch's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from llamatrain.data.cache import read_description
from llamatrain.data.examples import ExampleRows
from llamatrain.data.preferences import CHOSEN, REJECTED
from llamatrain.errors import LlamatrainWarning, TrainingError
from llamatrain.files import write_text_atomically, written_atomically
from llamatrain.lora import adapters_disabled
from llamatrain.model import Llama
from llamatrain.model_path import LoraBase
from llamatrain.ops.sets import IGNORE_INDEX

__all__ = [
    "METRICS",
    "OBJECTIVES",
    "PairLogps",
    "PreferenceObjective",
    "ReferenceTable",
    "cached_reference_table",
    "dpo_losses",
    "ipo_losses",
    "orpo_losses",
    "pair_logps",
    "reference_table",
    "simpo_losses",
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


# ---- the objective as the trainer uses it -----------------------------------------------------


@dataclass
class _Sums:
    """Per-pair quantities summed over a step's micro-batches."""

    values: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: torch.Tensor) -> None:
        self.values[name] = self.values.get(name, 0.0) + float(value.detach().double().sum())


class PreferenceObjective:
    """``train.objective`` (dpo, ipo, orpo, simpo) on a model: micro-batch losses weighted
    for the whole batch, and the step's reward metrics. ``gamma``: SimPO's target margin."""

    def __init__(
        self, objective: str, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0
    ) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown preference objective {objective!r}; one of {OBJECTIVES}")
        self.objective, self.beta, self.label_smoothing = objective, beta, label_smoothing
        self.gamma = gamma
        self.needs_reference = objective in ("dpo", "ipo")
        self._sums = _Sums()
        self._pairs = 0

    @staticmethod
    def batch_counts(targets: torch.Tensor, documents: torch.Tensor) -> tuple[int, int]:
        """A batch's pairs and its chosen replies' scored tokens (ORPO's NLL divisor)."""
        scored = targets != IGNORE_INDEX
        chosen_tokens = int((scored & (documents[..., 1] == CHOSEN)).sum())
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
        cached: torch.Tensor | None = None,
    ) -> PairLogps | None:
        """The reference's pair log-probs: these rows' ``cached`` slots (a
        :class:`ReferenceTable`'s, checked to be these rows' pairs) or, without them, the
        model's forward with its adapters off (no gradients); None for a reference-free
        objective."""
        if not self.needs_reference:
            return None
        if cached is not None:
            return _checked_slots(cached.to(inputs.device), targets, documents)
        with torch.no_grad(), adapters_disabled(model), autocast:
            logps = model(inputs, documents=documents, logps_of=targets)
        return pair_logps(logps, targets, documents)

    def loss(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor,
        reference: PairLogps | None,
        counts: tuple[int, int],
    ) -> torch.Tensor:
        """:meth:`loss_from_logps` on full ``logits`` (B, T, V): the plain path, for checks."""
        logps = token_logps(logits, targets)
        return self.loss_from_logps(logps, targets, documents, reference, counts)

    def loss_from_logps(
        self,
        logps: torch.Tensor,
        targets: torch.Tensor,
        documents: torch.Tensor,
        reference: PairLogps | None,
        counts: tuple[int, int],
    ) -> torch.Tensor:
        """This micro-batch's share of the step's loss from its targets' log-probs ``logps``
        (B, T): its per-pair losses summed over the step's pair count (ORPO's NLL: its chosen
        tokens' over the step's); metrics summed."""
        n_pairs, n_chosen_tokens = counts
        policy = pair_logps(logps, targets, documents)
        if self.objective == "dpo":
            assert reference is not None
            chosen, rejected = policy.chosen, policy.rejected
            ref = reference.chosen, reference.rejected
            losses, r_c, r_r = dpo_losses(chosen, rejected, *ref, self.beta, self.label_smoothing)
        elif self.objective == "ipo":
            assert reference is not None
            chosen, rejected = policy.means()
            losses, r_c, r_r = ipo_losses(chosen, rejected, *reference.means(), self.beta)
        elif self.objective == "simpo":
            chosen, rejected = policy.means()
            losses, r_c, r_r = simpo_losses(
                chosen, rejected, self.beta, self.gamma, self.label_smoothing
            )
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
        references: Iterable[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """The objective's loss (per pair) and reward metrics over ``batches``;
        ``references``: each batch's cached reference slots (:meth:`ReferenceTable.batches`),
        None for the adapters-off reference."""
        was_training = model.training
        model.eval()
        self.start_step()
        weighted, pairs = 0.0, 0
        cached = iter(references) if references is not None else None
        try:
            for batch in batches:
                inputs, targets, documents = (t.to(device) for t in batch[:3])
                counts = self.batch_counts(targets, documents)
                slots = next(cached) if cached is not None else None
                reference = self.reference_logps(model, inputs, targets, documents, autocast, slots)
                with torch.no_grad(), autocast:
                    logps = model(inputs, documents=documents, logps_of=targets)
                    loss = self.loss_from_logps(logps, targets, documents, reference, counts)
                weighted += float(loss) * counts[0]  # the batch's mean, weighted by its pairs
                pairs += counts[0]
        finally:
            model.train(was_training)
        return {"loss": weighted / max(pairs, 1), **self.metrics()}


# ---- the cached reference of a full finetune --------------------------------------------------

_REFERENCE_VERSION = 3
"""Part of every reference cache key: bump it when what a key describes changes (2: pairs
share their prompt, one document of branches a pair; 3: log-probs by the chunked head)."""

REFERENCE_KIND = "reference log-prob cache"
"""How the cache's files are named in a refusal (see :mod:`llamatrain.files`)."""


@dataclass
class ReferenceTable:
    """The reference's log-probs of every row of a run's pairs: ``train`` and ``val``, each
    (rows, slots, 4) float32 — per pair slot of a row (document j's branches) the chosen and
    the rejected reply's summed log-probs and their scored token counts (:func:`pair_slots`),
    zeros where a row has no more pairs. ``slots`` is the most pairs any row holds."""

    train: np.ndarray
    val: np.ndarray | None
    model: LoraBase | None = None
    """The model file the log-probs are of, which the run's checkpoints record so that a
    resume refuses a changed one; None for log-probs of a model in memory."""

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        """The training rows ``indices``' slots, as a batch of them (the sampler's indices)."""
        return torch.from_numpy(self.train[indices])

    def batches(self, n_seq: int, max_batches: int = 0) -> Iterator[torch.Tensor]:
        """The validation rows' slots cut as ``llamatrain.data.windows.val_batches`` cuts the
        rows: the first ``max_batches`` (0 = all) batches of ``n_seq`` rows, in order."""
        if self.val is None:
            return
        n = len(self.val)
        limit = n if max_batches <= 0 else min(n, max_batches * n_seq)
        for lo in range(0, limit, n_seq):
            yield torch.from_numpy(self.val[lo : min(lo + n_seq, limit)])


def _checked_slots(
    slots: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor
) -> PairLogps:
    """``slots``' pairs, after checking its token counts are these rows' (a table used with
    other rows than it was computed on fails here, not silently)."""
    zeros = torch.zeros(targets.shape, dtype=slots.dtype, device=targets.device)
    counts = pair_slots(zeros, targets, documents)[..., 2:]
    width = max(counts.shape[1], slots.shape[1])
    pad = (0, 0, 0, width - slots.shape[1])
    mine = F.pad(slots[..., 2:], pad)
    theirs = F.pad(counts, (0, 0, 0, width - counts.shape[1]))
    if not torch.equal(mine, theirs):
        raise TrainingError(
            "the cached reference log-probs are not this batch's pairs (their token counts "
            "differ): the data changed under the run; start it again to recompute them"
        )
    return slot_pairs(slots)


def _row_slots(rows: ExampleRows) -> int:
    """The most pairs one of ``rows`` holds."""
    if rows.documents is None or not len(rows):
        return 1
    pairs = np.where(rows.filled, rows.documents[..., 0], -1).max(axis=1) + 1
    return max(1, int(pairs.max()))


def reference_table(
    model: torch.nn.Module,
    train: ExampleRows,
    val: ExampleRows | None,
    n_seq: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
) -> ReferenceTable:
    """Every row's reference slots by ``model`` as it is (the run's initial weights), in
    eval mode and without gradients, ``n_seq`` rows a forward; float32 sums, as a live
    reference forward computes them."""
    was_training = model.training
    model.eval()
    try:
        tables = [
            None if rows is None else _rows_table(model, rows, n_seq, device, autocast)
            for rows in (train, val)
        ]
    finally:
        model.train(was_training)
    return ReferenceTable(tables[0], tables[1])


def _rows_table(
    model: torch.nn.Module,
    rows: ExampleRows,
    n_seq: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
) -> np.ndarray:
    slots = _row_slots(rows)
    out = np.zeros((len(rows), slots, 4), dtype=np.float32)
    for lo in range(0, len(rows), n_seq):
        batch = rows.batch(np.arange(lo, min(lo + n_seq, len(rows))))
        inputs, targets = batch.inputs.to(device), batch.targets.to(device)
        documents = batch.documents.to(device)
        with torch.no_grad(), autocast:
            logps = model(inputs, documents=documents, logps_of=targets)
        part = pair_slots(logps, targets, documents)
        out[lo : lo + len(inputs)] = part[:, :slots].float().cpu().numpy()
    return out


def _rows_digest(rows: ExampleRows | None) -> str | None:
    """sha256 of what a row is: its tokens, scored mask and documents."""
    if rows is None:
        return None
    digest = hashlib.sha256()
    for array in (rows.tokens, rows.scored, rows.documents):
        if array is not None:
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def cached_reference_table(
    cache_dir: str | Path,
    key: dict[str, Any],
    train: ExampleRows,
    val: ExampleRows | None,
    compute: Callable[[], ReferenceTable],
) -> tuple[ReferenceTable, bool]:
    """The reference table of ``train``/``val`` from the cache, or ``compute()``d and written
    to it; also whether it was computed now.

    ``key``: what else the log-probs depend on — the model file's sha256, the run's forward
    choices (ops, attention, dtype); the rows' own content is added here. The entry is a
    float32 ``.bin`` and its ``.json`` description (key, shapes, sha256 of the bytes), each
    written atomically; on every use the description must be this run's, the file its size
    and sha256, every value finite and every token count the rows' (else it is recomputed,
    with a warning naming what was wrong).
    """
    expected = {
        "version": _REFERENCE_VERSION,
        **key,
        "train_rows": _rows_digest(train),
        "val_rows": _rows_digest(val),
        "train_shape": [len(train), _row_slots(train), 4],
        "val_shape": None if val is None else [len(val), _row_slots(val), 4],
    }
    name = hashlib.sha256(json.dumps(expected, sort_keys=True).encode()).hexdigest()[:24]
    folder = Path(cache_dir).expanduser() / "reference"
    bin_path, meta_path = folder / f"{name}.bin", folder / f"{name}.json"
    if meta_path.is_file() and bin_path.is_file():
        problem, table = _read_table(bin_path, meta_path, expected, train, val)
        if table is not None:
            return table, False
        warnings.warn(
            f"reference cache {bin_path} {problem}; computing it again",
            LlamatrainWarning,
            stacklevel=3,
        )
    table = compute()
    folder.mkdir(parents=True, exist_ok=True)
    parts = [table.train] + ([] if table.val is None else [table.val])
    data = b"".join(np.ascontiguousarray(a, dtype="<f4").tobytes() for a in parts)
    with written_atomically(bin_path, REFERENCE_KIND) as tmp:
        tmp.write_bytes(data)
    meta = {**expected, "sha256": hashlib.sha256(data).hexdigest()}
    write_text_atomically(meta_path, json.dumps(meta, indent=1), REFERENCE_KIND)
    return table, True


def _read_table(
    bin_path: Path,
    meta_path: Path,
    expected: dict[str, Any],
    train: ExampleRows,
    val: ExampleRows | None,
) -> tuple[str | None, ReferenceTable | None]:
    """(what is wrong with an entry, or None; its table when nothing is)."""
    problem, meta = read_description(meta_path, expected)
    if problem:
        return problem, None
    shapes = [expected["train_shape"]] + ([] if val is None else [expected["val_shape"]])
    sizes = [int(np.prod(shape)) for shape in shapes]
    if bin_path.stat().st_size != 4 * sum(sizes):  # before reading it: it may be any size
        return "does not hold the number of values its description says", None
    data = bin_path.read_bytes()
    if len(data) != 4 * sum(sizes):  # it changed since
        return "does not hold the number of values its description says", None
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        return "does not match its recorded sha256", None
    flat = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if not np.isfinite(flat).all():
        return "holds a value that is not finite", None
    arrays = np.split(flat, np.cumsum(sizes)[:-1])
    tables = [a.reshape(shape) for a, shape in zip(arrays, shapes, strict=True)]
    for rows, table in zip((train, val), tables, strict=False):
        if not np.array_equal(table[..., 2:], _row_counts(rows, table.shape[1])):
            return "holds token counts other than the rows'", None
    return None, ReferenceTable(tables[0], tables[1] if val is not None else None)


def _row_counts(rows: ExampleRows, slots: int) -> np.ndarray:
    """(rows, slots, 2) the scored tokens of each slot's chosen and rejected reply."""
    batch = rows.batch(np.arange(len(rows)))
    zeros = torch.zeros(batch.targets.shape, dtype=torch.float32)
    counts = pair_slots(zeros, batch.targets, batch.documents)[:, :slots, 2:]
    return counts.numpy()
