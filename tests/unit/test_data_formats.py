"""The data people already have: Alpaca and ShareGPT rows, Parquet files, HF ``datasets``
folders, and tool-use conversations, read as the same examples the JSONL shapes give.

Equivalence is checked where it matters, on the tokens: each layout or table is encoded with a
real llama.cpp vocabulary and must give the very ids and scored masks its hand-written JSONL
equivalent gives. Parquet and HF folders are written here with pyarrow / datasets when those
extras are installed (skipped otherwise).
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from llama_cpp_files import vocab_dir as vocab_dir
from user_errors import error_of

from llamatrain.chat_template import ChatTemplate, chat_template_for
from llamatrain.config import load_config
from llamatrain.data import build_train_data, resolve_inputs, sources
from llamatrain.data.example_cache import load_examples
from llamatrain.data.examples import LineEncoder, read_examples
from llamatrain.data.jsonl import BadLines, ChatLine, CompletionLine, TextLine, parse_line
from llamatrain.data.layouts import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT
from llamatrain.errors import ConfigError, DataError
from llamatrain.gguf.llama import read_tokenizer

ALPACA = [
    {"instruction": "Name a colour.", "input": "", "output": "Red."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
]
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi?"},
            {"from": "gpt", "value": "Hello."},
            {"from": "human", "value": "Sky colour?"},
            {"from": "gpt", "value": "Blue."},
        ]
    },
    {
        "system": "Answer in French.",
        "conversations": [{"from": "human", "value": "Cat?"}, {"from": "gpt", "value": "Chat."}],
    },
]
ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


def native_of_alpaca(row: dict) -> dict:
    template = ALPACA_PROMPT if row["input"] else ALPACA_PROMPT_NO_INPUT
    return {"prompt": template.format(**row), "completion": row["output"]}


def native_of_sharegpt(row: dict) -> dict:
    system = [{"role": "system", "content": row["system"]}] if "system" in row else []
    turns = [{"role": ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]]
    return {"messages": system + turns}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def encoder(vocab_dir: Path) -> LineEncoder:
    tokenizer = read_tokenizer(vocab_dir / "ggml-vocab-qwen2.gguf")
    template = chat_template_for("chatml", None, bos_token="", eos_token="<|endoftext|>")
    return LineEncoder(tokenizer, template, train_on="completion")


def examples(paths, encoder, **kwargs):
    return read_examples(paths, encoder, BadLines("error"), **kwargs)


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.ids, y.ids) and np.array_equal(x.scored, y.scored)


# ---- layouts -------------------------------------------------------------------------------


def test_alpaca_rows_are_alpaca_prompts_with_the_output_as_completion():
    with_input = parse_line(json.dumps(ALPACA[1]), need_assistant=True)
    assert with_input == CompletionLine(
        "Below is an instruction that describes a task, paired with an input that provides "
        "further context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n",
        "5",
    )
    no_input = parse_line(json.dumps({"instruction": "Hi", "output": "Yo"}), need_assistant=True)
    assert no_input.prompt.endswith("### Instruction:\nHi\n\n### Response:\n")
    assert "### Input" not in no_input.prompt


def test_sharegpt_rows_are_conversations():
    line = parse_line(json.dumps(SHAREGPT[1]), need_assistant=True)
    assert line == ChatLine(
        (
            {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Cat?"},
            {"role": "assistant", "content": "Chat."},
        )
    )


def test_alpaca_and_sharegpt_train_the_tokens_of_their_jsonl_equivalents(tmp_path, encoder):
    rows = ALPACA + SHAREGPT
    natives = [native_of_alpaca(r) for r in ALPACA] + [native_of_sharegpt(r) for r in SHAREGPT]
    theirs = examples([write_jsonl(tmp_path / "theirs.jsonl", rows)], encoder)
    ours = examples([write_jsonl(tmp_path / "ours.jsonl", natives)], encoder)
    assert_same(theirs, ours)
    assert all(ex.scored.any() for ex in theirs)


@pytest.mark.parametrize(
    ("layout", "row", "problem"),
    [
        ("alpaca", {"messages": []}, "data.layout = 'alpaca' expects \"instruction\""),
        ("sharegpt", {"text": "x"}, "this row is in the text layout"),
        ("auto", {"conversations": [{"from": "robot", "value": "x"}]}, "is \"from\" 'robot'"),
        ("auto", {"conversations": [{"from": "gpt"}]}, 'needs a string "value"'),
        ("auto", {"instruction": "x", "output": 3}, 'Alpaca "output" must be a string'),
        ("auto", {"id": 1}, "Alpaca's"),
    ],
)
def test_rows_not_of_the_layout_say_what_is_wrong(layout, row, problem):
    with pytest.raises(DataError, match=None) as caught:
        parse_line(json.dumps(row), need_assistant=False, layout=layout)
    assert problem in str(caught.value)


def test_a_declared_layout_accepts_its_rows():
    row = json.dumps(ALPACA[0])
    assert isinstance(parse_line(row, need_assistant=True, layout="alpaca"), CompletionLine)
    text = json.dumps({"text": "x"})
    assert parse_line(text, need_assistant=True, layout="text") == TextLine("x")


# ---- tool use ------------------------------------------------------------------------------

TOOL_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function | tojson }}</call>{% endfor %}"
    "{% if m.tool_call_id %} [{{ m.name }} {{ m.tool_call_id }}]{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "Ask the tool.",
        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{}"}}],
    },
    {"role": "tool", "name": "weather", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."},
]


def test_tool_calls_reasoning_and_tools_reach_the_template(encoder):
    line = parse_line(json.dumps({"messages": TOOL_CHAT, "tools": TOOLS}), need_assistant=True)
    assert line.tools == tuple(TOOLS) and line.messages[1]["content"] == ""
    template = ChatTemplate(TOOL_TEMPLATE)
    text = "".join(s.text for s in template.segments(line.messages, tools=line.tools))
    assert text.startswith('<tools>[{"type": "function"')
    assert "<think>Ask the tool.</think><call>" in text and "sunny [weather c1]" in text
    tool_encoder = LineEncoder(encoder.tokenizer, template, train_on="completion")
    example = tool_encoder.encode(line)
    scored = encoder.tokenizer.decode(example.ids[example.scored].tolist())
    assert "Ask the tool." in scored and "Sunny." in scored and "Paris" not in scored


def test_tools_may_be_a_json_string_and_nulls_of_a_table_row_are_missing_keys():
    row = {
        "messages": [
            {"role": "user", "content": "x", "tool_calls": None, "name": None},
            {"role": "assistant", "content": "y", "tool_call_id": None},
        ],
        "tools": json.dumps(TOOLS),
        "prompt": None,  # another row's column
    }
    line = parse_line(row, need_assistant=True)
    assert line.tools == tuple(TOOLS)
    assert line.messages == (
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
    )
    with pytest.raises(DataError, match='"tools" must be a list of objects'):
        parse_line({"messages": row["messages"], "tools": 3}, need_assistant=True)


# ---- tables --------------------------------------------------------------------------------

MIXED = [
    {"text": "Plain text."},
    {"prompt": "Q: 1+1?\nA:", "completion": " 2"},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]},
] * 3


def columns(rows: list[dict]) -> dict[str, list]:
    """Every row's keys as columns, null where a row lacks one (``from_pylist`` and
    ``from_list`` would take the first row's keys alone)."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: [r.get(k) for r in rows] for k in keys}


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    parquet.write_table(pa.table(columns(rows)), path)
    return path


