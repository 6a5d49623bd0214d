"""Our GRPO advantages and loss against TRL 1.16's own ``GRPOTrainer`` code, in float64.

Sixteen completions — four prompts, G = 4 each — of a small random LoRA llama are scored by two
reward functions (weights 1 and 0.5) whose tables hold a ``None`` here and there, one row no
function scores, one group all alike (std 0) and one with a single scored row. TRL's side is its
real trainer methods, unbound from their setup as in ``test_preference_trl.py`` (the trainer made
with ``cls.__new__``, holding only what the methods read: :func:`grpo_trainer`):

- ``_generate_and_score_completions`` whole, with ``_generate`` replaced by the fixed rollout:
  it pads the completions, masks truncated ones, counts dapo's tokens, runs the rollout policy
  (μ = 2: the old log-probs) and the reference (β > 0) through our model behind TRL's call
  (``TrlFacingModel``), calls the reward functions (``_calculate_rewards``) and computes the
  advantages and reward metrics; nothing is reproduced on TRL's side.
- ``_compute_loss`` on what that returned, with the policy being trained: the loss, its
  gradient and the loss metrics.

With ``tools``, ``_generate`` also returns a ``tool_mask`` (runs of tool tokens inside the
completions, :func:`tool_masks`), as TRL's tool-calling loop does, and our side's mask is
``rollout.loss_mask`` over each completion's sampled-token mask: the multi-turn rollouts' loss.

Our side lays each completion after its prompt in one right-padded row, takes the log-probs and
the entropies from the chunked head (``model(…, logps_of=targets, with_entropy=True)``, what the
trainer logs; TRL's from the full logits), the reference with the adapters off, and calls
:mod:`~llamatrain.objectives.grpo.loss`. With μ = 2 the trained policy is the rollout's moved
by a random
step, so ratios leave the clip range on both sides (checked).

Tolerances: 1e-12 relative for the advantages, loss, gradients (relative to the largest
component) and the float64 metrics — the two sides order float64 sums differently (row layouts,
the chunked head against full logits), a few hundred roundings of 1.1e-16 each. TRL computes
its rewards table and ``nanstd``'s Bessel factor in the default dtype, so its calls run with
float64 as the default (a float32 run of TRL differs from ours by that factor's rounding,
3e-8, not a convention). Its clip shares and frac_reward_zero_std are taken of ``.float()``
booleans: float32, compared to 2 float32 ulps.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from random_models import randomly_adapted

from llamatrain.lora import adapters_disabled
from llamatrain.model import Llama
from llamatrain.objectives.grpo.loss import GRPOLoss, score_rewards, truncated_completions
from llamatrain.objectives.grpo.rollout import loss_mask
from llamatrain.objectives.grpo.turns import Completion
from llamatrain.ops.sets import IGNORE_INDEX

pytest.importorskip("trl")
from accelerate import PartialState  # noqa: E402
from test_preference_trl import (  # noqa: E402
    ONE_PROCESS,
    VOCAB,
    TrlFacingModel,
    gradient,
    random_base,
    stand_in,
    trainable,
)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

TOL = 1e-12
FLOAT32_TOL = 2 * 2.0**-24
STEP = 0.3
PAD, EOS = 0, 1
PROMPTS, G, PROMPT_LEN, MAX_COMPLETION = 4, 4, 4, 6
WEIGHTS = (1.0, 0.5)
NAMES = ("exact", "format")
FLOAT32_METRICS = {
    "frac_reward_zero_std",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
}


# ---- the rollout: prompts, completions and their rewards ---------------------------------------


def rollout(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, completion ids) of PROMPTS × G completions, G consecutive a prompt: prompts
    of PROMPT_LEN tokens (equal, so TRL's left padding is none and its rows stay causal for our
    model), completions of 1..MAX_COMPLETION tokens ending in EOS, or cut at MAX_COMPLETION."""
    rng = np.random.default_rng(seed)
    prompts, completions = [], []
    for _ in range(PROMPTS):
        prompt = rng.integers(2, VOCAB, PROMPT_LEN).tolist()
        for _ in range(G):
            length = int(rng.integers(1, MAX_COMPLETION + 1))
            ids = rng.integers(2, VOCAB, length).tolist()
            if length < MAX_COMPLETION or rng.random() < 0.3:
                ids[-1] = EOS
            prompts.append(prompt)
            completions.append(ids)
    return prompts, completions


