"""A model card's facts as the ``README.md`` the Hugging Face Hub reads: YAML front matter
(``base_model``, ``library_name``, ``license``, ``tags``, ``datasets``, ``pipeline_tag``: the
metadata fields the Hub indexes), then what the run did and how to run the result in llama.cpp.

Values come from files (a base's name, license and tags are whatever its GGUF says), so the
front matter writes every string as a JSON string, which YAML reads as the same double-quoted
scalar whatever it holds, and the body shows names escaped (:func:`llamatrain.errors.shown`):
no value can add a field or break the page.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import PurePath
from typing import Literal

from llamatrain.errors import shown
from llamatrain.model_card.facts import FINAL_METRICS, ModelCard, Training, hf_repo_url

__all__ = ["readme"]

Kind = Literal["model", "adapter"]
"""What the folder holds: an HF model, or a PEFT adapter for its base's HF export."""


def readme(card: ModelCard, kind: Kind) -> str:
    """The ``README.md`` of an HF model folder or PEFT adapter folder described by ``card``."""
    sections = [_front_matter(card), _title(card, kind), _intro(card, kind)]
    if card.training is not None:
        sections.append(_training_table(card, card.training))
    sections.append(_llama_cpp(card, kind))
    return "\n\n".join(sections) + "\n"


# ------------------------------------------------------------------------------- front matter


def _front_matter(card: ModelCard) -> str:
    """The Hub's metadata block; fields no file states are left out."""
    bases = card.hf_base_ids
    lines = ["---"]
    if bases:
        lines += _field("base_model", bases[0] if len(bases) == 1 else list(bases))
    lines += _field("library_name", "llamatrain")
    for name in ("license", "license_name", "license_link"):
        if value := getattr(card, name):
            lines += _field(name, value)
    lines += _field("tags", list(card.tags))
    if card.datasets:
        lines += _field("datasets", list(card.datasets))
    lines += _field("pipeline_tag", "text-generation")
    return "\n".join([*lines, "---"])


def _field(name: str, value: str | Sequence[str]) -> list[str]:
    """A YAML field: a scalar on its line, a list one item a line; each value quoted."""
    if isinstance(value, str):
        return [f"{name}: {_quoted(value)}"]
    return [f"{name}:", *(f"- {_quoted(item)}" for item in value)]


def _quoted(text: str) -> str:
    """``text`` as a YAML double-quoted string: JSON's escapes of quotes, backslashes and
    control characters, every other printable character as itself, and the rest escaped as
    YAML reads them (``\\u2028``, ``\\U000e0001``). Not ASCII-only JSON: its surrogate pair
    for an emoji (``\\ud83e\\udd99``) reads back from YAML as two broken characters."""
    quoted = json.dumps(text, ensure_ascii=False)
    return "".join(c if c.isprintable() else _yaml_escape(c) for c in quoted)


def _yaml_escape(char: str) -> str:
    code = ord(char)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


# ------------------------------------------------------------------------------- body


def _title(card: ModelCard, kind: Kind) -> str:
    """What the folder is: the model's name for a conversion, else what the run made of
    what."""
    run = card.training
    if run is None:
        return f"# {_shown(card.name or 'A model')}"
    what = f"{run.objective} {'LoRA adapter' if kind == 'adapter' else 'finetune'}"
    if not card.base_models:
        return f"# A model trained from scratch ({run.objective})"
    base = card.base_models[0]
    return f"# {what} of {_shown(base.hf_id or base.name or 'a base model')}"


def _intro(card: ModelCard, kind: Kind) -> str:
    """Who wrote the folder, from what."""
    folder = "PEFT LoRA adapter" if kind == "adapter" else "model"
    source = _base_link(card)
    if card.training is None:
        origin = f" converted from {source}" if source else ""
        return (
            f"This {folder}{origin} was written by llamatrain {card.version}; it was not "
            "trained by llamatrain."
        )
    if not card.base_models:
        return f"This {folder} was trained from scratch by llamatrain {card.version}."
    return f"This {folder} was trained by llamatrain {card.version} from {source}."


