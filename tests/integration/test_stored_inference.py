"""Inference over the stored file (issue 46, item 1): ``load``, ``generate``, ``chat`` and
``eval`` keep a model's frozen weights as its GGUF stores them (mapped, decoded a chunk at a
time as a product needs them) and apply a LoRA adapter unmerged, y = W·x + s·B(A·x), as
llama.cpp applies ``-m base.gguf --lora adapter.gguf``; float32 only with ``dequantize``.

A random llama of rows of 256 and 512 values (every block type applies) is exported f32, Q8_0
and Q4_0, and a random rank-4 adapter over it (A and B both nonzero: a fresh PEFT adapter
changes nothing) is written as llama.cpp's adapter GGUF. What must hold:

* the model ``load(base, lora=adapter)`` builds holds each matrix in the file's own type and
  computes the logits of the merged float32 model (the base dequantized by gguf-py, W + s·B·A
  summed in float32) to float32 rounding (``UNMERGED_TOL``), while the adapter moves them by
  whole units; ``dequantize=True`` gives that merged model itself;
* llama.cpp, given the same two files, draws the same greedy tokens over the f32 base, and
  over Q8_0 its logits stay within the rounding of its 8-bit activations (``Q8_0_BOUND``);
* a LoRA run's folder loads the same way whatever ``lora.base_dtype`` it trained with, and
  ``eval`` scores a base with ``--lora`` as the merged model scores;
* the memory this buys, at a real model's shape (slow): ``generate RUN --chat`` of a QLoRA run
  over a random Llama-3.2-1B-shape Q4_0 file peaks at its file's size + the KV cache + 1 GiB
  (issue 46's bound), where the merged float32 model alone is 4.6 GiB.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cli_peaks import run_child
from llama_cpp_files import vocab_dir as vocab_dir  # llama.cpp's vocab files (a fixture)
from llama_cpp_runs import cpp_logits, open_exact
from random_models import randomly_adapted, tiny_llama
from real_shapes import SHAPES, write_real_shape
from user_errors import error_of

from llamatrain import api
from llamatrain.cli import main
from llamatrain.data import SONNETS_PATH
from llamatrain.generate import generate
from llamatrain.gguf.adapter import read_lora_adapter, write_lora_adapter
from llamatrain.lora import FrozenLinear, FrozenTable, apply_lora, load_lora_state_dict, merge_lora
from llamatrain.model import KVCache, Llama
from llamatrain.model_config import tensor_shapes
from llamatrain.sampling import SamplingParams

RANK, ALPHA = 4, 8.0
TYPES = ("f32", "q8_0", "q4_0")
UNMERGED_TOL = 5e-5
"""Max |logit of base + adapter unmerged - logit of the merged float32 model|. The two sum
the same float32 products in another order (x·Wᵀ + s·(x·Aᵀ)·Bᵀ against x·(W + s·B·A)ᵀ):
measured 1.4e-5 on logits up to 4.1 (f32, Q8_0) and 1.0e-5 (Q4_0), where the adapter moves
them by 5.5; a lost, doubled or misscaled adapter fails by far."""
Q8_0_BOUND = 0.12
"""Max |llama.cpp's logit - ours| over the Q8_0 base + adapter: llama.cpp rounds the
activations to 8 bits for its Q8_0 products (tests/integration/test_qlora.py's LOGIT_BOUND);
measured 0.080 (48 tokens), the bound 1.5x that."""
GB = 1 << 30


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Path]:
    """type -> the random base exported as that type, and ``"adapter"`` -> a random adapter."""
    folder = tmp_path_factory.mktemp("stored")
    model, tokenizer = tiny_llama(
        cache_dir, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512
    )
    with torch.no_grad():  # activations ~1 through the blocks, so every block shows
        for name, p in model.named_parameters():
            if p.dim() == 2 and name != "token_embd.weight":
                p.normal_(0.0, 1 / math.sqrt(p.shape[1]))
    paths = {t: api.export_gguf(model, tokenizer, folder / f"{t}.gguf", type=t) for t in TYPES}
    adapted = randomly_adapted(model, RANK, ALPHA, std_a=0.1, std_b=0.1)
    paths["adapter"] = write_lora_adapter(folder / "adapter.gguf", adapted, alpha=ALPHA)
    return paths


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    import llama_cpp

    return llama_cpp


def prompt(tokenizer) -> list[int]:
    return tokenizer.encode(SONNETS_PATH.read_text()[:400], bos=True)[:48]


def logits(model: Llama, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor([ids]))[0].double().numpy()


def merged_reference(base: Path, adapter: Path) -> Llama:
    """The base read whole as float32 by gguf-py's dequantizers (``load_gguf``), the adapter
    merged into it: a path that shares neither our decoders nor the unmerged product."""
    model, _ = api.load_gguf(base)
    read = read_lora_adapter(adapter)
    apply_lora(model, read.rank, read.alpha, targets=read.targets)
    load_lora_state_dict(model, read.tensors)
    return merge_lora(model)


def stored_types(model: Llama) -> dict[str, str | None]:
    """The type each projection and vocabulary table is held in (None: a float32 parameter)."""
    held = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            frozen = isinstance(module, FrozenLinear | FrozenTable) or hasattr(module, "lora_a")
            held[f"{name}.weight"] = getattr(module, "qtype", None) if frozen else None
    return held


def test_the_decoding_steps_over_base_and_adapter_are_llama_cpps(files, llama_cpp) -> None:
    """Token by token over a KV cache, a Q8_0 base with its adapter unmerged decodes through
    the C++ step (``fused_decode``, the LoRA update inside it), each position's logits
    llama.cpp's over ``-m base.gguf --lora adapter.gguf`` within :data:`Q8_0_BOUND`."""
    quantized, tokenizer = api.load(files["q8_0"], lora=files["adapter"])
    ids = prompt(tokenizer)
    theirs = cpp_logits(llama_cpp, files["q8_0"], ids, lora=files["adapter"])
    cache = KVCache(quantized.cfg, 1, len(ids), "cpu", torch.float32)
    ours = []
    with torch.no_grad():
        for i, token in enumerate(ids):
            assert quantized.blk.step_layers(torch.zeros(1, 1, quantized.cfg.dim), cache)
            out = quantized(torch.tensor([[token]]), cache=cache, positions=torch.tensor([[i]]))
            ours.append(out[0, -1].double().numpy())
    assert np.abs(np.stack(ours) - theirs).max() < Q8_0_BOUND


@pytest.mark.usefixtures("decoded_products")  # exact: no 8-bit activations
@pytest.mark.parametrize("type_name", TYPES)
def test_the_base_stays_as_stored_and_the_adapter_applies_unmerged(files, type_name) -> None:
    base = files[type_name]
    model, tokenizer = api.load(base, lora=files["adapter"])
    expected = None if type_name == "f32" else type_name.upper()
    assert set(stored_types(model).values()) == {expected}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # norms, A and B
    ids = prompt(tokenizer)
    ours, merged = logits(model, ids), logits(merged_reference(base, files["adapter"]), ids)
    plain, _ = api.load(base)
    assert np.abs(ours - merged).max() < UNMERGED_TOL
    assert np.abs(logits(plain, ids) - merged).max() > 1.0  # the adapter counts
    widened, _ = api.load(base, lora=files["adapter"], dequantize=True)
    assert set(stored_types(widened).values()) == {None}
    assert not hasattr(widened.blk[0].attn_q, "lora_a")  # merged
    assert np.array_equal(logits(widened, ids), merged)


def test_llama_cpp_draws_our_greedy_tokens_over_base_and_adapter(files, llama_cpp) -> None:
    """``generate`` over base + ``--lora`` as ``llama-cli -m base.gguf --lora adapter.gguf``."""
    model, tokenizer = api.load(files["f32"], lora=files["adapter"])
    ids = tokenizer.encode("Shall I compare thee to a summer's day?", bos=True)
    ours = generate(model, torch.tensor(ids), 24, SamplingParams(temperature=0)).tolist()
    llm = open_exact(llama_cpp, files["f32"], lora=files["adapter"])
    try:
        theirs = list(itertools.islice(llm.generate(ids, temp=0.0, top_k=1), 24))
    finally:
        llm.close()
    assert ours[len(ids) :] == theirs
    quantized, _ = api.load(files["q8_0"], lora=files["adapter"])
    ids = prompt(tokenizer)
    theirs_q8 = cpp_logits(llama_cpp, files["q8_0"], ids, lora=files["adapter"])
    assert np.abs(logits(quantized, ids) - theirs_q8).max() < Q8_0_BOUND


@pytest.mark.usefixtures("decoded_products")  # exact: no 8-bit activations
def test_cli_generate_and_eval_take_an_adapter_over_a_base(files, tmp_path, capsys) -> None:
    args = ["generate", str(files["q4_0"]), "--lora", str(files["adapter"]), "--prompt",
            "Shall I", "--max-tokens", "12", "--seed", "1"]  # fmt: skip
    assert main(args) == 0
    model, tokenizer = api.load(files["q4_0"], lora=files["adapter"])
    pieces = api.generate_text(model, tokenizer, "Shall I", max_tokens=12, seed=1)
    assert capsys.readouterr().out == "".join(pieces) + "\n"
    text = tmp_path / "few.txt"
    text.write_text(SONNETS_PATH.read_text()[:2000])
    assert main(["eval", str(files["q4_0"]), "--lora", str(files["adapter"]), "--data",
                 str(text), "--n-ctx", "64"]) == 0  # fmt: skip
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("perp")]
    merged = merged_reference(files["q4_0"], files["adapter"])
    expected = api.perplexity(merged, tokenizer, text, n_ctx=64).perplexity
    assert float(line.split()[1]) == pytest.approx(expected, rel=1e-4)  # printed to 4 places


