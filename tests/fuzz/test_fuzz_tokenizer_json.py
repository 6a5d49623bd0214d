"""Fuzz the Hugging Face tokenizer.json reader (with tokenizer_config.json and config.json).

Two small valid folders (a byte-level BPE in Llama 3's form and a SentencePiece-style BPE in
Llama 2's) have their JSON trees edited: a value anywhere replaced by another JSON value (ids
of 3x10^8, negative ids, NaN, lone surrogates, nested lists and objects...), keys dropped, or
the text itself spliced with deep nesting, a 5000-digit number or bytes that are not UTF-8.
Reading the folder, and using what it gives (encode, decode, fingerprint), returns or raises
a LlamatrainError in one line, within ``conftest.bounded``'s time and memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fuzz_bounds import bounded
from hypothesis import given
from hypothesis import strategies as st

from llamatrain.tokenizer import read_hf_tokenizer
from llamatrain.tokenizer.bpe import BYTE_TO_CHAR

pytestmark = pytest.mark.fuzz

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPACE = "\u2581"
TEXT = "Hello world, <|begin_of_text|> the <s> 12345 \u00e9t\u00e9\n"


def byte_level_folder() -> dict[str, Any]:
    vocab = {c: i for i, c in enumerate(BYTE_TO_CHAR.values())}
    for merged in ("\u0120t", "he", "\u0120the", "ll", "llo"):
        vocab[merged] = len(vocab)
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    added = [
        {"id": len(vocab) + n, "content": t, "special": True, "normalized": False}
        for n, t in enumerate(specials)
    ]
    doc = {
        "version": "1.0",
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": LLAMA3_SPLIT},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False},
            ],
        },  # fmt: skip
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
        },
        "model": {
            "type": "BPE",
            "ignore_merges": True,
            "vocab": vocab,
            "merges": ["\u0120 t", "h e", ["\u0120t", "he"], "l l", "ll o"],
        },
    }
    config = {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>"}}
    return {
        "tokenizer.json": doc,
        "tokenizer_config.json": config,
        "config.json": {"vocab_size": len(vocab) + 8, "bos_token_id": len(vocab)},
    }


def sentencepiece_folder() -> dict[str, Any]:
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += [SPACE, "h", "e", "l", "o", "he", "ll", SPACE + "he", "llo"]
    doc = {
        "added_tokens": [
            {"id": 0, "content": "<unk>", "special": True},
            {"id": 1, "content": "<s>", "special": True},
            {"id": 2, "content": "</s>", "special": True},
        ],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": SPACE},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": None,
        "model": {
            "type": "BPE",
            "byte_fallback": True,
            "unk_token": "<unk>",
            "vocab": {p: i for i, p in enumerate(pieces)},
            "merges": ["h e", "l l", f"{SPACE} he", "ll o"],
        },
    }
    return {
        "tokenizer.json": doc,
        "tokenizer_config.json": {"bos_token": "<s>", "unk_token": "<unk>", "add_bos_token": True},
        "config.json": {"vocab_size": len(pieces)},
    }


BASES = {"byte_level": byte_level_folder(), "sentencepiece": sentencepiece_folder()}
FIELD_NAMES = [
    "model", "vocab", "merges", "type", "id", "content", "special", "added_tokens",
    "pre_tokenizer", "pretokenizers", "normalizer", "normalizers", "post_processor", "single",
    "SpecialToken", "pattern", "Regex", "String", "vocab_size", "bos_token", "unk_token",
    "bos_token_id", "eos_token_id", "unk_token_id", "add_bos_token", "byte_fallback",
    "processors", "prepend", "replacement",
]  # fmt: skip
json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([-1, 0, 1, 2, 255, 3 * 10**8, 10**8, 2**31, 2**63, -(2**63), 10**30]),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [
            "",
            " ",
            "a b",
            SPACE,
            "<s>",
            "\ud800",
            "a\udfffb",
            "BPE",
            "Sequence",
            "ByteLevel",
            "Split",
            "Metaspace",
            "<0x41>",
            "\u0120 t",
        ]
    ),  # fmt: skip
    st.text(max_size=6),
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
RAW = [
    "[" * 100_000 + "]" * 100_000,
    '{"a":' * 50_000 + "1" + "}" * 50_000,
    "9" * 5000,
    '"\\ud800"',
    "NaN",
    "-Infinity",
]


def locations(node: Any, path: tuple = ()) -> list[tuple]:
    """Every path into a JSON tree (object keys and list indices), the root included."""
    out = [path]
    if isinstance(node, dict):
        for key, value in node.items():
            out += locations(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += locations(value, (*path, i))
    return out


def edit(root: Any, path: tuple, op: str, value: Any) -> Any:
    if not path:
        return value if op == "replace" else root
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    last = path[-1]
    if op == "delete":
        del parent[last]
    elif op == "insert" and isinstance(parent, list):
        parent.insert(last, value)
    else:
        parent[last] = value
    return root


edits = st.tuples(
    st.sampled_from(["tokenizer.json", "tokenizer.json", "tokenizer_config.json", "config.json"]),
    st.integers(0, 10**6),  # which location (modulo their number)
    st.sampled_from(["replace", "replace", "delete", "insert"]),
    json_values,
)
splices = st.tuples(
    st.sampled_from(["tokenizer.json", "tokenizer_config.json", "config.json"]),
    st.floats(0, 1),
    st.sampled_from(RAW) | st.binary(max_size=4).map(lambda b: b.decode("latin-1")),
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_tokenizer_json")


def use(folder: Path) -> None:
    tok = read_hf_tokenizer(folder)
    ids = tok.encode(TEXT, bos=True, special=True)
    tok.decode(ids)
    tok.fingerprint()


@given(
    base=st.sampled_from(sorted(BASES)),
    changes=st.lists(edits, min_size=1, max_size=3),
    splice=st.none() | splices,
)
def test_edited_tokenizer_json_is_read_or_refused_in_one_line(
    folder: Path, base: str, changes: list, splice: Any
) -> None:
    files = json.loads(json.dumps(BASES[base]))
    for name, where, op, value in changes:
        paths = locations(files[name])
        files[name] = edit(files[name], paths[where % len(paths)], op, value)
    texts = {name: json.dumps(doc, ensure_ascii=True) for name, doc in files.items()}
    if splice is not None:
        name, at, raw = splice
        cut = int(at * len(texts[name]))
        texts[name] = texts[name][:cut] + raw + texts[name][cut:]
    for name, text in texts.items():
        (folder / name).write_bytes(text.encode("utf-8", "surrogatepass"))
    bounded(lambda: use(folder), f"{base} after {changes}, splice {str(splice)[:80]}")


@pytest.mark.parametrize("base", sorted(BASES))
def test_base_folders_read(folder: Path, base: str) -> None:
    for name, doc in BASES[base].items():
        (folder / name).write_text(json.dumps(doc))
    use(folder)
