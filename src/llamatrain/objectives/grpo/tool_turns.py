"""The tools' side of a multi-turn rollout (``train.tools``): a row's finished turn read for
tool calls in the model's format, the calls run, their results rendered as tool messages with
the chat template and tokenized, as the rows' :class:`~.turns.Responder`.

A turn is answered when its text (the stop token left out) holds calls
(:func:`~llamatrain.tools.calls.parse_reply`) and the row has rounds left
(``train.max_tool_calls``, TRL's ``max_tool_calling_iterations``: one round runs all the calls
of one reply). Each call becomes one tool message ``{"role": "tool", "name", "content"}``, as
TRL's: what the tool returned (``str``), or for a call that failed the error as TRL writes it,
``str({"error": ...})`` — a call the parser refused (unparseable, an unknown tool, arguments its
schema refuses: :class:`~llamatrain.tools.calls.FailedCall`), or one that raised or outran
``train.tool_timeout`` (:mod:`llamatrain.tools.running`). Failed calls are answered too, so the
model reads what it did wrong.

The answer's tokens are the chat template's rendering of the tool messages after the reply
(:func:`~.answers.answer_tokens`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from llamatrain.chat_template import ChatTemplate
from llamatrain.objectives.grpo.answers import answer_tokens
from llamatrain.tokenizer import Tokenizer
from llamatrain.tools.calls import (
    UNKNOWN_TOOL,
    UNPARSEABLE,
    WRONG_ARGUMENTS,
    CallSyntax,
    FailedCall,
    ToolCall,
    call_syntax,
    parse_reply,
)
from llamatrain.tools.loading import Tool
from llamatrain.tools.running import RAISED, TIMED_OUT, error_content, run_call

__all__ = [
    "COUNTS",
    "FAILURES",
    "ToolSettings",
    "ToolTurns",
    "counts",
    "row_record",
    "tool_metrics",
]

FAILURES = (UNPARSEABLE, UNKNOWN_TOOL, WRONG_ARGUMENTS, RAISED, TIMED_OUT)
"""The ways a call fails, as the metrics name them (``tools/failures/<kind>``)."""


@dataclass(frozen=True)
class ToolSettings:
    """The config's tool settings: ``train.max_tool_calls`` (rounds), ``train.tool_timeout``
    (seconds a call may run), ``train.tool_output_chars`` (a result's most characters)."""

    max_rounds: int
    timeout: float
    max_chars: int


@dataclass
class RowLog:
    """One row's conversation after its prompt (the messages its rounds added), its rounds,
    calls and failed calls by kind."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    rounds: int = 0
    calls: int = 0
    failures: Counter = field(default_factory=Counter)


class ToolTurns:
    """The rows' tool rounds: :meth:`answer` for :func:`~.turns.decode_turns`, and each
    row's log (:attr:`logs`) for the rewards, the metrics and the completions table."""

    def __init__(
        self,
        tools: Sequence[Tool],
        settings: ToolSettings,
        template: ChatTemplate,
        tokenizer: Tokenizer,
        prompts: Sequence[list[dict[str, Any]]],
    ) -> None:
        """``prompts``: each row's prompt messages (a row's conversation starts with them)."""
        self.tools = {tool.name: tool for tool in tools}
        self.schemas = [tool.schema for tool in tools]
        self.syntax: CallSyntax = call_syntax(template.source)
        self.settings, self.template, self.tokenizer = settings, template, tokenizer
        self.prompts = prompts
        self.logs = [RowLog() for _ in prompts]

    def answer(self, row: int, turn: Sequence[int], room: int, finished: bool) -> list[int] | None:
        """The tool messages answering row ``row``'s ``turn`` as tokens, or None: no call in
        it, no round left, or an answer of more than ``room`` tokens (the calls ran: TRL
        counts them; the conversation ends without their results). A turn the budget cut
        (not ``finished``) holding a call it cut off is text, as TRL's parser falls back to
        text on it: none of its calls run."""
        log = self.logs[row]
        reply = parse_reply(self.tokenizer.decode(list(turn)), self.syntax, self.schemas)
        if not reply.calls or log.rounds >= self.settings.max_rounds:
            return None
        if not finished and any(call.kind == UNPARSEABLE for call in reply.failed):
            return None
        log.rounds += 1
        assistant = _assistant_message(reply.content, reply.calls)
        results = [self._result(call, log) for call in reply.calls]
        before = [*self.prompts[row], *log.messages, assistant]
        tokens = answer_tokens(self.template, self.tokenizer, before, results, self.schemas)
        if len(tokens) > room:
            return None
        log.messages += [assistant, *results]
        return tokens

    def counts(self) -> torch.Tensor:
        """Each row's :func:`counts`."""
        return counts(self.logs)

    def final_messages(self, row: int, last_turn: Sequence[int], stops: frozenset[int]) -> list:
        """Row ``row``'s completion as messages, TRL's shape: its rounds' assistant and tool
        messages, then its last turn as an assistant message (with the calls it holds, which
        no round ran)."""
        ended = bool(last_turn) and last_turn[-1] in stops
        text = self.tokenizer.decode(list(last_turn[:-1] if ended else last_turn))
        reply = parse_reply(text, self.syntax, self.schemas)
        return [*self.logs[row].messages, _assistant_message(reply.content, reply.calls)]

    def _result(self, call: ToolCall | FailedCall, log: RowLog) -> dict[str, Any]:
        """The tool message answering ``call``, the call and any failure counted."""
        log.calls += 1
        if isinstance(call, FailedCall):
            log.failures[call.kind] += 1
            return _tool_message(call.name or "", error_content(call.error))
        s = self.settings
        outcome = run_call(self.tools[call.name], call.arguments, s.timeout, s.max_chars)
        if outcome.failure is not None:
            log.failures[outcome.failure] += 1
        return _tool_message(call.name, outcome.content)


def _assistant_message(content: str, calls: Sequence[ToolCall | FailedCall]) -> dict[str, Any]:
    """An assistant message as TRL's parsed reply: its text and, if any, its calls (a failed
    one by the name it gave, no arguments)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [_call_entry(call) for call in calls]
    return message


def _call_entry(call: ToolCall | FailedCall) -> dict[str, Any]:
    arguments: Mapping[str, Any] = call.arguments if isinstance(call, ToolCall) else {}
    return {"type": "function", "function": {"name": call.name or "", "arguments": arguments}}


def _tool_message(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": content}


COUNTS = ("calls", "rounds", *FAILURES)
"""The columns of :func:`counts`, each row's."""


def counts(logs: Sequence[RowLog]) -> torch.Tensor:
    """(rows, len(COUNTS)) float64: each row's calls, rounds and failed calls by kind (what
    the ranks exchange for the step's metrics)."""
    return torch.tensor(
        [[log.calls, log.rounds, *(log.failures[kind] for kind in FAILURES)] for log in logs],
        dtype=torch.float64,
    )


def tool_metrics(table: torch.Tensor) -> dict[str, float]:
    """The step's tool metrics from every row's :func:`counts`: TRL's ``tools/call_frequency``
    (calls per completion) and ``tools/failure_frequency`` (failed calls per call), the
    assistant turns per completion, and each kind of failed call per completion."""
    rows = max(table.shape[0], 1)
    calls, rounds, failures = table[:, 0].sum(), table[:, 1], table[:, 2:]
    metrics = {
        "tools/call_frequency": float(calls) / rows,
        "tools/failure_frequency": float(failures.sum() / calls) if calls > 0 else 0.0,
        "tools/turns": float((rounds + 1).mean()) if len(rounds) else 0.0,
    }
    for kind, column in zip(FAILURES, failures.T, strict=True):
        metrics[f"tools/failures/{kind}"] = float(column.sum()) / rows
    return metrics


def row_record(row: torch.Tensor) -> dict[str, Any]:
    """What the completions table shows of a row's tools, from its :func:`counts`: its calls,
    rounds and failed calls by kind (the kinds it had)."""
    calls, rounds, *failures = (int(v) for v in row.tolist())
    failed = {kind: n for kind, n in zip(FAILURES, failures, strict=True) if n}
    return {"calls": calls, "rounds": rounds, "failures": failed}
