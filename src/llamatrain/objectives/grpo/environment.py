"""Environments (``train.environment = "env.py:make_env"``): multi-turn GRPO tasks without a tool
format — games, tutors, graders that reply — on the same turn-by-turn decode as the tools
(:mod:`.turns`), with the same masks.

``make_env()`` gives one environment per completion (each of a prompt's G completions has its
own, so their conversations stay apart). ``env.reset(row)`` gets the prompt row (``{"prompt":
..., **columns}``) and returns the first user message (a string; None: the row's prompt as it
is), which follows the row's prompt messages. Each time the model ends a turn (with its stop
token, the budget's last token included; a turn the budget cuts is not stepped),
``env.step(reply)`` gets the reply's text and returns the next user message, or None to end
the conversation. An environment with a ``reward()`` method owns a reward: called once per
finished conversation, it becomes the reward column ``environment`` (weight 1, as TRL's
environments' ``get_reward``). The environment's messages and the template's tokens around them
are masked out of the loss, like a tool's results.

An environment's code is the config's, as a reward's is: an exception it raises (or an exit)
stops the run in one line naming it (:mod:`llamatrain.user_code`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llamatrain.chat_template import ChatTemplate, prompt_ids
from llamatrain.data.prompts import PromptRow
from llamatrain.errors import ConfigError, TrainingError, shown
from llamatrain.objectives.grpo.answers import answer_tokens
from llamatrain.tokenizer import Tokenizer
from llamatrain.tools.specs import Named, import_function
from llamatrain.user_code import user_code

__all__ = [
    "ENVIRONMENT",
    "Environment",
    "REWARD_NAME",
    "EnvironmentTurns",
    "environment_metrics",
    "load_environment",
    "row_record",
]

ENVIRONMENT = Named(
    setting="train.environment",
    noun="environment",
    forms="'package.module:make_env' or 'path/to/file.py:make_env'",
    signature="name a function that makes an environment (with reset(row) and step(reply))",
)
"""How messages about ``train.environment`` name it."""

REWARD_NAME = "environment"
"""The reward column of an environment's own ``reward()`` (``rewards/environment/mean``)."""


@dataclass(frozen=True)
class Environment:
    """A loaded ``train.environment``: its spec, the function that makes one, and whether its
    environments own a reward (a ``reward()`` method)."""

    spec: str
    make: Callable[[], Any]
    owns_reward: bool


def load_environment(spec: str) -> Environment:
    """``make_env`` from ``spec`` (its module run now): one environment is made, as TRL probes
    its factory, and must have ``reset`` and ``step``."""
    with user_code(f"environment {shown(spec)!r}: running its module", ConfigError):
        make = import_function(spec, ENVIRONMENT)
    with user_code(f"environment {shown(spec)!r}", ConfigError):
        probe = _made(make, spec)
    missing = [m for m in ("reset", "step") if not callable(getattr(probe, m, None))]
    if missing:
        raise ConfigError(
            f"environment {shown(spec)!r} made a {type(probe).__name__} without "
            f"{' and '.join(missing)}; {ENVIRONMENT.signature}"
        )
    return Environment(spec, make, callable(getattr(probe, "reward", None)))


def _made(make: Callable[[], Any], spec: str) -> Any:
    try:
        return make()
    except Exception as e:
        raise ConfigError(
            f"environment {shown(spec)!r}: making one raised {type(e).__name__}: "
            f"{shown(str(e))}; {ENVIRONMENT.signature}"
        ) from None