def test_parquet_rows_train_the_tokens_of_the_jsonl_lines(tmp_path, encoder):
    folder = tmp_path / "pq"
    folder.mkdir()
    write_parquet(folder / "a.parquet", MIXED)  # one schema for all: nulls where a row lacks
    write_parquet(folder / "b.parquet", ALPACA)
    paths = resolve_inputs(str(folder), format="parquet")
    assert [p.name for p in paths] == ["a.parquet", "b.parquet"]
    jsonl = [write_jsonl(tmp_path / "a.jsonl", MIXED), write_jsonl(tmp_path / "b.jsonl", ALPACA)]
    assert_same(examples(paths, encoder, format="parquet"), examples(jsonl, encoder))


def test_hf_folders_train_the_tokens_of_the_jsonl_lines(tmp_path, encoder):
    datasets = pytest.importorskip("datasets")
    rows = [native_of_sharegpt(r) for r in SHAREGPT]
    datasets.Dataset.from_dict(columns(SHAREGPT)).save_to_disk(str(tmp_path / "one"))
    table = datasets.Dataset.from_dict(columns(MIXED))
    splits = {"train": table, "test": table.select([0])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
    paths = resolve_inputs([str(tmp_path / "one"), str(tmp_path / "dict")], format="hf")
    jsonl = [write_jsonl(tmp_path / "a.jsonl", rows), write_jsonl(tmp_path / "b.jsonl", MIXED)]
    assert_same(examples(paths, encoder, format="hf"), examples(jsonl, encoder))


def _hf_folder_reaching_out(tmp_path: Path, how: str) -> Path:
    """A save_to_disk folder (``ds``) whose rows would come from ``outside/`` — its Arrow
    file named by ``../``, by absolute path or through a link, or its train split a link."""
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict(columns(ALPACA)).save_to_disk(str(tmp_path / "outside"))
    (arrow,) = (tmp_path / "outside").glob("*.arrow")
    if how == "split link":
        datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns(MIXED))}).save_to_disk(
            str(tmp_path / "ds")
        )
        shutil.rmtree(tmp_path / "ds" / "train")
        (tmp_path / "ds" / "train").symlink_to(tmp_path / "outside")
        return tmp_path / "ds"
    datasets.Dataset.from_dict(columns(MIXED)).save_to_disk(str(tmp_path / "ds"))
    state_path = tmp_path / "ds" / "state.json"
    state = json.loads(state_path.read_text())
    name = {"dotdot": f"../outside/{arrow.name}", "absolute": str(arrow)}.get(how, "link.arrow")
    if how == "file link":
        (tmp_path / "ds" / name).symlink_to(arrow)
    state["_data_files"] = [{"filename": name}]
    state_path.write_text(json.dumps(state))
    return tmp_path / "ds"


