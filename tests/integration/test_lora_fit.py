"""LoRA runs end to end: ``[lora] rank > 0`` trains adapters over a frozen ``model.init_from``.

The base is the tiny config's model, random (seeded) and exported f32 with the tiny config's
vocabulary, so a run needs seconds. The run trains rank-4 adapters on every projection for 8
steps; what it must show: only the adapters change and the loss falls, its checkpoints hold
the adapter and its optimizer state (not the base) and resume bit-exactly, a different base is
refused, and its outputs (the adapter, the merged model, ``export --adapter``) compute in real
llama.cpp what our model computes (the 1e-5 of tests/integration/test_lora_llama_cpp.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llama_cpp_runs import cpp_logits
from random_models import tiny_llama

from llamatrain import api
from llamatrain.cli import main
from llamatrain.data import SONNETS_PATH
from llamatrain.errors import CheckpointError
from llamatrain.gguf.adapter import read_lora_adapter
from llamatrain.gguf.file import read_gguf
from llamatrain.lora import lora_state_dict, merge_lora
from llamatrain.model import Llama
from llamatrain.model_path import BASE_SHA256_KEY, base_sha256, is_lora_checkpoint

RANK, ALPHA = 4, 8.0
LORA_TOL = 1e-5


def lora_overrides(cache_dir: Path, run_dir: Path, base: Path, steps: int) -> list[str]:
    """A LoRA run of the tiny config over ``base``: a checkpoint every 2 steps, no evaluation
    on the way (one at the end), a high lr so 8 steps visibly lower the loss."""
    return [
        f'data.cache_dir="{cache_dir}"',
        f'output.dir="{run_dir}"',
        f'model.init_from="{base}"',
        f"lora.rank={RANK}",
        f"lora.alpha={ALPHA}",
        f"train.steps={steps}",
        "train.save_every=2",
        "train.keep_checkpoints=3",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "optim.lr=3e-2",
        "optim.warmup_steps=1",
    ]


def write_base(cache_dir: Path, path: Path, seed: int) -> Path:
    """A random tiny-config model with the tiny config's vocabulary, exported f32."""
    model, tokenizer = tiny_llama(cache_dir, seed)
    return api.export_gguf(model, tokenizer, path)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    return write_base(cache_dir, tmp_path_factory.mktemp("base") / "base.gguf", seed=0)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path, base: Path):
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    return api.fit("tiny", overrides=lora_overrides(cache_dir, run_dir, base, 8), progress=False)


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    import llama_cpp

    return llama_cpp


def our_logits(model: Llama, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.tensor([ids]))[0].double().numpy()


def prompt_ids(result: api.FitResult) -> list[int]:
    return result.tokenizer.encode(SONNETS_PATH.read_text()[:400], bos=True)[:48]


def test_a_lora_run_trains_the_adapters_alone_and_lowers_the_loss(lora_run, base):
    base_model, _ = api.load_gguf(base)
    trained = lora_run.model.state_dict()
    for name, weight in base_model.state_dict().items():
        assert torch.equal(trained[name], weight), name  # the base is frozen
    adapters = lora_state_dict(lora_run.model)
    assert len(adapters) == 2 * 7 * lora_run.model.cfg.n_layers
    assert all(t.abs().max() > 0 for n, t in adapters.items() if n.endswith("lora_b"))
    losses = [r["loss"] for r in lora_run.history.train]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses


def test_lora_checkpoints_hold_the_adapter_its_moments_and_the_base(lora_run, base):
    latest = lora_run.run_dir / "checkpoints" / "latest.gguf"
    assert is_lora_checkpoint(latest)
    contents = read_gguf(latest)
    adapters = lora_state_dict(lora_run.model)
    n_adapter = sum(t.numel() for t in adapters.values())
    model_tensors = {n for n in contents.tensors if not n.startswith(("training.", "optimizer."))}
    assert model_tensors == {n.replace(".lora", ".weight.lora") for n in adapters}
    assert contents.tensors["optimizer.adam.first_moments"].numel() == n_adapter
    assert contents.tensors["optimizer.adam.second_moments"].abs().max() > 0
    assert contents.metadata["training.iteration_count"] == 8
    assert contents.metadata[BASE_SHA256_KEY] == base_sha256(base)
    assert latest.stat().st_size < base.stat().st_size / 2  # no copy of the base


def test_lora_resume_is_bit_exact(lora_run, base, cache_dir, tmp_path):
    """4 steps, then ``--resume latest`` to 8, ends with the straight run's adapters and
    losses: adapters, AdamW moments, RNG and data cursor all come back over the same base."""
    run_dir = tmp_path / "run"
    api.fit("tiny", overrides=lora_overrides(cache_dir, run_dir, base, 4), progress=False)
    resumed = api.fit(
        "tiny",
        overrides=lora_overrides(cache_dir, run_dir, base, 8),
        resume="latest",
        progress=False,
    )
    straight = lora_state_dict(lora_run.model)
    for name, tensor in lora_state_dict(resumed.model).items():
        assert torch.equal(tensor, straight[name]), name
    straight_losses = [r["loss"] for r in lora_run.history.train]
    assert [r["loss"] for r in resumed.history.train] == straight_losses[4:]


def test_lora_resume_refuses_another_base_or_a_full_finetune(lora_run, cache_dir, tmp_path):
    other = write_base(cache_dir, tmp_path / "other.gguf", seed=1)
    checkpoint = lora_run.run_dir / "checkpoints" / "latest.gguf"
    overrides = lora_overrides(cache_dir, tmp_path / "run", other, 10)
    with pytest.raises(CheckpointError, match="is not the base model") as info:
        api.fit("tiny", overrides=overrides, resume=checkpoint, progress=False)
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="holds a LoRA adapter but .* lora.rank = 0"):
        api.fit("tiny", overrides=[*overrides, "lora.rank=0"], resume=checkpoint, progress=False)


