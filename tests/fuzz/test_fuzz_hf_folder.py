"""Fuzz the HF folder reader (config.json, safetensors, the shard index, tokenizer files).

Folders llamatrain writes (``write_hf_folder``) for a random model of each family, one of them
re-saved as two shards with ``model.safetensors.index.json``, are edited the ways a folder from
a stranger lies: config.json values replaced by other JSON values (wrong types, negative or
huge counts, head counts that do not divide, rope settings, NaN), keys dropped; a safetensors
header whose shapes, dtypes or byte ranges (overlapping, reversed, past the end of the file)
do not fit its bytes, or whose length field claims gigabytes; an index whose map names
missing shards, paths leading out of the folder (``../``, absolute, links), non-strings or
one tensor in two shards; chat templates of the wrong type or not UTF-8. Reading the folder
and running what it gives (``llamatrain.load``) ends in a LlamatrainError in one line or a
model that runs, within ``fuzz_bounds.bounded``'s time and memory.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from fuzz_bounds import bounded
from fuzz_models import TEXT, bpe_tokenizer, family_model
from hypothesis import example, given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from llamatrain import api
from llamatrain.hf.folder import write_hf_folder

pytestmark = pytest.mark.fuzz

FAMILIES = ("llama", "qwen2", "qwen3", "smollm3", "gemma3")
INDEX = "model.safetensors.index.json"
CONFIG_KEYS = [
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "head_dim", "tie_word_embeddings", "model_type", "architectures",
    "attention_bias", "mlp_bias", "sliding_window", "layer_types", "no_rope_layers",
    "rope_local_base_freq", "final_logit_softcapping", "query_pre_attn_scalar", "torch_dtype",
    "bos_token_id", "eos_token_id", "hidden_act", "use_sliding_window", "max_window_layers",
]  # fmt: skip
json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([-1, 0, 1, 2, 3, 7, 16, 32, 33, 64, 10**9, 2**31, 2**63, 10**30, 2**64]),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "llama", "qwen3", "gemma3_text", "linear", "yarn", "llama3", "dynamic",
                     "LlamaForCausalLM", "\ud800", "silu", "sliding_attention", "../x"]),
    st.text(max_size=6),
)  # fmt: skip
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "rope_type",
                    "factor",
                    "type",
                    "name",
                    "template",
                    "original_max_position_embeddings",
                ]
            )
            | st.text(max_size=3),
            inner,
            max_size=3,
        )  # fmt: skip
    ),
    max_leaves=5,
)
config_edits = st.tuples(
    st.sampled_from(["set", "set", "delete"]), st.sampled_from(CONFIG_KEYS), json_values
)
DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "X9", ""]
header_edits = st.tuples(
    st.sampled_from(["shape", "dtype", "offsets", "drop", "rename", "length", "metadata"]),
    st.integers(0, 1 << 20),  # which tensor
    st.sampled_from([0, 1, 2, 3, 31, 32, 33, 64, 2**31, 2**32, 2**62, 2**64, -1]),
    st.sampled_from(DTYPES),
)
SHARD_NAMES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
index_edits = st.tuples(
    st.sampled_from(["point", "point", "drop", "duplicate", "map"]),
    st.integers(0, 1 << 20),
    st.sampled_from(
        [
            *SHARD_NAMES,
            "missing.safetensors",
            "../outside.safetensors",
            "/etc/passwd",
            "",
            ".",
            "..",
            "a/b.safetensors",
            "link.safetensors",
            7,
            None,
            ["x"],
            "config.json",
            "x" * 300,
        ]
    ),  # fmt: skip
)
tokenizer_edits = st.sampled_from(
    [
        ("tokenizer_config.json", {"chat_template": [{"name": ["x"], "template": "t"}]}),
        ("tokenizer_config.json", {"chat_template": [{"name": "default", "template": 7}]}),
        ("tokenizer_config.json", {"chat_template": 7}),
        ("tokenizer_config.json", ["not", "an", "object"]),
        ("chat_template.jinja", b"\xff\xfe{{ x }}"),
        ("chat_template.jinja", b"{% for m in messages %}{{ m.content }}{% endfor %}"),
    ]
)


def split_into_shards(folder: Path) -> None:
    """Re-save ``model.safetensors`` as two shards and their index, as transformers does."""
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, shard in enumerate(SHARD_NAMES):
        part = {n: tensors[n] for n in names[i::2]}
        save_file(part, folder / shard)
        weight_map |= {n: shard for n in part}
    (folder / "model.safetensors").unlink()
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz_hf_bases")
    tokenizer, folders = bpe_tokenizer(), {}
    for arch in FAMILIES:
        model = family_model(arch, tokenizer, rope_freq_factors=False)  # HF: llama3's form only
        state = {k: v.detach() for k, v in model.state_dict().items()}
        folders[arch] = write_hf_folder(root / arch, model.cfg, state, tokenizer)
    shutil.copytree(folders["qwen3"], root / "sharded")
    split_into_shards(root / "sharded")
    folders["sharded"] = root / "sharded"
    (root / "outside.safetensors").write_bytes(
        (folders["llama"] / "model.safetensors").read_bytes()
    )
    return folders


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_hf_cases")


def edit_header(path: Path, change: tuple) -> None:
    """One lie in a safetensors file's header (its JSON, or its length field)."""
    kind, which, number, dtype = change
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    try:
        header, body = json.loads(data[8 : 8 + length]), data[8 + length :]
    except ValueError:  # an earlier edit already made the header unreadable
        return
    names = sorted(k for k in header if k != "__metadata__")
    name = names[which % len(names)]
    entry = header[name]
    if kind == "length":
        path.write_bytes(struct.pack("<Q", number % 2**64) + data[8:])
        return
    if kind == "shape":
        entry["shape"] = [number, *entry["shape"][1:]] if which % 2 else [*entry["shape"], number]
    elif kind == "dtype":
        entry["dtype"] = dtype
    elif kind == "offsets":
        begin, end = entry["data_offsets"]
        entry["data_offsets"] = [[0, end], [begin, begin + number], [end, begin], [number, number]][
            which % 4
        ]
    elif kind == "drop":
        del header[name]
    elif kind == "rename":
        header[names[(which + 1) % len(names)] if which % 2 else "model.layers.7.x.weight"] = (
            header.pop(name)
        )
    else:
        header["__metadata__"] = {"format": number} if which % 2 else [dtype]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def edit_index(folder: Path, change: tuple) -> None:
    index = folder / INDEX
    if not index.exists():
        return
    kind, which, target = change
    doc = json.loads(index.read_text())
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict) or not weight_map:  # an earlier edit replaced it
        return
    names = sorted(weight_map)
    name = names[which % len(names)]
    if target == "link.safetensors":
        (folder / target).unlink(missing_ok=True)
        os.symlink(folder.parent / "outside.safetensors", folder / target)
    if kind == "point":
        weight_map[name] = target
    elif kind == "drop":
        del weight_map[name]
    elif kind == "duplicate" and weight_map[name] in SHARD_NAMES:  # also in the other shard
        other = SHARD_NAMES[(SHARD_NAMES.index(weight_map[name]) + 1) % 2]
        tensors = load_file(folder / other)
        tensors[name] = load_file(folder / weight_map[name])[name]
        save_file(tensors, folder / other)
    elif kind == "map":
        doc["weight_map"] = target
    index.write_text(json.dumps(doc))


