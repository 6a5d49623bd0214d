"""What the chat template budget costs: budgeted renders against plain sandboxed renders.

Why: every example of a chat dataset is rendered through its template (several times for
``segments``), and since a template is untrusted code each render is metered
(``llamatrain.data.template_sandbox``). The issue asks that real templates render "as before,
at no measurable cost per example"; this measures it.

Templates: the built-in ``chatml`` and ``llama-3``, and the real ``qwen2.5`` (with tools),
``qwen3`` (with tools and thinking), ``gemma3`` and ``smollm3`` (with xml tools and thinking)
of ``tests/fixtures/chat_templates``. Conversations: ``--conversations`` (default 300) made
from a fixed seed: an optional system prompt, 1-4 user/assistant turns of 5-150 words, and
for the templates that take tools a third of them with a tool call and its result.

Rows, per template, each rendering every conversation once per round, the three in rotating
order within each round (``--rounds``, default 15):

* ``budgeted``: ``ChatTemplate``'s metered render (``_render_unchecked``: the render inside
  its budget, as every ``render``/``segments`` does it);
* ``plain``: the same source compiled by ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with
  transformers' settings and helpers and no budget (what rendered before the budget);
* ``plain again``: ``plain`` a second time, so the spread of ``plain again / plain`` says how
  large a difference this run could measure at all.

Both render the same validated data (``_checked``/``_context`` are done once, outside the
timing: they are the same with or without the budget), and every budgeted render is checked
to equal the plain one. Time is the thread's CPU time (``time.thread_time``), so other
processes of a shared machine taking the cores do not count; interleaving the rows round by
round keeps what they still change (caches, frequency) alike for all three. Columns:
``us/conv`` the median over rounds of the seconds per conversation; ``x plain`` the median
over rounds of the per-round ratio to ``plain``, with its min-max.

Usage: ``python bench/template_budget.py [--rounds N] [--conversations N] [--json PATH]``.
About a minute on 2 CPU cores. The latest figures are in ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ops import cpu_name, finish, load_average  # noqa: E402

from llamatrain.data import chat_template as ct  # noqa: E402

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "tests" / "fixtures" / "chat_templates"
DEFAULT_JSON = HERE / "results" / "template_budget.json"
ROWS = ("budgeted", "plain", "plain again")
TEMPLATES = {  # name: (source, BOS, EOS, the keyword that passes tools, thinking)
    "chatml": (ct.BUILTIN_TEMPLATES["chatml"], "", "<|im_end|>", None, False),
    "llama-3": (ct.BUILTIN_TEMPLATES["llama-3"], "<|begin_of_text|>", "<|eot_id|>", None, False),
    "qwen2.5": ("qwen2.5.jinja", "", "<|im_end|>", "tools", False),
    "qwen3": ("qwen3.jinja", "", "<|im_end|>", "tools", True),
    "gemma3": ("gemma3.jinja", "<bos>", "<eos>", None, False),
    "smollm3": ("smollm3.jinja", "<|begin_of_text|>", "<|im_end|>", "xml_tools", True),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "description": f"The {arg}."}},
                "required": [arg],
            },
        },
    }
    for name, description, arg in (
        ("get_weather", "The current weather in a city.", "city"),
        ("search", "Search the web and return the top results.", "query"),
    )
]
VOCABULARY = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make"
)


def plain_template(source: str):
    """``source`` compiled as before the budget: Jinja's immutable sandbox with transformers'
    settings and the same helpers, unmetered."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[ct._Generation, loopcontrols]
    )
    env.filters["tojson"] = ct._tojson
    env.globals.update(
        raise_exception=ct._raise_exception,
        strftime_now=lambda format: datetime.now().strftime(format),
        dict=ct._Dict(),
        namespace=ct._Namespace,
    )
    return env.from_string(source)


