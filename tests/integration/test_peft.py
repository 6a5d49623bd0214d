"""PEFT adapter folders (``llamatrain.hf.peft``), proven by PEFT and transformers themselves.

A small random llama (GQA, attention and MLP biases) gets LoRA on all seven projections with
random nonzero A and B and alpha ≠ rank; its base is exported as an HF folder
(``api.export_hf``), its adapters as a PEFT folder. ``PeftModel.from_pretrained`` over
transformers' ``LlamaForCausalLM`` of the base must give our logits: measured max |Δlogit|
1.4e-6 on logits up to 0.75 that the adapter moves by 1.03; limit 1e-5 (test_hf.py's: float32
rounding in another order). The q/k rows of B matter: left in our adjacent-pair order, the
logits move by 1.2 (asserted: > 1e-3). The vocabulary is llama.cpp's deepseek-coder
(byte-level BPE, 32256 tokens), only because an HF export needs a byte-level BPE one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from llama_cpp_files import vocab_dir as vocab_dir  # llama.cpp's vocab files
from peft import PeftModel
from random_models import move_off_neutral, randomly_adapted
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from llamatrain import api
from llamatrain.errors import CheckpointError, ConfigError
from llamatrain.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_peft_adapter
from llamatrain.lora import lora_state_dict
from llamatrain.model import Llama, ModelConfig
from llamatrain.tokenizer import Tokenizer

RANK, ALPHA = 4, 12.0
TOL = 1e-5
SHAPE = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=128,
    attention_bias=True, mlp_bias=True, tie_embeddings=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(vocab_dir: Path) -> Tokenizer:
    return api.load_tokenizer(vocab_dir / "ggml-vocab-deepseek-coder.gguf")


def base_and_adapted(tokenizer: Tokenizer) -> tuple[Llama, Llama]:
    torch.manual_seed(0)
    base = Llama(ModelConfig(vocab_size=tokenizer.vocab_size, **SHAPE)).eval()
    move_off_neutral(base, norms=False)
    return base, randomly_adapted(base, RANK, ALPHA, std_a=0.3, std_b=0.1)


def peft_logits(base_folder: Path, adapter_folder: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = LlamaForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    model = PeftModel.from_pretrained(hf, adapter_folder).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits[0]


def test_peft_loads_our_adapter_onto_our_hf_export(tokenizer: Tokenizer, tmp_path: Path) -> None:
    base, adapted = base_and_adapted(tokenizer)
    base_folder = api.export_hf(base, tokenizer, tmp_path / "base")
    adapter = write_peft_adapter(
        tmp_path / "adapter", adapted.state_dict(), adapted.cfg, alpha=ALPHA
    )
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    ids = torch.tensor([tokenizer.encode("def fib(n):\n    return n if n < 2 else fib(n - 1)")])
    with torch.no_grad():
        ours, ours_base = adapted(ids)[0], base(ids)[0]
    theirs = peft_logits(base_folder, adapter, ids)
    assert (ours - ours_base).abs().max() > 0.3  # the adapter matters
    torch.testing.assert_close(theirs, ours, atol=TOL, rtol=TOL)
    # q/k B rows left in our (adjacent-pair) order would not do: same files, one change
    weights, ours_b = load_file(adapter / ADAPTER_WEIGHTS), lora_state_dict(adapted)
    for layer in range(adapted.cfg.n_layers):
        for hf_module, module in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
            name = f"base_model.model.model.layers.{layer}.self_attn.{hf_module}.lora_B.weight"
            assert name in weights
            weights[name] = ours_b[f"blk.{layer}.{module}.lora_b"]
    save_file(weights, adapter / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    assert (peft_logits(base_folder, adapter, ids) - ours).abs().max() > 100 * TOL


def test_refusals(tokenizer: Tokenizer, tmp_path: Path) -> None:
    base, adapted = base_and_adapted(tokenizer)
    with pytest.raises(ConfigError, match="no LoRA adapters to write"):
        write_peft_adapter(tmp_path / "a", base.state_dict(), base.cfg, alpha=ALPHA)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("someone's")
    with pytest.raises(CheckpointError, match="not an empty folder"):
        write_peft_adapter(occupied, adapted.state_dict(), adapted.cfg, alpha=ALPHA)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["occupied"]  # nothing left behind
    empty = tmp_path / "empty"
    empty.mkdir()
    written = write_peft_adapter(empty, adapted.state_dict(), adapted.cfg, alpha=ALPHA)
    assert sorted(p.name for p in written.iterdir()) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