@pytest.mark.parametrize("how", ["dotdot", "absolute", "file link", "split link"])
def test_an_hf_folder_naming_files_outside_it_is_refused_by_every_reader(tmp_path, encoder, how):
    """Neither resolving data.path, nor reading the rows, nor keying the example cache reads a
    file outside the folder named (the cache hashed only files inside, then served rows the
    outside file no longer held)."""
    folder = _hf_folder_reaching_out(tmp_path, how)
    refused = r"(a path outside|a link leading out of) .*ds; data.format = 'hf' reads only"
    with pytest.raises(DataError, match=refused):
        resolve_inputs(str(folder), format="hf")
    with pytest.raises(DataError, match=refused):
        examples([folder], encoder, format="hf")
    with pytest.raises(DataError, match=refused):
        load_examples([folder], encoder, BadLines("error"), tmp_path / "cache", format="hf")


def test_a_bad_table_row_is_named_by_file_and_row(tmp_path, encoder):
    path = write_parquet(
        tmp_path / "bad.parquet", [ALPACA[0], {"instruction": "x", "output": None}]
    )
    with pytest.raises(DataError, match=r"bad\.parquet:2: .*Alpaca \"output\" must be a string"):
        examples([path], encoder, format="parquet")
    bad = BadLines("skip")
    assert len(read_examples([path], encoder, bad, format="parquet")) == 1
    assert "skipped 1 of 2 lines" in bad.summaries()[0]


def test_a_parquet_cell_that_expands_past_a_lines_most_is_refused_before_it_is_read(
    tmp_path, encoder, monkeypatch
):
    """Issue 37, item 4: a 92 KB Parquet file holding one zstd cell of 1 GB text peaked at
    4.2 GB, cells read whole where JSONL lines are cut. The footer's uncompressed sizes are
    checked first (the bound lowered here: a 4 MB cell against 1 MB)."""
    pa = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    monkeypatch.setattr(sources, "MAX_CHUNK_BYTES", 1 << 20)
    path = tmp_path / "bomb.parquet"
    rows = {"text": ["short", "x" * (4 << 20), "short"]}
    parquet.write_table(pa.table(rows), path, compression="zstd", row_group_size=2)
    assert path.stat().st_size < 4096
    decompressed = []
    monkeypatch.setattr(parquet.ParquetFile, "iter_batches", lambda *a, **k: decompressed.append(1))
    message = error_of(examples, [path], encoder, format="parquet")
    assert "bomb.parquet: rows 1-2 (row group 0) hold 4 MiB uncompressed" in message
    assert "row_group_size" in message and not decompressed


