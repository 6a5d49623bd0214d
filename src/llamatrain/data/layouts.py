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

``data.layout = "auto"`` tells each row's layout by its keys (:func:`layout_of`), as the three
native shapes always were, so a file may mix them; naming a layout makes every other row a bad
row instead (a typo'd key is then reported, not read as something else). :func:`to_native`
gives the native row; :mod:`~llamatrain.data.jsonl` then checks it as it checks a JSONL line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llamatrain.data.json_text import load_json
from llamatrain.errors import DataError

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "LAYOUTS",
    "SHAREGPT_ROLES",
    "layout_of",
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
"""The keys that tell a layout (any one of them, tried in this order)."""

_SHAPES = (
    '{"messages": [...]}, {"prompt": ..., "completion": ...}, {"text": ...}, Alpaca\'s '
    '{"instruction": ..., "input": ..., "output": ...} or ShareGPT\'s {"conversations": '
    '[{"from": ..., "value": ...}, ...]}'
)


def layout_of(row: Mapping[str, Any]) -> str:
    """The layout a row's keys say it is in; DataError naming the layouts if none fits."""
    for layout, keys in _KEYS.items():
        if any(key in row for key in keys):
            return layout
    raise DataError(f"an object with none of the keys of {_SHAPES}")


def to_native(row: Mapping[str, Any], layout: str = "auto") -> dict[str, Any]:
    """``row`` as a ``messages``, ``prompt``/``completion`` or ``text`` row; DataError (one
    line, no location) when it is not in ``layout`` (``"auto"``: whichever its keys say)."""
    found = layout_of(row)
    if layout not in ("auto", found):
        keys = " and ".join(f'"{k}"' for k in _KEYS[layout])
        raise DataError(
            f"data.layout = {layout!r} expects {keys}; this row is in the {found} layout "
            f"(keys {', '.join(map(repr, row))})"
        )
    if found == "alpaca":
        return _alpaca(row)
    if found == "sharegpt":
        return _sharegpt(row)
    return dict(row)


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
