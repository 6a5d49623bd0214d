"""llamatrain.gguf.file: the GGUF container — value and tensor types, atomic writes, the reader.

What we write is read back twice: by our reader and by the ``gguf`` package's ``GGUFReader``,
an implementation independent of ours, so a bug shared by our writer and reader cannot hide.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from llamatrain.cli import main
from llamatrain.errors import ConfigError, GGUFError
from llamatrain.gguf import file as gguf_file
from llamatrain.gguf.export_types import (
    ALL_EXPORT_TYPES,
    EXPORT_TYPES,
    FILE_TYPES,
    QUANTIZER_TYPES,
    general_file_type,
)
from llamatrain.gguf.file import (
    STATE_SHA256_KEY,
    TENSOR_SHA256_KEY,
    read_gguf,
    read_gguf_metadata,
    read_tensors_into,
    verify_gguf,
)
from llamatrain.gguf.write import DeferredTensor, write_gguf


def value_types(path: Path) -> dict[str, tuple[str, ...]]:
    """GGUF value type names per key, as GGUFReader sees them (arrays: ARRAY and the item type)."""
    fields = GGUFReader(path).fields.items()  # the header is listed too, as GGUF.* pseudo-keys
    return {n: tuple(t.name for t in f.types) for n, f in fields if not n.startswith("GGUF.")}


def stored_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """(GGML type name, ggml dims fastest-first, bytes) per tensor, as GGUFReader sees them."""
    return {
        t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.n_bytes))
        for t in GGUFReader(path).tensors
    }


def weights(rows: int = 4, cols: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------- metadata

EXPLICIT = {
    "t.u8": (np.uint8(200), ("UINT8",)),
    "t.i8": (np.int8(-100), ("INT8",)),
    "t.u16": (np.uint16(60000), ("UINT16",)),
    "t.i16": (np.int16(-30000), ("INT16",)),
    "t.u32": (np.uint32(4_000_000_000), ("UINT32",)),
    "t.i32": (np.int32(-2_000_000_000), ("INT32",)),
    "t.u64": (np.uint64(2**64 - 1), ("UINT64",)),
    "t.i64": (np.int64(-(2**62)), ("INT64",)),
    "t.f32": (np.float32(1e-5), ("FLOAT32",)),
    "t.f64": (np.float64(0.1), ("FLOAT64",)),
    "t.np_bool": (np.bool_(True), ("BOOL",)),
    "t.f32_array": (np.array([0.5, -1.25], dtype=np.float32), ("ARRAY", "FLOAT32")),
    "t.i32_array": (np.array([1, 6, 3], dtype=np.int32), ("ARRAY", "INT32")),
}
INFERRED = {
    "t.bool": (False, ("BOOL",)),
    "t.int": (-3, ("INT64",)),
    "t.huge": (2**63, ("UINT64",)),
    "t.float": (3e-4, ("FLOAT64",)),
    "t.str": ("héllo ▁world", ("STRING",)),
    "t.strs": (["<s>", "▁the", "<0x0A>"], ("ARRAY", "STRING")),
    "t.ints": ((1, 2, 3), ("ARRAY", "INT64")),
    "t.bools": ([True, False], ("ARRAY", "BOOL")),
}


def test_metadata_types_are_explicit_or_inferred(tmp_path: Path) -> None:
    metadata = {key: value for key, (value, _) in {**EXPLICIT, **INFERRED}.items()}
    path = write_gguf(tmp_path / "kv.gguf", "test", metadata, {})
    expected_types = {key: types for key, (_, types) in {**EXPLICIT, **INFERRED}.items()}
    assert value_types(path) == {"general.architecture": ("STRING",), **expected_types}
    meta = read_gguf_metadata(path)
    assert list(meta) == ["general.architecture", *metadata]  # order kept
    assert meta["general.architecture"] == "test"
    for key, value in metadata.items():
        expected = value.tolist() if isinstance(value, np.ndarray) else value
        expected = list(expected) if isinstance(expected, tuple) else expected
        assert meta[key] == expected, key
    assert meta["t.f32"] == 1e-5  # FLOAT32 reads back as the shortest decimal that round-trips
    assert type(meta["t.u64"]) is int and type(meta["t.np_bool"]) is bool


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("t.empty", [], TypeError),
        ("t.mixed", [1, "one"], TypeError),
        ("t.dict", {"a": 1}, TypeError),
        ("t.too_big", 2**64, TypeError),
        ("t.matrix", np.zeros((2, 2), dtype=np.float32), TypeError),
        ("t.surrogate", "\udc80", UnicodeEncodeError),
        ("general.architecture", "gemma", GGUFError),
    ],
)
def test_unstorable_metadata_fails_before_touching_the_disk(tmp_path, key, value, error) -> None:
    folder = tmp_path / "not-yet"
    with pytest.raises(error):
        write_gguf(folder / "x.gguf", "test", {key: value}, {"w": (weights(), "f32")})
    assert not folder.exists()


# ---------------------------------------------------------------------------------- tensors


def test_export_types_are_one_list() -> None:
    assert EXPORT_TYPES == tuple(FILE_TYPES) == ("f32", "f16", "bf16", "q8_0", "q4_0")
    # llama.cpp's LLAMA_FTYPE_ALL_F32, MOSTLY_F16, MOSTLY_BF16, MOSTLY_Q8_0, MOSTLY_Q4_0
    assert [general_file_type(t) for t in EXPORT_TYPES] == [0, 1, 32, 7, 2]
    assert EXPORT_TYPES + tuple(QUANTIZER_TYPES) == ALL_EXPORT_TYPES
    # llama.h's LLAMA_FTYPE_MOSTLY_<TYPE> of the types llama.cpp's quantizer writes for us
    assert QUANTIZER_TYPES == {
        "q4_1": 3, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13,
        "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18, "iq4_nl": 25,
        "iq4_xs": 30,
    }  # fmt: skip
    with pytest.raises(ConfigError, match="unknown GGUF type 'q5_k'; choose one of f32, f16"):
        general_file_type("q5_k")
    with pytest.raises(ConfigError, match="'q4_k_m' is written by llama.cpp's quantizer"):
        general_file_type("q4_k_m")  # not a type one tensor is written as


@pytest.mark.parametrize(
    ("type_name", "stored", "bytes_per_64", "tolerance"),
    [
        ("f32", "F32", 256, 0.0),
        ("f16", "F16", 128, 1e-3),
        ("bf16", "BF16", 128, 8e-3),
        ("q8_0", "Q8_0", 68, 1 / 127),
        ("q4_0", "Q4_0", 36, 1 / 8),
    ],
)
def test_matrices_take_their_type_and_vectors_stay_f32(
    tmp_path, type_name, stored, bytes_per_64, tolerance
) -> None:
    matrix, vector = weights(4, 64), torch.linspace(0.5, 1.5, 64)
    tensors = {"m.weight": (matrix, type_name), "norm.weight": (vector, type_name)}
    path = write_gguf(tmp_path / "t.gguf", "test", {}, tensors)
    assert stored_tensors(path) == {
        "m.weight": (stored, (64, 4), 4 * bytes_per_64),  # ggml dims: the row length first
        "norm.weight": ("F32", (64,), 256),
    }
    contents = read_gguf(path)
    assert contents.tensor_types == {"m.weight": stored, "norm.weight": "F32"}
    assert contents.tensor_nbytes == {"m.weight": 4 * bytes_per_64, "norm.weight": 256}
    assert torch.equal(contents.tensors["norm.weight"], vector)
    back = contents.tensors["m.weight"]
    assert back.dtype == torch.float32 and back.shape == matrix.shape
    assert (back - matrix).abs().max() <= tolerance * matrix.abs().max()


def test_rows_that_are_not_whole_blocks_fall_back_to_f16(tmp_path: Path) -> None:
    tensors = {"narrow": (weights(4, 48), "q8_0"), "wide": (weights(4, 64), "q8_0")}
    with pytest.warns(UserWarning, match="narrow: row length 48 is not a multiple of 32"):
        path = write_gguf(tmp_path / "t.gguf", "test", {}, tensors)
    assert read_gguf(path).tensor_types == {"narrow": "F16", "wide": "Q8_0"}


def test_wider_floats_are_stored_f32(tmp_path: Path) -> None:
    tensors = {
        "f64": (torch.tensor([[0.1, 0.2]], dtype=torch.float64), "f32"),
        "bf16": (torch.tensor([0.5, 2.0], dtype=torch.bfloat16), "f32"),
        "numpy": (np.arange(6, dtype=np.float64).reshape(2, 3), "f32"),
    }
    contents = read_gguf(write_gguf(tmp_path / "t.gguf", "test", {}, tensors))
    assert set(contents.tensor_types.values()) == {"F32"}
    assert contents.tensors["f64"].tolist() == [[np.float32(0.1), np.float32(0.2)]]
    assert contents.tensors["numpy"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_integer_tensors_keep_an_integer_type(tmp_path: Path) -> None:
    """GGUF's integer types are signed: bool and unsigned tensors widen to one that holds
    every value, whatever export type is asked for (an integer cannot be quantized)."""
    tensors = {
        "i64": (torch.tensor([-(2**40), 2**40]), "q8_0"),
        "i32": (torch.tensor([[1, -2], [3, -4]], dtype=torch.int32), "f16"),
        "i16": (torch.tensor([-300], dtype=torch.int16), "f32"),
        "i8": (torch.tensor([-7], dtype=torch.int8), "f32"),
        "bool": (torch.tensor([True, False]), "f32"),
        "u8": (torch.tensor([0, 200, 255], dtype=torch.uint8), "f32"),
    }
    contents = read_gguf(write_gguf(tmp_path / "t.gguf", "test", {}, tensors))
    assert contents.tensor_types == {
        "i64": "I64", "i32": "I32", "i16": "I16", "i8": "I8", "bool": "I8", "u8": "I16",
    }  # fmt: skip
    for name, (tensor, _) in tensors.items():
        back = contents.tensors[name]
        assert not back.is_floating_point() and back.tolist() == tensor.tolist(), name
    with pytest.raises(TypeError, match="cannot store uint64"):
        write_gguf(tmp_path / "u.gguf", "test", {}, {"u64": (np.array([1], np.uint64), "f32")})


def test_unknown_tensor_type_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown GGUF type 'q5_k'"):
        write_gguf(tmp_path / "t.gguf", "test", {}, {"w": (weights(), "q5_k")})
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------------------------- atomicity


@pytest.mark.parametrize("limit", [40, 64 * 1024], ids=["in-the-header", "in-the-tensors"])
def test_a_write_that_fails_midway_leaves_no_trace(
    tmp_path: Path, limit: int, file_size_limit
) -> None:
    target = tmp_path / "m.gguf"
    big = {"w": (weights(256, 256), "f32")}  # 256 KiB of tensor data
    with file_size_limit(limit), pytest.raises(OSError):
        write_gguf(target, "test", {"t.note": "first"}, big)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp file

    write_gguf(target, "test", {"t.note": "first"}, big)
    before = target.read_bytes()
    with file_size_limit(limit), pytest.raises(OSError):
        write_gguf(target, "test", {"t.note": "second"}, {"w": (weights(256, 256, 1), "f32")})
    assert target.read_bytes() == before  # the old file survives a failed overwrite
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_a_successful_write_replaces_the_file(tmp_path: Path) -> None:
    target = write_gguf(tmp_path / "sub" / "m.gguf", "test", {"t.note": "first"}, {})
    write_gguf(target, "test", {"t.note": "second"}, {})
    assert read_gguf_metadata(target)["t.note"] == "second"
    assert [p.name for p in target.parent.iterdir()] == ["m.gguf"]


# -------------------------------------------------------------------------------- streaming


@pytest.mark.parametrize("type_name", ["f16", "bf16", "q8_0", "q4_0"])
def test_encoding_a_chunk_of_rows_at_a_time_gives_the_whole_arrays_bytes(
    tmp_path: Path, type_name: str, monkeypatch
) -> None:
    monkeypatch.setattr(gguf_file, "CHUNK_VALUES", 3 * 64)  # 3 rows a chunk, 43 rows: 15 chunks
    w = weights(43, 64)
    path = write_gguf(tmp_path / "w.gguf", "test", {}, {"w": (w, type_name)}, checksums=True)
    qtype = FILE_TYPES[type_name][0]
    whole = w.numpy().astype(np.float16) if type_name == "f16" else quantize(w.numpy(), qtype)
    info = read_gguf(path, tensor_data=False).infos["w"]
    with path.open("rb") as f:
        f.seek(info.offset)
        assert f.read(info.n_bytes) == whole.tobytes()
    assert verify_gguf(path) == 1  # the digest is of the bytes written, chunk by chunk


def test_deferred_tensors_are_produced_one_at_a_time(tmp_path: Path) -> None:
    """What makes a write stream: a tensor's values exist only while it is written (a merged
    7B held whole is 27 GB). Each read hands out a fresh tensor and counts the live ones."""
    live: list[int] = []
    peak = [0]

    def produce(seed: int) -> torch.Tensor:
        tensor = weights(64, 64, seed)
        live.append(seed)
        peak[0] = max(peak[0], len(live))
        weakref.finalize(tensor, live.remove, seed)
        return tensor

    tensors = {
        f"w{i}": (DeferredTensor((64, 64), torch.float32, functools.partial(produce, i)), "q8_0")
        for i in range(6)
    }
    path = write_gguf(tmp_path / "d.gguf", "test", {}, tensors)
    assert peak[0] == 1 and live == []
    read = read_gguf(path).tensors
    for i in range(6):
        expected = quantize(weights(64, 64, i).numpy(), GGMLQuantizationType.Q8_0)
        assert torch.equal(
            read[f"w{i}"], torch.from_numpy(dequantize(expected, GGMLQuantizationType.Q8_0))
        )


def test_a_deferred_tensor_of_another_shape_than_declared_is_refused(tmp_path: Path) -> None:
    wrong = DeferredTensor((64, 64), torch.float32, lambda: weights(32, 64))
    with pytest.raises(GGUFError, match="planned"):
        write_gguf(tmp_path / "d.gguf", "test", {}, {"w": (wrong, "f32")})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------- reading


@pytest.fixture()
def small_file(tmp_path: Path) -> Path:
    tensors = {"a.weight": (weights(4, 64), "f32"), "b.weight": (weights(2, 32), "q8_0")}
    return write_gguf(tmp_path / "s.gguf", "test", {"t.name": "small"}, tensors)


def test_read_everything(small_file: Path) -> None:
    contents = read_gguf(small_file)
    assert contents.path == small_file
    assert contents.metadata == read_gguf_metadata(small_file)
    assert contents.metadata == {"general.architecture": "test", "t.name": "small"}
    assert list(contents.tensors) == ["a.weight", "b.weight"]
    assert torch.equal(contents.tensors["a.weight"], weights(4, 64))
    data_bytes = sum(contents.tensor_nbytes.values())
    assert data_bytes < small_file.stat().st_size < data_bytes + 1024


def test_error_not_a_gguf(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="does not exist; check the path"):
        read_gguf(tmp_path / "missing.gguf")
    text = tmp_path / "notes.txt"
    text.write_text("hello, I am text")
    with pytest.raises(GGUFError, match=r"not a GGUF file \(it starts with b'hell'"):
        read_gguf_metadata(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(empty)


def test_error_truncated(small_file: Path) -> None:
    data = small_file.read_bytes()
    for cut in (6, 30, len(data) // 3, len(data) - 40):  # the last 28 bytes are padding
        small_file.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated"):
            read_gguf(small_file)


def test_error_corrupt_header(small_file: Path) -> None:
    data = small_file.read_bytes()
    small_file.write_bytes(data[:4] + b"\x03\x00\x00\x00" + b"\xff" * 16 + data[24:])
    with pytest.raises(GGUFError, match=r"truncated or corrupt \(it claims"):
        read_gguf(small_file)
    small_file.write_bytes(data[:4] + b"\x07\x00\x00\x00" + data[8:])
    with pytest.raises(GGUFError, match="is GGUF version 7; llamatrain reads versions 2 and 3"):
        read_gguf(small_file)
    small_file.write_bytes(data[:4] + b"\x00\x00\x00\x03" + data[8:])
    with pytest.raises(GGUFError, match="big-endian"):
        read_gguf(small_file)


MIXED = {
    "f32.weight": (weights(3, 64, 1), "f32"),
    "f16.weight": (weights(5, 64, 2), "f16"),
    "bf16.weight": (weights(2, 32, 3), "bf16"),
    "q8_0.weight": (weights(7, 96, 4), "q8_0"),
    "q4_0.weight": (weights(6, 64, 5), "q4_0"),
    "norm.weight": (weights(1, 48, 6)[0], "q8_0"),  # 1-D: stays F32
    "ids": (torch.arange(10, dtype=torch.int32), "f32"),
}


def test_header_only_read_then_read_into_place(tmp_path: Path) -> None:
    """``tensor_data=False`` gives each tensor's shape and dtype without its data, and
    ``read_tensors_into`` fills given tensors exactly as a full read does."""
    path = write_gguf(tmp_path / "m.gguf", "test", {}, MIXED)
    full = read_gguf(path)
    header = read_gguf(path, tensor_data=False)
    assert (header.tensor_types, header.tensor_nbytes) == (full.tensor_types, full.tensor_nbytes)
    targets = {}
    for name, placeholder in header.tensors.items():
        tensor = full.tensors[name]
        assert placeholder.is_meta and placeholder.shape == tensor.shape, name
        assert placeholder.dtype == tensor.dtype, name
        targets[name] = torch.full(placeholder.shape, 7, dtype=placeholder.dtype)
    read_tensors_into(path, targets)
    for name, tensor in full.tensors.items():
        assert torch.equal(targets[name], tensor), name


def test_dequantizing_in_chunks_changes_nothing(tmp_path: Path, monkeypatch) -> None:
    """Rows are dequantized a chunk at a time into the result; a chunk smaller than a row,
    or not dividing the rows, gives the same values as one whole-tensor dequantization."""
    path = write_gguf(tmp_path / "m.gguf", "test", {}, MIXED)
    whole = read_gguf(path).tensors
    for chunk in (1, 100, 3 * 96):
        monkeypatch.setattr(gguf_file, "CHUNK_VALUES", chunk)
        for name, tensor in read_gguf(path).tensors.items():
            assert torch.equal(tensor, whole[name]), (chunk, name)


def test_read_into_refuses_what_does_not_fit(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", "test", {}, MIXED)
    with pytest.raises(GGUFError, match=r"has no tensor output.weight \(of 1 missing\)"):
        read_tensors_into(path, {"output.weight": torch.empty(3, 64)})
    with pytest.raises(GGUFError, match=r"tensor q8_0.weight is Q8_0 \(7, 96\) but is read into"):
        read_tensors_into(path, {"q8_0.weight": torch.empty(7, 95)})
    with pytest.raises(ValueError, match="into a contiguous CPU tensor"):  # a view: writes lost
        read_tensors_into(path, {"q8_0.weight": torch.empty(96, 7).t()})


def write_raw_tensor(path: Path, qtype: GGMLQuantizationType, raw: np.ndarray) -> Path:
    """A GGUF with one tensor ``x.weight`` of ``qtype`` whose stored bytes are ``raw``
    (rows x bytes per row), as llama.cpp may write types llamatrain never writes."""
    writer = GGUFWriter(path, "test")
    writer.add_tensor("x.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_type_no_library_dequantizes_is_one_error_naming_tensor_type_and_fix(
    tmp_path: Path, capsys
) -> None:
    """Q8_K is a real GGML type (llama.cpp's activation format) that gguf cannot dequantize;
    the header still reads (and ``info`` shows it), the data fails with one line, and so does
    ``info --verify`` (exit 1)."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_K]
    path = write_raw_tensor(
        tmp_path / "q8_k.gguf", GGMLQuantizationType.Q8_K, np.zeros((2, type_size), np.uint8)
    )
    header = read_gguf(path, tensor_data=False)
    assert header.tensor_types == {"x.weight": "Q8_K"}
    assert header.tensors["x.weight"].shape == (2, block)
    message = r"tensor x.weight has type Q8_K, which llamatrain cannot dequantize; convert"
    with pytest.raises(GGUFError, match=message):
        read_gguf(path)
    assert main(["info", str(path)]) == 0  # a summary reads the header alone
    assert "Q8_K" in capsys.readouterr().out
    assert main(["info", "--verify", str(path)]) == 1  # verifying reads every value
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "x.weight" in err and "Q8_K" in err and "convert" in err


def test_error_unknown_metadata_type(small_file: Path, patch) -> None:
    key = b"t.name"
    patch(small_file, key + struct.pack("<I", 8), key + struct.pack("<I", 77))
    with pytest.raises(GGUFError, match="unknown metadata value type 77"):
        read_gguf_metadata(small_file)


def test_error_bad_alignment(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "a.gguf", "test", {"general.alignment": np.uint32(24)}, {})
    with pytest.raises(GGUFError, match="general.alignment 24 is not a power of two"):
        read_gguf(path)


def test_error_tensor_records(small_file: Path, patch, capsys) -> None:
    data = small_file.read_bytes()
    name = b"a.weight"
    i = data.index(name) + len(name) + 4 + 2 * 8  # past the name, n_dims and both dims
    small_file.write_bytes(data[:i] + struct.pack("<I", 99) + data[i + 4 :])
    with pytest.raises(GGUFError, match="tensor a.weight has unknown type id 99"):
        read_gguf(small_file)
    output = small_file.with_name("out.gguf")
    for command in (["info", str(small_file)], ["export", str(small_file), "-o", str(output)]):
        assert main(command) == 1  # the CLI: one line naming the tensor, the id and the fix
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "a.weight has unknown type id 99" in err, err
        assert "re-export it as f32" in err and not output.exists()
    small_file.write_bytes(data)
    patch(small_file, b"b.weight", b"a.weight")
    with pytest.raises(GGUFError, match="corrupt: tensor a.weight appears twice"):
        read_gguf(small_file)


def tensor_record(data: bytes, name: bytes) -> int:
    """Where tensor ``name``'s record (n_dims, dims, type, offset) starts in the header."""
    return data.index(name + b"\x02\x00\x00\x00") + len(name)


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        ((1 << 58, 1 << 6), r"claims \[288230376151711744, 64\] elements, more than 2\^63"),
        ((1 << 63, 2), "more than 2\\^63"),
        ((1 << 40, 64), "tensor a.weight ends at byte"),  # no overflow, but past the file
    ],
)
def test_error_huge_dimensions(small_file: Path, dims, message) -> None:
    data = small_file.read_bytes()
    i = tensor_record(data, b"a.weight") + 4
    small_file.write_bytes(data[:i] + struct.pack("<QQ", *dims) + data[i + 16 :])
    with pytest.raises(GGUFError, match=message):
        read_gguf(small_file)