def _hf_folder_holding(tmp_path: Path, rows: dict, compression: str | None = None) -> Path:
    """A save_to_disk folder whose Arrow file holds ``rows`` instead (as one IPC stream
    batch, compressed when asked: datasets itself never compresses)."""
    datasets = pytest.importorskip("datasets")
    pa = pytest.importorskip("pyarrow")
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict(columns(ALPACA)).save_to_disk(str(folder))
    (arrow,) = folder.glob("*.arrow")
    table = pa.table(rows)
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with (
        pa.OSFile(str(arrow), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema, options=options) as out,
    ):
        out.write_table(table)
    return folder


def test_an_arrow_file_that_expands_past_a_lines_most_is_refused_before_it_is_read(
    tmp_path, encoder, monkeypatch
):
    """Issue 37, item 4: an HF folder's Arrow file was read whole by datasets as it opened the
    folder: a 7 KB zstd-compressed batch of 200 MB took 200 MB, a plain batch had no bound.
    Each batch is checked from its metadata first: compressed (never written by save_to_disk)
    refused, a plain one held to a Parquet row group's most (lowered here: 4 MB against 1 MB)."""
    cell = "### Response:\n" + "x" * (4 << 20)
    rows = {"instruction": ["a", "b"], "output": ["short", cell]}
    compressed = _hf_folder_holding(tmp_path / "zstd", rows, compression="zstd")
    assert sum(f.stat().st_size for f in compressed.iterdir()) < 8192
    loaded = []
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.Dataset, "load_from_disk", lambda *a, **k: loaded.append(1))
    message = error_of(examples, [compressed], encoder, format="hf")
    assert "message 1 is a compressed record batch" in message and "re-save" in message
    monkeypatch.setattr(sources, "MAX_CHUNK_BYTES", 1 << 20)
    plain = _hf_folder_holding(tmp_path / "plain", rows)
    message = error_of(examples, [plain], encoder, format="hf")
    assert "message 1 holds a record batch of 4 MiB, more than the 1 MiB" in message
    assert "writer_batch_size" in message and not loaded


def test_an_arrow_file_claiming_more_than_it_holds_is_refused(tmp_path, encoder):
    """Issue 37, item 4: pyarrow believes a batch's offsets; one claiming a 1 GB cell in a
    tiny file was read past the end of its buffer (memory outside the file, or a crash).
    Every batch is validated in full before datasets opens the folder."""
    folder = _hf_folder_holding(tmp_path, {"instruction": ["hello"], "output": ["world"]})
    (arrow,) = folder.glob("*.arrow")
    data = arrow.read_bytes()
    cell = struct.pack("<2i", 0, 5) + b"hello"  # a string column's offsets, then its bytes
    assert data.count(cell) == 1
    arrow.write_bytes(data.replace(cell, struct.pack("<2i", 0, 1 << 30) + b"hello"))
    message = error_of(examples, [folder], encoder, format="hf")
    assert "cannot be read as an Arrow stream" in message and "re-save the dataset" in message
    bad = BadLines("skip")  # not a bad row to skip: the file is refused whatever the policy
    with pytest.raises(DataError, match="Arrow stream"):
        read_examples([folder], encoder, bad, format="hf")


def test_inputs_that_are_not_tables_are_refused(tmp_path):
    text = tmp_path / "x.parquet"
    text.write_text("not parquet at all")
    with pytest.raises(DataError, match="is not a Parquet file"):
        resolve_inputs(str(text), format="parquet")
    with pytest.raises(DataError, match="contains no \\*.parquet files"):
        resolve_inputs(str(_empty(tmp_path)), format="parquet")
    with pytest.raises(DataError, match="save_to_disk"):
        resolve_inputs(str(tmp_path), format="hf")


