"""What ``auto`` in ``model.ops``, ``model.attention`` and ``train.dtype`` becomes on each
device (``llamatrain.device.resolve_run_settings``), and the CUDA branches of the device's
process settings, selected on a CPU-only machine by making PyTorch report a GPU.

The CUDA cases patch ``torch.cuda.is_available`` and ``torch.cuda.is_bf16_supported``: the
resolution only asks those questions, so the branch a GPU machine takes runs here; nothing
touches a real device.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import tomllib

import pytest
import torch

from llamatrain import api
from llamatrain.config import Config
from llamatrain.denormals import denormals_flushed, flushing
from llamatrain.device import configure_process, resolve_run_settings
from llamatrain.model import Llama
from llamatrain.model_config import ModelConfig
from llamatrain.ops.attention import flash_attn
from llamatrain.ops.sets import GgmlOps, TorchOps, op_set
from llamatrain.trainer import Trainer


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """Make PyTorch report a CUDA device; ``gpu(bf16=False)`` one without native bf16."""

    def make(*, bf16: bool = True) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)

    return make


def resolved(**settings: object) -> tuple[str, str, str]:
    """(ops, attention, dtype) that a Config with ``settings`` (``section__key``) trains with."""
    cfg = Config()
    for key, value in settings.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    out = resolve_run_settings(cfg)
    return out.model.ops, out.model.attention, out.train.dtype


def test_the_defaults_are_auto():
    cfg = Config()
    assert (cfg.model.ops, cfg.model.attention, cfg.train.dtype) == ("auto", "auto", "auto")


def test_auto_on_the_cpu_is_the_ggml_path_in_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolved() == ("ggml", "flash", "float32")


@pytest.mark.parametrize(
    ("amx", "base_dtype", "dtype"),
    [(True, "quantized", "bfloat16"), (False, "quantized", "float32"), (True, "bf16", "float32")],
)
def test_auto_on_the_cpu_is_bf16_for_qlora_where_amx_multiplies_it(
    monkeypatch, amx, base_dtype, dtype
):
    """QLoRA's usual compute dtype where the CPU has bf16 tiles; LoRA over a float base, and
    a CPU that would emulate bf16, keep float32."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolved(lora__rank=8, lora__base_dtype=base_dtype) == ("ggml", "flash", dtype)


def test_auto_on_cuda_picks_torch_ops_sdpa_and_bf16(gpu):
    gpu()
    assert resolved() == ("torch", "sdpa", "bfloat16")


def test_auto_on_cuda_without_native_bf16_stays_float32(gpu):
    gpu(bf16=False)
    assert resolved() == ("torch", "sdpa", "float32")


def test_ggml_ops_alone_give_the_ggml_path_on_cuda(gpu):
    gpu()
    assert resolved(model__ops="ggml") == ("ggml", "flash", "float32")


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"model__attention": "softmax"}, ("torch", "softmax", "bfloat16")),
        ({"train__dtype": "float32"}, ("torch", "sdpa", "float32")),
        ({"model__ops": "ggml", "train__dtype": "bfloat16"}, ("ggml", "flash", "bfloat16")),
        ({"model__ops": "ggml", "model__attention": "sdpa"}, ("ggml", "sdpa", "float32")),
        ({"train__device": "cpu"}, ("ggml", "flash", "float32")),
    ],
)
def test_on_cuda_a_setting_made_explicitly_is_kept(gpu, settings, expected):
    gpu()
    assert resolved(**settings) == expected


def test_resolving_twice_changes_nothing(gpu):
    gpu()
    once = resolve_run_settings(Config())
    assert resolve_run_settings(once) == once


@pytest.mark.parametrize(
    "built, expected",
    [
        (GgmlOps("flash"), ("ggml", "flash", "float32")),
        (TorchOps("sdpa"), ("torch", "sdpa", "bfloat16")),
        (TorchOps("flash"), ("torch", "flash", "bfloat16")),
    ],
)
def test_on_cuda_a_built_model_s_ops_decide_whatever_the_config_says(gpu, built, expected):
    """A Trainer given a model (built with the CPU's choices) trains its ops: auto's dtype
    follows them, and the record names them."""
    gpu()
    for ops in ("auto", "ggml", "torch"):
        cfg = Config()
        cfg.model.ops = ops
        out = resolve_run_settings(cfg, built)
        assert (out.model.ops, out.model.attention, out.train.dtype) == expected


def test_a_trainer_given_a_model_makes_auto_concrete(tmp_path):
    """A notebook's ``Trainer(model, Config())`` runs and records the concrete choices of the
    model it was given, as fit does."""
    cfg = Config()
    cfg.output.dir = str(tmp_path / "run")
    built = dataclasses.replace(cfg.model, vocab_size=64, max_seq_len=cfg.data.n_ctx)
    model = Llama(dataclasses.replace(built, ops="torch", attention="sdpa"))
    trainer = Trainer(model, cfg, progress=False)
    chosen = (trainer.cfg.model.ops, trainer.cfg.model.attention, trainer.cfg.train.dtype)
    assert chosen == ("torch", "sdpa", "float32")  # the CPU's dtype for the model's ops
    recorded = trainer.state.config
    assert (recorded["model"]["ops"], recorded["train"]["dtype"]) == ("torch", "float32")


