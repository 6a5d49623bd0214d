"""An HF folder from a stranger cannot lead the reader outside itself (shard names with
``..``, absolute paths or separators, links to files elsewhere — the Hugging Face cache's own
links into ``blobs/`` excepted), and its claims are checked before anything is allocated
(an index naming a million shards, a tensor in two shards or elsewhere than the index says,
safetensors headers that lie about sizes)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from user_errors import error_of

from llamatrain.hf import weights as weights_module
from llamatrain.hf.inside import file_in_folder
from llamatrain.hf.tokenizer_files import read_chat_template, read_folder_tokenizer
from llamatrain.hf.weights import INDEX_FILE, hf_state_dict, read_hf_weights, weight_files
from llamatrain.model_config import ModelConfig, tensor_shapes

CFG = ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=40, max_seq_len=16
)


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ours = {name: torch.randn(shape) for name, shape in tensor_shapes(CFG).items()}
    return hf_state_dict(CFG, ours)


def sharded(folder: Path, weight_map: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Two shards and their index (``weight_map`` instead of the true one when given)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = state()
    names = sorted(tensors)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, members in halves.items():
        save_file({n: tensors[n] for n in members}, folder / shard)
    true_map = {n: shard for shard, members in halves.items() for n in members}
    index = {"weight_map": weight_map if weight_map is not None else true_map}
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return tensors


def quick_error(fn, *args) -> str:
    """The one-line refusal of ``fn(*args)``, reached within 2 s of this process's CPU time
    (the work done before refusing, whatever else the machine runs)."""
    start = time.process_time()
    message = error_of(fn, *args)
    assert time.process_time() - start < 2
    return message


@pytest.mark.parametrize(
    "shard",
    ["../outside.safetensors", "/etc/passwd", "sub/a.safetensors", "sub\\a.safetensors", "..", ""],
)
def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path, shard):
    folder = tmp_path / "model"
    tensors = sharded(folder)
    save_file(tensors, tmp_path / "outside.safetensors")  # what ../ would reach
    (folder / "sub").mkdir()
    save_file(tensors, folder / "sub" / "a.safetensors")
    index = json.loads((folder / INDEX_FILE).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (folder / INDEX_FILE).write_text(json.dumps(index))
    message = quick_error(read_hf_weights, folder, CFG)
    assert "not a plain file name" in message and "refusing to read outside the folder" in message
    assert repr(shard) in message


def test_an_index_whose_shard_names_are_not_strings_is_refused(tmp_path):
    sharded(tmp_path, {"model.norm.weight": ["a.safetensors"]})
    assert "not a safetensors index" in quick_error(weight_files, tmp_path)
    sharded(tmp_path, {"model.norm.weight": 7})
    assert "names the file 7" in quick_error(weight_files, tmp_path)


def test_an_index_naming_a_million_shards_is_refused_before_looking_for_them(tmp_path):
    weight_map = {f"t{i}": f"model-{i:07d}.safetensors" for i in range(10**6)}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    message = quick_error(weight_files, tmp_path)
    assert "names 1,000,000 shards" in message and "4,096 at most" in message


def test_an_oversized_index_is_refused_before_it_is_read(tmp_path, monkeypatch):
    sharded(tmp_path)
    monkeypatch.setattr(weights_module, "MAX_INDEX_BYTES", 100)
    assert "more than any safetensors index" in quick_error(weight_files, tmp_path)


def test_a_link_to_a_shard_outside_the_folder_is_refused(tmp_path):
    folder = tmp_path / "model"
    sharded(folder)
    (folder / "b.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (folder / "b.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    message = quick_error(read_hf_weights, folder, CFG)
    assert "b.safetensors is a link to" in message and "outside" in message
    # the single-file layout too
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    assert "is a link to" in quick_error(read_hf_weights, single, CFG)


def test_links_inside_the_folder_and_into_the_hugging_face_cache_blobs_are_read(tmp_path):
    folder = tmp_path / "model"
    tensors = sharded(folder)
    (folder / "b.safetensors").rename(folder / "b.real")
    (folder / "b.safetensors").symlink_to("b.real")
    assert set(read_hf_weights(folder, CFG)) == set(tensor_shapes(CFG)) - {"rope_freqs.weight"}
    # snapshot_download's layout: snapshots/<revision>/<file> -> ../../blobs/<hash>
    cache = tmp_path / "hub" / "models--org--name"
    snapshot = cache / "snapshots" / "0123abc"
    sharded(snapshot)
    (cache / "blobs").mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        (snapshot / name).rename(cache / "blobs" / f"hash-{name}")
        (snapshot / name).symlink_to(f"../../blobs/hash-{name}")
    back = read_hf_weights(snapshot, CFG)
    assert len(back) == len(tensors)


def test_a_tensor_in_two_shards_or_elsewhere_than_the_index_says_is_refused(tmp_path):
    tensors = sharded(tmp_path)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    name = next(n for n, shard in index["weight_map"].items() if shard == "a.safetensors")
    b = {n: tensors[n] for n, s in index["weight_map"].items() if s == "b.safetensors"}
    save_file({**b, name: tensors[name]}, tmp_path / "b.safetensors")
    message = quick_error(read_hf_weights, tmp_path, CFG)
    assert f"the tensor {name} is in both a.safetensors and b.safetensors" in message
    sharded(tmp_path)
    index["weight_map"][name] = "b.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    message = quick_error(read_hf_weights, tmp_path, CFG)
    assert f"puts {name} in b.safetensors but it is in a.safetensors" in message


def lying_safetensors(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


@pytest.mark.parametrize(
    "header, data, length, fragment",
    [
        (
            {"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
            b"\0" * 4,
            1 << 60,
            "too large",
        ),
        (
            {"t": {"dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "",
        ),
        (
            {"t": {"dtype": "F32", "shape": [2**40] * 3, "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            "overflow",
        ),
        (
            {"t": {"dtype": "F32", "shape": [2**30], "data_offsets": [0, 2**32]}},
            b"\0" * 8,
            None,
            "",
        ),
    ],
    ids=[
        "header length",
        "shape larger than the data",
        "shape overflowing",
        "offsets past the end",
    ],
)
def test_safetensors_headers_that_lie_about_sizes_are_refused_before_allocating(
    tmp_path, header, data, length, fragment
):
    """safetensors checks the header against the file before any tensor is read; what it says
    reaches the user as one line."""
    lying_safetensors(tmp_path / "model.safetensors", header, data, length)
    message = quick_error(read_hf_weights, tmp_path, CFG)
    assert "is not a readable safetensors file" in message and fragment in message


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json"])
def test_tokenizer_and_config_files_linking_outside_are_refused(tmp_path, name):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret.json").write_text("{}")
    (folder / name).symlink_to(tmp_path / "secret.json")
    assert "is a link to" in quick_error(read_folder_tokenizer, folder, 40)


def test_a_chat_template_file_linking_outside_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "secret.txt").write_text("{{ messages }}")
    (folder / "chat_template.jinja").symlink_to(tmp_path / "secret.txt")
    assert "is a link to" in quick_error(read_chat_template, folder)
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").symlink_to(tmp_path / "secret.txt")
    assert "is a link to" in quick_error(read_chat_template, folder)


def test_file_in_folder_accepts_plain_names_only(tmp_path):
    assert file_in_folder(tmp_path, "model.safetensors") == tmp_path / "model.safetensors"
    for name in ("../x", "/x", "a/b", "a\\b", ".", "..", "", "x\0y", "x" * 300):
        assert "not a plain file name" in error_of(file_in_folder, tmp_path, name)