def _empty(tmp_path: Path) -> Path:
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def test_a_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if absent
    monkeypatch.setitem(sys.modules, "datasets", None)
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1" + b"\0" * 8 + b"PAR1")
    with pytest.raises(DataError) as caught:
        read_examples([path], None, BadLines("error"), format="parquet")
    assert str(caught.value) == (
        "pyarrow.parquet is not installed; pip install 'llamatrain[parquet]' to read this data"
    )
    with pytest.raises(DataError, match=r"pip install 'llamatrain\[datasets\]'"):
        read_examples([tmp_path], None, BadLines("error"), format="hf")


def test_table_formats_need_a_tokenizer_that_is_not_trained_on_them():
    with pytest.raises(ConfigError, match="set tokenizer.path"):
        load_config("tiny", ['data.format="parquet"', 'data.path="x.parquet"'])


def test_build_train_data_reads_a_parquet_file(tmp_path, vocab_dir):
    path = write_parquet(tmp_path / "chats.parquet", SHAREGPT * 4)
    vocab = vocab_dir / "ggml-vocab-qwen2.gguf"
    overrides = [
        f'tokenizer.path="{vocab}"',
        f'data.path="{path}"',
        'data.format="parquet"',
        'data.layout="sharegpt"',
        'data.chat_template="chatml"',
        "data.val_fraction=0.25",
        "train.n_batch=128",
    ]
    cfg = load_config("tiny", overrides)
    data = build_train_data(cfg, read_tokenizer(vocab), model_template=None)
    assert data.paths == [path] and len(data.train) >= 1 and data.val is not None


@pytest.mark.parametrize("packing", [True, False])
def test_a_run_whose_examples_all_lose_their_trained_tokens_is_refused_in_one_line(
    tmp_path, vocab_dir, packing
):
    """Alpaca's prompt alone fills a 16-token row, so no output is left to score: refused
    before training, not an empty row whose loss divides by zero (nor a "too short corpus")."""
    path = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA * 4)
    vocab = vocab_dir / "ggml-vocab-qwen2.gguf"
    overrides = [
        f'tokenizer.path="{vocab}"',
        f'data.path="{path}"',
        f'data.cache_dir="{tmp_path / "cache"}"',
        'data.format="jsonl"',
        "data.n_ctx=16",
        "data.val_fraction=0",
        f"data.packing={str(packing).lower()}",
        "train.n_batch=32",
    ]
    cfg = load_config("tiny", overrides)
    refused = pytest.raises(DataError, match=r"^no example keeps a trained token .* data\.n_ctx")
    with refused, pytest.warns(UserWarning, match="8 examples had no trained token"):
        build_train_data(cfg, read_tokenizer(vocab), model_template=None)


ULTRACHAT = {"prompt": "Hi", "prompt_id": "7", "messages": MIXED[2]["messages"]}
"""UltraChat's rows: the first user turn again as a ``prompt`` beside the ``messages``."""
TATSU = {**ALPACA[1], "text": "### Instruction:\nAdd the numbers. ..."}
"""tatsu-lab/alpaca's rows: Alpaca's fields and their rendering as ``text``."""


def test_rows_that_fit_two_layouts_are_counted_with_the_layout_read(tmp_path, vocab_dir, encoder):
    """Issue 37, item 8: a row fitting two layouts was read as the first silently, the other's
    fields lost. One warning per kind counts them and names the layout read and how to choose,
    again when the examples come from the cache; naming a layout reads the rows in it."""
    rows = [MIXED[0], ULTRACHAT, TATSU, ULTRACHAT, {**ULTRACHAT, "completion": " Yo"}]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    vocab = vocab_dir / "ggml-vocab-qwen2.gguf"

    def warned(layout: str) -> list[str]:
        overrides = [f'tokenizer.path="{vocab}"', f'data.path="{path}"', 'data.format="jsonl"',
                     f'data.layout="{layout}"', 'data.chat_template="chatml"', "train.n_batch=128",
                     "data.val_fraction=0", f'data.cache_dir="{tmp_path / "cache"}"']  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build_train_data(load_config("tiny", overrides), read_tokenizer(vocab))
        return [str(w.message) for w in caught if "layout" in str(w.message)]

    expected = [
        f"3 rows fit the messages layout and also prompt_completion (first: {path}:2); read "
        "as messages, their other fields unread: set data.layout = "
        "'prompt_completion' to read those instead, or 'messages' to say that was meant",
        f"1 row fits the alpaca layout and also text (first: {path}:3); read as alpaca, "
        "their other fields unread: set data.layout = 'text' to read those instead, or "
        "'alpaca' to say that was meant",
    ]
    assert warned("auto") == expected
    assert warned("auto") == expected  # the cached examples warn as the first reading did
    with pytest.raises(DataError, match=r"rows\.jsonl:1: data\.layout = 'messages' expects"):
        warned("messages")  # the plain text row is not a conversation
    write_jsonl(path, rows[1:2] + rows[3:])
    assert warned("messages") == []  # the layout named: nothing to tell
    both = write_jsonl(tmp_path / "both.jsonl", rows[-1:])  # read as the layout named
    native = write_jsonl(tmp_path / "native.jsonl", [{"prompt": "Hi", "completion": " Yo"}])
    assert_same(examples([both], encoder, layout="prompt_completion"), examples([native], encoder))


