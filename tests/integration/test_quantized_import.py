"""Quantized weights in and out, proved against llama.cpp itself.

In: a random llama whose every row is a multiple of 256 values (what K-quants need), on
llama.cpp's own llama-spm vocabulary, is exported f32 by llamatrain and quantized by llama.cpp's
quantizer (``llama_model_quantize``, what ``llama-quantize`` runs) to Q4_K_M, Q5_K_M, Q6_K,
Q3_K_M, Q2_K and IQ4_XS, once per type. ``llamatrain.load_gguf`` imports each file:

- weights: every dequantized tensor is bit for bit what llama.cpp's own ``dequantize_row_*``
  (its ggml library, through ctypes) and gguf-py make of the stored bytes, and its error
  against the f32 original lies in the range measured for its type;
- logits: ours on a fixed token sequence match llama.cpp's on the same file within a bound
  measured per type (``LOGIT_BOUND_VS_FILE``).

Out: ``llamatrain export --type q4_k_m`` / ``export_gguf(type="q6_k")`` go through the same
quantizer: the file is the one ``llama_model_quantize`` makes, llama.cpp runs it within the
type's measured distance from the f32 model, ``general.file_type`` names the type, and a
missing extra or a failing quantization is one error that leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import math
import sys
from pathlib import Path
from typing import Any

import llama_cpp  # the test extra; the tests fail without it rather than skip
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from llama_cpp_files import vocab_dir as vocab_dir  # llama.cpp's vocab files
from test_llama_cpp import cpp_logits, our_logits

from llamatrain import api
from llamatrain.cli import main
from llamatrain.errors import ConfigError, GGUFError
from llamatrain.gguf.export_types import QUANTIZER_TYPES
from llamatrain.gguf.file import read_gguf_metadata
from llamatrain.gguf.llama import read_tokenizer
from llamatrain.model import Llama, ModelConfig
from llamatrain.tokenizer import Tokenizer

N_CTX = 64
TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading"
)

FILE_TYPES = {
    "q4_k_m": "Q4_K",
    "q5_k_m": "Q5_K",
    "q6_k": "Q6_K",
    "q3_k_m": "Q3_K",
    "q2_k": "Q2_K",
    "iq4_xs": "IQ4_XS",
}
"""The llama.cpp file types imported here and the GGML type most of their matrices take
(llama.cpp keeps some Q6_K or other types: Q4_K_M's attn_v, ffn_down and output, ...)."""

LOGIT_BOUND_VS_FILE = {
    "q4_k_m": 0.15,
    "q5_k_m": 0.16,
    "q6_k": 0.15,
    "q3_k_m": 0.15,
    "q2_k": 0.16,
    "iq4_xs": 0.15,
}
"""Max |our logit - llama.cpp's| on the same quantized file (39 tokens; logits ~N(0, 1), |max|
5.6). Not zero because llama.cpp does not multiply by the dequantized weights we use: its CPU
kernels quantize the activations too (to Q8_K for K-quant and IQ4_XS matrices, to Q8_0 for the
Q4_0 family) and take integer dot products, an 8-bit rounding of every matmul input.
Measured (2-core AMD EPYC, llama-cpp-python 0.3.36): q4_k_m 0.098, q5_k_m 0.107, q6_k 0.101,
q3_k_m 0.100, q2_k 0.106, iq4_xs 0.100; the bounds are 1.5x that. An import error shows far
above: the two halves of every 32-value block of any one matrix swapped move the logits by
2.7-7.9, a matrix scaled 5% off by 0.15-0.27 (and the weight test sees any difference)."""

WEIGHT_ERROR_RANGE = {
    "Q6_K": (0.013, 0.022),
    "Q5_K": (0.027, 0.045),
    "Q4_K": (0.053, 0.090),
    "IQ4_XS": (0.057, 0.096),
    "Q3_K": (0.11, 0.19),
    "Q2_K": (0.22, 0.37),
}
"""Relative RMS error |dequantized - f32| / |f32| of a Gaussian matrix stored in each GGML
type. Measured on this model (every tensor of that type in any of the files): Q6_K
0.0175-0.0179, Q5_K 0.0357-0.0364, Q4_K 0.0706-0.0720, IQ4_XS 0.0760-0.0773, Q3_K
0.150-0.152, Q2_K 0.296-0.299 - each bit fewer doubles it, as for a uniform quantizer; the
ranges are those ±25%."""

LOGIT_BOUND_ANY_TYPE = 0.16
"""``LOGIT_BOUND_VS_FILE`` for every type ``export --type`` offers through llama.cpp. Measured
on this model: q4_1 0.072, q5_0 0.075, q5_1 0.081, iq4_nl 0.078 (their activations go to
Q8_0), the K-quants and iq4_xs 0.098-0.107 (Q8_K); the bound is 1.5x the largest."""

LOGIT_BOUND_VS_F32 = {"q4_k_m": 1.4, "q6_k": 0.38}
"""Max |llama.cpp's logit on our export - the f32 model's|: the type's end-to-end error (the
weights' rounding and llama.cpp's 8-bit activations). Measured 0.913 and 0.249; bounds 1.5x."""


# ------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One torch thread: the models are small and the 2 cores are shared (see test_llama_cpp)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def spm(vocab_dir: Path) -> Tokenizer:
    """llama.cpp's llama-spm test vocabulary (Llama 2's 32000 pieces)."""
    return read_tokenizer(vocab_dir / "ggml-vocab-llama-spm.gguf")


def unit_scale_llama(vocab_size: int, seed: int = 0) -> Llama:
    """A llama whose rows are all multiples of 256 values, with random weights at the scale
    that keeps activations ~1 through every layer: token embeddings N(0, 1), matrices
    N(0, 1/fan_in), norms U(0.5, 1.5). Every tensor then moves the logits; with the training
    init (std 0.02) the blocks barely touch the residual stream and an import error in one of
    them could hide under the bound."""
    cfg = ModelConfig(vocab_size=vocab_size, dim=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_dim=768, max_seq_len=N_CTX, ops="torch")  # fmt: skip
    model = Llama(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                scale = 1.0 if name == "token_embd.weight" else 1 / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


@pytest.fixture(scope="module")
def original(spm: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The f32 model, its export and its logits on ``TEXT``."""
    model = unit_scale_llama(spm.vocab_size)
    path = api.export_gguf(model, spm, tmp_path_factory.mktemp("quantized") / "f32.gguf")
    ids = spm.encode(TEXT, bos=True)
    return {"model": model, "path": path, "ids": ids, "logits": our_logits(model, ids)}


@pytest.fixture(scope="module")
def by_llama_cpp(original: dict[str, Any]) -> dict[str, Path]:
    """type name -> the f32 export quantized by llama.cpp to that type, once, on first use."""
    return _QuantizedByLlamaCpp(original["path"])


class _QuantizedByLlamaCpp(dict[str, Path]):
    def __init__(self, source: Path) -> None:
        super().__init__()
        self.source = source

    def __missing__(self, name: str) -> Path:
        """What ``llama-quantize SOURCE TARGET TYPE`` does, with llama.cpp's default parameters."""
        target = self.source.with_name(f"llama-cpp-{name}.gguf")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = QUANTIZER_TYPES[name]
        status = llama_cpp.llama_model_quantize(
            str(self.source).encode(), str(target).encode(), ctypes.byref(params)
        )
        assert status == 0, f"llama.cpp failed to quantize {self.source} to {name}"
        self[name] = target
        return target


@pytest.fixture(scope="module", params=list(FILE_TYPES))
def quantized(request: pytest.FixtureRequest, by_llama_cpp: dict[str, Path]) -> dict[str, Any]:
    """A file llama.cpp quantized to one type, and llamatrain's import of it."""
    path = by_llama_cpp[request.param]
    model, tokenizer = api.load_gguf(path, ops="torch")
    return {"name": request.param, "path": path, "model": model.eval(), "tokenizer": tokenizer}


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits for every position of ``ids`` (F32 KV cache, no flash attention)."""
    llm = llama_cpp.Llama(
        str(path), n_ctx=N_CTX, logits_all=True, type_k=0, type_v=0, flash_attn=False,
        n_threads=1, n_threads_batch=1, verbose=False,
    )  # fmt: skip
    try:
        return cpp_logits(llm, ids)
    finally:
        llm.close()


_GGML = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
"""llama.cpp's ggml library, as llama-cpp-python ships it: its own GGUF reader and
dequantizers, independent of gguf-py (the package our reader dequantizes with)."""


class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


def _bind(name: str, argtypes: list[Any], restype: Any) -> Any:
    function = getattr(_GGML, name)
    function.argtypes, function.restype = argtypes, restype
    return function


_c, _i64, _size = ctypes.c_void_p, ctypes.c_int64, ctypes.c_size_t
_gguf_init = _bind("gguf_init_from_file", [ctypes.c_char_p, _GGUFInitParams], _c)
_gguf_n_tensors = _bind("gguf_get_n_tensors", [_c], _i64)
_gguf_name = _bind("gguf_get_tensor_name", [_c, _i64], ctypes.c_char_p)
_gguf_type = _bind("gguf_get_tensor_type", [_c, _i64], ctypes.c_int)
_gguf_offset = _bind("gguf_get_tensor_offset", [_c, _i64], _size)
_gguf_size = _bind("gguf_get_tensor_size", [_c, _i64], _size)
_gguf_data_offset = _bind("gguf_get_data_offset", [_c], _size)
_gguf_free = _bind("gguf_free", [_c], None)


def llama_cpp_tensors(path: Path) -> dict[str, tuple[GGMLQuantizationType, np.ndarray]]:
    """Each tensor's type and stored bytes where llama.cpp's own GGUF reader finds them."""
    ctx = _gguf_init(str(path).encode(), _GGUFInitParams(True, None))
    assert ctx, f"llama.cpp cannot read {path}"
    data = np.fromfile(path, dtype=np.uint8)
    try:
        tensors = {}
        for i in range(_gguf_n_tensors(ctx)):
            start = _gguf_data_offset(ctx) + _gguf_offset(ctx, i)
            raw = data[start : start + _gguf_size(ctx, i)]
            tensors[_gguf_name(ctx, i).decode()] = (GGMLQuantizationType(_gguf_type(ctx, i)), raw)
        return tensors
    finally:
        _gguf_free(ctx)


def ggml_dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, n_values: int) -> np.ndarray:
    """llama.cpp's own dequantization of a tensor's bytes (``dequantize_row_<type>``)."""
    name = qtype.name.lower().replace("_k", "_K")  # dequantize_row_q4_K, dequantize_row_iq4_xs
    function = _bind(f"dequantize_row_{name}", [_c, _c, _i64], None)
    out = np.empty(n_values, dtype=np.float32)
    function(np.ascontiguousarray(raw).ctypes.data, out.ctypes.data, n_values)
    return out


# ------------------------------------------------------------------------------------ import


def test_weights_are_llama_cpps_dequantization(
    quantized: dict[str, Any], original: dict[str, Any]
) -> None:
    """Each tensor as imported is, bit for bit, what llama.cpp's own GGUF reader and
    dequantizer and gguf-py's dequantizer make of the file; a quantized one is as far from
    the f32 original as its type makes it."""
    ours = quantized["model"].state_dict()
    f32 = original["model"].state_dict()
    stored = llama_cpp_tensors(quantized["path"])
    assert stored.keys() == ours.keys()
    for name, (qtype, raw) in stored.items():
        imported = ours[name].numpy()
        if qtype == GGMLQuantizationType.F32:
            np.testing.assert_array_equal(imported, f32[name].numpy(), err_msg=name)
            continue
        by_llama_cpp = ggml_dequantize(raw, qtype, imported.size).reshape(imported.shape)
        np.testing.assert_array_equal(imported, by_llama_cpp, err_msg=name)
        by_gguf_py = gguf_quants.dequantize(raw.reshape(imported.shape[0], -1), qtype)
        np.testing.assert_array_equal(imported, by_gguf_py, err_msg=name)
        reference = f32[name].numpy()
        error = np.linalg.norm(imported - reference) / np.linalg.norm(reference)
        low, high = WEIGHT_ERROR_RANGE[qtype.name]
        assert low <= error <= high, f"{name} {qtype.name}: relative error {error:.4f}"
    stored_types = {qtype.name for qtype, _ in stored.values()}
    assert FILE_TYPES[quantized["name"]] in stored_types, (quantized["name"], stored_types)


def test_logits_match_llama_cpp_on_the_same_file(
    quantized: dict[str, Any], original: dict[str, Any]
) -> None:
    ids = original["ids"]
    assert quantized["tokenizer"].encode(TEXT, bos=True) == ids
    theirs = llama_cpp_logits(quantized["path"], ids)
    diff = np.abs(our_logits(quantized["model"], ids) - theirs).max()
    name = quantized["name"]
    assert diff < LOGIT_BOUND_VS_FILE[name], f"{name}: max |Δlogit| = {diff:.3e}"


# ------------------------------------------------------------------------------------ export


@pytest.mark.parametrize("type_name", ["q4_k_m", "q6_k"])
def test_k_quant_export_runs_in_llama_cpp(
    type_name: str,
    original: dict[str, Any],
    spm: Tokenizer,
    by_llama_cpp: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    """q4_k_m through the CLI, q6_k through the API: byte for byte the tensors llama.cpp's
    quantizer makes of the f32 file, typed as asked, and llama.cpp runs the file within the
    type's distance from the f32 model."""
    out = tmp_path / f"model-{type_name}.gguf"
    if type_name == "q4_k_m":
        assert main(["export", str(original["path"]), "-o", str(out), "--type", type_name]) == 0
        assert capsys.readouterr().out.endswith(f" bytes, {type_name})\n")
    else:
        assert api.export_gguf(original["model"], spm, out, type=type_name) == out
    assert sorted(tmp_path.iterdir()) == [out]  # the temporary f32 and quantized files are gone
    assert read_gguf_metadata(out)["general.file_type"] == QUANTIZER_TYPES[type_name]
    exported, direct = llama_cpp_tensors(out), llama_cpp_tensors(by_llama_cpp[type_name])
    assert exported.keys() == direct.keys()
    for name, (qtype, raw) in direct.items():
        assert exported[name][0] == qtype and np.array_equal(exported[name][1], raw), name
    diff = np.abs(llama_cpp_logits(out, original["ids"]) - original["logits"]).max()
    assert diff < LOGIT_BOUND_VS_F32[type_name], f"{type_name}: max |Δlogit| vs f32 = {diff:.3e}"


@pytest.mark.slow
def test_every_quantizer_type_exports_and_imports(
    original: dict[str, Any], spm: Tokenizer, tmp_path: Path
) -> None:
    """Each of the 14 ``QUANTIZER_TYPES`` (~1 min): llama.cpp writes it with its file type, and
    llamatrain's import of the file gives llama.cpp's logits within the measured bound."""
    ids = original["ids"]
    for name, ftype in QUANTIZER_TYPES.items():
        path = api.export_gguf(original["model"], spm, tmp_path / f"{name}.gguf", type=name)
        assert read_gguf_metadata(path)["general.file_type"] == ftype, name
        model, _ = api.load_gguf(path, ops="torch")
        diff = np.abs(our_logits(model.eval(), ids) - llama_cpp_logits(path, ids)).max()
        assert diff < LOGIT_BOUND_ANY_TYPE, f"{name}: max |Δlogit| = {diff:.3e}"


def test_missing_quantizer_is_one_line_naming_the_extra(
    original: dict[str, Any],
    spm: Tokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now fails
    out = tmp_path / "model.gguf"
    assert main(["export", str(original["path"]), "-o", str(out), "--type", "q4_k_m"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'llamatrain[quantize]'" in err, err
    with pytest.raises(ConfigError, match=r"'q6_k' .* pip install 'llamatrain\[quantize\]'"):
        api.export_gguf(original["model"], spm, out, type="q6_k")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_quantization_leaves_the_old_file_and_no_temporaries(
    original: dict[str, Any], spm: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IQ2_XXS needs an importance matrix, so llama.cpp refuses: its reason is the message."""
    monkeypatch.setitem(QUANTIZER_TYPES, "iq2_xxs", 19)  # LLAMA_FTYPE_MOSTLY_IQ2_XXS
    out = tmp_path / "model.gguf"
    out.write_bytes(b"GGUF: the previous export")  # only a GGUF is ever replaced
    with pytest.raises(GGUFError, match="could not quantize the model to iq2_xxs: .*imatrix"):
        api.export_gguf(original["model"], spm, out, type="iq2_xxs")
    assert list(tmp_path.iterdir()) == [out]
    assert out.read_bytes() == b"GGUF: the previous export"
