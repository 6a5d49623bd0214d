"""What the chat template budget costs: budgeted renders against plain sandboxed renders, and
whole examples (render, tokenize, answer mask) as the data layer makes them, with either.

Why: every example of a chat dataset is rendered through its template (several times for
``segments``), and since a template is untrusted code each render is metered
(``llamatrain.chat_template.sandbox``). The issue asks that real templates render "as before,
at no measurable cost per example"; this measures it, per render and per example.

Templates: the built-in ``chatml`` and ``llama-3``, and the real ``qwen2.5`` (with tools),
``qwen3`` (with tools and thinking), ``gemma3`` and ``smollm3`` (with xml tools and thinking)
of ``tests/fixtures/chat_templates``. Conversations: ``--conversations`` (default 300) made
from a fixed seed: an optional system prompt, 1-4 user/assistant turns of 5-150 words, and
for the templates that take tools a third of them with a tool call and its result.

Rows, per template, all interleaved in rotating order within each round (``--rounds``,
default 15). Renders, each rendering every conversation once per round:

* ``budgeted``: ``ChatTemplate``'s metered render (``_render_unchecked``: the render inside
  its budget, as every ``render``/``segments`` does it);
* ``plain``: the same source compiled by ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with
  transformers' settings and helpers and no budget (what rendered before the budget);
* ``plain again``: ``plain`` a second time, so the spread of ``plain again / plain`` says how
  large a difference this run could measure at all;
* ``plain, our ctx``: ``plain`` rendered as the budgeted render starts one (from the root
  render function, with ``sandbox._new_context``, which makes the context without
  Jinja's walk of its globals); the line ``metering alone`` is ``budgeted`` against it: what
  the metering itself costs, apart from the cheaper start that pays for part of it.

Examples, each encoding the first ``--examples`` (default 60) conversations the data layer
accepts, once per round (``qwen3`` refuses a conversation whose earlier assistant turns have
thinking, so fewer of its conversations are used):

* ``example``: ``LineEncoder.encode`` of each conversation as a ``ChatLine`` (its tools for
  the templates that take ``tools``; SmolLM3's ``xml_tools`` are no ``ChatLine`` field, so its
  examples have none): the budget-checked copy, the renders of ``segments`` (one per turn
  and the whole, one measure of the tools), tokenizing and the trained mask, as the data
  layer makes every example (parsing the JSON line is left out: it is the same either way);
* ``ex. plain``: the same, with ``ChatTemplate``'s render swapped for the ``plain`` render;
* ``ex. plain again``: ``ex. plain`` a second time (the noise, as above).

The tokenizers are llama.cpp's own vocabularies (``ggml-vocab-llama-bpe.gguf`` for llama-3
and smollm3, ``ggml-vocab-qwen2.gguf`` for the others) from the cache the integration tests
fill (``tests/integration/test_llama_cpp_vocabs.py``; ``--vocab-dir`` elsewhere).

Both sides use the same validated data (for the renders, ``_checked``/``_context`` are done
once, outside the timing: they are the same with or without the budget), and every budgeted
render and example is checked to equal the plain one. Time is the thread's CPU time
(``time.thread_time``), so other processes of a shared machine taking the cores do not
count; interleaving the rows round by round keeps what they still change (caches, frequency)
alike for all. Columns: ``us/conv`` the median over rounds of the seconds per conversation;
``x ref`` the median over rounds of the per-round ratio to ``plain`` (renders), ``plain, our
ctx`` (``metering alone``) or ``ex. plain`` (examples), with its min-max.

Usage: ``python bench/template_budget.py [--rounds N] [--conversations N] [--examples N]
[--templates a,b] [--vocab-dir DIR] [--json PATH]``. About two minutes on 2 CPU cores. The
latest figures are in ``bench/README.md``.
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
from itertools import islice
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ops import cpu_name, finish, load_average  # noqa: E402

from llamatrain.chat_template import helpers, sandbox  # noqa: E402
from llamatrain.chat_template import render as ct  # noqa: E402
from llamatrain.data.examples import Example, LineEncoder, cut_chars  # noqa: E402
from llamatrain.data.jsonl import ChatLine  # noqa: E402
from llamatrain.errors import DataError  # noqa: E402
from llamatrain.gguf.llama import read_tokenizer  # noqa: E402
from llamatrain.tokenizer import Tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "tests" / "fixtures" / "chat_templates"
DEFAULT_JSON = HERE / "results" / "template_budget.json"
VOCABS = Path.home() / ".cache" / "llamatrain-test" / "llama-cpp-python-0.3.36"
"""Where ``tests/llama_cpp_files.py`` keeps llama.cpp's vocabularies."""
RENDER_ROWS = ("budgeted", "plain", "plain again", "plain, our ctx")
EXAMPLE_ROWS = ("example", "ex. plain", "ex. plain again")
ROWS = RENDER_ROWS + EXAMPLE_ROWS
COMPARISONS = [
    *((row, row, "plain") for row in RENDER_ROWS),
    ("metering alone", "budgeted", "plain, our ctx"),
    *((row, row, "ex. plain") for row in EXAMPLE_ROWS),
]
"""(name, row, the row it is compared with) of each line of the results."""
TEMPLATES = {  # name: (source, BOS, EOS, the keyword that passes tools, thinking, vocabulary)
    "chatml": (ct.BUILTIN_TEMPLATES["chatml"], "", "<|im_end|>", None, False, "qwen2"),
    "llama-3": (
        *(ct.BUILTIN_TEMPLATES["llama-3"], "<|begin_of_text|>", "<|eot_id|>", None, False),
        "llama-bpe",
    ),
    "qwen2.5": ("qwen2.5.jinja", "", "<|im_end|>", "tools", False, "qwen2"),
    "qwen3": ("qwen3.jinja", "", "<|im_end|>", "tools", True, "qwen2"),
    "gemma3": ("gemma3.jinja", "<bos>", "<eos>", None, False, "qwen2"),
    "smollm3": (
        *("smollm3.jinja", "<|begin_of_text|>", "<|im_end|>", "xml_tools", True),
        "llama-bpe",
    ),
}
N_CTX = 4096
"""The context the examples are encoded for (only the length a line is cut to depends on it:
none of these conversations comes near it)."""
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
    env = ImmutableSandboxedEnvironment(**helpers.OPTIONS)
    env.filters.update(helpers.FILTERS)
    env.globals.update(helpers.GLOBALS, strftime_now=lambda format: datetime.now().strftime(format))
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


