"""What answers a GRPO run's turns, as the objective sees it: its tools (:mod:`.tool_turns`), its
environment (:mod:`.environment`), or nothing (single-turn rollouts), behind one interface —
each step's responder over its rows, the prompts the rows decode from and the reward functions
get, the completions as the reward functions get them, the metrics and the completions table's
entry of each row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llamatrain.chat_template import ChatTemplate
from llamatrain.data.prompts import PromptRow
from llamatrain.objectives.grpo import environment as env_turns
from llamatrain.objectives.grpo import tool_turns
from llamatrain.objectives.grpo.environment import Environment, EnvironmentTurns
from llamatrain.objectives.grpo.rewards import trl_completions
from llamatrain.objectives.grpo.tool_turns import ToolSettings, ToolTurns
from llamatrain.objectives.grpo.turns import Completion
from llamatrain.tokenizer import Tokenizer
from llamatrain.tools.loading import Tool

__all__ = ["MultiTurn", "Turns"]


@dataclass(frozen=True)
class Turns:
    """One step's rows as their turns were answered: the prompts they decoded from (ids, and
    as the reward functions get them) and the responder (None: single-turn)."""

    prompt_ids: list[Sequence[int]]
    prompts: list[Any]
    responder: ToolTurns | EnvironmentTurns | None

    def completions(
        self, completions: Sequence[Completion], texts: Sequence[str], stops: frozenset[int]
    ) -> list[Any]:
        """The completions as TRL hands them to reward functions: the text (one assistant
        message for a conversation), or a multi-turn conversation's messages."""
        if self.responder is None:
            return trl_completions(self.prompts, texts)
        return [
            self.responder.final_messages(i, c.tokens[c.last_turn :], stops)
            for i, c in enumerate(completions)
        ]

    def counts(self) -> torch.Tensor | None:
        """Each row's counts of calls or replies (None: single-turn), which ranks exchange."""
        return None if self.responder is None else self.responder.counts()

    def rewards(self) -> list[float]:
        """The environment's reward of each row (a run whose environment owns one)."""
        return self.responder.rewards()


class MultiTurn:
    """The run's tools or environment (at most one of them), its template and tokenizer."""

    def __init__(
        self,
        tools: Sequence[Tool],
        settings: ToolSettings,
        environment: Environment | None,
        template: ChatTemplate | None,
        tokenizer: Tokenizer,
    ) -> None:
        self.tools, self.settings, self.environment = list(tools), settings, environment
        self.template, self.tokenizer = template, tokenizer

    @property
    def key(self) -> str | None:
        """What the metrics and the table call this run's turns: "tools", "environment"."""
        if self.tools:
            return "tools"
        return "environment" if self.environment is not None else None

    def start(self, rows: Sequence[PromptRow]) -> Turns:
        """The step's (or evaluation's) rows ready to decode, one responder over them."""
        prompts = [r.prompt for r in rows]
        ids = [r.ids for r in rows]
        if self.tools:
            args = (self.template, self.tokenizer, prompts)
            return Turns(ids, prompts, ToolTurns(self.tools, self.settings, *args))
        if self.environment is not None:
            turns = EnvironmentTurns(self.environment, self.template, self.tokenizer, rows)
            return Turns(turns.prompt_ids, turns.prompts, turns)
        return Turns(ids, prompts, None)

    def metrics(self, table: torch.Tensor | None) -> dict[str, float]:
        """The step's metrics of the rows' counts (every rank's)."""
        if table is None:
            return {}
        if self.tools:
            return tool_turns.tool_metrics(table)
        return env_turns.environment_metrics(table)

    def record(self, row: torch.Tensor) -> dict[str, Any]:
        """A row's entry in the completions table, from its counts."""
        if self.tools:
            return tool_turns.row_record(row)
        return env_turns.row_record(row)
