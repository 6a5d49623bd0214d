"""``lora.init_from``: a run's adapters start from an adapter file (an SFT warm-up's before GRPO),
so the model computes what base + that adapter computes, whatever the run's alpha."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from user_errors import error_of

from llamatrain.build import start_adapters_from
from llamatrain.config import LoraSection, load_config
from llamatrain.gguf.adapter import write_lora_adapter
from llamatrain.lora import apply_lora, lora_state_dict
from llamatrain.model import Llama, ModelConfig

SMALL = dict(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
TARGETS = ["attn_q", "attn_v", "ffn_down"]


def base() -> Llama:
    torch.manual_seed(0)
    return Llama(ModelConfig(**SMALL))


@pytest.fixture
def adapter(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """An adapter file (rank 4, alpha 12, random A and B) and the logits base + it gives."""
    model = apply_lora(base(), rank=4, alpha=12.0, targets=TARGETS)
    with torch.no_grad():
        for tensor in lora_state_dict(model).values():
            tensor.normal_(std=0.1)
    tokens = torch.arange(10).unsqueeze(0)
    path = write_lora_adapter(tmp_path / "sft.gguf", model, alpha=12.0)
    return path, model(tokens)[0]


def test_the_adapters_start_as_the_files_at_any_alpha(adapter):
    path, expected = adapter
    for alpha in (12.0, 32.0):
        lora = LoraSection(rank=4, alpha=alpha, targets=TARGETS, init_from=str(path))
        model = apply_lora(base(), rank=4, alpha=alpha, targets=TARGETS)
        start_adapters_from(model, lora)
        got = model(torch.arange(10).unsqueeze(0))[0]
        assert torch.allclose(got, expected, atol=1e-5, rtol=0), alpha


def test_an_adapter_of_another_rank_or_targets_is_refused(adapter):
    path, _ = adapter
    lora = LoraSection(rank=8, alpha=16.0, targets=TARGETS, init_from=str(path))
    model = apply_lora(base(), rank=8, alpha=16.0, targets=TARGETS)
    assert "has rank 4 but lora.rank = 8; set lora.rank = 4" in error_of(
        start_adapters_from, model, lora
    )
    lora = LoraSection(rank=4, alpha=16.0, targets=["attn_q"], init_from=str(path))
    model = apply_lora(base(), rank=4, alpha=16.0, targets=["attn_q"])
    message = error_of(start_adapters_from, model, lora)
    assert "adapts attn_q, attn_v, ffn_down but the run adapts attn_q" in message


def test_the_config_wants_a_file_and_a_rank(adapter, tmp_path, monkeypatch):
    path, _ = adapter
    model = ["model.init_from=base.gguf"]
    refused = error_of(load_config, None, [*model, f"lora.init_from={path}"])
    assert "needs lora.rank > 0" in refused
    missing = [*model, "lora.rank=4", f"lora.init_from={tmp_path / 'none.gguf'}"]
    assert "is not a file; name an adapter GGUF" in error_of(load_config, None, missing)
    monkeypatch.chdir(path.parent)
    cfg = load_config(None, [*model, "lora.rank=4", f"lora.init_from={path.name}"])
    assert cfg.lora.init_from == str(path)  # absolute: a resume from elsewhere reads it too
