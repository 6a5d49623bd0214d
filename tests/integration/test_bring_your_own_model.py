"""Bring your own model, end to end, for three real vocabularies, against llama.cpp.

For llama's SPM vocabulary, Llama 3's byte-level BPE and DeepSeek's: a random-weight llama with
that vocabulary (untied with Llama 3.1's ``rope_freqs``, tied, untied) is quantized to Q4_K_M
by llama.cpp itself, then finetuned by ``llamatrain fit --set model.init_from=…`` for a few
dozen steps on a text and exported. llama.cpp must load the export, tokenize the text exactly as
we do, give our f32 logits, and score the text better than the base model it started from.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llama_cpp_files import vocab_dir as vocab_dir  # llama.cpp's vocab files
from llama_cpp_runs import logits_of, open_exact

from llamatrain import api
from llamatrain.data.sources import SONNETS_PATH
from llamatrain.gguf.llama import read_tokenizer
from llamatrain.model import Llama, ModelConfig

MODELS = {
    "llama-spm": dict(rope_freq_factors=True, rope_theta=500000.0),
    "llama-bpe": dict(tie_embeddings=True),
    "deepseek-llm": dict(),
}
"""Vocabulary -> the variant its random base model takes."""
SHAPE = dict(dim=256, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=512, max_seq_len=256)
"""Small, with every row a multiple of 256 so that llama.cpp's K-quants apply to each matrix."""
LOGIT_TOL = 1e-5
"""Max |Δlogit|, f32 export vs our model, llama.cpp with an F32 KV cache, ~150–180 tokens: the
finetuned logits reach 7–8.5; measured 3.8e-6 (llama-spm), 4.8e-6 (llama-bpe), 4.8e-6
(deepseek-llm)."""


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    import llama_cpp

    return llama_cpp


def quantized_base(llama_cpp: Any, vocab: Path, folder: Path, **variant: Any) -> Path:
    """A random llama with ``vocab``'s tokenizer, written f16 and quantized by llama.cpp."""
    tokenizer = read_tokenizer(vocab)
    torch.manual_seed(0)
    model = Llama(ModelConfig(vocab_size=tokenizer.vocab_size, **SHAPE, **variant))
    if model.rope_freqs is not None:  # Llama 3.1's shape: 1 for the fast pairs, 8 for the slow
        model.rope_freqs.weight.copy_(torch.linspace(1.0, 8.0, model.rope_freqs.weight.numel()))
    f16 = api.export_gguf(model, tokenizer, folder / "base-f16.gguf", type="f16")
    out = folder / "base-q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params) == 0
    return out


def mean_nll(logits: np.ndarray, ids: list[int]) -> float:
    """Mean next-token negative log-likelihood of ``ids`` under ``logits`` (llama.cpp's)."""
    z = logits[:-1] - logits[:-1].max(axis=1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(ids) - 1), ids[1:]].mean())


# 17 s, 48 s, 41 s on 2 cores: the SPM vocabulary in the default suite, the two BPE ones slow
@pytest.mark.parametrize(
    "vocab", [v if v == "llama-spm" else pytest.param(v, marks=pytest.mark.slow) for v in MODELS]
)
def test_finetune_a_llama_cpp_quantized_model_and_run_it_in_llama_cpp(
    llama_cpp: Any,
    vocab_dir: Path,
    tiny_overrides,
    tmp_path: Path,
    vocab: str,
) -> None:
    base = quantized_base(
        llama_cpp, vocab_dir / f"ggml-vocab-{vocab}.gguf", tmp_path, **MODELS[vocab]
    )
    overrides = tiny_overrides(**{
        "model.init_from": f'"{base}"', "train.steps": 24, "train.n_batch": 128,
        "optim.warmup_steps": 4, "optim.cos_decay_steps": 20, "train.eval_every": 0,
        "train.save_every": 0, "train.sample_tokens": 0, "output.export_type": '"f32"',
    })  # fmt: skip
    result = api.fit("tiny", overrides=overrides, progress=False)
    text = SONNETS_PATH.read_text()[:600]

    finetuned = open_exact(llama_cpp, result.export_path)
    base_llm = open_exact(llama_cpp, base)
    try:
        ids = result.tokenizer.encode(text, bos=True)
        theirs = finetuned.tokenize(text.encode(), add_bos=True, special=False)
        assert theirs == ids, f"{vocab}: llama.cpp tokenizes the text differently"
        ids = ids[:200]
        logits = logits_of(finetuned, ids)
        model, _ = api.load_gguf(result.export_path)
        with torch.no_grad():
            ours = model(torch.tensor([ids]))[0].double().numpy()
        diff = np.abs(ours - logits).max()
        assert diff < LOGIT_TOL, f"{vocab}: max |Δlogit| {diff:.2e}"
        before, after = mean_nll(logits_of(base_llm, ids), ids), mean_nll(logits, ids)
    finally:
        finetuned.close()
        base_llm.close()
    # measured: 10.38 -> 7.35 (llama-spm), 11.83 -> 8.25 (llama-bpe), 11.54 -> 7.62 (deepseek)
    assert after < before - 1.0, f"{vocab}: llama.cpp's loss {before:.3f} -> {after:.3f}"
    assert before > 0.5 * math.log(result.tokenizer.vocab_size)  # the base knew nothing
