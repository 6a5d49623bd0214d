"""llamatrain.memory: the memory a run will need, planned before it loads, and the refusal of a
run that cannot fit.

The plan's weights and trained state are counts, checked exactly against the tensors a run
holds; its activations are a calibrated estimate (the module docstring says how), checked
here for the rules that do not depend on the calibration: more tokens need more, activation
checkpointing needs less.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from user_errors import error_of

from llamatrain import memory
from llamatrain.config import load_config
from llamatrain.lora import ALL_TARGETS, apply_lora, lora_state_dict, store_frozen_targets
from llamatrain.memory import check_fits, plan_memory
from llamatrain.model import Llama, ModelConfig
from llamatrain.model_config import VOCAB_TABLES, tensor_shapes

SEVEN_B = ModelConfig(
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=32,
    ffn_dim=11008,
    vocab_size=32000,
    max_seq_len=4096,
)
"""Llama-2-7B's shape."""
SMALL = ModelConfig(
    dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=512, max_seq_len=64
)


def lora_config(*extra: str):
    return load_config(
        "tiny", ['model.init_from="base.gguf"', "lora.rank=8", "data.n_ctx=64", *extra]
    )


def test_a_qlora_plan_counts_the_blocks_it_holds_and_float32_for_the_rest() -> None:
    """Exactly the bytes of the model a QLoRA run builds: every adapted projection and the
    vocabulary tables as its file's blocks, everything else float32; trained state: adapters,
    gradients, 2 moments."""
    cfg = lora_config('lora.base_dtype="quantized"')
    types = dict.fromkeys(tensor_shapes(SMALL), "Q4_0")
    targets = {
        name: "Q4_0"
        for name in types
        if name in VOCAB_TABLES or name.rsplit(".", 2)[1] in ALL_TARGETS
    }
    with torch.device("meta"):
        model = Llama(SMALL)
        store_frozen_targets(model, targets)
    model.to_empty(device="cpu")
    apply_lora(model, 8, 16.0)
    plan = plan_memory(cfg, SMALL, types)
    adapters = lora_state_dict(model)
    held = sum(t.nbytes for name, t in model.state_dict().items() if name not in adapters)
    assert plan.weights == held
    assert plan.training == 3 * sum(t.nbytes for t in adapters.values())


def test_a_full_finetune_plan_counts_every_parameter_four_times() -> None:
    cfg = load_config("tiny", ["data.n_ctx=64"])
    plan = plan_memory(cfg, SMALL)
    params = sum(t.numel() for t in Llama(SMALL).state_dict().values())
    assert plan.weights == 4 * params
    assert plan.training == 4 * params * 3


def test_activations_grow_with_tokens_and_shrink_with_checkpointing() -> None:
    def activations(*extra: str) -> int:
        return plan_memory(lora_config(*extra), SEVEN_B).activations

    base = activations("train.n_batch=256", "train.checkpointing='none'")
    assert activations("train.n_batch=512", "train.checkpointing='none'") > 1.9 * base
    assert activations("train.n_batch=256", "train.checkpointing='full'") < base / 4


def test_a_7b_qlora_plan_is_the_files_size() -> None:
    types = dict.fromkeys(tensor_shapes(SEVEN_B), "Q4_0")
    plan = plan_memory(lora_config('lora.base_dtype="quantized"'), SEVEN_B, types)
    blocks = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008) // 32 * 18  # Q4_0: 18 bytes a block
    embeddings = 2 * 32000 * 4096 // 32 * 18  # token_embd and output as blocks too (147 MB)
    norms = 4 * 4096 * (2 * 32 + 1)
    assert plan.weights == blocks + embeddings + norms  # 3.79 GB (4.69 GB with float32 tables)
    f32_tables = plan_memory(
        lora_config('lora.base_dtype="quantized"'), SEVEN_B,
        {**types, "token_embd.weight": "F32", "output.weight": "F32"},
    )  # fmt: skip
    assert f32_tables.weights == blocks + 2 * 4 * 32000 * 4096 + norms
    assert plan.export == 2 * 4 * 11008 * 4096  # the largest merged weight and its base
    bf16 = plan_memory(lora_config('lora.base_dtype="bf16"'), SEVEN_B, types)
    assert bf16.weights > 1.5 * plan.weights


