"""Hugging Face tokenizer.json files: read as llama.cpp's converter reads them, and written.

The reference is the real HF ``tokenizers`` library: tokenizers trained with it on the built-in
sonnets, in the configurations of real models (Llama 3's split regex, Qwen2's, GPT-2's
ByteLevel, SmolLM's digits, a Llama 2-style SentencePiece BPE), must give the same ids through
:func:`read_hf_tokenizer` as through HF on a few hundred varied strings. (The regexes are
written out here as the models' tokenizer.json files have them, not taken from llamatrain.)
Real vocabularies (llama.cpp's Llama 3 vocabulary written out and read back) are checked in
tests/integration/test_tokenizer_parity.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_tokenizer_texts import ascii_texts, varied_texts, with_tokens
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from llamatrain.api import load_tokenizer
from llamatrain.data.sources import SONNETS_PATH
from llamatrain.tokenizer import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
    BpeTokenizer,
    SpmTokenizer,
    TokenizerError,
    read_hf_tokenizer,
    write_hf_tokenizer,
)

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL_ONLY = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
N_TEXTS = 300


def byte_level(*steps: Any) -> Any:
    """``steps`` then the ByteLevel mapping without its own regex, as Llama 3 writes it."""
    last = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*steps, last])


PRE_TOKENIZERS = {
    "llama-bpe": (byte_level(pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated")), True),
    "qwen2": (byte_level(pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated")), False),
    "gpt-2": (pre_tokenizers.ByteLevel(add_prefix_space=False), False),
    "smollm": (
        pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        ),
        False,
    ),
    "deepseek-coder": (
        byte_level(
            *(
                pre_tokenizers.Split(Regex(r), "isolated")
                for r in ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+")
            ),
            pre_tokenizers.Digits(True),
        ),
        False,
    ),
}
"""Pre-tokenizers as the models llama.cpp names so write them, and their ignore_merges."""


def train_byte_level(pre_tokenizer: Any, ignore_merges: bool) -> Tokenizer:
    hf = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    hf.pre_tokenizer = pre_tokenizer
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator([SONNETS_PATH.read_text(encoding="utf-8")], trainer)
    return hf


def save(folder: Path, hf: Tokenizer | dict[str, Any], **config: Any) -> Path:
    """``folder`` with the tokenizer.json (and a tokenizer_config.json of ``config``)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = hf.to_str() if isinstance(hf, Tokenizer) else json.dumps(hf)
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def trained() -> dict[str, Tokenizer]:
    """pre name -> an HF tokenizer trained with that pre-tokenizer (each trained once)."""
    return {name: train_byte_level(*config) for name, config in PRE_TOKENIZERS.items()}


def mismatches(ours: Any, hf: Tokenizer, texts: list[str], special: bool = False) -> list[Any]:
    cases = [
        (t, ours.encode(t, special=special), hf.encode(t, add_special_tokens=False).ids)
        for t in texts
    ]
    return [case for case in cases if case[1] != case[2]]


@pytest.mark.parametrize("name", PRE_TOKENIZERS)
def test_byte_level_bpe_encodes_like_hf_tokenizers(
    trained: dict[str, Tokenizer], tmp_path: Path, name: str
) -> None:
    hf = trained[name]
    ours = read_hf_tokenizer(save(tmp_path, hf) / "tokenizer.json")
    assert isinstance(ours, BpeTokenizer)
    assert ours.pre == name  # recognised from the pre-tokenizer's regexes
    assert ours.vocab_size == hf.get_vocab_size()
    texts = varied_texts(5, N_TEXTS) + ascii_texts(5, 100)
    wrong = mismatches(ours, hf, texts)
    assert not wrong, f"{len(wrong)}/{len(texts)} differ; first (text, ours, HF): {wrong[0]}"
    assert all(ours.decode(ours.encode(t)) == t for t in texts)
    with_specials = with_tokens(texts[:100], SPECIALS, seed=5)
    assert not mismatches(ours, hf, with_specials, special=True)