def test_lora_outputs_compute_in_llama_cpp_what_the_run_computes(lora_run, base, llama_cpp):
    """The run's adapter over the base, and its merged export alone, in real llama.cpp."""
    ids = prompt_ids(lora_run)
    ours = our_logits(lora_run.model, ids)
    adapter = lora_run.adapter_path
    assert adapter == lora_run.run_dir / "adapter-f32.gguf"
    with_adapter = cpp_logits(llama_cpp, base, ids, lora=adapter)
    assert np.abs(with_adapter - ours).max() < LORA_TOL
    merged = cpp_logits(llama_cpp, lora_run.export_path, ids)
    assert np.abs(merged - ours).max() < LORA_TOL
    assert np.abs(cpp_logits(llama_cpp, base, ids) - ours).max() > 100 * LORA_TOL  # it learned


def test_cli_exports_the_adapter_or_the_merged_model_of_a_lora_run(lora_run, tmp_path, capsys):
    out = tmp_path / "adapter.gguf"
    assert main(["export", str(lora_run.run_dir), "--adapter", "-o", str(out)]) == 0
    written, trained = read_lora_adapter(out), lora_state_dict(lora_run.model)
    assert written.alpha == ALPHA and written.rank == RANK
    assert all(torch.equal(written.tensors[n], t) for n, t in trained.items())
    merged_out = tmp_path / "merged.gguf"
    assert main(["export", str(lora_run.run_dir), "-o", str(merged_out)]) == 0
    merged, _ = api.load_gguf(merged_out)
    expected = merge_lora(lora_run.model).state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in merged.state_dict().items())
    # generate and eval on the run folder use base + adapter, unmerged (float32 rounding
    # apart: tests/integration/test_stored_inference.py), or merged when asked
    loaded, _ = api.load(lora_run.run_dir)
    ids = prompt_ids(lora_run)
    expected = our_logits(merge_lora(lora_run.model), ids)
    assert np.abs(our_logits(loaded, ids) - expected).max() < LORA_TOL
    widened, _ = api.load(lora_run.run_dir, dequantize=True)
    assert np.array_equal(our_logits(widened, ids), expected)
    text = tmp_path / "few.txt"
    text.write_text(SONNETS_PATH.read_text()[:2000])  # a few chunks: eval's cost is per chunk
    assert main(["eval", str(lora_run.run_dir), "--data", str(text)]) == 0
    assert "perplexity:" in capsys.readouterr().out


def test_cli_exports_a_lora_run_as_a_peft_adapter_that_peft_runs(lora_run, base, tmp_path):
    """`export RUN --adapter --format hf`: PEFT loads the folder onto the HF export of the base
    and computes the run's logits (float32 both; 1e-5 as tests/integration/test_peft.py)."""
    from peft import PeftModel  # test dependencies
    from transformers import LlamaConfig, LlamaForCausalLM

    from llamatrain.hf.config import hf_config
    from llamatrain.hf.weights import hf_state_dict

    folder = tmp_path / "peft"
    args = ["export", str(lora_run.run_dir), "--adapter", "--format", "hf", "-o", str(folder)]
    assert main(args) == 0
    # the base in transformers (the run's SPM vocabulary has no tokenizer.json form, which
    # export --format hf would write too; the weights and config.json are the same code's)
    model, tokenizer = api.load(base)
    hf = LlamaForCausalLM(LlamaConfig(**hf_config(model.cfg, tokenizer, None)))
    hf.load_state_dict(hf_state_dict(model.cfg, model.state_dict()))
    peft_model = PeftModel.from_pretrained(hf, folder).eval()
    ids = prompt_ids(lora_run)
    with torch.no_grad():
        theirs = peft_model(input_ids=torch.tensor([ids])).logits[0].double().numpy()
    ours = our_logits(merge_lora(lora_run.model), ids)
    assert np.abs(ours - our_logits(model, ids)).max() > 1e-3  # the adapter matters
    assert np.abs(theirs - ours).max() < 1e-5


@pytest.mark.parametrize(
    "source, extra, message",
    [
        ("base", [], "holds no LoRA adapter"),
        ("run", ["--type", "q8_0"], "drop --type"),
        ("run", ["--format", "onnx"], "unknown export format"),
    ],
)
def test_export_adapter_errors_are_one_line(
    lora_run, base, tmp_path, capsys, source, extra, message
):
    path = base if source == "base" else lora_run.run_dir
    assert main(["export", str(path), "--adapter", "-o", str(tmp_path / "x.gguf"), *extra]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "x.gguf").exists()


def test_cli_fit_of_a_lora_run_names_its_adapter_and_merged_model(
    base, cache_dir, tmp_path, capsys
):
    overrides = lora_overrides(cache_dir, tmp_path / "run", base, 2)
    assert main(["fit", "--config", "tiny", *[a for o in overrides for a in ("--set", o)]]) == 0
    out = capsys.readouterr().out
    assert f"LoRA adapter: {tmp_path / 'run' / 'adapter-f32.gguf'}" in out
    assert f"exported GGUF: {tmp_path / 'run' / 'model-f32.gguf'}" in out


def test_an_hf_base_is_hashed_by_its_weight_files(tmp_path):
    """A base folder's identity is its weights' bytes, whatever else the folder holds."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "README.md").write_text("notes")
    assert base_sha256(folder) == hashlib.sha256(b"weights").hexdigest()
    (folder / "README.md").write_text("other notes")
    assert base_sha256(folder) == hashlib.sha256(b"weights").hexdigest()