@pytest.mark.usefixtures("decoded_products")  # exact: no 8-bit activations
def test_a_lora_run_loads_its_base_as_stored_whatever_it_trained_with(
    files, cache_dir, tmp_path
) -> None:
    """A run over the Q4_0 file that held its base as bf16 while training still loads it as
    its Q4_0 blocks, the run's adapter unmerged over them, as llama.cpp applies the adapter
    the run wrote over that file; ``dequantize`` merges it into the float32 base."""
    run_dir = tmp_path / "run"
    overrides = [
        f'data.cache_dir="{cache_dir}"', f'output.dir="{run_dir}"',
        f'model.init_from="{files["q4_0"]}"', "lora.rank=4", 'lora.base_dtype="bf16"',
        "train.steps=2", "train.n_batch=128", "train.eval_every=0", "train.sample_tokens=0",
        "optim.lr=3e-2", "output.export=false",
    ]  # fmt: skip
    api.fit("tiny", overrides=overrides, progress=False)
    model, tokenizer = api.load(run_dir)
    assert set(stored_types(model).values()) == {"Q4_0"}
    ids = prompt(tokenizer)
    merged = logits(merged_reference(files["q4_0"], run_dir / "adapter-f32.gguf"), ids)
    assert np.abs(logits(model, ids) - merged).max() < UNMERGED_TOL
    widened, _ = api.load(run_dir, dequantize=True)
    assert np.array_equal(logits(widened, ids), merged)


