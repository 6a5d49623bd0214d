"""Our preference losses against TRL's own code (TRL 1.16) on the same model's log-probs.

One small random llama (float64, so a difference is a formula's and not rounding's) scores six
preference pairs twice: our way — whole pairs packed into rows as the data lays them
(``pair_rows``), through :class:`~llamatrain.objectives.preference.PreferenceObjective` —
and TRL's way —
one right-padded row per reply, chosen rows then rejected rows, through TRL's trainer methods
with our model behind the call signature TRL uses for a transformers model
(:class:`TrlFacingModel`). The loss, its gradient with respect to every trainable parameter
and the reward metrics must agree to 1e-5; the layouts differ (ours packs pairs, TRL runs
prompt + reply alone in a row), so agreement checks our layout's log-probs too.

TRL's trainers are not constructed: their ``__init__`` wants a transformers model, a tokenizer
and a ``datasets`` dataset, none of which the loss reads. Each test makes the trainer object
with ``cls.__new__`` and sets only the attributes the called method reads (listed in
:func:`stand_in`), so the code run is TRL's real method, unbound from its setup:

- DPO and IPO: ``trl.DPOTrainer._compute_loss`` (``loss_type`` "sigmoid" / "ipo"), the policy
  a LoRA model and TRL's ``ref_model`` the base; ours takes the reference as it does in a LoRA
  run, the same model with its adapters off.
- Conservative DPO (label smoothing ε): TRL 1.16's DPOTrainer no longer has it — its
  ``label_smoothing`` now only feeds the robust and EXO losses, and "sigmoid" ignores it.
  TRL's one conservative sigmoid of a log-prob difference is
  ``trl.experimental.cpo.CPOTrainer.cpo_loss`` ("sigmoid"); fed the log-ratios
  log π − log π_ref (summed by TRL's ``get_batch_logps``) it is exactly cDPO.
- ORPO: ``trl.experimental.orpo.ORPOTrainer.concatenated_forward``, ``odds_ratio_loss`` and
  ``get_batch_loss_metrics``.
- SimPO: ``trl.experimental.cpo.CPOTrainer.get_batch_loss_metrics`` with ``loss_type="simpo"``
  and ``cpo_alpha=0`` (no NLL term).

Conventions that differ (the test compares like with like and says where):

- IPO's reward metrics: TRL logs β·(Σ log π − Σ log π_ref) over the reply, summed even though
  its IPO loss averages; ours are the per-token means the loss uses (β·(mean − mean_ref)).
- ORPO's NLL: TRL's is the mean over the chosen rows' prompt *and* reply tokens; ours (the
  paper's L_SFT of the reply given the prompt) over the reply tokens only. The odds-ratio
  term, the rewards and the log-probs are the same.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from random_models import move_off_neutral, randomly_adapted

from llamatrain.data.examples import Example
from llamatrain.data.preferences import Pair, pair_rows
from llamatrain.model import Llama, ModelConfig
from llamatrain.objectives.preference.losses import token_logps
from llamatrain.objectives.preference.objective import PreferenceObjective
from llamatrain.ops.sets import IGNORE_INDEX

pytest.importorskip("trl")
from trl import DPOTrainer  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402
from trl.trainer.utils import selective_log_softmax  # noqa: E402

TOL = 1e-5
VOCAB = 48
PAD = 0
NO_AUTOCAST = contextlib.nullcontext()
OURS_TO_TRL = {
    "reward_chosen": "rewards/chosen",
    "reward_rejected": "rewards/rejected",
    "reward_margin": "rewards/margins",
    "reward_accuracy": "rewards/accuracies",
    "logp_chosen": "logps/chosen",
    "logp_rejected": "logps/rejected",
}


# ---- the pairs, in both layouts --------------------------------------------------------------


def random_pairs(n_pairs: int = 6, seed: int = 0) -> list[Pair]:
    """Pairs of random tokens: a shared prompt of 3-5 tokens, replies of 2-7 (only they
    scored), lengths differing so sums and means differ."""
    rng = np.random.default_rng(seed)

    def example(prompt: np.ndarray, reply_len: int) -> Example:
        ids = np.concatenate([prompt, rng.integers(1, VOCAB, reply_len)]).astype(np.int64)
        return Example(ids, np.arange(len(ids)) >= len(prompt))

    pairs = []
    for _ in range(n_pairs):
        prompt = rng.integers(1, VOCAB, int(rng.integers(3, 6)))
        chosen, rejected = (int(n) for n in rng.integers(2, 8, 2))
        pairs.append(Pair(example(prompt, chosen), example(prompt, rejected)))
    return pairs


def our_batch(pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, documents): the pairs packed into rows as the data lays them."""
    rows = pair_rows(pairs, 40, PAD, packing=True)
    assert len(rows) < len(pairs)  # several pairs share a row: the documents matter
    batch = rows.batch(np.arange(len(rows)))
    return batch.inputs, batch.targets, batch.documents