def tool_masks(seed: int = 0) -> list[list[int]]:
    """Each completion's tool mask as a multi-turn rollout leaves it (TRL's ``tool_mask``): 0
    on a run of tool tokens inside each completion of 4 tokens or more (the model wrote its
    call before them and its reply after), 1 on every token the model sampled."""
    rng = np.random.default_rng(seed + 2)
    masks = []
    for ids in rollout(seed)[1]:
        mask = [1] * len(ids)
        if len(ids) >= 4:
            start = int(rng.integers(1, len(ids) - 2))
            end = int(rng.integers(start + 1, len(ids) - 1))
            mask[start:end] = [0] * (end - start)
        masks.append(mask)
    return masks


def reward_columns(seed: int = 0) -> list[list[float | None]]:
    """Each function's score of each completion, in eighths (exact in TRL's float32 table):
    row 1 scored by no function, group 2 scored alike (std 0), group 3 scored only in one row
    by the first function."""
    rng = np.random.default_rng(seed + 1)
    columns: list[list[float | None]] = [
        (rng.integers(-8, 9, PROMPTS * G) / 8).tolist() for _ in NAMES
    ]
    for column in columns:
        column[1] = None
        column[2 * G : 3 * G] = [0.5] * G
    columns[0][5] = None  # only the second function scores row 5
    columns[0][3 * G + 1 :] = [None] * (G - 1)
    columns[1][3 * G :] = [None] * G
    return columns


def rewards_table() -> torch.Tensor:
    """(N, F) float64 of :func:`reward_columns`, ``None`` as NaN (what the trainer's reward
    calls hand :func:`~llamatrain.objectives.grpo.loss.score_rewards`)."""
    columns = [[float("nan") if v is None else v for v in c] for c in reward_columns()]
    return torch.tensor(columns, dtype=torch.float64).T


def reward_function(index: int):
    """TRL's reward function signature, reading the completion's score off its ``row``."""

    column = reward_columns()[index]

    def score(prompts, completions, completion_ids, row, **_):
        return [column[r] for r in row]

    score.__name__ = NAMES[index]
    return score


# ---- TRL's side ---------------------------------------------------------------------------------


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@pytest.fixture(scope="module", autouse=True)
def accelerate_state() -> None:
    """accelerate's one-process state: TRL's logger (it warns of the unscorable row) needs it."""
    PartialState()


ACCELERATOR = SimpleNamespace(
    **vars(ONE_PROCESS),
    process_index=0,
    num_processes=1,
    is_main_process=True,
    autocast=contextlib.nullcontext,
    reduce=lambda x, reduction: x,
)
"""TRL's ``accelerator`` as one CPU process sees it, with what GRPO also reads."""


