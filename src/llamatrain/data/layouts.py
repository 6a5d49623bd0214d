"""The field layouts instruction data is shared in, mapped onto llamatrain's own rows.

A row (a JSONL line's object, a Parquet or HF ``datasets`` row) holds one example in one of:

- ``messages``: ``{"messages": [{"role", "content", …}, …], "tools": [...]?}`` (OpenAI/TRL);
- ``prompt_completion``: ``{"prompt": …, "completion": …}``;
- ``text``: ``{"text": …}``;
- ``alpaca``: ``{"instruction": …, "input": …?, "output": …}`` (Stanford Alpaca), read as a
  prompt/completion row whose prompt is Alpaca's own (:data:`ALPACA_PROMPT`,
  :data:`ALPACA_PROMPT_NO_INPUT`) and whose completion is ``output``;
- ``sharegpt``: ``{"conversations": [{"from": "human" | "gpt" | "system" | …, "value": …}],
  "system": …?, "tools": …?}``, read as a ``messages`` row (:data:`SHAREGPT_ROLES`).

``data.layout = "auto"`` tells each row's layout by its keys (:func:`layouts_of`), as the three
native shapes always were, so a file may mix them; naming a layout makes every other row a bad
row instead (a typo'd key is then reported, not read as something else). :func:`to_native`
gives the native row, holding only the fields of the layout it is read in;
:mod:`~llamatrain.data.jsonl` then checks it as it checks a JSONL line.

A row may fit several layouts (``messages`` beside a ``prompt`` column, as UltraChat's rows
are; Alpaca's ``instruction``/``output`` beside the ``text`` tatsu-lab/alpaca renders them
into). ``"auto"`` reads it in the first that fits, in :data:`LAYOUTS`' order, and the others'
fields go unread: :class:`MixedRows` counts such rows for one warning naming what was chosen,
and naming the layout reads the row in it (or says the choice was meant).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llamatrain.data.json_text import load_json
from llamatrain.errors import DataError

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "LAYOUTS",
    "SHAREGPT_ROLES",
    "MixedRows",
    "layouts_of",
    "to_native",
]

LAYOUTS = ("auto", "messages", "prompt_completion", "text", "alpaca", "sharegpt")
"""The values of ``data.layout``."""

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
"""Stanford Alpaca's prompt for a row with a non-empty ``input`` (``train.py``'s PROMPT_DICT)."""

ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
"""Stanford Alpaca's prompt for a row without ``input`` (or an empty one)."""

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
"""ShareGPT's ``from`` values and the role each becomes."""

_KEYS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
"""The keys that tell a layout (any one of them), in the order ``"auto"`` tries them."""

