"""GRPO learns from its reward, and only from it (issue 36's second proof), and one step's
gradient is the policy gradient computed by hand from the step's own completions.

The task: a prompt is a string of 3-6 random digits, the answer the next digit counting on from
its last one ("4179" -> "0"); one completion token (the tiny vocabulary's byte tokens hold the
digits, one token each); the reward is 1 when the completion starts with the right digit,
else 0. Held out: the prompt file's last 40 of 400 rows, new strings, so only "last digit + 1"
carries over.

GRPO cannot start from random weights here: a digit is 10 of 384 tokens, the right one 1 in 384,
so almost every group's rewards are all 0 and teach nothing. The base is a random tiny llama
first trained (plain next-token loss, ~10 s) on digit strings whose every next digit is
uniform over the nine that differ from the one before: it writes a digit after digits, and it
must look at the last one to avoid it, but nothing in it favours "+1" — the right answer has a
chance of 1/9 when sampled; its greedy answers score 0.03 on the held-out prompts. (Trained on
uniform digits instead, its last position hardly tells the digits apart and GRPO memorises
training prompts without carrying over; 600 steps instead of 1000 left three digits alike and
the reward stuck at 0.7.)

Controls, through the public reward interface only (``train.rewards`` and
``train.reward_weights``): *negated* trains on ``correct`` with weight -1 (every advantage
negated); *shuffled* trains on ``correct``'s rewards permuted across the step's completions
(``shuffled`` below, weight 1) while ``correct`` rides along at weight 0. In all three runs
``val_rewards/correct/mean`` is the true held-out greedy reward (functions' metrics are
unweighted).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from random_models import tiny_llama

from llamatrain import api
from llamatrain.model import Llama
from llamatrain.plot import read_records
from llamatrain.tokenizer import Tokenizer

REWARD_FILE = '''
import random


def correct(prompts, completions, completion_ids, answer, **columns):
    return [float(c.strip().startswith(a)) for c, a in zip(completions, answer)]


def shuffled(prompts, completions, completion_ids, answer, trainer_state, **columns):
    """correct's rewards of the step, each handed to another completion."""
    rewards = correct(prompts, completions, completion_ids, answer)
    random.Random(trainer_state.global_step).shuffle(rewards)
    return rewards
