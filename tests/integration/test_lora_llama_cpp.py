"""LoRA adapters proven against real llama.cpp (``llama_cpp.Llama(base, lora_path=adapter)``).

A small random llama (ggml op set) gets LoRA on all seven projections with random nonzero A
and B (a fresh adapter's B = 0 would prove nothing) and alpha ≠ rank (so a wrong scale
shows). llama.cpp runs the exported base with our adapter file, and its logits must be ours:

* f32 base + adapter: max |Δlogit| measured 8.7e-7 (plain) and 6.1e-7 (biases, tied
  embeddings, head width ≠ dim / heads) on logits up to ~0.7, which the adapter moves by up
  to 1.07 and 0.76; the limit is the issue's 1e-5;
* the merged model (W + s·B·A, ``merge_lora``) exported f32 and run without an adapter:
  measured 1.2e-6 and 7.7e-7, same limit;
* q8_0 base + the same adapter, against our model on the q8_0 file's dequantized weights plus
  the adapter read back from its file: measured 6.0e-3, limit 1.5e-2. That is llama.cpp
  rounding the activations to q8_0 for its quantized matmuls: the two q8_0 bases alone
  already differ by 4.8e-3. Against our f32 model, the q8_0 run differs by 3.4e-2.

(2-core x86 machine, llama-cpp-python 0.3.36, F32 KV cache, no flash attention.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llama_cpp_runs import cpp_logits
from random_models import move_off_neutral, randomly_adapted

from llamatrain import api
from llamatrain.data import SONNETS_PATH
from llamatrain.gguf.adapter import read_lora_adapter, write_lora_adapter
from llamatrain.lora import apply_lora, load_lora_state_dict, merge_lora
from llamatrain.model import Llama, ModelConfig
from llamatrain.tokenizer import SpmTokenizer, train_spm

RANK, ALPHA = 8, 24.0
BASE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=128)
VARIANTS = {
    "plain": {},
    "biases-tied-key_length": dict(
        attention_bias=True, mlp_bias=True, tie_embeddings=True, key_length=24
    ),
}
F32_TOL = 1e-5
Q8_0_TOL = 1.5e-2


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    import llama_cpp

    return llama_cpp


@pytest.fixture(scope="module")
def tokenizer() -> SpmTokenizer:
    return train_spm([SONNETS_PATH], vocab_size=320)


@pytest.fixture(scope="module")
def prompt(tokenizer: SpmTokenizer) -> list[int]:
    return tokenizer.encode(SONNETS_PATH.read_text()[:600], bos=True)[:100]


def random_adapted_model(tokenizer: SpmTokenizer, **variant: Any) -> tuple[Llama, Llama]:
    """(the base, a copy of it with random nonzero LoRA on every target), both in eval mode."""
    torch.manual_seed(0)
    base = Llama(ModelConfig(vocab_size=tokenizer.vocab_size, **{**BASE, **variant})).eval()
    move_off_neutral(base)
    return base, randomly_adapted(base, RANK, ALPHA, std_a=0.2, std_b=0.05)


def our_logits(model: Llama, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].double().numpy()


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpp_applies_our_adapter_and_our_merge_like_we_do(
    llama_cpp: Any, tokenizer: SpmTokenizer, prompt: list[int], tmp_path: Path, variant: str
) -> None:
    base, adapted = random_adapted_model(tokenizer, **VARIANTS[variant])
    base_path = api.export_gguf(base, tokenizer, tmp_path / "base.gguf")
    adapter_path = write_lora_adapter(tmp_path / "adapter.gguf", adapted, alpha=ALPHA)
    ours = our_logits(adapted, prompt)
    assert max_diff(ours, our_logits(base, prompt)) > 0.3  # the adapter matters
    with_adapter = cpp_logits(llama_cpp, base_path, prompt, lora=adapter_path)
    assert max_diff(ours, with_adapter) < F32_TOL, f"{variant}: {max_diff(ours, with_adapter)}"
    merged_path = api.export_gguf(merge_lora(adapted), tokenizer, tmp_path / "merged.gguf")
    merged = cpp_logits(llama_cpp, merged_path, prompt)
    assert max_diff(ours, merged) < F32_TOL, f"{variant} merged: {max_diff(ours, merged)}"


def test_over_a_q8_0_base(
    llama_cpp: Any, tokenizer: SpmTokenizer, prompt: list[int], tmp_path: Path
) -> None:
    """The adapter over a quantized base, against our model on that base's weights as the
    file holds them (what a QLoRA run trains on), read back from the adapter file."""
    base, adapted = random_adapted_model(tokenizer)
    q8_path = api.export_gguf(base, tokenizer, tmp_path / "base-q8_0.gguf", type="q8_0")
    adapter_path = write_lora_adapter(tmp_path / "adapter.gguf", adapted, alpha=ALPHA)
    adapter = read_lora_adapter(adapter_path)
    ours, _ = api.load_gguf(q8_path)
    apply_lora(ours.eval(), adapter.rank, adapter.alpha, targets=adapter.targets)
    load_lora_state_dict(ours, adapter.tensors)
    expected = our_logits(ours, prompt)
    theirs = cpp_logits(llama_cpp, q8_path, prompt, lora=adapter_path)
    assert max_diff(expected, theirs) < Q8_0_TOL, max_diff(expected, theirs)
    without = cpp_logits(llama_cpp, q8_path, prompt)
    assert max_diff(theirs, without) > 0.3  # llama.cpp did apply it
