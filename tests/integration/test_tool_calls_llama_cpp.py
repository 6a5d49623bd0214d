"""Tool calls parsed from model text equal what llama.cpp's own parser returns for the same text.

llama-cpp-python does not expose llama.cpp's chat parser (``common_chat_parse`` in
common/chat.cpp, what ``llama-server --jinja`` runs on a completion; its own Python chat
handlers parse calls their own way), so the test builds a small program on the ``common``
sources the pinned llama-cpp-python vendors (tests/fixtures/llama_cpp_chat_parse.cpp), linked
against the llama.cpp libraries it installed: once, ~4 minutes on 2 cores, cached after.

For each family's real template the replies below go through both parsers. Where llama.cpp
reads calls, ours reads the same calls (name, arguments), content and thinking; where it refuses
the reply (``"does not match the expected format"``: text after a call, an unknown tool, keys
out of order …), ours says why in ``Reply.refused`` and runs no call. Where ours is stricter on
purpose (a truncated call, arguments its schema refuses, a tag without its new line), the cases
are listed apart and checked as such; so are the forms the pinned server reads as plain text
(Llama 3.1's ``<|python_tag|>``, the generic JSON reply, SmolLM3's template).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from os import cpu_count
from pathlib import Path

import llama_cpp  # a test dependency (pip install -e '.[test]'): missing, collection fails
import pytest
from llama_cpp_files import llama_cpp_sources as llama_cpp_sources  # llama.cpp's sources
from tool_functions import brave_search, lookup, multiply

from llamatrain.tools.calls import CallFormat, CallSyntax, Reply, call_syntax, parse_reply
from llamatrain.tools.schema import json_schema

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DRIVER = FIXTURES / "llama_cpp_chat_parse.cpp"
LIBRARIES = Path(llama_cpp.__file__).parent / "lib"
COMMON = [
    "chat.cpp", "chat-auto-parser-generator.cpp", "chat-auto-parser-helpers.cpp",
    "chat-diff-analyzer.cpp", "chat-peg-parser.cpp", "peg-parser.cpp",
    "json-schema-to-grammar.cpp", "json-schema.cpp", "json.cpp", "log.cpp", "unicode.cpp",
    "trie.cpp", "common.cpp",
]  # fmt: skip
"""The ``common`` sources the chat parser needs; the rest of what common.cpp references is
dropped at link time (``--gc-sections``), as the driver never calls it."""


TOOLS = [json_schema(multiply), json_schema(lookup)]


# ---- llama.cpp's parser as a program -------------------------------------------------------------


@pytest.fixture(scope="session")
def chat_parse(llama_cpp_sources: Path) -> Path:
    """The driver, compiled against the vendored sources and the installed libraries; rebuilt
    when its source changes."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.fail("no C++ compiler (g++) to build llama.cpp's chat parser", pytrace=False)
    build = llama_cpp_sources / "build"
    binary = build / f"chat_parse-{hashlib.sha256(DRIVER.read_bytes()).hexdigest()[:12]}"
    if binary.exists():
        return binary
    common = llama_cpp_sources / "common"
    sources = [common / name for name in COMMON]
    sources += sorted((common / "jinja").glob("*.cpp")) + sorted((common / "parsers").glob("*.cpp"))
    includes = ["common", "include", "ggml/include", "vendor"]
    flags = ["-std=c++17", "-O1", "-fPIC", "-ffunction-sections", "-fdata-sections"]
    flags += [f"-I{llama_cpp_sources / folder}" for folder in includes]
    (build / "obj").mkdir(parents=True, exist_ok=True)

    def compiled(source: Path, name: str) -> Path:
        target = build / "obj" / name
        if not target.exists():
            partial = target.with_suffix(".part")
            _run([compiler, *flags, "-c", str(source), "-o", str(partial)])
            partial.rename(target)
        return target

    names = ["_".join(s.relative_to(llama_cpp_sources).with_suffix(".o").parts) for s in sources]
    with ThreadPoolExecutor(cpu_count() or 1) as pool:
        objects = list(pool.map(compiled, [*sources, DRIVER], [*names, f"{binary.name}.o"]))
    libraries = ["-lllama", "-lggml", "-lggml-base", "-lpthread"]
    link = [f"-L{LIBRARIES}", f"-Wl,-rpath,{LIBRARIES}", "-Wl,--gc-sections"]
    _run([compiler, "-o", str(binary), *map(str, objects), *link, *libraries])
    return binary


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command[:3])}…:\n{done.stderr[-3000:]}"