def padded(examples: list[Example], width: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, completion_mask) of ``examples``, right-padded."""
    ids = torch.full((len(examples), width), PAD)
    attention = torch.zeros(len(examples), width, dtype=torch.int64)
    completion = torch.zeros(len(examples), width, dtype=torch.int64)
    for i, ex in enumerate(examples):
        ids[i, : len(ex.ids)] = torch.from_numpy(ex.ids)
        attention[i, : len(ex.ids)] = 1
        completion[i, : len(ex.ids)] = torch.from_numpy(ex.scored.astype(np.int64))
    return ids, attention, completion


def width_of(pairs: list[Pair]) -> int:
    return max(max(len(p.chosen.ids), len(p.rejected.ids)) for p in pairs)


def dpo_inputs(pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """DPOTrainer's batch: chosen rows then rejected rows (``_compute_loss`` chunks it so)."""
    examples = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    ids, attention, completion = padded(examples, width_of(pairs))
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def paired_inputs(pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """The CPO/ORPO trainers' batch: ``chosen_*`` and ``rejected_*`` ids, attention masks and
    labels (the prompt and padding -100), as their ``tokenize_row`` and collator make it."""
    batch = {}
    for side in ("chosen", "rejected"):
        ids, attention, completion = padded([getattr(p, side) for p in pairs], width_of(pairs))
        batch[f"{side}_input_ids"] = ids
        batch[f"{side}_attention_mask"] = attention
        batch[f"{side}_labels"] = ids.masked_fill(completion == 0, IGNORE_INDEX)
    return batch


# ---- our model behind TRL's calls -------------------------------------------------------------


class TrlFacingModel(torch.nn.Module):
    """Our :class:`Llama` answering the two calls TRL's trainers make on a transformers model:
    ``model(input_ids, attention_mask=..., use_cache=False).logits`` (CPO, ORPO) and
    ``model(..., labels=..., fused_lm_head=True)`` (DPO), whose fields are what
    ``trl.trainer.utils.add_fused_lm_head`` documents: per next-token ``log_probs`` (TRL's
    ``selective_log_softmax``), ``entropy``, ``mean_logits`` and ``is_top1``, 0 where the
    label is -100. Rows are right-padded, so a causal model needs no attention mask."""

    is_gradient_checkpointing = False

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.inner = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        fused_lm_head: bool = False,
        use_cache: bool = False,
    ) -> SimpleNamespace:
        if attention_mask is not None:  # right padding only: every 1 before every 0
            assert torch.equal(attention_mask, attention_mask.cummin(dim=1).values)
        logits = self.inner(input_ids)
        if not fused_lm_head:
            return SimpleNamespace(logits=logits)
        logits, labels = logits[:, :-1], labels[:, 1:]
        mask = labels != IGNORE_INDEX
        log_softmax = logits.log_softmax(-1)

        def kept(x: torch.Tensor) -> torch.Tensor:
            return torch.where(mask, x, torch.zeros((), dtype=x.dtype))

        return SimpleNamespace(
            log_probs=kept(selective_log_softmax(logits, labels.clamp(min=0))),
            entropy=kept(-(log_softmax.exp() * log_softmax).sum(-1)),
            mean_logits=kept(logits.mean(-1)),
            is_top1=mask & (logits.argmax(-1) == labels),
        )


