"""Gemma 3 end to end (issue 28): ``llamatrain fit`` with ``model.arch = "gemma3"`` from scratch
trains, resumes bit-exactly and exports a GGUF llama.cpp runs; a LoRA run over a gemma3 HF
folder exports a PEFT adapter that PEFT loads onto our HF export of the base.

The from-scratch model is the tiny config's (dim 64, 4 heads, GQA) with 6 layers — 5
sliding-window layers with a window of 16, then a full one — so the 64-token windows of the
run pass the window. llama.cpp's logits on the export are compared at test_gemma3's
``GELU_TOL`` (its CPU GELU is a float16 table; measured 1.8e-5 on this 4-step model); PEFT's at
the 1e-5 of test_peft (measured 1.2e-6, on logits up to 1.7 that the adapter moves by 2.5).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llama_cpp_runs import open_exact
from test_gemma3 import GELU_TOL
from test_gemma3 import hf_gemma as hf_gemma  # transformers' Gemma3ForCausalLM, saved
from test_gemma3 import tokenizer_files as tokenizer_files  # its byte-level BPE files

from llamatrain import api
from llamatrain.cli import main
from llamatrain.data import SONNETS_PATH
from llamatrain.gguf.file import read_gguf
from llamatrain.lora import merge_lora

STEPS = 4
GEMMA3 = {
    "model.arch": '"gemma3"', "model.n_layers": 6, "model.sliding_window": 16,
    "model.rope_theta_swa": 1e4, "model.tie_embeddings": "true",
}  # fmt: skip
PEFT_TOL = 1e-5


def fit_overrides(tiny_overrides, run_dir: Path, steps: int) -> list[str]:
    return tiny_overrides(**{
        **GEMMA3, "output.dir": f'"{run_dir}"', "train.steps": steps, "train.save_every": 2,
        "train.keep_checkpoints": 3, "train.eval_every": 0, "train.sample_tokens": 0,
        "train.n_batch": 128, "optim.warmup_steps": 2,
    })  # fmt: skip


def as_cli(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    import llama_cpp

    return llama_cpp


def our_logits(model: Any, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor([ids]))[0].double().numpy()


def test_gemma3_from_scratch_trains_resumes_bit_exactly_and_runs_in_llama_cpp(
    llama_cpp, tiny_overrides, tmp_path: Path
) -> None:
    straight = api.fit("tiny", overrides=fit_overrides(tiny_overrides, tmp_path / "a", STEPS),
                       progress=False)  # fmt: skip
    cfg = straight.model.cfg
    shape = (cfg.arch, cfg.n_layers, cfg.sliding_window, cfg.tie_embeddings)
    assert shape == ("gemma3", 6, 16, True)
    losses = [r["loss"] for r in straight.history.train]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.2, losses

    # `llamatrain fit` for half the steps, then --resume latest to the end: the straight run
    half = fit_overrides(tiny_overrides, tmp_path / "b", STEPS // 2)
    assert main(["fit", "--config", "tiny", *as_cli(half)]) == 0
    resumed = api.fit(
        "tiny", overrides=fit_overrides(tiny_overrides, tmp_path / "b", STEPS),
        resume="latest", progress=False,
    )  # fmt: skip
    assert [r["loss"] for r in resumed.history.train] == losses[STEPS // 2 :]
    expected = straight.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name

    # the export runs in llama.cpp: its tokens and (GELU table aside) our logits
    path = straight.export_path
    assert read_gguf(path).metadata["general.architecture"] == "gemma3"
    text = SONNETS_PATH.read_text()[:400]
    ids = straight.tokenizer.encode(text, bos=True)[:64]
    llm = open_exact(llama_cpp, path)
    try:
        assert llm.tokenize(text.encode(), add_bos=True, special=False)[:64] == ids
        llm.reset()
        llm.eval(ids)
        theirs = np.array(llm.scores[: len(ids)], dtype=np.float64)
    finally:
        llm.close()
    diff = np.abs(our_logits(straight.model, ids) - theirs).max()
    assert diff < GELU_TOL, f"gemma3 fit export: max |Δlogit| = {diff:.2e}"


def test_a_gemma3_lora_runs_peft_adapter_loads_in_peft_onto_our_hf_export(
    hf_gemma, tiny_overrides, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    folder, _ = hf_gemma
    model, tokenizer = api.load(folder)
    base = api.export_hf(model, tokenizer, tmp_path / "base")
    overrides = tiny_overrides(**{
        "model.init_from": f'"{base}"', "lora.rank": 4, "lora.alpha": 8.0, "train.steps": 4,
        "train.n_batch": 128, "train.eval_every": 0, "train.save_every": 0,
        "train.sample_tokens": 0, "optim.lr": 3e-2, "optim.warmup_steps": 1,
    })  # fmt: skip
    run = api.fit("tiny", overrides=overrides, progress=False)
    assert run.model.cfg.arch == "gemma3"
    peft_folder = tmp_path / "peft"
    args = ["export", str(run.run_dir), "--adapter", "--format", "hf", "-o", str(peft_folder)]
    assert main(args) == 0
    config = json.loads((peft_folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    assert type(hf) is Gemma3ForCausalLM
    peft_model = PeftModel.from_pretrained(hf, peft_folder).eval()
    ids = run.tokenizer.encode(SONNETS_PATH.read_text()[:300], bos=True)[:40]
    with torch.no_grad():
        theirs = peft_model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    ours = our_logits(merge_lora(run.model), ids)
    assert np.abs(ours - our_logits(model, ids)).max() > 1e-3  # the adapter matters
    diff = np.abs(theirs - ours).max()
    assert diff < PEFT_TOL, f"gemma3 PEFT adapter: max |Δlogit| = {diff:.2e}"