@functools.cache
def config_scale_rewards(scale_rewards: str | bool) -> str:
    """``scale_rewards`` as TRL's trainer reads it: after ``GRPOConfig`` mapped the booleans
    (the config is made, not written anywhere; transformers' own deprecation warning about
    the config's ``gradient_checkpointing`` field is silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        config = GRPOConfig(
            output_dir="unused", use_cpu=True, bf16=False, report_to=[], scale_rewards=scale_rewards
        )
    return config.scale_rewards


def grpo_trainer(rollout_model: Llama, reference: Llama | None, case: dict) -> GRPOTrainer:
    """What ``GRPOTrainer._generate_and_score_completions`` and ``_compute_loss`` read, for
    one case of the grid; ``_generate`` answers the fixed :func:`rollout`."""
    prompts, completions = rollout()

    def generate(prompt_texts):
        texts = [" ".join(map(str, ids)) for ids in completions]
        masks = tool_masks() if case["tools"] else None
        return prompts, completions, masks, texts, None, {}, None, None

    trainer = stand_in(
        GRPOTrainer,
        model=TrlFacingModel(rollout_model),
        ref_model=None if reference is None else TrlFacingModel(reference),
        _generate=generate,
        args=SimpleNamespace(
            report_to=[],
            steps_per_generation=1,
            gradient_accumulation_steps=1,
            per_device_train_batch_size=PROMPTS * G,
            gradient_checkpointing_kwargs=None,
            use_bias_correction_kl=case["use_bias_correction_kl"],
            delta=case["delta"],
        ),
        state=SimpleNamespace(global_step=0),
        environment_factories=None,
        environments=None,
        tools=None,
        _tokenizer=SimpleNamespace(pad_token_id=PAD),
        pad_to_multiple_of=None,
        eos_token_ids=[EOS],
        mask_truncated_completions=case["mask_truncated_completions"],
        num_iterations=case["num_iterations"],
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        beta=case["beta"],
        num_generations=G,
        multi_objective_aggregation="sum_then_normalize",
        reward_funcs=[reward_function(i) for i in range(len(NAMES))],
        reward_processing_classes=[None] * len(NAMES),
        reward_func_names=list(NAMES),
        reward_weights=torch.tensor(WEIGHTS, dtype=torch.float64),
        scale_rewards=config_scale_rewards(case["scale_rewards"]),
        loss_type=case["loss_type"],
        epsilon_low=case["epsilon"],
        epsilon_high=case["epsilon_high"] or case["epsilon"],
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_COMPLETION,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": defaultdict(list),
            "advantages": [],
            "extra": defaultdict(list),
        },
        _pending_extra_logs={},
        _pending_metrics={},
    )
    trainer.accelerator = ACCELERATOR
    return trainer


def trls(policy: Llama, rollout_model: Llama, base: Llama, case: dict):
    """TRL's advantages, loss and logged metrics (one value each) for ``case``."""
    reference = base if case["beta"] else None
    trainer = grpo_trainer(rollout_model, reference, case)
    rows = [{"prompt": "p", "row": i} for i in range(PROMPTS * G)]
    with default_dtype(torch.float64):
        inputs = trainer._generate_and_score_completions(rows)
        loss = trainer._compute_loss(TrlFacingModel(policy), inputs)
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return inputs["advantages"], loss, metrics


# ---- our side -----------------------------------------------------------------------------------


def our_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): each completion after its prompt in a right-padded row, only the
    completion's tokens targeted."""
    prompts, completions = rollout()
    width = PROMPT_LEN + MAX_COMPLETION
    tokens = torch.full((len(prompts), width), PAD)
    targets = torch.full((len(prompts), width), IGNORE_INDEX)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        row = torch.tensor(prompt + completion)
        tokens[i, : len(row)] = row
        targets[i, len(prompt) : len(row)] = row[len(prompt) :]
    return tokens[:, :-1], targets[:, 1:]


def ours(policy: Llama, rollout_model: Llama, case: dict):
    """Our advantages, loss and metrics for ``case``; the reference: ``policy``'s base."""
    scored = score_rewards(
        rewards_table(),
        torch.tensor(WEIGHTS, dtype=torch.float64),
        NAMES,
        G,
        case["scale_rewards"],
    )
    inputs, targets = our_rows()
    ids = rollout()[1]
    masks = tool_masks() if case["tools"] else [[1] * len(c) for c in ids]
    completions = [Completion(c, m) for c, m in zip(ids, masks, strict=True)]
    truncated = truncated_completions(ids, {EOS, PAD})
    mask = loss_mask(targets, completions, truncated, case["mask_truncated_completions"])
    with torch.no_grad():
        old = None if case["num_iterations"] == 1 else rollout_model(inputs, logps_of=targets)
        with adapters_disabled(policy):
            ref = policy(inputs, logps_of=targets) if case["beta"] else None
    objective = GRPOLoss(
        case["loss_type"],
        case["beta"],
        case["epsilon"],
        case["epsilon_high"],
        case["delta"],
        case["use_bias_correction_kl"],
    )
    logps, entropies = policy(inputs, logps_of=targets, with_entropy=True)
    terms = objective(
        logps,
        mask,
        scored.advantages,
        old_logps=old,
        ref_logps=ref,
        entropies=entropies,
        batch_tokens=mask.sum(),
        max_completion_length=MAX_COMPLETION,
    )
    metrics = {**scored.metrics, **{k: float(v) for k, v in terms.metrics.items()}}
    return scored.advantages, terms.loss, metrics


# ---- models -----------------------------------------------------------------------------------


def stepped(model: Llama, lr: float) -> Llama:
    """``model`` after a plain gradient step of size ``lr`` on the policy gradient
    −Σ A·log π(completion tokens) (what GRPO's first step follows): tokens of positive advantage
    become likelier, of negative less likely, so the ratios leave the clip range both ways."""
    inputs, targets = our_rows()
    advantages = score_rewards(
        rewards_table(), torch.tensor(WEIGHTS, dtype=torch.float64), NAMES, G
    ).advantages
    logps = model(inputs, logps_of=targets)
    grads = gradient(model, -(advantages.unsqueeze(1) * logps).sum())
    with torch.no_grad():
        for name, p in trainable(model).items():
            p.sub_(lr * grads[name])
    return model


@functools.cache
def models(num_iterations: int) -> tuple[Llama, Llama, Llama]:
    """(policy, rollout policy, base), float64: LoRA policies on a random base; with μ = 2 the
    policy is the rollout's after a step, with μ = 1 the same model. Made once a μ: nothing
    changes them (gradients are taken with ``autograd.grad``, the adapters' switch restored)."""
    base = random_base()
    rollout_model = randomly_adapted(base, 4, 8.0, std_a=0.6, std_b=0.6).double()
    policy = rollout_model
    if num_iterations > 1:
        policy = stepped(randomly_adapted(base, 4, 8.0, std_a=0.6, std_b=0.6).double(), STEP)
    return policy, rollout_model, base.double()


# ---- the comparison -----------------------------------------------------------------------------


def relative_gap(mine: float | torch.Tensor, theirs: float | torch.Tensor) -> float:
    mine = torch.as_tensor(mine, dtype=torch.float64)
    theirs = torch.as_tensor(theirs, dtype=torch.float64)
    scale = max(1.0, float(theirs.abs().max()))
    return float((mine - theirs).abs().max()) / scale


def gaps(case: dict) -> dict[str, float]:
    """Each compared quantity's largest relative difference, ours against TRL's, for ``case``;
    asserts the metric names agree and, with μ = 2, that both clip bounds were reached."""
    policy, rollout_model, base = models(case["num_iterations"])
    adv, loss, metrics = ours(policy, rollout_model, case)
    trl_adv, trl_loss, trl_metrics = trls(policy, rollout_model, base, case)
    assert set(metrics) <= set(trl_metrics), set(metrics) - set(trl_metrics)
    ours_grad, trl_grad = gradient(policy, loss), gradient(policy, trl_loss)
    scale = max(float(g.abs().max()) for g in trl_grad.values())
    assert scale > 1e-3  # the comparison is not between zeros
    out = {
        "advantages": relative_gap(adv, trl_adv),
        "loss": relative_gap(loss.detach(), trl_loss.detach()),
        "grads": max(float((g - trl_grad[n]).abs().max()) for n, g in ours_grad.items()) / scale,
    }
    for name, value in metrics.items():
        theirs = trl_metrics[name]
        both_nan = np.isnan(value) and np.isnan(theirs)
        out[name] = 0.0 if both_nan else relative_gap(value, theirs)
    if case["num_iterations"] > 1:
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    return out