_NATIVE_FIELDS = {
    "messages": ("messages", "tools"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
"""The fields a native layout reads (a row's other keys are ids, sources, other layouts')."""

_SHAPES = (
    '{"messages": [...]}, {"prompt": ..., "completion": ...}, {"text": ...}, Alpaca\'s '
    '{"instruction": ..., "input": ..., "output": ...} or ShareGPT\'s {"conversations": '
    '[{"from": ..., "value": ...}, ...]}'
)


def layouts_of(row: Mapping[str, Any]) -> list[str]:
    """Every layout whose keys ``row`` has, in the order ``"auto"`` tries them (none: [])."""
    return [layout for layout, keys in _KEYS.items() if any(key in row for key in keys)]


def to_native(row: Mapping[str, Any], layout: str = "auto") -> dict[str, Any]:
    """``row`` as a ``messages``, ``prompt``/``completion`` or ``text`` row holding only that
    layout's fields; DataError (one line, no location) when it does not fit ``layout``
    (``"auto"``: the first its keys fit)."""
    fits = layouts_of(row)
    if not fits:
        raise DataError(f"an object with none of the keys of {_SHAPES}")
    read_as = fits[0] if layout == "auto" else layout
    if read_as not in fits:
        keys = " and ".join(f'"{k}"' for k in _KEYS[layout])
        raise DataError(
            f"data.layout = {layout!r} expects {keys}; this row is in the {fits[0]} layout "
            f"(keys {', '.join(map(repr, row))})"
        )
    if read_as == "alpaca":
        return _alpaca(row)
    if read_as == "sharegpt":
        return _sharegpt(row)
    return {key: row[key] for key in _NATIVE_FIELDS[read_as] if key in row}


@dataclass
class MixedRows:
    """Rows read under ``data.layout = "auto"`` whose keys fit more than one layout, counted
    for one warning per kind: a file whose rows carry ``messages`` and ``prompt`` trains on
    the messages, and its user should hear that, and how to choose, before the run does."""

    kinds: dict[str, list[Any]] = field(default_factory=dict)
    """"read as|also fits" -> [rows, the first's ``file:line``]."""

    def check(self, row: Mapping[str, Any], layout: str, where: str) -> None:
        """Count ``row`` (read at ``where``) if ``layout`` is ``"auto"`` and it fits several."""
        fits = layouts_of(row) if layout == "auto" else []
        if len(fits) > 1:
            self.kinds.setdefault("|".join(fits), [0, where])[0] += 1

    def notes(self) -> list[str]:
        """One warning per kind of row counted (none when every row fit one layout)."""
        notes = []
        for kind, (count, first) in self.kinds.items():
            read_as, *others = kind.split("|")
            rows = "1 row fits" if count == 1 else f"{count} rows fit"
            notes.append(
                f"{rows} the {read_as} layout and also {' and '.join(others)} (first: "
                f"{first}); read as {read_as}, their other fields unread: set "
                f"data.layout = '{others[0]}' to read those instead, or '{read_as}' to say "
                "that was meant"
            )
        return notes


def _alpaca(row: Mapping[str, Any]) -> dict[str, Any]:
    fields = {}
    for key in ("instruction", "input", "output"):
        value = row.get(key, "") if key == "input" else row.get(key)
        if value is None and key == "input":
            value = ""
        if not isinstance(value, str):
            raise DataError(f'Alpaca "{key}" must be a string, got {_type(value)}')
        fields[key] = value
    template = ALPACA_PROMPT if fields["input"] else ALPACA_PROMPT_NO_INPUT
    prompt = template.format(instruction=fields["instruction"], input=fields["input"])
    return {"prompt": prompt, "completion": fields["output"]}


def _sharegpt(row: Mapping[str, Any]) -> dict[str, Any]:
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise DataError(f'ShareGPT "conversations" must be a non-empty list, not {_type(turns)}')
    messages: list[dict[str, Any]] = []
    system = row.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise DataError(f'ShareGPT "system" must be a string, got {_type(system)}')
        if system:
            messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise DataError(f"conversation turn {i} must be an object, not {_type(turn)}")
        speaker, value = turn.get("from"), turn.get("value")
        if speaker not in SHAREGPT_ROLES:
            raise DataError(
                f'conversation turn {i} is "from" {speaker!r}; ShareGPT speakers are '
                + ", ".join(SHAREGPT_ROLES)
            )
        if not isinstance(value, str):
            raise DataError(f'conversation turn {i} needs a string "value", got {_type(value)}')
        if turn.get("weight") == 0:
            raise DataError(
                f"conversation turn {i} has weight 0 (axolotl's untrained turn), which "
                "llamatrain does not read; drop the key, or the turn"
            )
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": value})
    native: dict[str, Any] = {"messages": messages}
    if row.get("tools") is not None:
        native["tools"] = row["tools"]
    return native


def _type(value: Any) -> str:
    if value is None:
        return "nothing (missing or null)"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}
    names |= {list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def decode_tools(tools: Any) -> Any:
    """``tools`` as given, or decoded when it is a JSON string (tables often store the tool
    schemas as text, since their fields differ from tool to tool)."""
    if isinstance(tools, str):
        try:
            return load_json(tools)
        except DataError as e:
            raise DataError(f'"tools" is a string that is not usable JSON: {e}') from None
    return tools