def test_adapter_errors_are_one_line(files, cache_dir, tmp_path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        f'data.cache_dir="{cache_dir}"', f'output.dir="{run_dir}"',
        f'model.init_from="{files["f32"]}"', "lora.rank=4", "train.steps=1",
        "train.eval_every=0", "train.sample_tokens=0", "output.export=false",
    ]  # fmt: skip
    api.fit("tiny", overrides=overrides, progress=False)
    message = error_of(api.load, run_dir, lora=files["adapter"])
    assert "applies its own adapter" in message and str(files["f32"].resolve()) in message
    other, tokenizer = tiny_llama(cache_dir, seed=1)  # the tiny config's 64-wide model
    narrow = api.export_gguf(other, tokenizer, tmp_path / "narrow.gguf")
    assert "pass the base model the adapter was trained on" in error_of(
        api.load, narrow, lora=files["adapter"]
    )
    adapted = randomly_adapted(other, RANK, ALPHA, std_a=0.1, std_b=0.1)
    some_blocks = {n: t for n, t in adapted.state_dict().items() if ".lora_" in n and "blk.0." in n}
    partial = write_lora_adapter(tmp_path / "partial.gguf", some_blocks, alpha=ALPHA)
    assert "only some of the base's 2 blocks" in error_of(api.load, narrow, lora=partial)
    assert "is not a LoRA adapter" in error_of(api.load, narrow, lora=narrow)