def test_error_offsets_and_dimension_counts(small_file: Path) -> None:
    data = small_file.read_bytes()
    i = tensor_record(data, b"b.weight")
    offset_at = i + 4 + 16 + 4
    (offset,) = struct.unpack_from("<Q", data, offset_at)
    for new_offset, message in ((offset + 4, "starts off the 32-byte alignment"),
                                (1 << 62, "tensor b.weight ends at byte")):  # fmt: skip
        small_file.write_bytes(
            data[:offset_at] + struct.pack("<Q", new_offset) + data[offset_at + 8 :]
        )
        with pytest.raises(GGUFError, match=message):
            read_gguf(small_file)
    small_file.write_bytes(data[:i] + struct.pack("<I", 1 << 31) + data[i + 4 :])
    with pytest.raises(GGUFError, match="tensor b.weight claims 2147483648 dimensions"):
        read_gguf(small_file)


def test_error_array_counts_and_nesting(tmp_path: Path, patch) -> None:
    path = write_gguf(tmp_path / "a.gguf", "test", {"t.words": ["ab", "cd"], "t.n": [1, 2]}, {})
    string, array, i64 = (struct.pack("<I", t) for t in (8, 9, 11))
    data = path.read_bytes()
    patch(path, b"t.words" + array + string, b"t.words" + array + array)
    with pytest.raises(GGUFError, match="has items of type 9"):
        read_gguf(path)
    path.write_bytes(data)
    patch(path, b"t.words" + array + string + struct.pack("<Q", 2),
          b"t.words" + array + string + struct.pack("<Q", 1 << 60))  # fmt: skip
    with pytest.raises(GGUFError, match="claims 1152921504606846976 strings"):
        read_gguf(path)
    path.write_bytes(data)
    patch(path, b"t.n" + array + i64 + struct.pack("<Q", 2),
          b"t.n" + array + i64 + struct.pack("<Q", 1 << 61))  # fmt: skip
    with pytest.raises(GGUFError, match="past the end of the file"):  # 2^64 bytes: no overflow
        read_gguf(path)