def test_added_tokens_get_the_converters_types(tmp_path: Path) -> None:
    """Special -> control; special-looking -> control; others user-defined (spaces kept);
    ids below config.json's vocab_size that nothing uses -> [PAD<id>], unused."""
    hf = train_byte_level(*PRE_TOKENIZERS["gpt-2"])
    hf.add_tokens(["<|tool|>", "hello world"])
    n = hf.get_vocab_size()
    save(tmp_path, hf)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": n + 2}))
    tok = read_hf_tokenizer(tmp_path)
    types = tok.token_types
    assert [types[tok.piece_to_id(t)] for t in SPECIALS] == [TOKEN_TYPE_CONTROL] * 3
    assert types[tok.piece_to_id("<|tool|>")] == TOKEN_TYPE_CONTROL
    assert types[tok.piece_to_id("hello world")] == TOKEN_TYPE_USER_DEFINED
    assert tok.tokens[n:] == [f"[PAD{n}]", f"[PAD{n + 1}]"]
    assert types[n:] == [TOKEN_TYPE_UNUSED] * 2
    assert tok.encode("say hello world") == [*tok.encode("say "), tok.piece_to_id("hello world")]


def test_special_ids_and_add_flags_come_from_the_tokenizer_config(
    trained: dict[str, Tokenizer], tmp_path: Path
) -> None:
    hf = trained["llama-bpe"]
    bos, eos = (hf.token_to_id(t) for t in SPECIALS[:2])
    config = {
        "bos_token": SPECIALS[0],
        "eos_token": {"content": SPECIALS[1], "special": True},
        "add_bos_token": False,
    }
    tok = read_hf_tokenizer(save(tmp_path, hf, **config))
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (bos, eos, False, False)
    # No add_bos_token: llama.cpp's default for the pre-tokenizer (Llama 3: add BOS).
    tok = read_hf_tokenizer(save(tmp_path, hf, bos_token=SPECIALS[0], eos_token=SPECIALS[1]))
    assert tok.add_bos


def test_add_flags_follow_the_post_processor_template(
    trained: dict[str, Tokenizer], tmp_path: Path
) -> None:
    doc = json.loads(trained["llama-bpe"].to_str())
    doc["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": SPECIALS[1], "type_id": 0}},
        ],
    }
    tok = read_hf_tokenizer(save(tmp_path, doc, bos_token=SPECIALS[0], eos_token=SPECIALS[1]))
    assert tok.add_eos and tok.add_bos  # EOS by the template, BOS by Llama 3's default


def test_merges_in_either_form_read_the_same(trained: dict[str, Tokenizer], tmp_path: Path) -> None:
    """tokenizers writes merges as [left, right] pairs; older files as "left right"."""
    pairs = json.loads(trained["qwen2"].to_str())
    assert isinstance(pairs["model"]["merges"][0], list)
    strings = json.loads(trained["qwen2"].to_str())
    strings["model"]["merges"] = [" ".join(pair) for pair in pairs["model"]["merges"]]
    old = read_hf_tokenizer(save(tmp_path / "old", strings))
    new = read_hf_tokenizer(save(tmp_path / "new", pairs))
    assert new.fingerprint() == old.fingerprint()


def test_falcons_pre_tokenizer_is_recognised(trained: dict[str, Tokenizer], tmp_path: Path) -> None:
    doc = json.loads(trained["gpt-2"].to_str())
    doc["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Punctuation", "behavior": "Contiguous"},
            {**BYTE_LEVEL_ONLY, "use_regex": True},
            {"type": "Digits", "individual_digits": False},
            {"type": "Split", "pattern": {"Regex": "[0-9][0-9][0-9]"}, "behavior": "Isolated"},
        ],
    }
    assert read_hf_tokenizer(save(tmp_path, doc)).pre == "falcon"