@pytest.mark.slow
@pytest.mark.parametrize("shape_name", ["llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b"])
def test_chat_with_a_qlora_run_of_a_real_shape_holds_its_file_not_float32(
    tmp_path: Path, vocab_dir: Path, shape_name: str
) -> None:
    """``generate RUN --chat`` after a QLoRA run over a random Llama-3.2-1B-shape Q4_0 file
    (0.65 GiB; 4.6 GiB as float32) peaks within its file + the KV cache + 1 GiB: the file's
    pages (mapped, every one read by a forward), PyTorch, the 128k vocabulary and its head's
    chunks. Measured 1.19-1.22 GiB; before, the base was widened to float32 and the adapter
    merged into it: 10.15 GiB for the same question (14.4 GB at Qwen2.5-1.5B Q4_K_M, issue 46).
    The same at Llama-3.2-3B's and Llama-3.1-8B's shapes (issue 46's target at 8B: a 4.3 GiB
    file, 30 GiB as float32)."""
    shape = SHAPES[shape_name].config
    base = write_real_shape(tmp_path / "base.gguf", shape_name, "q4_0", vocab_dir)
    run_dir = tmp_path / "run"
    overrides = [
        f'model.init_from="{base}"', "lora.rank=8", 'lora.base_dtype="quantized"',
        "data.n_ctx=16", "train.n_batch=16", "train.steps=1", "train.eval_every=0",
        "train.sample_tokens=0", "train.save_every=0", "output.export=false",
        f'output.dir="{run_dir}"', f'data.cache_dir="{tmp_path / "cache"}"',
    ]  # fmt: skip
    run_child("fit", "--config", "tiny", *(f"--set={o}" for o in overrides))
    max_tokens = 8
    chat = run_child(
        "generate", str(run_dir), "--chat", "Shall I compare thee to a summer's day?",
        "--chat-template", "llama-3", "--max-tokens", str(max_tokens),
    )  # fmt: skip
    file_bytes = base.stat().st_size
    context = 64 + max_tokens  # the rendered question and the reply, generously
    kv_cache = 2 * shape.n_layers * shape.kv_heads * shape.head_dim * context * 4
    float32_weights = 4 * sum(math.prod(dims) for dims in tensor_shapes(shape).values())
    print(json.dumps({"file_gb": file_bytes / GB, "chat_peak_gb": chat / GB,
                      "float32_weights_gb": float32_weights / GB}))  # fmt: skip
    assert chat < file_bytes + kv_cache + GB
    assert chat < float32_weights / 2