def _base_link(card: ModelCard) -> str | None:
    """The first base, linked to its Hub page where its file names one."""
    if not card.base_models:
        return None
    base = card.base_models[0]
    if base.hf_id:  # an id is plain letters, digits, ".", "_", "-" and one "/"
        return f"[{base.hf_id}]({hf_repo_url(base.hf_id)})"
    return _shown(base.name or "its base model")


def _training_table(card: ModelCard, run: Training) -> str:
    """What the run did, one row a fact."""
    rows = [
        ("Objective", f"`{run.objective}`"),
        ("Optimizer steps", f"{run.steps:,}"),
        ("Tokens trained on (scored by the loss)", f"{run.tokens:,}"),
    ]
    rows += [
        (f"Final {label}", f"{run.final[key][1]:.4f} (step {run.final[key][0]:,})")
        for key, label in FINAL_METRICS
        if key in run.final
    ]
    if run.lora is not None:
        lora = run.lora
        rows.append(
            (
                "LoRA" + (" (QLoRA: the base held in its quantized blocks)" * lora.quantized_base),
                f"rank {lora.rank}, alpha {lora.alpha:g}, targets {', '.join(lora.targets)}",
            )
        )
    if run.base_file:
        digest = f" (sha256 `{_cell(run.base_sha256)}`)" if run.base_sha256 else ""
        rows.append(("Base file", f"`{_cell(PurePath(run.base_file).name)}`{digest}"))
    if card.datasets:
        links = (f"[{d}]({hf_repo_url(d, 'datasets')})" for d in card.datasets)
        rows.append(("Datasets", ", ".join(links)))
    rows.append(("llamatrain version", card.version))
    table = ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]
    return "## Training\n\n" + "\n".join(table)


def _llama_cpp(card: ModelCard, kind: Kind) -> str:
    """The commands that run the folder's contents in llama.cpp."""
    if kind == "adapter":
        base = _base_file_name(card)
        return (
            "## Run it with llama.cpp\n\n"
            "llama.cpp applies a LoRA adapter as a GGUF over the base model's GGUF. Write the "
            "adapter GGUF from the run folder, then pass both:\n\n"
            "```sh\n"
            "llamatrain export RUN_DIR --adapter -o adapter.gguf\n"
            f'llama-cli -m {shlex.quote(base)} --lora adapter.gguf -p "Hello"\n'
            "```\n\n"
            "or convert this folder with llama.cpp's `convert_lora_to_gguf.py` "
            "(`--base` the base's HF folder). With PEFT: "
            "`PeftModel.from_pretrained(base_model, this_folder)`."
        )
    return (
        "## Run it with llama.cpp\n\n"
        "Convert this folder with llama.cpp's converter, or write the GGUF straight from the "
        "run folder, then run it:\n\n"
        "```sh\n"
        "python convert_hf_to_gguf.py THIS_FOLDER --outfile model.gguf\n"
        "# or: llamatrain export RUN_DIR -o model.gguf\n"
        'llama-cli -m model.gguf -p "Hello"\n'
        "```\n\n"
        "With transformers: `AutoModelForCausalLM.from_pretrained(this_folder)`."
    )


def _base_file_name(card: ModelCard) -> str:
    run = card.training
    if run is not None and run.base_file:
        return _shown(PurePath(run.base_file).name)
    return "BASE.gguf"


def _shown(text: str) -> str:
    """A value from a file as the page shows it: escaped and cut (:func:`shown`), with no
    backtick to end a code span."""
    return shown(text, 200).replace("`", "'")


def _cell(text: str) -> str:
    """:func:`_shown` for a table cell, which a ``|`` would split."""
    return _shown(text).replace("|", "\\|")
