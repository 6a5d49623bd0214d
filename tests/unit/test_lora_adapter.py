"""llama.cpp's LoRA adapter GGUF (``llamatrain.gguf.adapter``): what is written, what reads back.

The keys and their GGUF types, the tensor names and shapes are those llama.cpp's adapter
loader checks (its acceptance of the file, and the logits it then computes, are proven in
tests/integration/test_lora_llama_cpp.py); reading gives back exactly the model's adapter
tensors, and a file that is not a usable adapter is one GGUFError.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFValueType

from llamatrain.errors import ConfigError, GGUFError
from llamatrain.gguf.adapter import read_lora_adapter, write_lora_adapter
from llamatrain.gguf.file import read_gguf
from llamatrain.gguf.write import write_gguf
from llamatrain.lora import apply_lora, lora_state_dict
from llamatrain.model import Llama, ModelConfig

SMALL = dict(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
BASE_KEYS = {
    "general.name": "Base-Llama",
    "general.license": "apache-2.0",
    "general.file_type": np.uint32(7),  # describes the base's file: not the adapter's
    "tokenizer.chat_template": "{{ messages }}",  # a vocabulary key: not the adapter's
}


def adapted(targets: tuple[str, ...] = ("attn_q", "attn_v", "ffn_down")) -> Llama:
    torch.manual_seed(0)
    model = apply_lora(Llama(ModelConfig(**SMALL)), rank=4, alpha=12.0, targets=targets)
    with torch.no_grad():
        for tensor in lora_state_dict(model).values():
            tensor.normal_()
    return model


def test_the_file_says_what_llama_cpp_checks(tmp_path: Path) -> None:
    path = write_lora_adapter(tmp_path / "a.gguf", adapted(), alpha=12.0, inherited=BASE_KEYS)
    contents = read_gguf(path)
    meta, types = contents.metadata, contents.value_types
    assert meta["general.type"] == "adapter" and meta["adapter.type"] == "lora"
    assert meta["general.architecture"] == "llama"
    assert meta["adapter.lora.alpha"] == 12.0
    assert types["adapter.lora.alpha"] == (GGUFValueType.FLOAT32, None)
    assert meta["general.name"] == "Base-Llama" and meta["general.license"] == "apache-2.0"
    assert "general.file_type" not in meta and "tokenizer.chat_template" not in meta
    expected = {
        f"blk.{i}.{t}.weight.lora_{ab}"
        for i in range(2)
        for t in ("attn_q", "attn_v", "ffn_down")
        for ab in "ab"
    }
    assert set(contents.tensors) == expected
    assert set(contents.tensor_types.values()) == {"F32"}
    # torch (row-major) shapes: A (r, in), B (out, r) — ggml's ne [in, r] and [r, out]
    assert contents.tensors["blk.0.attn_v.weight.lora_a"].shape == (4, 32)
    assert contents.tensors["blk.0.attn_v.weight.lora_b"].shape == (16, 4)
    assert contents.tensors["blk.1.ffn_down.weight.lora_a"].shape == (4, 48)


def test_reads_back_the_models_adapter(tmp_path: Path) -> None:
    model = adapted()
    path = write_lora_adapter(tmp_path / "a.gguf", model, alpha=12.0, inherited=BASE_KEYS)
    adapter = read_lora_adapter(path)
    assert (adapter.alpha, adapter.rank, adapter.architecture) == (12.0, 4, "llama")
    assert adapter.targets == ("attn_q", "attn_v", "ffn_down")
    assert adapter.inherited == {"general.name": "Base-Llama", "general.license": "apache-2.0"}
    expected = lora_state_dict(model)
    assert adapter.tensors.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(adapter.tensors[name], tensor), name


def test_a_missing_alpha_reads_as_llama_cpps_scale_one(tmp_path: Path) -> None:
    tensors = {
        "blk.0.attn_q.weight.lora_a": (torch.ones(4, 32), "f32"),
        "blk.0.attn_q.weight.lora_b": (torch.ones(32, 4), "f32"),
    }
    kind = {"general.type": "adapter", "adapter.type": "lora"}
    path = write_gguf(tmp_path / "a.gguf", "llama", kind, tensors)
    adapter = read_lora_adapter(path)
    assert adapter.alpha / adapter.rank == 1.0


def test_refuses_to_write_what_is_not_an_adapter(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no LoRA adapters to write; apply_lora"):
        write_lora_adapter(tmp_path / "a.gguf", Llama(ModelConfig(**SMALL)), alpha=8.0)
    with pytest.raises(ConfigError, match="lora.alpha = 0.0 must be positive"):
        write_lora_adapter(tmp_path / "a.gguf", adapted(), alpha=0.0)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def _foreign(tmp_path: Path, tensors: dict[str, torch.Tensor], **meta: object) -> Path:
    metadata = {"general.type": "adapter", "adapter.type": "lora", **meta}
    to_write = {name: (tensor, "f32") for name, tensor in tensors.items()}
    return write_gguf(tmp_path / "foreign.gguf", "llama", metadata, to_write)


A, B = "blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b"


@pytest.mark.parametrize(
    ("tensors", "meta", "message"),
    [
        ({A: torch.ones(4, 32)}, {}, "LoRA pair blk.0.attn_q has no lora_b"),
        ({A: torch.ones(4, 32), B: torch.ones(32, 2)}, {}, r"A \(4, 32\) and B \(32, 2\)"),
        (
            {A: torch.ones(4, 32), B: torch.ones(32, 4), "blk.0.attn_norm.weight": torch.ones(32)},
            {},
            "tensor blk.0.attn_norm.weight is not a LoRA A/B tensor",
        ),
        (
            {A: torch.ones(4, 32), B: torch.ones(32, 4),
             "blk.0.attn_k.weight.lora_a": torch.ones(2, 32),
             "blk.0.attn_k.weight.lora_b": torch.ones(16, 2)},
            {},
            r"ranks \[2, 4\]",
        ),
        ({A: torch.ones(4, 32), B: torch.ones(32, 4)}, {"adapter.type": "cvec"}, "not a LoRA"),
    ],
)  # fmt: skip
def test_refuses_to_read_what_is_not_a_usable_adapter(
    tmp_path: Path, tensors: dict, meta: dict, message: str
) -> None:
    path = _foreign(tmp_path, tensors, **meta)
    with pytest.raises(GGUFError, match=message) as error:
        read_lora_adapter(path)
    assert "\n" not in str(error.value)


def test_a_model_file_is_not_an_adapter(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "m.gguf", "llama", {}, {"token_embd.weight": (torch.ones(4, 4), "f32")}
    )
    with pytest.raises(GGUFError, match=r"is not a LoRA adapter \(general.type = None"):
        read_lora_adapter(path)
