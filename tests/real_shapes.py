"""Random GGUFs of real models' exact shapes, written in seconds, one tensor at a time.

Why: memory and speed at the sizes people finetune (issue 39) can only be proven on files of
those sizes, and none can be downloaded here. A model's cost depends on its shape and stored
types, not on its values, so a file with the exact tensors, keys and vocabulary of Llama-2-7B,
Llama-3.2-1B or Qwen2.5-1.5B, filled with random but valid blocks, stands in for the real one.

How: gguf-py's ``GGUFWriter`` is given every tensor's info first, then each tensor's bytes are
made and written before the next, so the writer holds one tensor (at most ~0.5 GB, a 128k-151k
vocabulary's embedding in f16), never the model. Q4_0 and Q8_0 blocks are made directly as
random bytes (numpy's generator runs at ~1 GB/s): a random f16 scale per block, sized so that a
matrix times a unit-RMS vector gives unit RMS again (weight std ~ 1/sqrt(columns)), then random
quants; nothing is quantized from floats, so a 7B is written as fast as the disk takes it.
Q4_K_M is llama.cpp's own quantizer run over a random f16 file of the shape (its per-tensor
type mix, Q6_K for ``output`` and some ``attn_v`` / ``ffn_down``, is only knowable from it):
minutes, not seconds. The keys are the ones llama.cpp's converter writes (no llamatrain
``CONFIG_KEY``), so llamatrain reads the file as it reads a downloaded one; the vocabulary is
the real model's, copied key by key from llama.cpp's ``models/ggml-vocab-*.gguf``
(``tests/llama_cpp_files.py`` fetches them). Every matrix, ``token_embd`` and ``output``
included, is stored in the named type (``llama-quantize`` would store a Q4_0 model's
``output`` as Q6_K: 1% of a 7B's bytes); norms, biases and ``rope_freqs`` are F32.

A module beside the top ``conftest.py`` (pytest puts its folder on ``sys.path``), imported by
the tests and by ``bench/scale.py``: it lives with the tests because the tests are the proof
that must pass on a fresh clone, and the vocabulary cache it reads is the tests' own.
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, LlamaFileType

from llamatrain.gguf.file import read_gguf
from llamatrain.model_config import ModelConfig, tensor_shapes

_T = GGMLQuantizationType


@dataclass(frozen=True)
class RealShape:
    """A real model's architecture and the llama.cpp vocabulary file (``ggml-vocab-<name>``)
    of the same tokenizer; ``llama3_rope``: Llama 3.1+'s ``rope_freqs`` frequency factors."""

    config: ModelConfig
    vocabulary: str
    llama3_rope: bool = False


SHAPES: dict[str, RealShape] = {
    "llama-2-7b": RealShape(
        ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008,
                    max_seq_len=4096, norm_eps=1e-5),
        "llama-spm",
    ),
    "llama-3.2-1b": RealShape(
        ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                    ffn_dim=8192, max_seq_len=131072, norm_eps=1e-5, rope_theta=500000.0,
                    rope_freq_factors=True, tie_embeddings=True),
        "llama-bpe",
        llama3_rope=True,
    ),
    "llama-3.2-3b": RealShape(
        ModelConfig(vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8,
                    ffn_dim=8192, max_seq_len=131072, norm_eps=1e-5, rope_theta=500000.0,
                    rope_freq_factors=True, tie_embeddings=True),
        "llama-bpe",
        llama3_rope=True,
    ),
    "llama-3.1-8b": RealShape(
        ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                    ffn_dim=14336, max_seq_len=131072, norm_eps=1e-5, rope_theta=500000.0,
                    rope_freq_factors=True),
        "llama-bpe",
        llama3_rope=True,
    ),
    "qwen2.5-1.5b": RealShape(
        ModelConfig(arch="qwen2", vocab_size=151936, dim=1536, n_layers=28, n_heads=12,
                    n_kv_heads=2, ffn_dim=8960, max_seq_len=32768, norm_eps=1e-6,
                    rope_theta=1000000.0, tie_embeddings=True),
        "qwen2",
    ),
}  # fmt: skip
"""Real models' shapes by name: issue 39's three (Llama-2-7B, Llama-3.2-1B, Qwen2.5-1.5B) and
the 3B and 8B of the Llama 3 family that the README's what-fits-where table is measured at."""

