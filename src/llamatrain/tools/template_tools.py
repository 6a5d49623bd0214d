"""How a chat template is shown the tools: the variables its rendering gets.

transformers' ``apply_chat_template(tools=…)`` and llama.cpp's ``--jinja`` pass the tools'
JSON schemas as ``tools``, which Qwen 2.5/3's and Llama 3.x's templates render. SmolLM3's
template renders no ``tools``: it lists functions only from its own ``xml_tools`` variable (its
model card passes the schemas there), so a rollout with tools would prompt it with none. Where a
template reads ``xml_tools``, the schemas are passed under that name too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["tool_variables"]


def tool_variables(
    template_source: str, schemas: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any]:
    """The keyword arguments of ``ChatTemplate.render`` that show the template (its source)
    the tools ``schemas`` (None or empty: no tools)."""
    if not schemas:
        return {"tools": None}
    if "xml_tools" in template_source:
        return {"tools": list(schemas), "xml_tools": list(schemas)}
    return {"tools": list(schemas)}