def test_a_model_built_with_auto_makes_the_cpu_choices():
    """Inference builds models on the CPU from files that hold no run choices."""
    assert op_set("auto", "auto") == GgmlOps("flash")
    assert op_set("torch", "auto") == TorchOps("flash")
    model = Llama(ModelConfig(dim=32, n_heads=4, n_layers=1, vocab_size=16, max_seq_len=8))
    assert model.ops == GgmlOps("flash")


@pytest.fixture
def tf32_flag():
    """Restore PyTorch's process-wide TF32 switch after a test flips it."""
    saved = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.usefixtures("tf32_flag")
def test_configure_process_on_cuda_allows_tf32_under_bf16_only():
    torch.backends.cuda.matmul.allow_tf32 = False
    configure_process(torch.device("cuda"), bf16=False)
    assert torch.backends.cuda.matmul.allow_tf32 is False
    configure_process(torch.device("cuda"), bf16=True)
    assert torch.backends.cuda.matmul.allow_tf32 is True


def _attention_gradients(inputs: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    q, k, v = (t.to(dtype, copy=True).requires_grad_() for t in inputs)
    (flash_attn(q, k, v, block_size=32) * v.detach().flip(2)).sum().backward()
    return [t.grad.double() for t in (q, k, v)]


def _denormals_made() -> int:
    """How many of a million float32 products below 2^-126 stay denormal: an element-wise op
    that long is split over PyTorch's threads, so each thread's setting shows."""
    return int(torch.count_nonzero(torch.full((1 << 20,), 1e-30) * 1e-10))


def test_denormals_are_flushed_inside_the_block_only_and_attention_keeps_its_tolerance():
    """``denormals_flushed`` makes a float32 product below 2^-126 an exact zero while it runs,
    in PyTorch's worker threads as in this one (attention's tail of tiny probabilities ran
    ~100x slower as denormals), and puts the state back after, Python's own floats included
    (a test framework's float strategies refuse to run without subnormals). What flushing
    loses is invisible: flash attention's gradients over scores whose softmax makes hundreds
    of denormals move by < 1e-10 of their largest entry (measured 6e-14; float32's own
    rounding is 1.2e-7) and stay within 2e-5 of the float64 reference (measured 1e-5 with
    and without: the scores are huge)."""
    torch.manual_seed(0)  # scores spread over ~±300: ~900 probabilities below 2^-126
    inputs = [torch.randn(1, 4, 96, 32, dtype=torch.float64) * s for s in (10.0, 10.0, 1.0)]
    q, k, _ = (t.float() for t in inputs)
    p = (q @ k.transpose(-1, -2) / 32**0.5).softmax(-1)
    assert int(((p > 0) & (p < torch.finfo(torch.float32).tiny)).sum()) > 500
    assert _denormals_made() == 1 << 20
    kept = _attention_gradients(inputs, torch.float32)
    reference = _attention_gradients(inputs, torch.float64)
    with denormals_flushed():
        assert _denormals_made() == 0 and flushing()
        flushed = _attention_gradients(inputs, torch.float32)
    assert _denormals_made() == 1 << 20 and not flushing() and sys.float_info.min / 2 > 0.0
    for a, b, r in zip(kept, flushed, reference, strict=True):
        scale = r.abs().max()
        assert (a - b).abs().max() / scale < 1e-10
        assert (b - r).abs().max() / scale < 2e-5


def test_a_runs_steps_flush_denormals_and_the_process_keeps_them_after(tiny_overrides, monkeypatch):
    """``fit``'s trainer runs inside ``denormals_flushed``; the caller's process is as before
    once it returns."""
    seen = []
    step = Trainer.train_step

    def recording(self, *args, **kwargs):
        seen.append(_denormals_made())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", recording)
    overrides = {
        "train.steps": 2,
        "train.eval_every": 0,
        "train.save_every": 0,
        "train.sample_tokens": 0,
        "output.export": "false",
    }
    api.fit("tiny", overrides=tiny_overrides(**overrides), progress=False)
    assert seen == [0, 0]
    assert _denormals_made() == 1 << 20


def test_torch_ops_sdpa_and_bf16_autocast_train_on_the_cpu(tiny_overrides):
    """The settings ``auto`` picks on CUDA, set explicitly, train a few steps on the CPU and
    are what the run records."""
    overrides = {
        "model.ops": '"torch"',
        "model.attention": '"sdpa"',
        "train.dtype": '"bfloat16"',
        "train.steps": 3,
        "train.eval_every": 0,
        "train.save_every": 0,
        "train.sample_tokens": 0,
        "output.export": "false",
    }
    result = api.fit("tiny", overrides=tiny_overrides(**overrides), progress=False)
    assert result.history.train and all(math.isfinite(m["loss"]) for m in result.history.train)
    recorded = tomllib.loads((result.run_dir / api.RUN_CONFIG).read_text())
    assert recorded["model"]["ops"] == "torch" and recorded["model"]["attention"] == "sdpa"
    assert recorded["train"]["dtype"] == "bfloat16"


def test_a_run_records_what_auto_chose(tiny_overrides, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    overrides = {
        "train.steps": 1,
        "train.eval_every": 0,
        "train.save_every": 0,
        "train.sample_tokens": 0,
        "output.export": "false",
    }
    result = api.fit("tiny", overrides=tiny_overrides(**overrides), progress=False)
    recorded = tomllib.loads((result.run_dir / api.RUN_CONFIG).read_text())
    chosen = (recorded["model"]["ops"], recorded["model"]["attention"], recorded["train"]["dtype"])
    assert chosen == ("ggml", "flash", "float32")
    assert (result.config.model.ops, result.config.train.dtype) == ("ggml", "float32")
