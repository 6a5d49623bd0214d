"""What a GRPO rollout with tools conditions the model on is what ``llama-server --jinja`` feeds
it when it serves the same conversation: the prompt with the tools, and after a call the tool's
result, as text and as tokens.

llama.cpp's own server (built from the sources the pinned llama-cpp-python vendors, by
bench/peers.py's ``llama_cpp_program``: once, ~20 minutes on 2 cores, cached in
bench/.cache/peers; or the binary ``LLAMA_SERVER`` names) serves SmolLM2-135M-Instruct's Q4_1
file with ``examples/smollm2-tools.jinja`` (ChatML with Qwen 2.5's tool blocks: SmolLM2's own
template has none), as README's tour and bench/grpo_tools_server.py serve it. For a question,
and for the question with a ``multiply`` call and its result (the second request a client
sends), the server's rendering (``/apply-template``, with its OpenAI-style inputs: arguments as
a JSON string) must equal ours, and its tokens (``/tokenize``) ours; the second one must also
be what a rollout holds at that point: the prompt, the call as the template writes it, the
end-of-turn token and :func:`~llamatrain.objectives.grpo.answers.answer_tokens`. A tool with a
return annotation shows why the bench leaves it off: the server drops the schema's ``return``.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from llamatrain import api
from llamatrain.chat_template import ChatTemplate, prompt_ids
from llamatrain.objectives.grpo.answers import answer_tokens
from llamatrain.tools.schema import json_schema

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CACHE = Path.home() / ".cache" / "llamatrain-test" / "smollm2"
QUESTION = [{"role": "user", "content": "What is 347 * 862?"}]
CALL = {"name": "multiply", "arguments": {"a": 347, "b": 862}}
RESULT = [{"role": "tool", "name": "multiply", "content": "299114"}]


def annotated(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    """bench/grpo_tools_server.py: its tools and template, llama-server found or built,
    started and asked as it does."""
    return bench_module("grpo_tools_server")


@pytest.fixture(scope="module")
def server(bench, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server --jinja on SmolLM2's Q4_1 file with the tools template; its URL."""
    binary = bench.server_binary(os.environ.get("LLAMA_SERVER"))
    model = bench_module("lora").smollm2_file(CACHE)
    log = tmp_path_factory.mktemp("llama_server") / "server.log"
    with bench.served(binary, model, None, log) as url:
        yield url


@pytest.fixture(scope="module")
def ours(bench) -> tuple:
    tokenizer = api.load_tokenizer(bench_module("lora").smollm2_file(CACHE))
    return ChatTemplate(bench.TEMPLATE.read_text(), name=bench.TEMPLATE.name), tokenizer


def served_prompt(bench, url: str, messages: list[dict], tools: list[dict]) -> tuple:
    """The server's prompt for ``messages`` with ``tools`` (what /v1/chat/completions would
    decode from) and its tokens."""
    prompt = bench.post(url, "/apply-template", {"messages": messages, "tools": tools})["prompt"]
    body = {"content": prompt, "parse_special": True}
    return prompt, bench.post(url, "/tokenize", body)["tokens"]


def test_the_question_is_served_as_the_rollout_prompts_it(bench, server, ours):
    template, tokenizer = ours
    text, tokens = served_prompt(bench, server, QUESTION, bench.TOOLS)
    expected = template.render(QUESTION, add_generation_prompt=True, tools=bench.TOOLS)
    assert text == expected
    assert tokens == prompt_ids(tokenizer, expected)


def test_after_a_call_the_server_feeds_what_the_rollout_holds(bench, server, ours):
    """The second request (the call as a client sends it back: arguments a JSON string, then
    the tool's result) is served as the rollout's tokens at that point."""
    template, tokenizer = ours
    tools = bench.TOOLS
    wire = {"type": "function", "function": {**CALL, "arguments": json.dumps(CALL["arguments"])}}
    sent = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [wire]}, *RESULT]
    text, tokens = served_prompt(bench, server, sent, tools)
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": CALL}],
    }
    assert text == template.render(
        [*QUESTION, call, *RESULT], add_generation_prompt=True, tools=tools
    )
    written = f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"  # as the template writes it
    prompt = template.render(QUESTION, add_generation_prompt=True, tools=tools)
    rollout = prompt_ids(tokenizer, prompt) + tokenizer.encode(written, special=True)
    rollout += [
        tokenizer.eos_id,
        *answer_tokens(template, tokenizer, [*QUESTION, call], RESULT, tools),
    ]
    assert tokens == rollout


def test_the_server_drops_a_schemas_return(bench, server, ours):
    """transformers' schema of an annotated function has a ``return`` the server leaves out of
    its prompt (it keeps name, description, parameters): train on tools without one."""
    template, _ = ours
    schema = json_schema(annotated)
    assert "return" in schema["function"]
    text, _ = served_prompt(bench, server, QUESTION, [schema])
    assert '"return"' not in text
    assert text != template.render(QUESTION, add_generation_prompt=True, tools=[schema])
