"""The families beyond llama (qwen2, qwen3, smollm3, gemma3) from files llama.cpp quantized,
proven in llama.cpp itself: the import, and a finetune from such a file (issue 28).

Import. A random model of each family, at the scale test_quantized_import uses for llama
(every row a multiple of 256 values; the residual stream enters the first block at ~N(0, 1),
logits come out ~N(0, 1), norms U(0.5, 1.5), biases N(0, 0.1)), is exported f32 by llamatrain
and quantized by llama.cpp: Q4_K_M through our own export path (``export_gguf(type="q4_k_m")``,
which calls ``llama_model_quantize``) and Q8_0 through ``llama_model_quantize`` directly.
``load_gguf`` must give, tensor for tensor, what llama.cpp's own dequantizer (``ggml``, through
ctypes) makes of the stored bytes, and llama.cpp's logits on the same file within
:data:`LOGIT_BOUND`.

Finetune. A default-init model of each family on the tiny config's vocabulary is written f16
and quantized to Q4_K_M by llama.cpp; ``fit --set model.init_from=<that file>`` trains a QLoRA
adapter over it (``lora.base_dtype = "quantized"``: the base stays in its blocks) and, in the
slow set, a full finetune from it. llama.cpp must tokenize the text as we do and score it better
than the base: through our adapter over the quantized file (``--lora``) and through the merged
f32 export (as tests/integration/test_bring_your_own_model.py does for llama).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from llama_cpp_runs import cpp_logits, logits_of, open_exact
from test_bring_your_own_model import mean_nll
from test_quantized_import import ggml_dequantize, llama_cpp_tensors

from llamatrain import api
from llamatrain.build import build_tokenizer
from llamatrain.config import load_config
from llamatrain.data import SONNETS_PATH, resolve_inputs
from llamatrain.gguf.file import read_gguf
from llamatrain.model import Llama, ModelConfig
from llamatrain.tokenizer import Tokenizer

FAMILIES = ("qwen2", "qwen3", "smollm3", "gemma3")
SHAPE = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, max_seq_len=64)
"""Rows of 256 and 512 values, so llama.cpp's K-quants apply to every matrix."""
VARIANTS: dict[str, dict[str, Any]] = {
    "qwen2": dict(arch="qwen2", tie_embeddings=True),
    "qwen3": dict(arch="qwen3", key_length=128),  # heads 4 x 128 = 512 != dim
    "smollm3": dict(arch="smollm3", n_layers=4, tie_embeddings=True, rope_theta=2e6),  # NoPE 4th
    "gemma3": dict(
        arch="gemma3", n_layers=6, sliding_window=16, rope_theta=1e6, rope_theta_swa=1e4,
        tie_embeddings=True,
    ),  # 5 sliding-window layers, then a full one; 40-64 tokens pass the window
}  # fmt: skip

LOGIT_BOUND = {"qwen2": 0.15, "qwen3": 0.15, "smollm3": 0.15, "gemma3": 0.25}
"""Max |our logit - llama.cpp's| on the same quantized file, Q4_K_M and Q8_0 alike.

0.15 is the llama suite's bound for Q4_K_M on the same kind of model
(test_quantized_import.LOGIT_BOUND_VS_FILE, measured 0.098 on its 2-layer llama; its Q8_0
bound, test_llama_cpp.TOL_VS_FILE, is 0.5): not zero because llama.cpp's CPU kernels round the
activations to 8 bits (Q8_K, Q8_0) for quantized matmuls. Measured here (64 tokens, 2 shared
cores, llama-cpp-python 0.3.36), Q4_K_M / Q8_0: qwen2 0.078 / 0.057, qwen3 0.083 / 0.051,
smollm3 0.103 / 0.070, gemma3 0.138 / 0.096 (seeds 1-3: 0.136-0.155 / 0.097-0.125). The error
grows with depth, and gemma3 needs 6 layers to have a full-attention one: a 6-layer llama of
the same construction measures 0.127-0.140 / 0.081-0.101, so gemma3's bound is 1.5x its
largest measure over four seeds. gemma3's float16 GELU table in llama.cpp (test_gemma3) is not
the cause: a reference with the table moves it by 0.001. An import error shows in the weight
check, which is exact."""

