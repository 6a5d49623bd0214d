"""Fuzz table data — Parquet files and HF ``save_to_disk`` folders — property-based.

A real Parquet file of chat, Alpaca and text rows (zstd, small row groups) is damaged: bytes
flipped or overwritten anywhere (its footer, page headers, compressed pages), cut, grown, or
its footer length pointed elsewhere; so is a real ``save_to_disk`` folder's Arrow file (its
batches' metadata, offsets and cells), and its ``state.json``, ``dataset_info.json`` or Arrow
file are replaced by drawn bytes or JSON. Reading either as
``data.format = "parquet"`` / ``"hf"`` rows encoded as examples gives examples or a
LlamatrainError in one line, within ``fuzz_bounds.bounded``'s time and memory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fuzz_bounds import bounded
from fuzz_models import bpe_tokenizer
from hypothesis import given
from hypothesis import strategies as st

from llamatrain.chat_template import resolve_chat_template
from llamatrain.data.examples import LineEncoder, read_examples
from llamatrain.data.jsonl import BadLines

pytestmark = pytest.mark.fuzz
pa = pytest.importorskip("pyarrow")
parquet = pytest.importorskip("pyarrow.parquet")

ROWS = {
    "messages": [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]
                 for i in range(6)] + [None, None],
    "instruction": [None] * 6 + ["do it", "again"],
    "output": [None] * 6 + ["done", "done"],
}  # fmt: skip


@pytest.fixture(scope="module")
def encoder() -> LineEncoder:
    tokenizer = bpe_tokenizer()
    template = resolve_chat_template("chatml", None, tokenizer)
    return LineEncoder(tokenizer, template, train_on="completion")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tables")
    path = folder / "rows.parquet"
    parquet.write_table(pa.table(ROWS), path, compression="zstd", row_group_size=3)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict(ROWS).save_to_disk(str(folder / "ds"))
    return {"parquet": path, "hf": folder / "ds"}


def read(paths: list[Path], encoder: LineEncoder, format: str, policy: str) -> list:
    return read_examples(paths, encoder, BadLines(policy), format=format)


edits = st.lists(
    st.tuples(st.integers(0, 1 << 16), st.binary(min_size=1, max_size=8)), min_size=1, max_size=4
)


@given(edits=edits, cut=st.none() | st.integers(0, 4096), policy=st.sampled_from(["skip", "error"]))
def test_a_damaged_parquet_file_gives_examples_or_one_line(
    clean, encoder, tmp_path_factory, edits, cut, policy
):
    data = bytearray(clean["parquet"].read_bytes())
    for offset, patch in edits:  # anywhere: counted from the end half the time (the footer)
        at = offset % len(data) if offset % 2 else len(data) - 1 - offset % len(data)
        data[at : at + len(patch)] = patch
    if cut is not None:
        data = data[: len(data) - cut]
    path = tmp_path_factory.mktemp("p") / "rows.parquet"
    path.write_bytes(bytes(data))
    bounded(lambda: read([path], encoder, "parquet", policy), f"parquet {edits} {cut}")


json_or_bytes = st.one_of(
    st.binary(max_size=120),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=12),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner),
        max_leaves=6,
    ).map(lambda v: json.dumps(v).encode()),
    st.sampled_from([
        b'{"_data_files": [{"filename": "../../etc/passwd"}]}',
        b'{"_data_files": [{"filename": "/etc/hostname"}]}',
        b'{"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": 3}',
    ]),
)  # fmt: skip


@given(name=st.sampled_from(["state.json", "dataset_info.json", "arrow"]), raw=json_or_bytes)
def test_a_damaged_datasets_folder_gives_examples_or_one_line(
    clean, encoder, tmp_path_factory, name, raw
):
    folder = tmp_path_factory.mktemp("h") / "ds"
    shutil.copytree(clean["hf"], folder)
    target = next(folder.glob("*.arrow")) if name == "arrow" else folder / name
    target.write_bytes(raw)
    bounded(lambda: read([folder], encoder, "hf", "skip"), f"hf {name} {raw[:80]!r}")


@given(edits=edits, cut=st.none() | st.integers(0, 512))
def test_a_damaged_arrow_file_gives_examples_or_one_line(
    clean, encoder, tmp_path_factory, edits, cut
):
    """Issue 37, item 4: the Arrow file's bytes damaged in place (its batches' metadata,
    lengths, offsets, cells) rather than replaced: pyarrow believed what a batch claimed, and
    a claimed 1 GB cell in a 432-byte file was a bus error."""
    folder = tmp_path_factory.mktemp("a") / "ds"
    shutil.copytree(clean["hf"], folder)
    (arrow,) = folder.glob("*.arrow")
    data = bytearray(arrow.read_bytes())
    for offset, patch in edits:
        at = offset % len(data)
        data[at : at + len(patch)] = patch
    if cut is not None:
        data = data[: max(len(data) - cut, 0)]
    arrow.write_bytes(bytes(data))
    bounded(lambda: read([folder], encoder, "hf", "skip"), f"arrow {edits} {cut}")