HOSTILE = "\x1b]0;owned\x07\x1b[2J"
"""A terminal title change and a screen clear."""


def test_the_python_apis_data_warnings_escape_what_they_quote(tmp_path, vocab_dir):
    """Issue 37, item 6: the CLI escapes the warnings it prints, but the Python API's (a
    notebook, a script) quoted a data file's name raw. Their text is escaped as an error's is,
    whatever formats them: a file name, a conversation and a chat template's raise_exception."""
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    refused = [{"role": "user", "content": f"bad{HOSTILE}"}, chat[1]]
    path = write_jsonl(
        tmp_path / f"rows{HOSTILE}.jsonl", [{"messages": m} for m in [refused] + [chat] * 3]
    )
    template = (
        "{% for m in messages %}{% if 'bad' in m.content %}{{ raise_exception('" + HOSTILE
        + "' + m.content) }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}"
    )  # fmt: skip
    vocab = vocab_dir / "ggml-vocab-qwen2.gguf"
    overrides = [f'tokenizer.path="{vocab}"', f"data.path={json.dumps(str(path))}",
                 'data.format="jsonl"', 'data.on_bad_line="skip"', "train.n_batch=128",
                 "data.val_fraction=0", f'data.cache_dir="{tmp_path / "cache"}"']  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg, tokenizer = load_config("tiny", overrides), read_tokenizer(vocab)
        build_train_data(cfg, tokenizer, model_template=template)
    (note,) = [str(w.message) for w in caught if "skipped" in str(w.message)]
    assert note.isprintable() and note.startswith("skipped 1 of 4 lines of ")
    escaped = HOSTILE.encode("unicode_escape").decode()
    assert f"rows{escaped}.jsonl" in note and f"refused the conversation: {escaped}bad" in note


def test_degenerate_preference_pairs_are_counted_in_one_warning(tmp_path, vocab_dir):
    """Issue 37, item 8: pairs with identical or empty replies trained at loss ln 2 without a
    word; now one warning counts them and names the first."""
    good = {"prompt": "Q", "chosen": " yes", "rejected": " no"}
    chat = {"prompt": [{"role": "user", "content": "Q"}], "chosen": " a", "rejected": " a"}
    rows = [good, {**good, "rejected": " yes"}, {**good, "chosen": "  "}, good, chat]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows * 4)
    vocab = vocab_dir / "ggml-vocab-qwen2.gguf"
    overrides = [f'tokenizer.path="{vocab}"', f'data.path="{path}"', 'data.format="jsonl"',
                 'train.objective="orpo"', 'data.chat_template="chatml"', "train.n_batch=128",
                 "data.val_fraction=0"]  # fmt: skip
    cfg = load_config("tiny", overrides)
    with pytest.warns(UserWarning) as caught:
        build_train_data(cfg, read_tokenizer(vocab), model_template=None)
    notes = [str(w.message) for w in caught if "preference pairs" in str(w.message)]
    assert notes == [
        f"8 preference pairs have identical replies and 4 an empty one (first: {path}:2); they "
        "teach nothing (the loss stays at ln 2): fix or remove them"
    ]
