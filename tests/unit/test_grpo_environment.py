"""GRPO with an environment (``train.environment``): a guessing game that replies to each turn,
played through the objective's rollout with scripted replies (as in ``test_grpo_tool_turns``):
the tokens are the chat template's rendering of the conversation, the mask marks exactly the
model's tokens, the reward functions get the whole conversation, the environment's own reward
is a reward column, and its faults are one-line errors.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from llama_cpp_files import vocab_dir as vocab_dir
from test_grpo_setup import GRPO
from test_grpo_setup import checked as check_config
from test_grpo_tool_turns import scripted
from test_grpo_tool_turns import setup as setup  # noqa: F401 - the shared fixture

from llamatrain.chat_template import prompt_ids
from llamatrain.data.prompts import PromptRow
from llamatrain.errors import ConfigError, TrainingError
from llamatrain.objectives.grpo.environment import load_environment
from llamatrain.objectives.grpo.objective import GRPOObjective
from llamatrain.objectives.grpo.rewards import load as load_rewards

GAME = '''
class Guess:
    """Guess my number (7): each guess is answered higher or lower, the right one ends."""

    def reset(self, row):
        self.guesses, self.won = 0, False
        return f"Guess my number from 1 to {row['top']}."

    def step(self, reply):
        self.guesses += 1
        if reply.strip() == "7":
            self.won = True
            return None
        return "higher" if int(reply) < 7 else "lower"

    def reward(self):
        return 1.0 / self.guesses if self.won else 0.0


def make_env():
    return Guess()


class Broken(Guess):
    def step(self, reply):
        raise ValueError("no such move")


def make_broken():
    return Broken()


def make_nothing():
    return object()
'''


@pytest.fixture(scope="module")
def game(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("env") / "game.py"
    path.write_text(GAME)
    return path


def play(setup, monkeypatch, game, scripts, maker="make_env", budget=120):
    """The objective's rollout of one prompt row, G = len(scripts) completions each
    "sampling" its script; what the reward function got."""
    model, tokenizer, template = setup
    overrides = [
        *GRPO,
        f"train.num_generations={len(scripts)}",
        f"train.max_completion_length={budget}",
        "data.n_ctx=1024",
        f"train.n_batch={1024 * len(scripts)}",
        f'train.environment="{game}:{maker}"',
    ]
    seen = {}

    def gets_all(prompts, completions, completion_ids, **_):
        seen.update(prompts=prompts, completions=completions)
        return [float(len(c)) for c in completions]

    cfg = check_config("tiny", overrides)
    environment = load_environment(cfg.train.environment)
    rewards = load_rewards([gets_all])
    objective = GRPOObjective(cfg, tokenizer, template, rewards, environment=environment)
    system = [{"role": "system", "content": "Answer with a number."}]
    row = PromptRow((1,), system, {"top": 10})
    scripted(monkeypatch, tokenizer, ["".join(s) for s in scripts])
    return objective.rollout([row], 0, model, contextlib.nullcontext()), seen


def test_a_game_is_played_turn_by_turn_and_rewarded(setup, monkeypatch, game):
    _, tokenizer, template = setup
    scripts = [["3<|im_end|>", "9<|im_end|>", "7<|im_end|>"], ["7<|im_end|>"]]
    rollout, seen = play(setup, monkeypatch, game, scripts)
    opening = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "Guess my number from 1 to 10."},
    ]
    assert seen["prompts"] == [opening, opening]
    assert seen["completions"][0] == [
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "higher"},
        {"role": "assistant", "content": "9"},
        {"role": "user", "content": "lower"},
        {"role": "assistant", "content": "7"},
    ]
    conversation = [*opening, *seen["completions"][0]]
    rendered = prompt_ids(tokenizer, template.render(conversation))
    prompt = prompt_ids(tokenizer, template.render(opening, add_generation_prompt=True))
    scored = rollout.targets[0] != -100
    completion = rollout.targets[0][scored].tolist()
    assert prompt + completion == rendered[: len(prompt) + len(completion)]
    mask = rollout.mask[0][scored].tolist()
    sampled = [t for t, m in zip(completion, mask, strict=True) if m]
    assert sampled == tokenizer.encode("".join(scripts[0]), special=True)
    assert [r["rewards"]["environment"] for r in rollout.table] == [pytest.approx(1 / 3), 1.0]
    assert [r["environment"] for r in rollout.table] == [{"replies": 2}, {"replies": 0}]
    assert rollout.metrics["environment/turns"] == 2.0
    assert rollout.metrics["rewards/environment/mean"] == pytest.approx((1 / 3 + 1) / 2)


def test_environment_faults_are_one_line_errors(setup, monkeypatch, game):
    with pytest.raises(TrainingError, match="raised ValueError when stepped: no such move"):
        play(setup, monkeypatch, game, [["3<|im_end|>"], ["7<|im_end|>"]], maker="make_broken")
    with pytest.raises(ConfigError, match="made a object without reset and step"):
        load_environment(f"{game}:make_nothing")
    with pytest.raises(ConfigError, match="train.environment .* samples none"):
        check_config("tiny", [f'train.environment="{game}:make_env"'])
    with pytest.raises(ConfigError, match="both answer the model's turns"):
        check_config(
            "tiny", [*GRPO, f'train.environment="{game}:make_env"', 'train.tools=["t.py:f"]']
        )
    with pytest.raises(ConfigError, match="train.environment"):
        check_config("tiny", [*GRPO, 'train.environment="not a spec"'])


def test_the_environment_steps_on_a_turn_ended_at_the_budget_not_on_a_cut_one(
    setup, monkeypatch, game
):
    """A right guess whose end-of-turn token is the budget's last token is stepped (and won);
    the same guess cut before its end-of-turn token is not."""
    _, tokenizer, _ = setup
    turn = len(tokenizer.encode("7<|im_end|>", special=True))
    for budget, won in [(turn, 1.0), (turn - 1, 0.0)]:
        rollout, _ = play(setup, monkeypatch, game, [["7<|im_end|>"]] * 2, budget=budget)
        assert [r["rewards"]["environment"] for r in rollout.table] == [won, won], budget