ONE_B = ModelConfig(
    dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
    max_seq_len=131072, tie_embeddings=True,
)  # fmt: skip
"""Llama-3.2-1B's shape."""


def gb(plan) -> str:
    return f"{plan.peak / (1 << 30):,.1f} GB"


def refusal(monkeypatch, available_gb: float, cfg, model, types=None) -> str:
    monkeypatch.setattr(memory, "available_memory", lambda: int(available_gb * (1 << 30)))
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0)
    return error_of(check_fits, cfg, model, types)


def test_a_run_that_cannot_fit_is_one_line_naming_the_least_change_that_fits(monkeypatch):
    """The refusal plans the alternatives, least change first, and names the first that fits
    with its size: a bf16 LoRA base of a 7B over 5 GB fits only as the file's Q4_0 blocks."""
    types = dict.fromkeys(tensor_shapes(SEVEN_B), "Q4_0")
    bf16 = lora_config('lora.base_dtype="bf16"', 'train.checkpointing="full"')
    message = refusal(monkeypatch, 5, bf16, SEVEN_B, types)
    quantized = plan_memory(
        lora_config('lora.base_dtype="quantized"', 'train.checkpointing="full"'), SEVEN_B, types
    )
    assert message.startswith("this run needs about") and "about 5.0 GB is available" in message
    assert message.endswith(
        f"it would fit with lora.base_dtype = 'quantized' (about {gb(quantized)})"
    )
    # nothing planned fits (no file types known): the plan's remedy for what dominates
    message = refusal(monkeypatch, 5, bf16, SEVEN_B)
    assert "would fit" not in message and message.endswith("(lora.base_dtype = 'quantized')")


def test_a_full_finetune_of_a_1b_shape_is_refused_naming_the_lora_run_that_fits(monkeypatch):
    """Issue 39's check: a full finetune of Llama-3.2-1B (float32 master weights, their
    gradients and AdamW's two moments: 4 x 4.9 GB) does not fit 16 GB; LoRA over the same
    float32 base does, and the refusal says so with its size."""
    full = load_config(
        "tiny", ['model.init_from="base.gguf"', "data.n_ctx=64", 'train.checkpointing="full"']
    )
    plan = plan_memory(full, ONE_B)
    assert plan.training == 3 * 4 * sum(
        s[0] * (s[1] if len(s) > 1 else 1) for s in tensor_shapes(ONE_B).values()
    )
    assert plan.peak > 19 << 30  # 19.6 GB
    message = refusal(monkeypatch, 16, full, ONE_B)
    lora = plan_memory(lora_config("lora.rank=16", 'train.checkpointing="full"'), ONE_B)
    assert message.endswith(
        f"it would fit with lora.rank = 16 and lora.base_dtype = 'f32' (about {gb(lora)})"
    ), message
    monkeypatch.setattr(memory, "available_memory", lambda: 32 << 30)
    check_fits(full, ONE_B, None)  # on a 32 GB machine it runs


def test_fit_refuses_before_reading_the_model_under_an_address_space_limit(tmp_path) -> None:
    """A from-scratch run of a 7B shape under a 4 GB address-space limit: refused in one line
    before the model is allocated (exit 1, no traceback), where it would have died in a
    MemoryError traceback or been killed."""
    script = textwrap.dedent(
        f"""
        import resource, sys
        from llamatrain.cli import main
        used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (used + (4 << 30), resource.RLIM_INFINITY))
        sys.exit(main(["fit", "--config", "tiny", "--set", "model.dim=4096",
                       "--set", "model.n_layers=32", "--set", "model.n_heads=32",
                       "--set", "model.ffn_dim=11008", "--set", 'output.dir="{tmp_path}/run"',
                       "--set", 'data.cache_dir="{tmp_path}/cache"']))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr
    assert "this run needs about" in lines[-1] and "lora.rank" in lines[-1]


@pytest.mark.parametrize("limit", ["max\n", "1073741824\n"])
def test_a_cgroup_limit_counts_as_the_machine(monkeypatch, tmp_path, limit) -> None:
    (tmp_path / "memory.max").write_text(limit)
    (tmp_path / "memory.current").write_text(str(1 << 28))
    monkeypatch.setattr(memory, "Path", lambda p: tmp_path if p == "/sys/fs/cgroup" else p)
    expected = None if limit == "max\n" else (1 << 30) - (1 << 28)
    assert memory._cgroup_headroom() == expected