TEXT = SONNETS_PATH.read_text()[:600]
QLORA_DROP = 0.3
"""llama.cpp's mean NLL on the text must fall by this much after 16 QLoRA steps (rank 8 on
every projection, the head and embeddings frozen), through our adapter over the quantized file.
Measured: 6.00 -> 5.40 (qwen2), 5.95 -> 5.43 (qwen3), 6.03 -> 5.40 (smollm3), 5.99 -> 5.40
(gemma3); the base scores about log(384) = 5.95. The merged f32 export scores within 0.001 of
the adapter."""
FULL_DROP = 1.0
"""The same after 24 full-finetune steps (merged export), test_bring_your_own_model's margin.
Measured: 6.00 -> 4.52 (qwen2), 5.95 -> 4.32 (qwen3), 6.03 -> 4.51 (smollm3), 5.99 -> 4.36
(gemma3)."""
MERGED_TOL = {"qwen2": 1e-5, "qwen3": 1e-5, "smollm3": 2e-5, "gemma3": 5e-3}
"""Max |Δlogit| between the finetuned model and llama.cpp on its merged f32 export: the issue's
1e-5 (measured 7e-7 to 3.8e-6), and for gemma3 the bound of llama.cpp's float16 GELU table
(test_gemma3.GELU_TOL; measured 3.6e-5 after QLoRA, 5.1e-4 after the full finetune).
smollm3's QLoRA run measured 1.09e-5 (logits up to 1.94) once its vocabulary tables were kept
as stored: its training then goes through the table head (``ops.table_head``), whose
rounding differs from the dense head's by ~1e-7 a step, so it ends at a slightly different
adapter; our forward with the tables as blocks is bit for bit the forward with them decoded
(0.0 on these logits), so the gap is llama.cpp's float32 arithmetic against ours on that
model (qwen2, qwen3: 1.3e-6)."""


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One torch thread: the models are small and the 2 cores are shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    import llama_cpp

    return llama_cpp


@pytest.fixture(scope="module")
def tokenizer(cache_dir: Path) -> Tokenizer:
    """The tiny config's vocabulary (384 sentencepiece BPE pieces trained on the sonnets)."""
    cfg = load_config("tiny", [f'data.cache_dir="{cache_dir}"'])
    return build_tokenizer(cfg, resolve_inputs(cfg.data.path, cfg.data.cache_dir))


def family_config(arch: str, vocab_size: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, **{**SHAPE, **VARIANTS[arch]})