TRUNCATED_UNDER_THE_COMMAND = """
import os, sys
from llamatrain import api, cli
path, opener = sys.argv[1:3]
opens = getattr(api, opener)

def open_then_truncate(*args, **kwargs):
    opened = opens(*args, **kwargs)  # the weights mapped, not yet read
    os.truncate(path, 4096)
    return opened

setattr(api, opener, open_then_truncate)
sys.exit(cli.main(sys.argv[3:]))
"""


@pytest.mark.parametrize(
    "command",
    [
        ["load", "generate", "{path}", "--prompt", "Shall I", "--max-tokens", "2"],
        pytest.param(  # generate's opener, over the sonnets: 10-40 s
            ["load", "eval", "{path}", "--data", str(SONNETS_PATH)], marks=pytest.mark.slow
        ),
        ["model_to_export", "export", "{path}", "-o", "{path}.out", "--type", "q8_0"],
    ],
    ids=["generate", "eval", "export"],
)
def test_a_model_file_truncated_under_a_command_is_told_in_one_line(
    files, tmp_path, command
) -> None:
    """A file cut short while ``generate``/``eval``/``export`` map it (a download rewritten,
    a disk full elsewhere): reads past its new end would be SIGBUS, which kills the process with no
    word; the command exits 1 with one line naming the file and how it changed, and writes
    nothing. In a child
    process, so that a regression is that child's death, not the test session's."""
    path = tmp_path / "base.gguf"
    path.write_bytes(files["q8_0"].read_bytes())
    argv = [part.format(path=path) for part in command]
    done = subprocess.run(
        [sys.executable, "-c", TRUNCATED_UNDER_THE_COMMAND, str(path), *argv],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert lines == [
        f"llamatrain: error: {path}, which this run maps, changed (it is 4,096 bytes, "
        f"{files['q8_0'].stat().st_size:,} when the run mapped it); leave the file as it is "
        "while a command reads it, and run the command again"
    ], done.stderr
    assert not Path(f"{path}.out").exists()  # export: nothing written from the zeros read


@pytest.mark.slow
def test_grpo_over_a_1b_shape_q4_k_m_base_runs_within_its_file_and_2_gib(
    tmp_path: Path, vocab_dir: Path
) -> None:
    """Issue 46's item 5: a QLoRA GRPO run over a random Llama-3.2-1B-shape Q4_K_M file (its
    Q4_K/Q6_K blocks as llama.cpp's quantizer wrote them) completes its steps within the
    file's size + 2 GiB: 8 rows a step (2 prompts x 4), which the quantized kernels serve, so
    the rollouts sample over the mapped blocks and no decoded float32 base (4.6 GiB) is held.
    The peak is the whole child process: PyTorch, the 128k vocabulary, the file's pages."""
    base = write_real_shape(tmp_path / "base.gguf", "llama-3.2-1b", "q4_k_m", vocab_dir)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What is {a} plus {a}?", "answer": str(2 * a)} for a in range(8)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = tmp_path / "run"
    overrides = [
        f'model.init_from="{base}"', "lora.rank=8", 'lora.base_dtype="quantized"',
        'train.objective="grpo"', 'data.format="jsonl"', f'data.path="{prompts}"',
        'train.rewards=["builtin:exact_answer"]', "train.num_generations=4",
        "train.max_completion_length=8", "data.n_ctx=64", "train.n_batch=512",
        "train.steps=2", "train.eval_every=0", "train.sample_tokens=0", "train.save_every=0",
        "data.val_fraction=0",
        "output.export=false", f'output.dir="{run_dir}"', f'data.cache_dir="{tmp_path / "c"}"',
    ]  # fmt: skip
    peak = run_child("fit", "--config", "tiny", *(f"--set={o}" for o in overrides))
    file_bytes = base.stat().st_size
    print(json.dumps({"file_gb": file_bytes / GB, "grpo_peak_gb": peak / GB}))
    assert (run_dir / "adapter-f32.gguf").exists() or any(run_dir.glob("checkpoints/*.gguf"))
    assert peak < file_bytes + 2 * GB