def conversations(n: int, seed: int, tools: bool, thinking: bool) -> list[list[dict]]:
    """``n`` conversations of the kind chat datasets hold (see the module docstring)."""
    rng = random.Random(seed)
    words = VOCABULARY.split()

    def text(low: int, high: int) -> str:
        return " ".join(rng.choices(words, k=rng.randint(low, high))).capitalize() + "."

    chats = []
    for i in range(n):
        chat = [{"role": "system", "content": text(5, 40)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            chat.append({"role": "user", "content": text(5, 80)})
            reply = {"role": "assistant", "content": text(5, 150)}
            if thinking and rng.random() < 0.5:
                reply["reasoning_content"] = text(5, 60)
            chat.append(reply)
        if tools and i % 3 == 0:
            chat[-1:] = [
                {"role": "assistant", "content": "", "tool_calls": [tool_call(rng, words)]},
                {"role": "tool", "content": json.dumps({"result": text(5, 30)})},
                chat[-1],
            ]
        chats.append(chat)
    return chats


def tool_call(rng: random.Random, words: list[str]) -> dict:
    function = rng.choice(TOOLS)["function"]
    (arg,) = function["parameters"]["required"]
    arguments = {arg: rng.choice(words)}
    return {"type": "function", "function": {"name": function["name"], "arguments": arguments}}


def renderers(name: str, n: int) -> dict[str, Callable[[], list[str]]]:
    """The three rows' renders of every conversation of template ``name``."""
    source, bos, eos, tools_key, thinking = TEMPLATES[name]
    if source.endswith(".jinja"):
        source = (FIXTURES / source).read_text(encoding="utf-8")
    chat = ct.ChatTemplate(source, bos_token=bos, eos_token=eos, name=name)
    plain = plain_template(source)
    given = {tools_key: TOOLS} if tools_key else {}
    context = ct._context(given.pop("tools", None), None, given)
    chats = [ct._checked(c) for c in conversations(n, 0, tools_key is not None, thinking)]
    tokens = {"bos_token": bos, "eos_token": eos}

    def budgeted() -> list[str]:
        return [chat._render_unchecked(c, False, context) for c in chats]

    def unbudgeted() -> list[str]:
        return [
            plain.render(**context, messages=c, add_generation_prompt=False, **tokens)
            for c in chats
        ]

    return {"budgeted": budgeted, "plain": unbudgeted, "plain again": unbudgeted}


def measure(name: str, n: int, rounds: int) -> list[dict]:
    """Interleaved rounds of the three rows of one template; one result row each."""
    rows = renderers(name, n)
    expected = rows["plain"]()
    if rows["budgeted"]() != expected:
        sys.exit(f"{name}: a budgeted render differs from the plain one")
    seconds: dict[str, list[float]] = {row: [] for row in ROWS}
    for r in range(rounds):
        for row in ROWS[r % 3 :] + ROWS[: r % 3]:
            start = time.thread_time()
            rows[row]()
            seconds[row].append(time.thread_time() - start)
    results = []
    for row in ROWS:
        ratios = [a / b for a, b in zip(seconds[row], seconds["plain"], strict=True)]
        results.append(
            {
                "template": name,
                "row": row,
                "us_per_conversation": round(statistics.median(seconds[row]) / n * 1e6, 2),
                "x_plain": round(statistics.median(ratios), 3),
                "x_plain_min": round(min(ratios), 3),
                "x_plain_max": round(max(ratios), 3),
            }
        )
    return results


def print_table(rows: list[dict]) -> None:
    print(f"{'template':<10}{'row':<13}{'us/conv':>9}{'x plain':>9}{'min-max':>15}")
    for row in rows:
        spread = f"{row['x_plain_min']:.3f}-{row['x_plain_max']:.3f}"
        print(
            f"{row['template']:<10}{row['row']:<13}{row['us_per_conversation']:>9.1f}"
            f"{row['x_plain']:>9.3f}{spread:>15}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--conversations", type=int, default=300, help="per template")
    parser.add_argument("--templates", default=",".join(TEMPLATES), help="comma-separated")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    started = time.time()
    meta = {
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "conversations": args.conversations,
        "rounds": args.rounds,
        "clock": "time.thread_time",
        "load_avg_start": load_average(),
    }
    rows = []
    for name in args.templates.split(","):
        rows += measure(name, args.conversations, args.rounds)
    print_table(rows)
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
