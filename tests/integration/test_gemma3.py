"""Gemma 3 (``model.arch = "gemma3"``) proven against llama.cpp and transformers: random weights,
norms away from neutral, 6 layers (5 sliding-window layers, then a full one), window 4 and
contexts longer than it, so every switch of the family changes the logits.

Tolerances. vs transformers: 1e-5 (measured <= 1.7e-6). vs llama.cpp: 1e-5 for the whole
graph with the feed-forward's up projection zeroed (measured <= 1.6e-6, with LoRA 1.5e-6; GEGLU
then gives exactly 0 in both, and every other part — scaled embeddings, q/k and sandwich norms,
the window, the two rope bases, the attention scale, soft-capping, the tied head — is compared
at full precision). With the feed-forward on, llama.cpp's CPU GELU is a float16 lookup table
(ggml's ``GGML_GELU_FP16``: the gate is rounded to f16 and so is the result, relative error up
to 2^-11 per element), so the full model is compared at :data:`GELU_TOL` (measured 1.4e-3) and
shown to be that table: a reference that rounds as the table does is several times closer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from llama_cpp_runs import cpp_logits
from random_models import move_off_neutral, randomly_adapted

from llamatrain import api
from llamatrain.errors import CheckpointError
from llamatrain.gguf.adapter import read_lora_adapter, write_lora_adapter
from llamatrain.gguf.file import read_gguf
from llamatrain.gguf.llama import read_model
from llamatrain.hf.weights import hf_state_dict, read_hf_weights
from llamatrain.model import Llama, ModelConfig
from llamatrain.ops import sets
from llamatrain.tokenizer import SpmTokenizer, train_spm

TOL = 1e-5
GELU_TOL = 5e-3
TEXT = "\n".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times."
    for i in range(400)
)
BASE = dict(
    arch="gemma3", dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=128,
    sliding_window=4, rope_theta=1e6, rope_theta_swa=500.0,
    tie_embeddings=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    import llama_cpp

    return llama_cpp


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> SpmTokenizer:
    corpus = tmp_path_factory.mktemp("gemma3") / "corpus.txt"
    corpus.write_text(TEXT)
    return train_spm([corpus], vocab_size=320)


def gemma(vocab_size: int, *, ffn: bool = True, seed: int = 0, **changes: Any) -> Llama:
    """A random gemma3, matrices x3 (sharp attention, so the window shows), norms U(0.5, 1.5);
    ``ffn=False`` zeroes every ffn_up (the feed-forward then adds exactly 0)."""
    torch.manual_seed(seed)
    model = move_off_neutral(Llama(ModelConfig(vocab_size=vocab_size, **{**BASE, **changes})))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            if not ffn and "ffn_up" in name:
                p.zero_()
    return model.eval()


def changed(model: Llama, **changes: Any) -> Llama:
    """The same weights under another config (tensors it lacks left out)."""
    other = Llama(dataclasses.replace(model.cfg, **changes)).eval()
    state = model.state_dict()
    other.load_state_dict({k: state[k] for k in other.state_dict()})
    return other


def logits(model: Llama, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].double().numpy()


def ids_of(spm: SpmTokenizer, n: int = 40) -> list[int]:
    return spm.encode(TEXT[:400], bos=True)[:n]


# ---- GGUF out, llama.cpp runs it ------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"final_logit_softcap": 0.5},
        {"rope_scaling_factor": 4.0},
        {"n_layers": 62, "n_heads": 8, "n_kv_heads": 4, "key_length": 16},
    ],
    ids=["plain", "softcap", "linear-rope", "27b-scale"],
)
def test_llama_cpp_runs_gemma3_like_we_do(llama_cpp, spm, tmp_path: Path, changes) -> None:
    model = gemma(spm.vocab_size, ffn=False, **changes)
    path = api.export_gguf(model, spm, tmp_path / "g.gguf")
    meta = read_gguf(path).metadata
    assert meta["general.architecture"] == "gemma3"
    assert meta["gemma3.attention.sliding_window"] == 4
    assert meta["gemma3.rope.freq_base_swa"] == 500.0
    assert ("gemma3.final_logit_softcapping" in meta) == ("final_logit_softcap" in changes)
    ids = ids_of(spm)
    ours = logits(model, ids)
    theirs = cpp_logits(llama_cpp, path, ids)
    diff = np.abs(ours - theirs).max()
    assert diff < TOL, f"gemma3 {changes}: max |Δlogit| = {diff:.2e}"
    # each switch matters: the same weights without it are far from llama.cpp
    for other in (
        dict(sliding_window=4096),
        dict(rope_theta_swa=1e6),
        dict(arch="qwen3", sliding_window=None, rope_theta_swa=None, final_logit_softcap=None),
    ):
        assert np.abs(logits(changed(model, **other), ids) - theirs).max() > 100 * TOL, other
    if "n_layers" in changes:  # llama.cpp's 27B rule: 1/sqrt(dim / n_heads), not 1/sqrt(16)
        assert (model.cfg.attention_scalar, model.cfg.head_dim) == (8, 16)


def test_llama_cpps_gelu_is_a_float16_table(llama_cpp, spm, tmp_path: Path, monkeypatch) -> None:
    model = gemma(spm.vocab_size)
    path = api.export_gguf(model, spm, tmp_path / "g.gguf")
    ids = ids_of(spm)
    theirs = cpp_logits(llama_cpp, path, ids)
    exact = np.abs(logits(model, ids) - theirs).max()
    assert exact < GELU_TOL, f"gemma3 with GEGLU: max |Δlogit| = {exact:.2e}"

    def f16_table_geglu(self, gate, up):  # ggml_vec_geglu_f32 with GGML_GELU_FP16
        table = F.gelu(gate.half().float(), approximate="tanh").half().float()
        return torch.where(gate <= -10, 0.0, torch.where(gate >= 10, gate, table)) * up

    monkeypatch.setattr(sets.GgmlOps, "geglu", f16_table_geglu)
    tabled = np.abs(logits(changed(model), ids) - theirs).max()
    assert tabled < exact / 2, (tabled, exact)


def test_gemma3_reads_back_into_the_same_model(spm, tmp_path: Path) -> None:
    model = gemma(spm.vocab_size, final_logit_softcap=30.0)
    path = api.export_gguf(model, spm, tmp_path / "m.gguf")
    foreign = tmp_path / "foreign.gguf"  # as llama.cpp's converter leaves it: no config key
    data = path.read_bytes().replace(b"llamatrain.model_config", b"llamatrain.model_confiX")
    foreign.write_bytes(data)
    for source in (path, foreign):
        read = read_model(source)
        assert read.config.architecture() == model.cfg.architecture(), source
        for name, tensor in model.state_dict().items():
            assert torch.equal(read.tensors[name], tensor), name


def test_llama_cpp_applies_a_lora_adapter_over_gemma3(llama_cpp, spm, tmp_path: Path) -> None:
    base = gemma(spm.vocab_size, ffn=False)
    adapted = randomly_adapted(base, 4, 6.0, std_a=0.2, std_b=0.05)
    with torch.no_grad():  # keep ffn_up's output 0 (see the module doc)
        for block in adapted.blk:
            block.ffn_up.lora_b.zero_()
    base_path = api.export_gguf(base, spm, tmp_path / "base.gguf")
    adapter_path = write_lora_adapter(tmp_path / "lora.gguf", adapted, alpha=6.0)
    assert read_lora_adapter(adapter_path).architecture == "gemma3"
    ids = ids_of(spm)
    ours = logits(adapted, ids)
    theirs = cpp_logits(llama_cpp, base_path, ids, lora=adapter_path)
    diff = np.abs(ours - theirs).max()
    assert diff < TOL, f"gemma3 + LoRA: max |Δlogit| = {diff:.2e}"
    assert np.abs(ours - logits(base, ids)).max() > 0.05


# ---- HF folders in and out, against transformers ---------------------------------------------

N_TOKENS = 400


@pytest.fixture(scope="module")
def hf_gemma(tmp_path_factory, tokenizer_files) -> tuple[Path, Any]:
    """transformers' Gemma3ForCausalLM (Gemma3TextConfig), norm weights U(-0.5, 0.5) (HF's
    ``1 + w`` form), saved with save_pretrained next to the tokenizer files."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=N_TOKENS, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=2048, rms_norm_eps=1e-5, initializer_range=0.05,
        bos_token_id=0, eos_token_id=1, pad_token_id=None, sliding_window=4,
        final_logit_softcapping=3.0,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        },
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.uniform_(-0.5, 0.5)
    folder = tmp_path_factory.mktemp("hf-gemma3") / "gemma3"
    model.save_pretrained(folder)
    for path in tokenizer_files.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return folder, model


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_families import tokenizer_files as families_tokenizer_files

    return families_tokenizer_files.__wrapped__(tmp_path_factory)


def hf_ids() -> torch.Tensor:
    return torch.randint(0, N_TOKENS, (2, 12), generator=torch.Generator().manual_seed(1))


def hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("ops", ["ggml", "torch"])
def test_import_computes_what_transformers_computes(hf_gemma, ops: str) -> None:
    folder, reference = hf_gemma
    model, tokenizer = api.load(folder, ops=ops)
    cfg = model.cfg
    assert (cfg.arch, cfg.sliding_window, cfg.rope_theta_swa) == ("gemma3", 4, 500.0)
    assert cfg.final_logit_softcap == 3.0 and cfg.tie_embeddings
    ids = hf_ids()
    expected = hf_logits(reference, ids)
    torch.testing.assert_close(hf_logits(model.eval(), ids), expected, atol=TOL, rtol=TOL)
    assert (hf_logits(changed(model, sliding_window=4096), ids) - expected).abs().max() > 1e-3


def test_hf_export_loads_in_transformers_with_our_logits(hf_gemma, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    folder, _ = hf_gemma
    model, tokenizer = api.load(folder)
    model = move_off_neutral(model).eval()
    out = api.export_hf(model, tokenizer, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is Gemma3ForCausalLM
    ids = hf_ids()
    torch.testing.assert_close(hf_logits(reloaded, ids), hf_logits(model, ids), atol=TOL, rtol=TOL)


def test_norms_are_one_plus_w_in_gguf_and_round_trip(hf_gemma, tmp_path: Path) -> None:
    """llama.cpp's converter adds 1 to Gemma's norm weights; so does our import. GGUF -> HF ->
    GGUF is bit-exact for norm values >= 0.5 (g - 1 is exact there)."""
    folder, reference = hf_gemma
    model, _ = api.load(folder)
    hf_norm = reference.model.layers[2].post_feedforward_layernorm.weight
    ours = model.state_dict()["blk.2.post_ffw_norm.weight"]
    assert torch.equal(ours, hf_norm + 1)
    state = hf_state_dict(model.cfg, model.state_dict())
    from safetensors.torch import save_file

    (tmp_path / "rt").mkdir()
    save_file(state, tmp_path / "rt" / "model.safetensors")
    back = read_hf_weights(tmp_path / "rt", model.cfg)
    assert all(bool((t >= 0.5).all()) for n, t in back.items() if n.endswith("norm.weight"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(back[name], tensor), name


def test_hf_gemma3_converted_to_gguf_runs_in_llama_cpp(llama_cpp, hf_gemma, tmp_path: Path) -> None:
    """HF -> GGUF -> llama.cpp vs transformers, the feed-forward zeroed (see the module doc)."""
    from transformers import AutoModelForCausalLM

    folder, _ = hf_gemma
    model, tokenizer = api.load(folder)
    with torch.no_grad():
        for block in model.blk:
            block.ffn_up.weight.zero_()
    hf_folder = api.export_hf(model, tokenizer, tmp_path / "hf")
    reference = AutoModelForCausalLM.from_pretrained(hf_folder).eval()
    path = api.export(hf_folder, tmp_path / "m.gguf")
    ids = hf_ids()[0].tolist()
    theirs = cpp_logits(llama_cpp, path, ids, n_ctx=64)
    expected = hf_logits(reference, torch.tensor([ids]))[0].double().numpy()
    diff = np.abs(theirs - expected).max()
    assert diff < TOL, f"gemma3: llama.cpp vs transformers max |Δlogit| = {diff:.2e}"


def test_hf_configs_llama_cpp_cannot_run_are_refused(hf_gemma) -> None:
    folder, _ = hf_gemma
    config = json.loads((folder / "config.json").read_text())
    layer_types = ["full_attention"] + config["layer_types"][1:]
    cases = {
        "layer types": {**config, "layer_types": layer_types},
        "query_pre_attn_scalar": {**config, "query_pre_attn_scalar": 32},
        "attn_logit_softcapping": {**config, "attn_logit_softcapping": 50.0},
        "hidden_act": {**config, "hidden_activation": "gelu"},
    }
    for expected, changed_config in cases.items():
        (folder / "config.json").write_text(json.dumps(changed_config))
        try:
            with pytest.raises(CheckpointError, match=expected) as e:
                api.load(folder)
            assert "\n" not in str(e.value)
        finally:
            (folder / "config.json").write_text(json.dumps(config))