def test_error_duplicate_key(tmp_path: Path, patch) -> None:
    path = write_gguf(tmp_path / "a.gguf", "test", {"t.aa": 1, "t.bb": 2}, {})
    patch(path, b"t.bb", b"t.aa")
    with pytest.raises(GGUFError, match="key t.aa appears twice"):
        read_gguf(path)


# ------------------------------------------------------------------------------- checksums


def test_checksums_name_the_damaged_tensor(tmp_path: Path) -> None:
    tensors = {"a.weight": (weights(4, 64), "f32"), "b.weight": (weights(2, 32), "q8_0")}
    path = write_gguf(tmp_path / "c.gguf", "test", {}, tensors, checksums=True)
    assert verify_gguf(path) == 2
    reader = GGUFReader(path)
    recorded = json.loads(read_gguf_metadata(path)[TENSOR_SHA256_KEY])
    for t in reader.tensors:  # the sha256 of the bytes as stored, whatever their type
        assert recorded[t.name] == hashlib.sha256(t.data.tobytes()).hexdigest()
    start = next(t.data_offset for t in reader.tensors if t.name == "b.weight")
    data = bytearray(path.read_bytes())
    data[start + 5] ^= 0x10
    path.write_bytes(bytes(data))
    assert torch.isfinite(read_gguf(path).tensors["b.weight"]).all()  # still reads fine...
    with pytest.raises(GGUFError, match=r"damaged: tensor b.weight does not match the sha256"):
        verify_gguf(path)  # ...but is not what was written


@pytest.mark.parametrize("stripped", [TENSOR_SHA256_KEY, STATE_SHA256_KEY, "both"])
def test_a_checkpoint_stripped_of_its_sha256_is_not_called_sound(tmp_path, patch, stripped):
    """Issue 37, item 1: ``info --verify`` said "no sha256 recorded ... every value finite"
    (exit 0) of a checkpoint whose tensor sha256 map had been removed (renamed here)."""
    tensors = {"a.weight": (weights(4, 64), "f32")}
    meta = {"training.iteration_count": 3}
    path = write_gguf(tmp_path / "c.gguf", "test", meta, tensors, checksums=True)
    for key in [TENSOR_SHA256_KEY, STATE_SHA256_KEY] if stripped == "both" else [stripped]:
        patch(path, key.encode(), key.replace("training.", "stripped.").encode())
    with pytest.raises(GGUFError, match="training state but not training.* stripped or damaged"):
        verify_gguf(path)
    assert main(["info", "--verify", str(path)]) == 1


def test_files_without_checksums_verify_nothing(small_file: Path) -> None:
    assert TENSOR_SHA256_KEY not in read_gguf_metadata(small_file)
    assert verify_gguf(small_file) == 0
