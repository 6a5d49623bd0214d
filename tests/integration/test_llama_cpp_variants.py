"""The llama-architecture variants llama.cpp's ``llama`` loader accepts, proven against it.

Models people bring differ from the plain llama in ways llama.cpp's loader reads from the file:
a head width other than dim / n_heads (``attention.key_length``), q/k/v/o and feed-forward
biases, linear rope scaling, Llama 3.1's ``rope_freqs.weight`` frequency factors and tied
embeddings. For each, a random-weight model (norms, biases and factors away from their neutral
values, so a dropped or misread one would show) is exported, llama.cpp runs it, and its logits
must match ours; the file must read back into the same config. A finetune of a base file keeps
the base's own keys (name, license, chat template, extra token ids) with their GGUF types.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llama_cpp_runs import cpp_logits
from random_models import move_off_neutral

from llamatrain import api
from llamatrain.gguf.file import read_gguf
from llamatrain.gguf.llama import read_model, write_model
from llamatrain.model import Llama, ModelConfig
from llamatrain.tokenizer import SpmTokenizer, train_spm

TEXT = "\n".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times."
    for i in range(400)
)
BASE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=128)
VARIANTS: dict[str, dict[str, Any]] = {
    "key_length": dict(key_length=32),  # heads 32 wide, q is 128 wide in a 64-wide model
    "biases": dict(attention_bias=True, mlp_bias=True),
    "linear_rope": dict(rope_scaling_factor=4.0),
    "rope_freqs": dict(rope_freq_factors=True, rope_theta=500000.0),
    "tied": dict(tie_embeddings=True),
    "everything": dict(key_length=24, attention_bias=True, rope_freq_factors=True,
                       rope_scaling_factor=2.0, tie_embeddings=True, n_kv_heads=1),
}  # fmt: skip
TOL = 2e-6
"""Max |Δlogit| to llama.cpp (F32 weights and KV cache, no flash attention) on these random
models, whose logits reach 0.5–1.5: measured 1.8e-7–4.8e-7 (llama.cpp builds rope angles in
float32, ours in float64; the rest is summation order); the limit leaves ~4x margin."""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> SpmTokenizer:
    corpus = tmp_path_factory.mktemp("variants") / "corpus.txt"
    corpus.write_text(TEXT)
    return train_spm([corpus], vocab_size=320)


def random_model(tokenizer: SpmTokenizer, seed: int = 0, **variant: Any) -> Llama:
    """A random llama whose 1-D tensors (norms, biases, rope factors) are far from neutral."""
    torch.manual_seed(seed)
    model = Llama(ModelConfig(vocab_size=tokenizer.vocab_size, **{**BASE, **variant}))
    return move_off_neutral(model).eval()


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    import llama_cpp

    return llama_cpp


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpp_runs_the_variant_like_we_do(
    llama_cpp: Any, tokenizer: SpmTokenizer, tmp_path: Path, variant: str
) -> None:
    model = random_model(tokenizer, **VARIANTS[variant])
    path = api.export_gguf(model, tokenizer, tmp_path / f"{variant}.gguf")
    ids = tokenizer.encode(TEXT[:400], bos=True)[:100]
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0].double().numpy()
    theirs = cpp_logits(llama_cpp, path, ids)
    diff = np.abs(ours - theirs).max()
    assert diff < TOL, f"{variant}: max |Δlogit| = {diff:.2e}"
    assert np.abs(ours).max() > 0.3  # the comparison is not between two near-zero outputs


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_reads_back_into_the_same_model(
    tokenizer: SpmTokenizer, tmp_path: Path, variant: str
) -> None:
    model = random_model(tokenizer, **VARIANTS[variant])
    path = api.export_gguf(model, tokenizer, tmp_path / "m.gguf")
    read = read_model(path)
    assert read.config.architecture() == model.cfg.architecture()
    for name, tensor in model.state_dict().items():
        assert torch.equal(read.tensors[name], tensor), name


def test_a_file_without_our_config_key_gives_the_same_variant(
    tokenizer: SpmTokenizer, tmp_path: Path
) -> None:
    """llama.cpp's files carry no llamatrain.model_config: the llama.* keys and the tensors
    alone must say everything."""
    model = random_model(tokenizer, **VARIANTS["everything"])
    path = api.export_gguf(model, tokenizer, tmp_path / "m.gguf")
    data = path.read_bytes().replace(b"llamatrain.model_config", b"llamatrain.model_confiX")
    (tmp_path / "foreign.gguf").write_bytes(data)
    read = read_model(tmp_path / "foreign.gguf")
    assert read.config.architecture() == model.cfg.architecture()


BASE_KEYS = {
    "general.name": "Base-Llama-Instruct",
    "general.license": "apache-2.0",
    "general.tags": ["text-generation", "llama"],
    "tokenizer.chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}",
    "tokenizer.ggml.prefix_token_id": np.uint32(3),
}  # fmt: skip


def test_finetune_keeps_the_base_models_keys(
    llama_cpp: Any, tokenizer: SpmTokenizer, tiny_overrides, tmp_path: Path
) -> None:
    """A finetune's checkpoints and export keep the base file's name, license, tags, chat
    template and extra token ids, with the base's GGUF types (llama.cpp checks them), and its
    context length stays the base model's. The export's tags extend the base's with the run's
    (``llamatrain.model_card``: tests/integration/test_model_card.py)."""
    base = random_model(tokenizer, **VARIANTS["rope_freqs"])
    tensors = {k: v.detach() for k, v in base.state_dict().items()}
    base_path = write_model(
        tmp_path / "base.gguf", base.cfg, tensors, tokenizer, inherited=BASE_KEYS
    )
    result = api.fit(
        "tiny",
        overrides=tiny_overrides(**{"model.init_from": f'"{base_path}"', "train.steps": 4,
                                    "train.save_every": 2, "train.eval_every": 0})
        + ["train.sample_tokens=0"],
        progress=False,
    )  # fmt: skip
    base_contents = read_gguf(base_path)
    for path in (result.export_path, result.run_dir / "checkpoints" / "latest.gguf"):
        contents = read_gguf(path)
        for key in BASE_KEYS:
            value = contents.metadata[key]
            if key == "general.tags" and path == result.export_path:
                value = value[: len(BASE_KEYS[key])]
            assert value == base_contents.metadata[key], (path, key)
            assert contents.value_types[key] == base_contents.value_types[key], (path, key)
        assert contents.metadata["llama.context_length"] == base.cfg.max_seq_len
    exported = api.export(result.run_dir, tmp_path / "again.gguf", type="f16")
    assert (
        read_gguf(exported).metadata["tokenizer.chat_template"]
        == BASE_KEYS["tokenizer.chat_template"]
    )
    llm = llama_cpp.Llama(str(result.export_path), n_ctx=64, verbose=False)
    try:
        assert llm.metadata["tokenizer.chat_template"] == BASE_KEYS["tokenizer.chat_template"]
        assert llm.metadata["general.license"] == "apache-2.0"
    finally:
        llm.close()
    finetuned = read_model(result.export_path).config
    assert finetuned.architecture() == dataclasses.replace(base.cfg).architecture()
