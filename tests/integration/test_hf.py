"""HF checkpoint folders in and out, proved against transformers itself (test-only).

Each model is transformers' own ``LlamaForCausalLM`` built from a ``LlamaConfig`` with random
weights (no download) and saved with ``save_pretrained``; its tokenizer is a small byte-level
BPE trained with HF ``tokenizers`` on the built-in sonnets. llamatrain must import the folder
as the same network (same logits as transformers on the same tokens), convert it to a GGUF
that real llama.cpp runs as the same network, export a folder that transformers loads as the
same network, finetune from one, and refuse what it cannot run.

Tolerance of the logit comparisons: both sides compute in float32 from the same weights, in a
different order (our rope angles in float64 where transformers' are float32, other matmul and
softmax kernels), so they agree to float32 rounding accumulated over two layers: measured at
most 9.5e-7 over all variants and both op sets, on logits up to ~3 (std 0.4).
``atol = rtol = 1e-5`` leaves a 10x margin, while a real mistake moves the logits by far more:
q/k rows left in HF's order by 0.22 to 0.39 (checked below), a linear or llama3 rope scaling
ignored by 0.19 and 2.5e-2, biases dropped by 1.6 (measured when these tests were written).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from llamatrain import api
from llamatrain.cli import main
from llamatrain.data import SONNETS_PATH
from llamatrain.errors import CheckpointError, TokenizerError
from llamatrain.gguf.llama import read_model
from llamatrain.gguf.vocab import tokenizer_metadata
from llamatrain.hf import folder as hf_folder
from llamatrain.hf.folder import read_hf_folder
from llamatrain.hf.weights import to_rotate_half
from llamatrain.lora import LoraLinear, apply_lora, lora_modules, merge_lora
from llamatrain.model import Llama, ModelConfig
from llamatrain.tokenizer import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    SpmTokenizer,
)

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
N_TOKENS = 400  # the trained tokenizer's size
TOLERANCE = dict(atol=1e-5, rtol=1e-5)
BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    # transformers' 0.02 gives near-uniform attention, almost blind to rope; 0.2 makes it so
    # sharp that float32 rounding alone reaches 2e-5
    initializer_range=0.05,
    bos_token_id=0,
    eos_token_id=1,
)
VARIANTS = {
    # sharded weights with an index; the embedding padded past the tokenizer (llama.cpp pads
    # the vocabulary with [PAD<id>] tokens to match)
    "gqa-sharded-padded": dict(vocab_size=N_TOKENS + 16),
    "tied": dict(tie_word_embeddings=True),
    "bias": dict(attention_bias=True, mlp_bias=True),
    "head-dim": dict(head_dim=32),  # not hidden_size / heads = 16
    "rope-linear": dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}),
    "rope-llama3": dict(
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 1024,
            "rope_theta": 1e4,
        }
    ),
}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json (a Llama-3-style byte-level BPE) and tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=N_TOKENS,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(SONNETS_PATH)], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    assert tok.get_vocab_size() == N_TOKENS and tok.token_to_id(BOS) == 0
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def save_hf_model(folder: Path, tokenizer_files: Path, variant: str) -> LlamaForCausalLM:
    """transformers' model for a variant (seeded random weights, random biases), saved as a
    folder with the tokenizer files; returns the model."""
    torch.manual_seed(0)
    config = LlamaConfig(**{"vocab_size": N_TOKENS, **BASE, **VARIANTS[variant]})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # transformers starts them at 0, which would hide them
                param.normal_(0.0, 0.05)
    shard = "40KB" if variant.endswith("sharded-padded") else "1GB"
    model.save_pretrained(folder, max_shard_size=shard)
    for path in tokenizer_files.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory, tokenizer_files) -> dict[str, tuple[Path, LlamaForCausalLM]]:
    """Every variant saved once per module: {variant: (folder, transformers model)}."""
    root = tmp_path_factory.mktemp("hf")
    return {
        variant: (root / variant, save_hf_model(root / variant, tokenizer_files, variant))
        for variant in VARIANTS
    }


def token_ids(vocab_size: int) -> torch.Tensor:
    """Two rows of 48 ids, reaching the padded ids too (positions up to 47 exercise rope)."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab_size, (2, 48), generator=generator)


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