TYPES = ("q4_0", "q8_0", "q4_k_m")
"""The stored types a shape can be written as (``f16`` too: the quantizer's input)."""

_RANDOM_BLOCKS = {"q4_0": (_T.Q4_0, 16.0), "q8_0": (_T.Q8_0, 256.0)}
"""Type -> (GGML type, how many values its quants take): the quants are uniform over them."""
_FILE_TYPES = {
    "f16": LlamaFileType.MOSTLY_F16,
    "q4_0": LlamaFileType.MOSTLY_Q4_0,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
}
_QUANTIZE = """
import ctypes, os, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
source, target = (os.fsencode(p) for p in sys.argv[1:3])
sys.exit(llama_cpp.llama_model_quantize(source, target, ctypes.byref(params)))
"""
"""llama.cpp's quantizer at its defaults, in a child process: its log and memory stay there."""


def write_real_shape(
    path: Path, shape: RealShape | str, type_name: str, vocab_dir: Path, *, seed: int = 0
) -> Path:
    """A random model of ``shape`` stored as ``type_name`` (``TYPES`` or ``f16``) at ``path``;
    ``vocab_dir`` holds llama.cpp's ``ggml-vocab-*.gguf`` files. Q4_K_M goes through an f16
    file beside ``path`` and llama.cpp's quantizer (deleted afterwards)."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    if type_name != "q4_k_m":
        return _write_random(path, shape, type_name, vocab_dir, seed)
    with tempfile.TemporaryDirectory(dir=path.parent) as folder:
        source = _write_random(Path(folder) / "f16.gguf", shape, "f16", vocab_dir, seed)
        return quantize_file(source, path, type_name)


def quantize_file(source: Path, path: Path, type_name: str) -> Path:
    """``source`` (an f16 or f32 GGUF) quantized into ``path`` as ``type_name`` (``TYPES``) by
    llama.cpp's quantizer at its defaults, in a child process: its log and memory stay there."""
    ftype = str(int(_FILE_TYPES[type_name]))
    command = [sys.executable, "-c", _QUANTIZE, str(source), str(path), ftype]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp could not quantize {path.name}:\n{done.stderr[-2000:]}")
    return path


def stored_bytes(shape: RealShape | str, type_name: str) -> int:
    """The tensor bytes of ``shape`` written by :func:`write_real_shape` as ``type_name``
    (``q4_k_m``: as Q4_K throughout, a lower bound), to check free disk space beforehand."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    ggml = _T.Q4_K if type_name == "q4_k_m" else _ggml_type(type_name)
    values_per_block, block_bytes = GGML_QUANT_SIZES[ggml]
    total = 0
    for dims in tensor_shapes(shape.config).values():
        n = math.prod(dims)
        total += n * block_bytes // values_per_block if len(dims) == 2 else 4 * n
    return total


def _ggml_type(type_name: str) -> GGMLQuantizationType:
    return _T.F16 if type_name == "f16" else _RANDOM_BLOCKS[type_name][0]


def _write_random(path: Path, shape: RealShape, type_name: str, vocab_dir: Path, seed: int) -> Path:
    """The streaming write: keys, every tensor's info, then each tensor's bytes in turn."""
    cfg = shape.config
    writer = GGUFWriter(None, cfg.arch)
    _add_hyper_parameters(writer, cfg, _FILE_TYPES[type_name])
    _copy_vocabulary(writer, vocab_dir / f"ggml-vocab-{shape.vocabulary}.gguf")
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(cfg).items()
    tensors = {name: _tensor_maker(name, dims, shape, type_name, rng) for name, dims in shapes}
    for name, (stored, raw_type, _) in tensors.items():
        writer.add_tensor_info(name, stored.shape, stored.dtype, stored.nbytes, raw_type)
    try:
        writer.write_header_to_file(path=path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, _, make in tensors.values():
            writer.write_tensor_data(make())
    finally:
        writer.close()
    return path


def _add_hyper_parameters(writer: GGUFWriter, cfg: ModelConfig, file_type: int) -> None:
    """The ``<arch>.*`` and ``general.*`` keys llama.cpp's converter writes for the model."""
    writer.add_name(f"random {cfg.arch} {cfg.dim}x{cfg.n_layers}")
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(2)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.dim)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.hidden_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)