ONE_PROCESS = SimpleNamespace(
    device=torch.device("cpu"),
    gather=lambda x: x,
    gather_for_metrics=lambda x: x,
    unwrap_model=lambda m: m,
)
"""The trainers' ``accelerator`` as one CPU process sees it: gathering is the identity."""


def stand_in(cls: type, **attributes: Any) -> Any:
    """A ``cls`` trainer made without its ``__init__`` (which wants a transformers model, a
    tokenizer and a dataset), holding ``attributes``: what the called methods read."""
    trainer = cls.__new__(cls)
    trainer.__dict__.update(accelerator=ONE_PROCESS, aux_loss_enabled=False, **attributes)
    return trainer


def dpo_trainer(policy: Llama, reference: Llama, loss_type: str, beta: float) -> DPOTrainer:
    """What ``DPOTrainer._compute_loss`` reads, for a policy and a separate reference model."""
    return stand_in(
        DPOTrainer,
        model=TrlFacingModel(policy),
        ref_model=TrlFacingModel(reference),
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        precompute_ref_logps=False,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )


def cpo_trainer(loss_type: str, beta: float, label_smoothing: float, gamma: float = 0.0):
    """What ``CPOTrainer.get_batch_loss_metrics`` and ``cpo_loss`` read (no NLL, no AlphaPO)."""
    return stand_in(
        CPOTrainer,
        is_encoder_decoder=False,
        pad_token_id=PAD,
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=gamma,
        cpo_alpha=0.0,
        alpha=0.0,
    )


# ---- models and our side ----------------------------------------------------------------------


def random_base(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=48, ops="torch")
    return move_off_neutral(Llama(cfg).eval())


def lora_policy_and_base() -> tuple[Llama, Llama]:
    """A LoRA policy whose random adapters move it off its base, and the base; float64."""
    base = random_base()
    policy = randomly_adapted(base, 4, 8.0, std_a=0.6, std_b=0.6).double()
    return policy, base.double()