# ---- import --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("ops", ["ggml", "torch"])
def test_import_computes_what_transformers_computes(hf_models, variant, ops):
    folder, reference = hf_models[variant]
    model, tokenizer = api.load(folder, ops=ops)
    ids = token_ids(reference.config.vocab_size)
    torch.testing.assert_close(logits_of(model.eval(), ids), logits_of(reference, ids), **TOLERANCE)
    assert tokenizer.vocab_size == model.cfg.vocab_size == reference.config.vocab_size


def test_import_fills_config_tokenizer_and_inherited_keys(hf_models):
    folder, _ = hf_models["gqa-sharded-padded"]
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1  # the sharded layout
    base = read_hf_folder(folder)
    assert (base.config.kv_heads, base.config.vocab_size, base.contents) == (2, N_TOKENS + 16, None)
    assert base.inherited == {
        "general.name": "gqa-sharded-padded",
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    tokenizer = base.tokenizer
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    vocab = tokenizer_metadata(tokenizer)  # llama.cpp's padding tokens past the tokenizer's
    assert vocab["tokenizer.ggml.tokens"][N_TOKENS + 3] == "[PAD403]"
    assert set(vocab["tokenizer.ggml.token_type"][N_TOKENS:]) == {TOKEN_TYPE_UNUSED}
    reference = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in ("Shall I compare thee to a summer's day?", "  When forty winters\n\n1609"):
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("variant", VARIANTS)
def test_converted_to_gguf_it_runs_in_llama_cpp_as_in_transformers(hf_models, variant, tmp_path):
    """``llamatrain export <hf folder> -o model.gguf`` does what llama.cpp's converter does:
    real llama.cpp gives transformers' logits (F32 weights and KV cache; measured 8.3e-7)."""
    import llama_cpp

    folder, reference = hf_models[variant]
    out = tmp_path / "model.gguf"
    assert main(["export", str(folder), "-o", str(out)]) == 0
    llm = llama_cpp.Llama(str(out), n_ctx=64, logits_all=True, verbose=False,
                          type_k=0, type_v=0, flash_attn=False, n_threads=1)  # fmt: skip
    try:
        ids = token_ids(N_TOKENS)[0]
        llm.eval(ids.tolist())
        theirs = torch.tensor(llm.scores[: len(ids)])
    finally:
        llm.close()
    torch.testing.assert_close(theirs, logits_of(reference, ids[None])[0], **TOLERANCE)


def test_the_logit_comparison_catches_a_wrong_row_order(hf_models):
    """Loading q/k without llama.cpp's permutation must fail the tolerance by far."""
    folder, reference = hf_models["tied"]
    model, _ = api.load(folder)
    state = {
        name: to_rotate_half(t, model.cfg.n_heads if "attn_q" in name else model.cfg.kv_heads)
        if name.endswith(("attn_q.weight", "attn_k.weight"))
        else t
        for name, t in model.state_dict().items()
    }
    model.load_state_dict(state)
    ids = token_ids(N_TOKENS)
    assert (logits_of(model.eval(), ids) - logits_of(reference, ids)).abs().max() > 1e-2


# ---- export --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["tied", "bias", "head-dim", "rope-linear", "rope-llama3"])
def test_export_loads_in_transformers_as_the_same_model(hf_models, variant, tmp_path):
    folder, _ = hf_models[variant]
    base = read_hf_folder(folder)
    model, tokenizer = api.load(folder)
    out = api.export_hf(model, tokenizer, tmp_path / "out", inherited=base.inherited)
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",  # the model card (tests/integration/test_model_card.py reads it)
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    reloaded = LlamaForCausalLM.from_pretrained(out).eval()
    ids = token_ids(N_TOKENS)
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(model.eval(), ids), **TOLERANCE)
    again = read_hf_folder(out)  # and back: the same model, bit for bit, the same tokenizer
    assert again.config == base.config
    assert all(torch.equal(again.tensors[k], t) for k, t in base.tensors.items())
    assert again.tokenizer.fingerprint() == tokenizer.fingerprint()
    hf_tokenizer = AutoTokenizer.from_pretrained(out)  # transformers' tokenizer: same ids
    assert hf_tokenizer.chat_template == CHAT_TEMPLATE
    for text in ("Shall I compare thee to a summer's day?", "  Thou art\n\nmore lovely 1609"):
        assert hf_tokenizer(text)["input_ids"] == tokenizer.encode(text, bos=True)
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == (
        CHAT_TEMPLATE
    )