def test_sentencepiece_style_bpe_encodes_like_hf_tokenizers(tmp_path: Path) -> None:
    """Llama 2's layout: <unk> <s> </s>, <0x00>..<0xFF> in the model's vocabulary, spaces as
    '▁' with one prepended, byte fallback."""
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    hf = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=900, special_tokens=["<unk>", "<s>", "</s>", *byte_pieces], show_progress=False
    )
    hf.train_from_iterator(SONNETS_PATH.read_text(encoding="utf-8").splitlines(), trainer)
    doc = json.loads(hf.to_str())
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] not in byte_pieces]
    doc["pre_tokenizer"] = None
    doc["normalizer"] = {
        "type": "Sequence",
        "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ],
    }
    folder = save(tmp_path, doc, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ours = read_hf_tokenizer(folder)
    assert isinstance(ours, SpmTokenizer)
    assert (ours.unk_id, ours.bos_id, ours.eos_id, ours.add_space_prefix) == (0, 1, 2, True)
    types = ours.token_types
    assert (types[0], types[1], types[3], types[300]) == (
        TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_BYTE, TOKEN_TYPE_NORMAL
    )  # fmt: skip
    texts = varied_texts(6, N_TEXTS)
    wrong = mismatches(ours, hf, texts)
    assert not wrong, f"{len(wrong)}/{N_TEXTS} differ; first (text, ours, HF): {wrong[0]}"
    # no post-processor: llama.cpp's default for a llama vocabulary (BOS, no EOS), unless the
    # tokenizer config says otherwise, as the converter writes it into the GGUF
    assert (ours.add_bos, ours.add_eos) == (True, False)
    flags = dict(add_bos_token=False, add_eos_token=True)
    folder = save(tmp_path, doc, bos_token="<s>", eos_token="</s>", unk_token="<unk>", **flags)
    framed = read_hf_tokenizer(folder)
    assert (framed.add_bos, framed.add_eos) == (False, True)
    assert framed.encode_prompt("Shall I") == [*ours.encode("Shall I"), ours.eos_id]


def test_written_tokenizer_json_reads_back_and_loads_in_hf(
    trained: dict[str, Tokenizer], tmp_path: Path
) -> None:
    ours = read_hf_tokenizer(save(tmp_path / "in", trained["llama-bpe"], bos_token=SPECIALS[0]))
    out = tmp_path / "out"
    out.mkdir()
    path = write_hf_tokenizer(ours, out)
    assert path == out / "tokenizer.json" and [p.name for p in out.iterdir()] == [path.name]
    config = {"bos_token": SPECIALS[0], "eos_token": ours.piece(ours.eos_id)}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_hf_tokenizer(out).fingerprint() == ours.fingerprint()
    hf = Tokenizer.from_file(str(path))
    texts = with_tokens(varied_texts(7, 100), SPECIALS, seed=7)
    assert not mismatches(ours, hf, texts, special=True)
    assert hf.encode("hi", add_special_tokens=True).ids == [ours.bos_id, *ours.encode("hi")]


def test_unreadable_or_unsupported_files_are_one_line_errors(
    trained: dict[str, Tokenizer], tmp_path: Path
) -> None:
    def error(path: Path) -> str:
        with pytest.raises(TokenizerError) as info:
            read_hf_tokenizer(path)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "has no tokenizer.json" in error(tmp_path)
    assert "does not exist" in error(tmp_path / "missing.json")
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert "not a readable JSON file" in error(tmp_path)
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert "'WordPiece' tokenizer" in error(save(tmp_path / "wp", wordpiece) / "tokenizer.json")
    doc = json.loads(trained["gpt-2"].to_str())
    split = {"type": "Split", "pattern": {"Regex": r"\w+"}, "behavior": "Isolated"}
    doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, BYTE_LEVEL_ONLY]}
    message = error(save(tmp_path / "odd", doc))
    assert "splits by \\w+" in message and "llama-bpe" in message and "qwen2" in message


def test_writing_refuses_what_tokenizer_json_cannot_hold(
    trained: dict[str, Tokenizer], tmp_path: Path
) -> None:
    ours = read_hf_tokenizer(save(tmp_path, trained["gpt-2"]))
    default = BpeTokenizer(
        ours.tokens, ours.token_types, ours.merges, pre="default", bos_id=0, eos_id=0
    )
    with pytest.raises(TokenizerError, match="'default' has no tokenizer.json form"):
        write_hf_tokenizer(default, tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def test_load_tokenizer_takes_a_tokenizer_json_or_its_folder(
    trained: dict[str, Tokenizer], tmp_path: Path
) -> None:
    folder = save(tmp_path, trained["qwen2"])
    by_file = load_tokenizer(folder / "tokenizer.json")
    assert isinstance(by_file, BpeTokenizer) and by_file.pre == "qwen2"
    assert load_tokenizer(folder).fingerprint() == by_file.fingerprint()
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