def llama_cpp_parse(binary: Path, tmp_path: Path, template: str, tools: list, replies: list[str]):
    """What llama.cpp's server makes of each reply to a conversation with ``tools``."""
    (tmp_path / "template.jinja").write_text(template)
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    done = subprocess.run(
        [str(binary), str(tmp_path / "template.jinja"), str(tmp_path / "tools.json")],
        input=json.dumps(replies),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- the replies --------------------------------------------------------------------------------

CALL = '{"name": "multiply", "arguments": {"a": 3, "b": 4.5}}'
LOOKUP = '{"name": "lookup", "arguments": {"word": "caf\\u00e9 \\ud83d\\ude00", "tags": ["a"]}}'


def hermes(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


HERMES_REPLIES = [
    "The answer is 13.5.",
    hermes(CALL),
    f"<tool_call>\n{CALL}</tool_call>",
    f"<tool_call>\n\n  {CALL}  \n\n</tool_call>",
    hermes('{"name":"multiply","arguments":{"a":3,"b":4.5}}'),
    hermes(
        '{\n  "name": "lookup",\n  "arguments": {\n    "word": "tool",\n    "lang": "fr"\n  }\n}'
    ),
    hermes(LOOKUP),
    "Sure. " + hermes(CALL),
    "\n" + hermes(CALL),
    hermes(CALL) + "\n",
    hermes(CALL) + "\n\n" + hermes(LOOKUP),
    hermes(CALL) + hermes(CALL),
    "A {b} " + hermes(CALL),
    "a </tool_call> b",
    # refused by llama.cpp
    hermes(CALL) + " Done.",
    hermes(CALL) + " and " + hermes(CALL),
    hermes(CALL.replace("multiply", "divide")),
    hermes('{"arguments": {"a": 3, "b": 4.5}, "name": "multiply"}'),
    hermes('{"name": "multiply", "arguments": {"a": 3, "b": 4.5}, "id": "7"}'),
    hermes('{"name": "multiply"}'),
    hermes('{"name": "multiply", "arguments": {"a": NaN, "b": 1}}'),
    hermes(CALL + " junk"),
    "<tool_call>\n" + hermes(CALL),
    # thinking: apart in Qwen3, plain text in Qwen 2.5
    "<think>hmm</think>" + hermes(CALL),
    " <think>\nhmm\n</think>\n\n" + hermes(CALL),
    "<think>\nhmm " + hermes(CALL) + "\n</think>\n\nok",
    "<think>\nhmm",
    "x <think>y</think> z",
]

LLAMA_CALL = '{"name": "multiply", "parameters": {"a": 3, "b": 4.5}}'
LLAMA_REPLIES = [
    "The answer is 13.5.",
    LLAMA_CALL,
    LLAMA_CALL + "\n",
    "\n" + LLAMA_CALL,
    '{"name":"multiply","parameters":{"a":3,"b":4.5}}',
    '{\n  "name": "lookup",\n  "parameters": {"word": "tool", "limit": 2}\n}',
    '{"type": "function", "name": "multiply", "parameters": {"a": 3, "b": 4.5}}',
    "Sure:\n" + LLAMA_CALL,
    "x\n\n" + LLAMA_CALL + "\n\n",
    "a } b",
    # refused by llama.cpp
    LLAMA_CALL + " then",
    LLAMA_CALL + LLAMA_CALL,
    LLAMA_CALL + "\n" + LLAMA_CALL,
    "a {b} " + LLAMA_CALL,
    "The set {1, 2}.",
    '{"answer": 3}',
    '{"name": "divide", "parameters": {"a": 3}}',
    '{"parameters": {"a": 3, "b": 4.5}, "name": "multiply"}',
    '{"name": "multiply", "parameters": {"a": 3, "b": 4.5}, "x": 1}',
    '{"type": "other", "name": "multiply", "parameters": {"a": 3, "b": 4.5}}',
]

STRICTER = {
    "hermes": [
        f"<tool_call>\n{CALL}",  # cut off: llama.cpp runs what it read
        hermes('{"name": "multiply", "arguments": {"a": "3", "b": 4.5}}'),  # a string for a number
        hermes('{"name": "multiply", "arguments": [3, 4.5]}'),  # llama.cpp: arguments {}
        f"<tool_call>{CALL}\n</tool_call>",  # no new line: llama.cpp takes it for text
    ],
    "llama": [
        '{"name": "multiply", "parameters": {"a": 3',  # cut off
        '{"name": "multiply", "parameters": {"a": true, "b": 4.5}}',
    ],
}
"""Replies where llama.cpp would run a call (or see no call) and this parser fails the call on
purpose: it runs no call that was cut off or whose arguments the schema refuses, and counts a
tag without its new line as a failed call, not as text."""


def agrees(ours: Reply, theirs: dict) -> None:
    """Ours reads what llama.cpp reads, or refuses what it refuses."""
    if "error" in theirs:
        assert ours.refused is not None and not ours.valid, theirs["error"]
        return
    assert ours.refused is None and not ours.failed, ours
    theirs_calls = [(c["name"], json.loads(c["arguments"])) for c in theirs["tool_calls"]]
    assert [(c.name, c.arguments) for c in ours.valid] == theirs_calls
    assert (ours.content, ours.reasoning) == (theirs["content"], theirs["reasoning_content"])


@pytest.mark.parametrize(
    ("name", "replies", "stricter"),
    [
        ("qwen2.5", HERMES_REPLIES, STRICTER["hermes"]),
        ("qwen3", HERMES_REPLIES, STRICTER["hermes"]),
        ("llama3.1", LLAMA_REPLIES, STRICTER["llama"]),
    ],
)
def test_replies_parse_as_llama_cpp_parses_them(chat_parse, tmp_path, name, replies, stricter):
    template = (FIXTURES / "chat_templates" / f"{name}.jinja").read_text()
    syntax = call_syntax(template)
    theirs = llama_cpp_parse(chat_parse, tmp_path, template, TOOLS, replies + stricter)
    for reply, their in zip(replies, theirs, strict=False):
        agrees(parse_reply(reply, syntax, TOOLS), their)
    for reply, their in zip(stricter, theirs[len(replies) :], strict=True):
        ours = parse_reply(reply, syntax, TOOLS)
        assert "error" not in their and not ours.valid and ours.failed and ours.refused is None


@pytest.mark.parametrize(
    ("template", "tools", "reply", "syntax"),
    [
        (
            "llama3.1",
            [brave_search],
            '<|python_tag|>brave_search.call(query="x")',
            "LLAMA_3_BUILTIN",
        ),
        ("gemma3", [multiply], json.dumps({"tool_call": json.loads(CALL)}), "GENERIC"),
        ("smollm3", [multiply], hermes(CALL), "HERMES"),
    ],
)
def test_forms_the_pinned_server_reads_as_text(
    chat_parse, tmp_path, template, tools, reply, syntax
):
    """The classic per-format forms (and SmolLM3's calls with its own template) are plain text
    to the pinned server; this parser reads them as calls only when asked for that format."""
    source = (FIXTURES / "chat_templates" / f"{template}.jinja").read_text()
    schemas = [json_schema(tool) for tool in tools]
    (their,) = llama_cpp_parse(chat_parse, tmp_path, source, schemas, [reply])
    assert (their["content"], their["tool_calls"]) == (reply, [])
    ours = parse_reply(reply, CallSyntax(CallFormat[syntax]), schemas)
    assert [c.name for c in ours.valid] == [tools[0].__name__]