def test_export_writes_what_transformers_saves(hf_models, tmp_path):
    """The tensors transformers' own save_pretrained writes (a tied model: no lm_head), and a
    llama3 model's rope_freqs as config.json's rope_scaling."""
    for variant in ("tied", "rope-llama3"):
        folder, _ = hf_models[variant]
        model, tokenizer = api.load(folder)
        out = api.export_hf(model, tokenizer, tmp_path / variant)
        with (
            safe_open(str(out / "model.safetensors"), framework="pt") as ours,
            safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as theirs,
        ):
            assert set(ours.keys()) == set(theirs.keys())
    config = json.loads((out / "config.json").read_text())
    scaling = dict(VARIANTS["rope-llama3"]["rope_parameters"])
    del scaling["rope_theta"]  # config.json keeps it at the top level
    assert (config["rope_scaling"], config["rope_theta"]) == (scaling, 1e4)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)


def test_export_replaces_only_its_own_folder(hf_models, tmp_path, capsys):
    model, tokenizer = api.load(hf_models["tied"][0])
    out = tmp_path / "out"
    api.export_hf(model, tokenizer, out)
    api.export_hf(model, tokenizer, out)  # ours: replaced
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="llamatrain did not write"):
        api.export_hf(model, tokenizer, tmp_path / "theirs")
    assert [p.name for p in (tmp_path / "theirs").iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "theirs"]  # no temp folders


def test_a_large_export_is_written_a_shard_at_a_time(hf_models, tmp_path, monkeypatch):
    """Past ``SHARD_BYTES`` the weights go into transformers' shards and index, each shard's
    tensors produced only when it is written (a LoRA model's merged weights: one shard's
    worth at a time, never the merged model); transformers loads the folder as the same
    model, our reader reads it back bit for bit, and a second export replaces it."""
    monkeypatch.setattr(hf_folder, "SHARD_BYTES", 64 << 10)
    model, tokenizer = api.load(hf_models["tied"][0])
    apply_lora(model, 2, 4.0)
    for _, module in lora_modules(model):
        torch.nn.init.normal_(module.lora_b, std=0.05)
    read, merged_weight = [], LoraLinear.merged_weight
    monkeypatch.setattr(
        LoraLinear, "merged_weight", lambda m, *rows: read.append(m) or merged_weight(m, *rows)
    )
    out = api.export_hf(model, tokenizer, tmp_path / "out")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert len(read) == sum(1 for _ in lora_modules(model))  # each merged weight once
    reloaded = LlamaForCausalLM.from_pretrained(out).eval()
    ids = token_ids(N_TOKENS)
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(model.eval(), ids), **TOLERANCE)
    again = read_hf_folder(out)
    merged = merge_lora(model).state_dict()
    assert all(torch.equal(again.tensors[k], merged[k]) for k in again.tensors)
    monkeypatch.setattr(hf_folder, "SHARD_BYTES", 2 << 30)
    api.export_hf(model, tokenizer, out)  # a sharded folder of ours: replaced whole
    assert not any(p.name.startswith("model-") for p in out.iterdir())
    assert (out / "model.safetensors").is_file()