'''

N_PROMPTS, N_HELD_OUT = 400, 40


def digit_ids(tokenizer: Tokenizer) -> list[int]:
    """The token of each digit 0-9 (one each in the tiny vocabulary: byte pieces)."""
    ids = [tokenizer.encode(str(d))[-1] for d in range(10)]
    assert [tokenizer.decode([i]) for i in ids] == [str(d) for d in range(10)]
    return ids


def no_repeat_strings(generator: torch.Generator, rows: int, length: int) -> torch.Tensor:
    """(rows, length) digits, each next one uniform over the nine unlike the one before."""
    first = torch.randint(0, 10, (rows, 1), generator=generator)
    steps = torch.randint(1, 10, (rows, length - 1), generator=generator)
    return torch.cat([first, first + steps.cumsum(dim=1)], dim=1) % 10


def warm_started(model: Llama, tokenizer: Tokenizer, steps: int = 1000) -> Llama:
    """``model`` trained on no-repeat digit strings as the prompts are tokenized (BOS, the
    word-start piece, digits): it learns the format and the one rule, not the answer."""
    digits = torch.tensor(digit_ids(tokenizer))
    head = torch.tensor(tokenizer.encode("0")[:-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        strings = digits[no_repeat_strings(generator, 32, 8)]
        start = torch.tensor([tokenizer.bos_id, *head]).expand(32, -1)
        tokens = torch.cat([start, strings], dim=1)
        targets = tokens[:, 1:].clone()
        targets[:, : len(head)] = -100  # the digits are the lesson
        _, loss = model(tokens[:, :-1], targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def prompt_rows(seed: int = 0) -> list[dict[str, str]]:
    """Random digit strings of 3-6 digits and the digit after the last one, mod 10."""
    rng = random.Random(seed)
    rows = []
    for _ in range(N_PROMPTS):
        digits = [rng.randrange(10) for _ in range(rng.randint(3, 6))]
        rows.append({"prompt": "".join(map(str, digits)), "answer": str((digits[-1] + 1) % 10)})
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("grpo_learning")
    model, tokenizer = tiny_llama(cache_dir)
    base = warm_started(model, tokenizer)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
    rewards = folder / "digit_rewards.py"
    rewards.write_text(REWARD_FILE)
    return {
        "base": api.export_gguf(base, tokenizer, folder / "base.gguf"),
        "prompts": prompts,
        "rewards": rewards,
        "cache": cache_dir,
    }


def overrides(files: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    """A full finetune of the base on the digit prompts: 8 prompts x 8 completions a step,
    each completion one token, the held-out prompts' greedy reward after every step."""
    return [
        f'data.cache_dir="{files["cache"]}"',
        f'output.dir="{run_dir}"',
        f'model.init_from="{files["base"]}"',
        f'data.path="{files["prompts"]}"',
        'data.format="jsonl"',
        f"data.val_fraction={N_HELD_OUT / N_PROMPTS}",
        'train.objective="grpo"',
        "train.num_generations=8",
        "train.max_completion_length=1",
        "train.n_batch=4096",  # 64 completions a step (n_ctx 64)
        "train.n_ubatch=2048",  # in 2 micro-batches
        "train.eval_every=1",
        "train.eval_batches=0",  # every held-out prompt
        "train.save_every=0",
        "train.sample_tokens=0",
        "train.log_every=1",
        "output.export=false",
        "optim.warmup_steps=0",
        *extra,
    ]


def rewards_spec(files: dict[str, Path], *names: str) -> str:
    specs = [f"{files['rewards']}:{name}" for name in names]
    return f"train.rewards={json.dumps(specs)}"


# ---- one step's gradient -------------------------------------------------------------------


def test_one_grpo_step_moves_the_weights_by_the_hand_computed_policy_gradient(files, tmp_path):
    """AdamW's first step moves a weight by -lr g/(|g| + eps) (m = g, v = g^2 after the bias
    corrections), so the gradient the trainer fed is read back exactly from the change d:
    g = d eps/(lr - |d|); with a huge epsilon the step (~ lr g/eps) is a smooth function of g,
    well above float32's rounding of the weights. By hand from the completions table (prompt,
    completion, advantage): -sum_i A_i log softmax(logits_i / T)[completion_i] / (completion
    tokens), dapo's loss at temperature T, with the group advantages the table holds
    recomputed from its rewards. Two micro-batches, T = 0.7, two-token completions: the
    advantages' sign and order, the mask, the temperature and the micro-batches' shares are
    the trainer's to get right."""
    eps = 1e4
    lr = 100 * eps  # a step of 100 g: well above float32's rounding of the weights
    run = api.fit(
        "tiny",
        overrides=overrides(
            files,
            tmp_path / "run",
            rewards_spec(files, "correct"),
            "train.steps=1",
            "train.temperature=0.7",
            "train.max_completion_length=2",
            "train.eval_every=0",
            f"optim.lr={lr}",
            f"optim.eps={eps}",
            "optim.weight_decay=0",
            "optim.grad_clip=0",
        ),
        progress=False,
    )
    table = read_records(run.run_dir / "completions.jsonl")
    assert len(table) == 64
    rewards = torch.tensor([row["reward"] for row in table], dtype=torch.float64).view(8, 8)
    assert 0 < rewards.sum() < 64  # some groups teach something
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    advantages = (centred / (rewards.std(dim=1, keepdim=True) + 1e-4)).flatten()
    torch.testing.assert_close(
        advantages, torch.tensor([row["advantage"] for row in table]).double()
    )

    base, tokenizer = api.load_gguf(files["base"])
    digits = {str(d): i for d, i in enumerate(digit_ids(tokenizer))}
    loss = torch.zeros(())
    tokens = 0
    for row, advantage in zip(table, advantages.float(), strict=True):
        completion = [digits[c] for c in row["completion"]]  # both digits: no stop token
        ids = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(row["prompt"]), *completion]])
        logits = base(ids[:, :-1])[0, -len(completion) :] / 0.7
        logps = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion)[:, None])
        loss = loss - advantage * logps.sum()
        tokens += len(completion)
    (loss / tokens).backward()

    trained = dict(run.model.named_parameters())
    for name, weight in base.named_parameters():
        moved = weight.detach() - trained[name].detach()
        fed = moved * eps / (lr - moved.abs())
        assert (fed - weight.grad).norm() <= 1e-5 * weight.grad.norm(), name


# ---- learning, and the controls ------------------------------------------------------------

RUNS = {  # name: the reward functions trained on, and their weights
    "normal": (("correct",), (1.0,)),
    "negated": (("correct",), (-1.0,)),
    "shuffled": (("correct", "shuffled"), (0.0, 1.0)),
}
STEPS = 30


def held_out_greedy(files: dict[str, Path]) -> float:
    """The base's held-out greedy reward: its top token after each held-out prompt."""
    model, tokenizer = api.load_gguf(files["base"])
    rows = prompt_rows()[-N_HELD_OUT:]
    right = 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(row["prompt"])]])
            right += tokenizer.decode([int(model(ids)[0, -1].argmax())]) == row["answer"]
    return right / len(rows)


@pytest.fixture(scope="module")
def curves(files, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list]]:
    """Each run's held-out greedy reward, before training and after every step ("greedy"),
    and its rollouts' sampled reward at every step ("sampled"), both ``correct``'s."""
    start = held_out_greedy(files)
    out = {}
    for name, (functions, weights) in RUNS.items():
        run_dir = tmp_path_factory.mktemp(name) / "run"
        extra = (
            rewards_spec(files, *functions),
            f"train.reward_weights={list(weights)}",
            f"train.steps={STEPS}",
            "optim.lr=3e-3",
            "optim.lr_min=3e-3",
        )
        api.fit("tiny", overrides=overrides(files, run_dir, *extra), progress=False)
        records = read_records(run_dir / "metrics.jsonl")
        out[name] = {
            "greedy": [start]
            + [r["val_rewards/correct/mean"] for r in records if "val_reward" in r],
            "sampled": [r["rewards/correct/mean"] for r in records if "loss" in r],
        }
    return out


@pytest.mark.slow
def test_grpo_learns_from_the_reward_and_not_from_shuffled_or_negated_rewards(curves):
    """Held-out greedy reward before training and after steps 1, 2, ... 30 (seeds fixed;
    32 s on 2 shared cores, 2.5 min when others load them):

    normal    0.03 .45 .53 .50 .62 .75 .88 (steps 6-12) 1.0 (steps 13-30)
    negated   0.03 .10 .10 0.0 (steps 3-30)
    shuffled  0.03 (steps 1-27) 0.0 (28-30)

    and the rollouts' sampled reward, steps 1-5 and 26-30: normal .19 .17 .08 .19 .17 ->
    .89 .75 .88 .72 .83; negated .19 .12 .08 .14 .06 -> 0 0 0 .02 0; shuffled .19 .12 .06 .14
    .08 -> .11 .19 .06 .14 .14 (chance 1/9 when sampled). Only the true reward teaches the
    rule; the same completions with their rewards shuffled teach nothing, negated they teach
    the model to avoid the right digit."""
    normal, negated, shuffled = (curves[name] for name in ("normal", "negated", "shuffled"))
    chance = normal["greedy"][0]
    assert chance <= 0.3
    assert min(normal["greedy"][-5:]) >= 0.8
    assert max(shuffled["greedy"][-5:]) <= 0.3
    assert max(negated["greedy"][-5:]) == 0.0
    assert sum(negated["sampled"][-5:]) < sum(negated["sampled"][:5])