@torch.no_grad()
def unit_scale(cfg: ModelConfig, seed: int = 0) -> Llama:
    """test_quantized_import's unit-scale llama for any family: matrices N(0, 1/fan_in), norms
    U(0.5, 1.5), biases N(0, 0.1); the first block sees ~N(0, 1) (gemma3 multiplies its
    embeddings by sqrt(dim), so they are N(0, 1/dim) there) and the logits are ~N(0, 1) (a tied
    head over N(0, 1) embeddings has its output norm divided by sqrt(dim))."""
    model = Llama(dataclasses.replace(cfg, ops="torch")).eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        elif p.dim() == 1:
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        elif name == "token_embd.weight" and cfg.arch != "gemma3":
            p.copy_(torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    if cfg.tie_embeddings and cfg.arch != "gemma3":
        model.output_norm.weight.div_(math.sqrt(cfg.dim))
    return model


def logits(model: Llama, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor([ids]))[0].double().numpy()


def quantize_with_llama_cpp(llama_cpp: Any, source: Path, target: Path, ftype: int) -> Path:
    """``llama-quantize SOURCE TARGET FTYPE`` with llama.cpp's default parameters."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    status = llama_cpp.llama_model_quantize(
        str(source).encode(), str(target).encode(), ctypes.byref(params)
    )
    assert status == 0, f"llama.cpp failed to quantize {source}"
    return target


# ---- a file llama.cpp quantized imports -------------------------------------------------------


@pytest.mark.parametrize("type_name", ["q4_k_m", "q8_0"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_a_llama_cpp_quantized_family_file_imports(
    llama_cpp, tokenizer, tmp_path: Path, arch: str, type_name: str
) -> None:
    model = unit_scale(family_config(arch, tokenizer.vocab_size))
    if type_name == "q4_k_m":  # our export path: llama.cpp's quantizer behind export_gguf
        path = api.export_gguf(model, tokenizer, tmp_path / "q4_k_m.gguf", type="q4_k_m")
    else:
        f32 = api.export_gguf(model, tokenizer, tmp_path / "f32.gguf")
        path = quantize_with_llama_cpp(llama_cpp, f32, tmp_path / "q8_0.gguf", 7)  # MOSTLY_Q8_0
    main_type = {"q4_k_m": "Q4_K", "q8_0": "Q8_0"}[type_name]
    assert read_gguf(path).tensor_types["blk.0.attn_q.weight"] == main_type
    imported, _ = api.load_gguf(path, ops="torch")
    assert imported.cfg.architecture() == model.cfg.architecture()

    ours, f32_state = imported.state_dict(), model.state_dict()
    stored = llama_cpp_tensors(path)
    assert stored.keys() == ours.keys()  # a tied head: no output.weight in the file or model
    for name, (qtype, raw) in stored.items():
        tensor = ours[name].numpy()
        if qtype == GGMLQuantizationType.F32:
            np.testing.assert_array_equal(tensor, f32_state[name].numpy(), err_msg=name)
        else:
            by_ggml = ggml_dequantize(raw, qtype, tensor.size).reshape(tensor.shape)
            np.testing.assert_array_equal(tensor, by_ggml, err_msg=f"{name} {qtype.name}")

    ids = tokenizer.encode(TEXT, bos=True)[:64]
    theirs = cpp_logits(llama_cpp, path, ids, n_ctx=64)
    diff = np.abs(logits(imported, ids) - theirs).max()
    assert diff < LOGIT_BOUND[arch], f"{arch} {type_name}: max |Δlogit| = {diff:.3e}"


# ---- finetune from a llama.cpp-quantized file, scored by llama.cpp ---------------------------


def quantized_base(llama_cpp: Any, tokenizer: Tokenizer, folder: Path, arch: str) -> Path:
    """A default-init model of the family, written f16 and quantized to Q4_K_M by llama.cpp
    (what a downloaded ``*-Q4_K_M.gguf`` is)."""
    torch.manual_seed(0)
    model = Llama(family_config(arch, tokenizer.vocab_size))
    f16 = api.export_gguf(model, tokenizer, folder / "base-f16.gguf", type="f16")
    out = quantize_with_llama_cpp(
        llama_cpp, f16, folder / "base-q4_k_m.gguf", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    )
    assert read_gguf(out).metadata["general.architecture"] == arch
    return out


def finetune_and_score(
    llama_cpp: Any, tokenizer: Tokenizer, tiny_overrides, folder: Path, arch: str, mode: str
) -> dict[str, float]:
    """Fit from the quantized base; llama.cpp's mean NLL of the text under the base, the base
    with the run's adapter (QLoRA) and the merged export."""
    base = quantized_base(llama_cpp, tokenizer, folder, arch)
    steps = {"qlora": 16, "full": 24}[mode]
    values: dict[str, object] = {
        "model.init_from": f'"{base}"', "train.steps": steps, "train.n_batch": 128,
        "optim.warmup_steps": 2, "optim.cos_decay_steps": steps, "train.eval_every": 0,
        "train.save_every": 0, "train.sample_tokens": 0, "output.export_type": '"f32"',
    }  # fmt: skip
    if mode == "qlora":
        values.update({
            "lora.rank": 8, "lora.alpha": 16.0, "lora.base_dtype": '"quantized"',
            "optim.lr": 3e-2, "train.dtype": '"float32"',  # MERGED_TOL's runs (auto: bf16 on AMX)
        })  # fmt: skip
    result = api.fit("tiny", overrides=tiny_overrides(**values), progress=False)
    assert result.model.cfg.arch == arch
    assert (result.adapter_path is not None) == (mode == "qlora")

    ids = result.tokenizer.encode(TEXT, bos=True)
    runs = {"base": (base, None), "merged": (result.export_path, None)}
    if mode == "qlora":
        runs["adapter"] = (base, result.adapter_path)
    scores = {}
    for name, (path, lora) in runs.items():
        llm = open_exact(llama_cpp, path, lora=lora)
        try:
            theirs = llm.tokenize(TEXT.encode(), add_bos=True, special=False)
            assert theirs == ids, f"{arch}: llama.cpp tokenizes the text differently"
            cpp = logits_of(llm, ids[:200])
        finally:
            llm.close()
        scores[name] = mean_nll(cpp, ids[:200])
        if name == "merged":
            diff = np.abs(logits(result.model, ids[:200]) - cpp).max()
            assert diff < MERGED_TOL[arch], f"{arch} {mode}: merged max |Δlogit| {diff:.2e}"
    assert scores["base"] > 0.95 * math.log(tokenizer.vocab_size)  # the base knew nothing
    return scores


@pytest.mark.parametrize(
    "arch", [*FAMILIES[:3], pytest.param("gemma3", marks=pytest.mark.slow)]
)  # ~5 s each; gemma3's 6 layers ~20 s
@pytest.mark.usefixtures("decoded_products")  # MERGED_TOL: float32 products, no 8-bit x
def test_qlora_from_a_llama_cpp_quantized_file_lowers_llama_cpps_nll(
    llama_cpp, tokenizer, tiny_overrides, tmp_path: Path, arch: str
) -> None:
    scores = finetune_and_score(llama_cpp, tokenizer, tiny_overrides, tmp_path, arch, "qlora")
    before, adapted, merged = scores["base"], scores["adapter"], scores["merged"]
    assert adapted < before - QLORA_DROP, f"{arch}: with adapter {before:.3f} -> {adapted:.3f}"
    assert abs(merged - adapted) < 0.02, f"{arch}: adapter {adapted:.4f}, merged {merged:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", FAMILIES)
def test_full_finetune_from_a_llama_cpp_quantized_file_lowers_llama_cpps_nll(
    llama_cpp, tokenizer, tiny_overrides, tmp_path: Path, arch: str
) -> None:
    scores = finetune_and_score(llama_cpp, tokenizer, tiny_overrides, tmp_path, arch, "full")
    before, after = scores["base"], scores["merged"]
    assert after < before - FULL_DROP, f"{arch}: llama.cpp's NLL {before:.3f} -> {after:.3f}"