def test_a_vocabulary_tokenizer_json_cannot_hold_is_refused_before_any_weight(tmp_path):
    """tokenizer.json is written for byte-level BPE only; an SPM model's export fails in one
    line and leaves nothing."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁a"]
    types = [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL]
    types += [TOKEN_TYPE_BYTE] * 256 + [TOKEN_TYPE_NORMAL]
    spm = SpmTokenizer(pieces, [0.0] * len(pieces), types)
    config = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=260, max_seq_len=16)
    with pytest.raises(TokenizerError, match="byte-level BPE vocabularies only") as error:
        api.export_hf(Llama(config), spm, tmp_path / "out")
    assert "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_leaves_nothing_behind(hf_models, tmp_path, file_size_limit):
    """A write that fails halfway (a full disk) leaves neither the folder nor its temp copy,
    and an earlier export in its place survives untouched."""
    model, tokenizer = api.load(hf_models["tied"][0])
    with file_size_limit(10_000), pytest.raises(CheckpointError, match="File too large"):
        api.export_hf(model, tokenizer, tmp_path / "new")
    assert list(tmp_path.iterdir()) == []
    out = api.export_hf(model, tokenizer, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with file_size_limit(10_000), pytest.raises(CheckpointError, match="could not write"):
        api.export_hf(model, tokenizer, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ---- finetuning and the command line ------------------------------------------------------


def test_fit_from_an_hf_folder_then_export_it_as_one(hf_models, tiny_overrides, tmp_path):
    """``llamatrain fit --set model.init_from=<hf folder>`` trains on, keeps the name and chat
    template in its GGUF export, and ``export --format hf`` gives transformers the result."""
    folder, reference = hf_models["bias"]
    overrides = tiny_overrides(
        **{"model.init_from": f'"{folder}"', "train.steps": 3, "train.eval_every": 0,
           "train.eval_batches": 1, "train.sample_tokens": 0, "train.save_every": 0,
           "optim.warmup_steps": 1}
    )  # fmt: skip
    args = ["fit", "--config", "tiny"] + [a for o in overrides for a in ("--set", o)]
    assert main(args) == 0
    run = tmp_path / "run"
    exported = read_model(run / "model-f32.gguf")
    assert exported.inherited["general.name"] == "bias"
    assert exported.inherited["tokenizer.chat_template"] == CHAT_TEMPLATE
    trained, _ = api.load(run)
    ids = token_ids(N_TOKENS)
    assert (logits_of(trained.eval(), ids) - logits_of(reference, ids)).abs().max() > 1e-3
    assert main(["export", str(run), "-o", str(tmp_path / "hf"), "--format", "hf"]) == 0
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(logits_of(reloaded, ids), logits_of(trained, ids), **TOLERANCE)


def broken_folders(hf_models, root: Path) -> dict[str, tuple[Path, str]]:
    """HF folders with one thing wrong each, and what the error must name."""
    source, _ = hf_models["tied"]
    cases = {}
    for case in ("no-weights", "no-config", "gemma", "yarn"):
        folder = root / case
        folder.mkdir()
        for path in source.iterdir():
            (folder / path.name).write_bytes(path.read_bytes())
        cases[case] = folder
    (cases["no-weights"] / "model.safetensors").unlink()
    (cases["no-config"] / "config.json").unlink()
    for case, change in (
        ("gemma", {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}),
        ("yarn", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}),
    ):
        config = json.loads((cases[case] / "config.json").read_text())
        (cases[case] / "config.json").write_text(json.dumps({**config, **change}))
    named = {
        "no-weights": "has no model.safetensors",
        "no-config": "has no config.json",
        "gemma": "'gemma' (GemmaForCausalLM) model",
        "yarn": "'yarn' rope scaling",
    }
    return {case: (folder, named[case]) for case, folder in cases.items()}


def test_bad_folders_are_one_line_errors_that_write_nothing(
    hf_models, tmp_path_factory, tmp_path, capsys, tiny_overrides
):
    cases = broken_folders(hf_models, tmp_path_factory.mktemp("broken"))
    for case, (folder, named) in cases.items():
        for args in (
            ["export", str(folder), "-o", str(tmp_path / "out.gguf")],
            ["fit", "--config", "tiny", "--set", f"model.init_from={folder}"]
            + [a for o in tiny_overrides() for a in ("--set", o)],
        ):
            assert main(args) == 1, case
            err = capsys.readouterr().err
            assert err.startswith("llamatrain: error:") and named in err, (case, err)
            assert err.count("\n") == 1, err
        # nothing written: no export, and the run folder holds no more than its lock
        assert not (tmp_path / "out.gguf").exists()
        assert [p.name for p in (tmp_path / "run").iterdir()] == [".lock"]


def test_export_options_an_hf_folder_cannot_take_are_refused(hf_models, tmp_path, capsys):
    folder, _ = hf_models["tied"]
    for extra, named in (
        (["--format", "hf", "--type", "q8_0"], "float32 safetensors"),
        (["--format", "onnx"], "unknown export format 'onnx'"),
    ):
        assert main(["export", str(folder), "-o", str(tmp_path / "out"), *extra]) == 1
        err = capsys.readouterr().err
        assert err.startswith("llamatrain: error:") and named in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []
