"""Fuzz the GGUF container reader (header and tensor data), property-based.

Valid files of every shape the container holds (keys of each value type, arrays, tensors of
several types and shapes, with or without checksums) are written, then damaged the ways files
are damaged or crafted: cut short, bytes flipped, counts / lengths / dimensions / offsets / type
ids set to telling values, spans deleted or repeated. Every reader then returns or raises a
LlamatrainError in one line, within the time and memory bounds of ``conftest.bounded``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from fuzz_bounds import bounded
from hypothesis import given
from hypothesis import strategies as st

from llamatrain.gguf.describe import describe_gguf
from llamatrain.gguf.file import nonfinite_tensors, read_gguf, read_gguf_metadata, verify_gguf
from llamatrain.gguf.write import write_gguf

pytestmark = pytest.mark.fuzz

READERS = {
    "read_gguf": read_gguf,
    "read_gguf_metadata": read_gguf_metadata,
    "verify_gguf": verify_gguf,
    "nonfinite_tensors": nonfinite_tensors,
    "describe_gguf": describe_gguf,
}
TELLING = [
    0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 24, 31, 32, 33, 64, 255, 256, 4096,
    (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, 1 << 40, 1 << 58, 1 << 62, 1 << 63,
    (1 << 64) - 1,
]  # fmt: skip

key_names = st.text("abcdefghijklmnopqrstuvwxyz_.", min_size=1, max_size=12).map(lambda s: "t." + s)
scalars = st.one_of(
    st.integers(0, 255).map(np.uint8),
    st.integers(-(1 << 31), (1 << 31) - 1).map(np.int32),
    st.integers(0, (1 << 32) - 1).map(np.uint32),
    st.integers(-(1 << 63), (1 << 63) - 1),
    st.floats(width=32).map(np.float32),
    st.floats(),
    st.booleans(),
    st.text(max_size=8),
)
values = st.one_of(
    scalars,
    st.lists(st.text(max_size=4), min_size=1, max_size=5),
    st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=1, max_size=5).map(
        lambda v: np.array(v, dtype=np.int32)
    ),
    st.lists(st.floats(width=32), min_size=1, max_size=5).map(
        lambda v: np.array(v, dtype=np.float32)
    ),
)
tensor_specs = st.tuples(
    st.sampled_from(["f32", "f16", "q8_0", "q4_0", "int"]),
    st.lists(st.integers(1, 3), min_size=0, max_size=3),  # leading dims
    st.integers(1, 2),  # row length in 32-value blocks
)


def tensor(spec: tuple[str, list[int], int], seed: int) -> tuple[torch.Tensor, str]:
    kind, lead, blocks = spec
    shape = (*lead, 32 * blocks)
    if kind == "int":
        return torch.arange(int(np.prod(shape)), dtype=torch.int32).reshape(shape), "f32"
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), kind


@st.composite
def gguf_files(draw: st.DrawFn) -> tuple[dict, dict, bool]:
    metadata = draw(st.dictionaries(key_names, values, max_size=5))
    specs = draw(st.lists(tensor_specs, max_size=4))
    tensors = {f"t{i}.weight": tensor(spec, i) for i, spec in enumerate(specs)}
    return metadata, tensors, draw(st.booleans())


mutations = st.tuples(
    st.sampled_from(["truncate", "flip", "u64", "u32", "delete", "repeat"]),
    st.floats(0, 1, exclude_max=True),  # where, as a fraction of the header (or the file)
    st.sampled_from(TELLING),
    st.integers(1, 64),  # a span's length
)


def mutate(data: bytes, header: int, mutation: tuple[str, float, int, int]) -> bytes:
    kind, where, value, span = mutation
    at = int(where * (len(data) if kind in ("truncate", "flip") else max(header, 1)))
    out = bytearray(data)
    if kind == "truncate":
        return bytes(out[:at])
    if kind == "flip":
        if at < len(out):
            out[at] ^= value & 0xFF or 0x80
        return bytes(out)
    if kind == "u64":
        return bytes(out[:at] + struct.pack("<Q", value) + out[at + 8 :])
    if kind == "u32":
        return bytes(out[:at] + struct.pack("<I", value & 0xFFFFFFFF) + out[at + 4 :])
    if kind == "delete":
        return bytes(out[:at] + out[at + span :])
    return bytes(out[:at] + out[at : at + span] * 2 + out[at + span :])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_gguf")


@given(
    file=gguf_files(),
    damage=st.lists(mutations, min_size=1, max_size=3),
    reader=st.sampled_from(sorted(READERS)),
)
def test_damaged_gguf_is_read_or_refused_in_one_line(folder: Path, file, damage, reader) -> None:
    metadata, tensors, checksums = file
    (folder / "f.gguf").unlink(missing_ok=True)  # the last example's damaged file
    path = write_gguf(folder / "f.gguf", "fuzz", metadata, tensors, checksums=checksums)
    data = path.read_bytes()
    header = read_gguf(path, tensor_data=False)
    first = min((i.offset for i in header.infos.values()), default=len(data))
    for mutation in damage:
        data = mutate(data, first, mutation)
    path.write_bytes(data)
    bounded(lambda: READERS[reader](path), f"{reader} after {damage}")


@given(file=gguf_files())
def test_valid_gguf_reads_back(folder: Path, file) -> None:
    metadata, tensors, checksums = file
    (folder / "v.gguf").unlink(missing_ok=True)
    path = write_gguf(folder / "v.gguf", "fuzz", metadata, tensors, checksums=checksums)
    contents = bounded(lambda: read_gguf(path), "a valid file")
    assert contents is not None, "a file write_gguf wrote is refused"
    assert set(contents.tensors) == set(tensors)
    assert verify_gguf(path) == (len(tensors) if checksums else 0)
    for name, (data, _) in tensors.items():
        assert tuple(contents.tensors[name].shape) == tuple(data.shape)