def _copy_vocabulary(writer: GGUFWriter, vocab: Path) -> None:
    """Every ``tokenizer.*`` key of llama.cpp's vocab-only file, with its stored types."""
    if not vocab.is_file():
        raise FileNotFoundError(
            f"{vocab} is missing: run pytest tests/integration/test_llama_cpp_vocabs.py once "
            "(tests/llama_cpp_files.py fetches llama.cpp's vocabularies)"
        )
    contents = read_gguf(vocab, tensor_data=False)  # llamatrain's parser: gguf-py's takes 11 s
    for key, value in contents.metadata.items():
        if key.startswith("tokenizer."):
            value_type, item_type = contents.value_types[key]
            writer.add_key_value(key, value, value_type, sub_type=item_type)


def _tensor_maker(
    name: str, dims: tuple[int, ...], shape: RealShape, type_name: str, rng: np.random.Generator
) -> tuple[np.ndarray, GGMLQuantizationType | None, Callable[[], np.ndarray]]:
    """(a zero-strided stand-in of the stored array: its shape, dtype and bytes for the
    header; the GGML type of raw blocks or None; a function making the stored array)."""
    if len(dims) == 1:
        values = _vector(name, dims[0], shape, rng)
        return values, None, lambda: values
    rows, columns = dims
    if type_name == "f16":
        stand_in = np.broadcast_to(np.float16(0), dims)
        return stand_in, None, lambda: _f16_matrix(rng, rows, columns)
    ggml = _ggml_type(type_name)
    values_per_block, block_bytes = GGML_QUANT_SIZES[ggml]
    stand_in = np.broadcast_to(np.uint8(0), (rows, columns // values_per_block * block_bytes))
    return stand_in, ggml, lambda: _random_blocks(rng, rows, columns, type_name)


def _vector(name: str, n: int, shape: RealShape, rng: np.random.Generator) -> np.ndarray:
    """A norm ~ U(0.8, 1.2), a bias ~ N(0, 0.02), or Llama 3's rope frequency factors."""
    if name == "rope_freqs.weight":
        return _llama3_rope_factors(shape.config)
    if name.endswith(".bias"):
        return rng.normal(0.0, 0.02, n).astype(np.float32)
    return rng.uniform(0.8, 1.2, n).astype(np.float32)


def _random_blocks(rng: np.random.Generator, rows: int, columns: int, type_name: str) -> np.ndarray:
    """Random Q4_0 / Q8_0 blocks: each an f16 scale, then its quants as random bytes. A
    quant's value is scale x (q - levels/2) with q uniform over ``levels``, whose std is
    ~levels/sqrt(12); the scale (x U(0.5, 1.5) per block) makes the weight std 1/sqrt(columns)."""
    ggml, levels = _RANDOM_BLOCKS[type_name]
    values_per_block, block_bytes = GGML_QUANT_SIZES[ggml]
    n_blocks = rows * columns // values_per_block
    blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    scale = 1.0 / (levels / math.sqrt(12.0) * math.sqrt(columns))
    scales = (scale * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, -1)


def _f16_matrix(rng: np.random.Generator, rows: int, columns: int) -> np.ndarray:
    """Random f16 values made from random bits: random sign and mantissa, one exponent, so
    magnitudes fall in [a, 2a) with RMS ~1.53a = 1/sqrt(columns)."""
    exponent = round(math.log2(1.0 / (1.53 * math.sqrt(columns)))) + 15
    bits = rng.integers(0, 1 << 16, (rows, columns), dtype=np.uint16)
    bits &= 0x83FF
    bits |= np.uint16(exponent << 10)
    return bits.view(np.float16)


def _llama3_rope_factors(cfg: ModelConfig) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's converter computes it for Llama 3.1+/3.2 (factor
    32, low/high frequency factors 1 and 4, original context 8192)."""
    factor, low, high, original = 32.0, 1.0, 4.0, 8192
    dims = np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim
    wavelengths = 2 * math.pi * cfg.rope_theta**dims
    smooth = (original / wavelengths - low) / (high - low)
    factors = np.where(
        wavelengths < original / high,
        1.0,
        np.where(wavelengths > original / low, factor, 1 / ((1 - smooth) / factor + smooth)),
    )
    return factors.astype(np.float32)


def shape_names() -> Iterator[str]:
    """The names of :data:`SHAPES`, smallest file first."""
    yield from sorted(SHAPES, key=lambda name: stored_bytes(name, "q4_0"))