class PlainRenderTemplate(ct.ChatTemplate):
    """A :class:`~llamatrain.chat_template.ChatTemplate` whose renders are the plain
    (unmetered) ones: the data layer's example path with only the render swapped."""

    def __init__(self, source: str, **tokens: str) -> None:
        super().__init__(source, **tokens)
        self._plain = plain_template(source)

    def _render_unchecked(
        self,
        chat: list[dict],
        add_generation_prompt: bool,
        context: dict,
        shapes: dict | None = None,
    ) -> str:
        return self._plain.render(
            **context,
            messages=chat,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


def template_source(name: str) -> str:
    source = TEMPLATES[name][0]
    return (FIXTURES / source).read_text(encoding="utf-8") if source.endswith(".jinja") else source


def renderers(name: str, n: int) -> dict[str, Callable[[], list[str]]]:
    """The render rows' renders of every conversation of template ``name``."""
    _, bos, eos, tools_key, thinking, _ = TEMPLATES[name]
    source = template_source(name)
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

    def our_context() -> list[str]:
        variables = {**context, "add_generation_prompt": False, **tokens}
        return [
            "".join(plain.root_render_func(sandbox._new_context(plain, variables | v)))
            for v in ({"messages": c} for c in chats)
        ]

    return {
        "budgeted": budgeted,
        "plain": unbudgeted,
        "plain again": unbudgeted,
        "plain, our ctx": our_context,
    }


def encoders(
    name: str, n: int, tokenizer: Tokenizer
) -> tuple[dict[str, Callable[[], list[Example]]], int]:
    """The example rows' encodings of the first ``n`` conversations of template ``name`` the
    data layer accepts, and how many those are."""
    _, bos, eos, tools_key, thinking, _ = TEMPLATES[name]
    source = template_source(name)
    tokens = {"bos_token": bos, "eos_token": eos}
    tools = tuple(TOOLS) if tools_key == "tools" else None
    candidates = (
        ChatLine(tuple(chat), tools)
        for chat in conversations(8 * n, 0, tools_key is not None, thinking)
    )

    def encoder(template: ct.ChatTemplate) -> LineEncoder:
        return LineEncoder(tokenizer, template, train_on="completion", max_chars=cut_chars(N_CTX))

    budgeted = encoder(ct.ChatTemplate(source, name=name, **tokens))
    plain = encoder(PlainRenderTemplate(source, **tokens))
    lines = list(islice((line for line in candidates if accepted(plain, line)), n))

    def encode_budgeted() -> list[Example]:
        return [budgeted.encode(line) for line in lines]

    def encode_plain() -> list[Example]:
        return [plain.encode(line) for line in lines]

    rows = {"example": encode_budgeted, "ex. plain": encode_plain, "ex. plain again": encode_plain}
    return rows, len(lines)


def accepted(encoder: LineEncoder, line: ChatLine) -> bool:
    try:
        encoder.encode(line)
    except DataError:
        return False
    return True


def same_examples(a: list[Example], b: list[Example]) -> bool:
    return len(a) == len(b) and all(
        (x.ids == y.ids).all() and (x.scored == y.scored).all() and x.inexact == y.inexact
        for x, y in zip(a, b, strict=True)
    )


def measure(name: str, args: argparse.Namespace) -> list[dict]:
    """Interleaved rounds of every row of one template; one result row each."""
    vocabulary = args.vocab_dir / f"ggml-vocab-{TEMPLATES[name][5]}.gguf"
    if not vocabulary.exists():
        sys.exit(
            f"{vocabulary} is missing: run pytest tests/integration/test_llama_cpp_vocabs.py "
            "once (it fetches llama.cpp's vocabularies), or give --vocab-dir"
        )
    rows = renderers(name, args.conversations)
    examples, used = encoders(name, args.examples, read_tokenizer(vocabulary))
    rows.update(examples)
    expected = rows["plain"]()
    if rows["budgeted"]() != expected or rows["plain, our ctx"]() != expected:
        sys.exit(f"{name}: a budgeted render differs from the plain one")
    if not same_examples(rows["example"](), rows["ex. plain"]()):
        sys.exit(f"{name}: a budgeted example differs from the plain one")
    counts = {**dict.fromkeys(RENDER_ROWS, args.conversations), **dict.fromkeys(EXAMPLE_ROWS, used)}
    seconds: dict[str, list[float]] = {row: [] for row in ROWS}
    for r in range(args.rounds):
        shift = r % len(ROWS)
        for row in ROWS[shift:] + ROWS[:shift]:
            start = time.thread_time()
            rows[row]()
            seconds[row].append(time.thread_time() - start)
    results = []
    for line, row, reference in COMPARISONS:
        ratios = [a / b for a, b in zip(seconds[row], seconds[reference], strict=True)]
        results.append(
            {
                "template": name,
                "row": line,
                "reference": reference,
                "conversations": counts[row],
                "us_per_conversation": round(
                    statistics.median(seconds[row]) / counts[row] * 1e6, 2
                ),
                "x_ref": round(statistics.median(ratios), 3),
                "x_ref_min": round(min(ratios), 3),
                "x_ref_max": round(max(ratios), 3),
            }
        )
    return results


def print_table(rows: list[dict]) -> None:
    print(f"{'template':<10}{'row':<17}{'convs':>6}{'us/conv':>9}{'x ref':>8}{'min-max':>15}")
    for row in rows:
        spread = f"{row['x_ref_min']:.3f}-{row['x_ref_max']:.3f}"
        print(
            f"{row['template']:<10}{row['row']:<17}{row['conversations']:>6}"
            f"{row['us_per_conversation']:>9.1f}{row['x_ref']:>8.3f}{spread:>15}"
        )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--conversations", type=int, default=300, help="per template")
    parser.add_argument("--examples", type=int, default=60, help="examples per template")
    parser.add_argument("--templates", default=",".join(TEMPLATES), help="comma-separated")
    parser.add_argument("--vocab-dir", type=Path, default=VOCABS, help="llama.cpp vocabularies")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write results")
    args = parser.parse_args(argv)
    started = time.time()
    meta = {
        "python": platform.python_version(),
        "cpu": cpu_name(),
        "conversations": args.conversations,
        "examples": args.examples,
        "rounds": args.rounds,
        "clock": "time.thread_time",
        "load_avg_start": load_average(),
    }
    rows = []
    for name in args.templates.split(","):
        rows += measure(name, args)
    print_table(rows)
    return finish({"meta": meta, "rows": rows}, meta, started, args.json)


if __name__ == "__main__":
    main()