def trainable(model: Llama) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def gradient(model: Llama, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """d loss / d each trainable parameter of ``model`` (its grads cleared before and after)."""
    params = trainable(model)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {
        name: torch.zeros_like(p) if g is None else g
        for (name, p), g in zip(params.items(), grads, strict=True)
    }


def ours(objective: PreferenceObjective, policy: Llama, pairs: list[Pair]):
    """Our loss over ``pairs`` (a LoRA policy's reference: its adapters off) and metrics."""
    inputs, targets, documents = our_batch(pairs)
    objective.start_step()
    reference = objective.reference_logps(policy, inputs, targets, documents, NO_AUTOCAST)
    logits = policy(inputs, documents=documents)
    counts = objective.batch_counts(targets, documents)
    assert counts[0] == len(pairs)
    loss = objective.loss(logits, targets, documents, reference, counts)
    return loss, objective.metrics()


def assert_close(name: str, mine: float | torch.Tensor, theirs: float | torch.Tensor) -> None:
    mine, theirs = float(mine), float(theirs)
    assert abs(mine - theirs) <= TOL * max(1.0, abs(theirs)), (name, mine, theirs)


def assert_same_gradient(mine: dict, theirs: dict) -> None:
    assert mine.keys() == theirs.keys()
    scale = max(float(g.abs().max()) for g in theirs.values())
    assert scale > 1e-3  # the comparison is not between zeros
    for name, g in mine.items():
        assert float((g - theirs[name]).abs().max()) <= TOL * scale, name


def trl_means(metrics: dict[str, list[float]]) -> dict[str, float]:
    return {name: float(np.mean(values)) for name, values in metrics.items()}


# ---- DPO and IPO: DPOTrainer._compute_loss ----------------------------------------------------


def test_dpo_matches_trls_dpo_trainer():
    """Sigmoid DPO on reply log-probs summed, reference = the base; metrics compared 1:1."""
    policy, base = lora_policy_and_base()
    pairs, beta = random_pairs(), 0.5
    loss, metrics = ours(PreferenceObjective("dpo", beta), policy, pairs)
    trainer = dpo_trainer(policy, base, "sigmoid", beta)
    trl_loss = trainer._compute_loss(trainer.model, dpo_inputs(pairs), return_outputs=False)
    assert_close("loss", loss.detach(), trl_loss.detach())
    assert_same_gradient(gradient(policy, loss), gradient(policy, trl_loss))
    logged = trl_means(trainer._metrics["train"])
    assert 0 < metrics["reward_accuracy"] < 1  # both outcomes occur among the pairs
    for mine, theirs in OURS_TO_TRL.items():
        assert_close(mine, metrics[mine], logged[theirs])


def test_ipo_matches_trls_dpo_trainer():
    """IPO on per-token means: the loss and gradient compared; TRL's logged rewards and
    log-probs are reply sums (β·Σ log-ratio), ours per-token means, so each of ours is
    compared with TRL's value for its pair divided by that reply's token count."""
    policy, base = lora_policy_and_base()
    pairs, beta = random_pairs(), 0.5
    loss, metrics = ours(PreferenceObjective("ipo", beta), policy, pairs)
    trainer = dpo_trainer(policy, base, "ipo", beta)
    trl_loss = trainer._compute_loss(trainer.model, dpo_inputs(pairs), return_outputs=False)
    assert_close("loss", loss.detach(), trl_loss.detach())
    assert_same_gradient(gradient(policy, loss), gradient(policy, trl_loss))

    per_pair = defaultdict(list)
    for pair in pairs:  # TRL's metrics are batch means: one pair a batch gives its values
        one = dpo_trainer(policy, base, "ipo", beta)
        with torch.no_grad():
            one._compute_loss(one.model, dpo_inputs([pair]), return_outputs=False)
        logged = trl_means(one._metrics["train"])
        n_c, n_r = int(pair.chosen.scored.sum()), int(pair.rejected.scored.sum())
        r_c, r_r = logged["rewards/chosen"] / n_c, logged["rewards/rejected"] / n_r
        per_pair["reward_chosen"].append(r_c)
        per_pair["reward_rejected"].append(r_r)
        per_pair["reward_margin"].append(r_c - r_r)
        per_pair["reward_accuracy"].append(float(r_c > r_r))
        per_pair["logp_chosen"].append(logged["logps/chosen"] / n_c)
        per_pair["logp_rejected"].append(logged["logps/rejected"] / n_r)
    for name, values in per_pair.items():
        assert_close(name, metrics[name], float(np.mean(values)))


@pytest.mark.parametrize("eps", [0.1, 0.3])
def test_conservative_dpo_matches_trls_conservative_sigmoid(eps):
    """cDPO: TRL's ``CPOTrainer.cpo_loss`` ("sigmoid", label smoothing ε) on the log-ratios
    log π − log π_ref, each summed over the reply by TRL's ``get_batch_logps``."""
    policy, base = lora_policy_and_base()
    pairs, beta = random_pairs(), 0.5
    loss, metrics = ours(PreferenceObjective("dpo", beta, label_smoothing=eps), policy, pairs)

    trainer = cpo_trainer("sigmoid", beta, eps)
    batch = trainer.concatenated_inputs(paired_inputs(pairs), padding_value=PAD)
    ids, labels = batch["concatenated_input_ids"], batch["concatenated_labels"]
    logps = trainer.get_batch_logps(TrlFacingModel(policy)(ids).logits, labels)
    with torch.no_grad():
        ref_logps = trainer.get_batch_logps(TrlFacingModel(base)(ids).logits, labels)
    ratios = (logps - ref_logps).chunk(2)
    losses, r_c, r_r = trainer.cpo_loss(*ratios)
    trl_loss = losses.mean()
    assert_close("loss", loss.detach(), trl_loss.detach())
    assert_same_gradient(gradient(policy, loss), gradient(policy, trl_loss))
    assert_close("reward_chosen", metrics["reward_chosen"], float(r_c.mean()))
    assert_close("reward_rejected", metrics["reward_rejected"], float(r_r.mean()))
    assert_close("reward_margin", metrics["reward_margin"], float((r_c - r_r).mean()))
    accuracy = float((r_c > r_r).double().mean())
    assert_close("reward_accuracy", metrics["reward_accuracy"], accuracy)


# ---- SimPO: CPOTrainer(loss_type="simpo", cpo_alpha=0) ---------------------------------------


@pytest.mark.parametrize(("beta", "gamma", "eps"), [(2.0, 0.5, 0.0), (2.5, 1.2, 0.2)])
def test_simpo_matches_trls_cpo_trainer(beta, gamma, eps):
    """The whole model trains (no reference); loss, gradient and metrics compared 1:1."""
    model = random_base().double()
    pairs = random_pairs()
    objective = PreferenceObjective("simpo", beta, label_smoothing=eps, gamma=gamma)
    loss, metrics = ours(objective, model, pairs)
    trainer = cpo_trainer("simpo", beta, eps, gamma)
    trl_loss, logged = trainer.get_batch_loss_metrics(TrlFacingModel(model), paired_inputs(pairs))
    assert logged["nll_loss"] == 0.0  # cpo_alpha = 0: SimPO has no NLL term
    assert_close("loss", loss.detach(), trl_loss.detach())
    assert_same_gradient(gradient(model, loss), gradient(model, trl_loss))
    for mine, theirs in OURS_TO_TRL.items():
        assert_close(mine, metrics[mine], logged[theirs])


# ---- ORPO: ORPOTrainer ----------------------------------------------------------------------


def test_orpo_matches_trls_orpo_trainer():
    """ORPO = NLL + λ·(odds-ratio term). The odds-ratio term, rewards and log-probs are TRL's;
    the NLL is where the conventions part: TRL's is the mean over the chosen rows' prompt and
    reply tokens, ours over the reply tokens. So the loss compared is TRL's odds-ratio term
    plus the reply-only NLL TRL's per-token means give (Σ mean·n / Σ n), and TRL's own NLL is
    checked to be the prompt-and-reply mean."""
    model = random_base().double()
    pairs, lam = random_pairs(), 0.25
    loss, metrics = ours(PreferenceObjective("orpo", lam), model, pairs)
    trainer = stand_in(ORPOTrainer, is_encoder_decoder=False, padding_value=PAD, beta=lam)
    batch, facing = paired_inputs(pairs), TrlFacingModel(model)

    chosen, rejected, _, _, trl_nll = trainer.concatenated_forward(facing, batch)
    or_terms, r_c, r_r, _, _ = trainer.odds_ratio_loss(chosen, rejected)
    n_chosen = (batch["chosen_labels"][:, 1:] != IGNORE_INDEX).sum(dim=1)
    reply_nll = -(chosen * n_chosen).sum() / n_chosen.sum()
    like_ours = reply_nll - or_terms.mean()
    assert_close("loss", loss.detach(), like_ours.detach())
    assert_close("nll", metrics["nll"], reply_nll.detach())
    assert_same_gradient(gradient(model, loss), gradient(model, like_ours))

    trl_loss, logged = trainer.get_batch_loss_metrics(facing, batch)
    or_term = trl_loss.detach() - trl_nll.detach()  # TRL's loss is its NLL + the term
    assert_close("odds-ratio term", loss.detach() - metrics["nll"], or_term)
    for mine, theirs in OURS_TO_TRL.items():
        assert_close(mine, metrics[mine], logged[theirs])

    ids = batch["chosen_input_ids"]  # TRL's NLL: every real token after the first
    every = ids.masked_fill(batch["chosen_attention_mask"] == 0, IGNORE_INDEX)[:, 1:]
    with torch.no_grad():
        logps = token_logps(model(ids)[:, :-1], every)
    prompt_and_reply = -float(logps.sum()) / int((every != IGNORE_INDEX).sum())
    assert_close("TRL's nll", logged["nll_loss"], prompt_and_reply)