def use(folder: Path) -> None:
    model, tokenizer = api.load(folder)
    ids = tokenizer.encode(TEXT, bos=True, special=True)
    with torch.no_grad():
        model(torch.tensor([[i % model.cfg.vocab_size for i in ids[:8]]]))


def case(base: str, **changes: Any) -> Any:
    """A seeded case: a crash the fuzzing found, kept."""
    defaults = dict(config=[], headers=[], index=[], tokenizer_file=None)
    return example(base=base, **(defaults | changes))


@given(
    base=st.sampled_from([*FAMILIES, "sharded", "sharded"]),
    config=st.lists(config_edits, max_size=3),
    headers=st.lists(header_edits, max_size=2),
    index=st.lists(index_edits, max_size=2),
    tokenizer_file=st.none() | tokenizer_edits,
)
@case("llama", tokenizer_file=("chat_template.jinja", b"\xff\xfe{{ x }}"))
@case("llama", tokenizer_file=("tokenizer_config.json", {"chat_template": [{"name": ["x"]}]}))
def test_edited_hf_folder_is_read_or_refused_in_one_line(
    bases: dict, folder: Path, base: str, config: list, headers: list, index: list, tokenizer_file
) -> None:
    target = folder / "case"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(bases[base], target, symlinks=True)
    doc = json.loads((target / "config.json").read_text())
    for kind, key, value in config:
        if kind == "delete":
            doc.pop(key, None)
        else:
            doc[key] = value
    (target / "config.json").write_text(json.dumps(doc), errors="surrogatepass")
    for change in index:  # first: it may re-save a shard, which must still be readable
        edit_index(target, change)
    shards = sorted(p for p in target.glob("*.safetensors") if not p.is_symlink())
    for change in headers:
        edit_header(shards[change[1] % len(shards)], change)
    if tokenizer_file is not None:
        name, content = tokenizer_file
        data = content if isinstance(content, bytes) else json.dumps(content).encode()
        (target / name).write_bytes(data)
    bounded(
        lambda: use(target),
        f"{base}: config {config}, headers {headers}, index {index}",
    )


def test_the_base_folders_load(bases: dict) -> None:
    for arch in (*FAMILIES, "sharded"):
        use(bases[arch])


@pytest.mark.parametrize(
    ("base", "key", "value"),
    [
        ("llama", "architectures", -1),
        ("llama", "model_type", []),
        ("gemma3", "rope_local_base_freq", None),
        ("llama", "rope_theta", None),
    ],
)
def test_config_values_of_the_wrong_type_are_one_line(
    bases: dict, folder: Path, base: str, key: str, value: object
) -> None:
    target = folder / "seeded"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(bases[base], target)
    doc = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(doc | {key: value}))
    bounded(lambda: use(target), f"config.json {key} = {value!r}")
