"""A bounded fuzz test of the GGUF reader: damaged files fail as GGUFError, never otherwise.

A seeded mutator (no new dependency, the same cases on every run) damages one small but
varied file (scalars of each width, strings, arrays, tensors of four types, checksums) in the
ways files get damaged or crafted: cut short, bytes flipped, counts / dimensions / offsets set
huge, type ids changed. Every read either succeeds or raises a LlamatrainError with a message;
none raises anything else, takes long, or allocates much more than the file's size.
"""

from __future__ import annotations

import random
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from llamatrain.errors import LlamatrainError
from llamatrain.gguf.describe import describe_gguf
from llamatrain.gguf.file import read_gguf, read_gguf_metadata, verify_gguf
from llamatrain.gguf.write import write_gguf

CASES = 400
HUGE = [1 << 63, (1 << 64) - 1, 1 << 58, 1 << 32, (1 << 31) + 1, 0xFFFFFFFF]
READERS: list[Callable[[Path], object]] = [
    read_gguf,
    read_gguf_metadata,
    verify_gguf,
    describe_gguf,
]


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    g = torch.Generator().manual_seed(0)
    metadata = {
        "general.name": "fuzz",
        "t.u32": np.uint32(7),
        "t.f32": np.float32(0.5),
        "t.flag": True,
        "t.i64": -3,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a", "b"],
        "tokenizer.ggml.scores": np.zeros(5, dtype=np.float32),
        "tokenizer.ggml.token_type": np.array([2, 3, 3, 1, 1], dtype=np.int32),
        "tokenizer.ggml.bos_token_id": np.uint32(1),
    }
    tensors = {
        "a.weight": (torch.randn(4, 32, generator=g), "f32"),
        "b.weight": (torch.randn(2, 32, generator=g), "q8_0"),
        "c.weight": (torch.randn(3, 32, generator=g), "f16"),
        "d.index": (torch.arange(6, dtype=torch.int32), "f32"),
    }
    path = tmp_path_factory.mktemp("fuzz") / "original.gguf"
    return write_gguf(path, "llama", metadata, tensors, checksums=True).read_bytes()


def header_length(data: bytes) -> int:
    """Bytes before the first tensor's data: where counts, types and offsets live."""
    return data.index(b"d.index") + 64


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One damage, described for the failure message."""
    out = bytearray(data)
    header = header_length(data)
    kind = rng.choice(["truncate", "flip", "huge u64", "huge u32", "type id"])
    if kind == "truncate":
        at = rng.randrange(len(data))
        return f"truncate at {at}", bytes(out[:at])
    at = rng.randrange(header - 8)
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            out[at] ^= rng.randrange(1, 256)
        return f"flip bytes, last at {at}", bytes(out)
    if kind == "huge u64":
        value = rng.choice(HUGE)
        out[at : at + 8] = struct.pack("<Q", value)
        return f"u64 {value} at {at}", bytes(out)
    if kind == "huge u32":
        value = rng.choice(HUGE) & 0xFFFFFFFF
        out[at : at + 4] = struct.pack("<I", value)
        return f"u32 {value} at {at}", bytes(out)
    value = rng.randrange(40)
    out[at : at + 4] = struct.pack("<I", value)
    return f"type id {value} at {at}", bytes(out)


def test_damaged_files_fail_as_gguf_errors(original: bytes, tmp_path: Path) -> None:
    rng = random.Random(15)
    path = tmp_path / "damaged.gguf"
    outcomes = {"read": 0, "refused": 0}
    tracemalloc.start()
    try:
        for case in range(CASES):
            what, data = mutate(original, rng)
            path.write_bytes(data)
            reader = READERS[case % len(READERS)]
            tracemalloc.reset_peak()
            started = time.perf_counter()
            try:
                reader(path)
                outcomes["read"] += 1
            except LlamatrainError as err:
                assert str(err).strip(), f"case {case} ({what}): an empty message"
                outcomes["refused"] += 1
            except Exception as err:  # noqa: BLE001 - the point of the test
                pytest.fail(f"case {case} ({what}), {reader.__name__}: {err!r}")
            assert time.perf_counter() - started < 2, f"case {case} ({what}) took long"
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < 64 * len(original) + (1 << 20), f"case {case} ({what}): {peak} bytes"
    finally:
        tracemalloc.stop()
    # the mutations reach both outcomes: not all refused at the magic, not all harmless
    assert outcomes["refused"] > CASES // 4 and outcomes["read"] > CASES // 20, outcomes