class EnvironmentTurns:
    """One environment per row: the rows' prompts (the row's messages and the environment's
    first message), :meth:`answer` for :func:`~.turns.decode_turns`, each row's messages and
    turns, and the environments' rewards."""

    def __init__(
        self,
        environment: Environment,
        template: ChatTemplate,
        tokenizer: Tokenizer,
        rows: Sequence[PromptRow],
    ) -> None:
        spec = environment.spec
        self.spec, self.template, self.tokenizer = spec, template, tokenizer
        with self._guarded("made or reset"):
            self.envs = [environment.make() for _ in rows]
            first = [env.reset(_row(r)) for env, r in zip(self.envs, rows, strict=True)]
        for message in first:
            if message is not None:
                _check_message(message, spec, "reset")
        self.prompts = [_opening(r.prompt, m) for r, m in zip(rows, first, strict=True)]
        self.prompt_ids = [
            prompt_ids(tokenizer, template.render(p, add_generation_prompt=True))
            for p in self.prompts
        ]
        self.messages: list[list[dict[str, Any]]] = [[] for _ in rows]

    def answer(self, row: int, turn: Sequence[int], room: int, finished: bool) -> list[int] | None:
        """The environment's next message as tokens, or None: it ended the conversation, its
        message would take more than ``room`` tokens, or the budget cut the turn (not
        ``finished``: the environment steps on the turns the model ended)."""
        if not finished:
            return None
        text = self.tokenizer.decode(list(turn))
        with self._guarded("stepped"):
            reply = self.envs[row].step(text)
        if reply is None:
            return None
        _check_message(reply, self.spec, "step")
        assistant = {"role": "assistant", "content": text}
        user = {"role": "user", "content": reply}
        before = [*self.prompts[row], *self.messages[row], assistant]
        tokens = answer_tokens(self.template, self.tokenizer, before, [user])
        if len(tokens) > room:
            return None
        self.messages[row] += [assistant, user]
        return tokens

    def final_messages(self, row: int, last_turn: Sequence[int], stops: frozenset[int]) -> list:
        """Row ``row``'s completion as messages: its turns and the environment's replies,
        then its last turn."""
        ended = bool(last_turn) and last_turn[-1] in stops
        text = self.tokenizer.decode(list(last_turn[:-1] if ended else last_turn))
        return [*self.messages[row], {"role": "assistant", "content": text}]

    def counts(self) -> torch.Tensor:
        """(rows, 1) float64: each row's environment replies (what the ranks exchange)."""
        return torch.tensor([[len(m) // 2] for m in self.messages], dtype=torch.float64)

    def rewards(self) -> list[float]:
        """Each row's environment reward (its ``reward()``), NaN for None."""
        with self._guarded("asked for its reward"):
            values = [env.reward() for env in self.envs]
        return [float("nan") if v is None else float(v) for v in values]

    def _guarded(self, what: str) -> contextlib.AbstractContextManager:
        return _environment_code(self.spec, what)


@contextlib.contextmanager
def _environment_code(spec: str, what: str) -> Iterator[None]:
    """The environment's code run as the config's: an exception or exit it raises stops the
    run in one line naming it."""
    with user_code(f"environment {shown(spec)!r}"):
        try:
            yield
        except TrainingError:
            raise
        except Exception as e:
            raise TrainingError(
                f"environment {shown(spec)!r} raised {type(e).__name__} when {what}: "
                f"{shown(str(e))}"
            ) from None


def _opening(prompt: str | list[dict[str, Any]], first: Any) -> list[dict[str, Any]]:
    """A row's opening messages: its prompt (text as a user message) then the environment's
    first message, if it gave one."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if first is None:
        return messages
    return [*messages, {"role": "user", "content": first}]


def _row(row: PromptRow) -> dict[str, Any]:
    """A prompt row as ``reset`` gets it: ``{"prompt": ..., **columns}``."""
    return {"prompt": row.prompt, **row.columns}


def _check_message(message: Any, spec: str, method: str) -> None:
    if not isinstance(message, str):
        raise TrainingError(
            f"environment {shown(spec)!r}: {method} returned a {type(message).__name__}; it "
            "returns the next user message (a string) or None"
        )


def environment_metrics(table: torch.Tensor) -> dict[str, float]:
    """The step's ``environment/turns``: the model's turns per completion (its replies + 1)."""
    return {"environment/turns": float((table[:, 0] + 1).mean()) if len(table) else 0.0}


def row_record(row: torch.Tensor) -> dict[str, int]:
    """What the completions table shows of a row's environment: its replies."""
    return {"replies": int(row[0])}