def assert_within_tolerance(found: dict[str, float]) -> None:
    for name, gap in found.items():
        assert gap <= (FLOAT32_TOL if name in FLOAT32_METRICS else TOL), (name, gap)


def case_of(**changes) -> dict:
    case = {
        "loss_type": "dapo",
        "beta": 0.0,
        "epsilon": 0.2,
        "epsilon_high": None,
        "delta": None,
        "num_iterations": 1,
        "use_bias_correction_kl": True,
        "mask_truncated_completions": False,
        "scale_rewards": "group",
        "tools": False,
    }
    return {**case, **changes}


GRID = [
    case_of(loss_type=lt, beta=beta, epsilon_high=eh, num_iterations=mu)
    for lt, beta, eh, mu in itertools.product(
        ("grpo", "bnpo", "dr_grpo", "dapo"), (0.0, 0.04), (None, 0.28), (1, 2)
    )
]


def case_id(case: dict) -> str:
    return "-".join(
        f"{k}={v}" for k, v in case.items() if v != case_of()[k] or k in ("loss_type", "beta")
    )


@pytest.mark.parametrize("case", GRID, ids=case_id)
def test_loss_matches_trls_grpo_trainer(case):
    """The issue's grid: loss_type × β ∈ {0, 0.04} × ε_high ∈ {ε, 0.28} × μ ∈ {1, 2}."""
    assert_within_tolerance(gaps(case))


TOOL_GRID = [
    case_of(tools=True, loss_type=lt, beta=beta, num_iterations=mu, mask_truncated_completions=mt)
    for lt, beta, mu, mt in itertools.product(
        ("grpo", "bnpo", "dr_grpo", "dapo"), (0.0, 0.04), (1, 2), (False, True)
    )
]


@pytest.mark.parametrize("case", TOOL_GRID, ids=case_id)
def test_multi_turn_masks_match_trls_tool_path(case):
    """A rollout whose completions hold tool tokens: TRL's ``tool_mask`` from ``_generate``
    against our loss mask (``rollout.loss_mask`` over each completion's sampled-token mask),
    with every loss type, the KL, μ = 2 and truncated completions masked."""
    masks = tool_masks()
    assert sum(m.count(0) for m in masks) >= 8 and all(m[0] == m[-1] == 1 for m in masks)
    assert_within_tolerance(gaps(case))


@pytest.mark.parametrize(
    "case",
    [
        case_of(scale_rewards="batch", mask_truncated_completions=True, num_iterations=2),
        case_of(scale_rewards="none", loss_type="bnpo", beta=0.04, num_iterations=2),
        case_of(scale_rewards=True, loss_type="grpo"),
        case_of(scale_rewards=False, loss_type="dr_grpo", mask_truncated_completions=True),
        case_of(beta=0.04, num_iterations=2, delta=1.35, epsilon_high=0.28),
        case_of(beta=0.04, num_iterations=2, use_bias_correction_kl=False),
        case_of(loss_type="grpo", beta=0.04, mask_truncated_completions=True, num_iterations=2),
    ],
    ids=case_id,
)
def test_other_settings_match_trls_grpo_trainer(case):
    """scale_rewards (also as TRL's booleans), truncated completions masked, delta, and the KL
    without the ratio (TRL 1.16's use_bias_correction_kl=False)."""
    assert_within_tolerance(gaps(case))


def test_rewards_are_what_the_case_was_built_for():
    """The reward table exercises what it claims: an unscorable row (advantage 0), a zero-std
    group, a group with one scored row; the advantages sum to 0 over each full group."""
    scored = score_rewards(rewards_table(), torch.tensor(WEIGHTS, dtype=torch.float64), NAMES, G)
    assert scored.rewards[1].isnan() and scored.advantages[1] == 0
    assert scored.metrics["frac_reward_zero_std"] == 0.25
    assert (scored.advantages[2 * G :] == 0).all()
    assert abs(float(scored.advantages[G : 2 * G].sum())) < 1e-12
