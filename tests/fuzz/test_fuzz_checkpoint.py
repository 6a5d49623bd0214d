"""Fuzz the checkpoint reader and a resume from what it read, property-based.

The checkpoints of two real runs of the tiny config (a full finetune with AdamW, and a LoRA
run that records its base) are edited at the key and tensor level (``fuzz_gguf_layout``): the
``training.*`` counters and JSON states (data cursor, convergence history, RNG layout), the
``optimizer.*`` keys and moment tensors, the LoRA base's path and hash, the seen-token bitmap.
Half the time the checksums (``training.tensor_sha256``, ``training.state_sha256``) are
recomputed, as anyone can, so the edit reaches the checks behind them. Then what
``Trainer.load_state`` does on a resume — weights into the model, AdamW's moments, the RNG,
the convergence history, the data sampler's cursor and its next batch — and ``info
--verify``'s checks each end in a LlamatrainError in one line or succeed, within
``fuzz_bounds.bounded``'s time and memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from fuzz_bounds import bounded
from fuzz_gguf_layout import Bases, edit, edits, read_layout, resign, write
from fuzz_models import base_files
from gguf import GGUFValueType as _V
from hypothesis import example, given
from hypothesis import strategies as st

from llamatrain.checkpoint import load_checkpoint
from llamatrain.config.sections import OptimSection
from llamatrain.convergence import ConvergenceTests
from llamatrain.data.windows import BatchSampler
from llamatrain.gguf.describe import describe_gguf
from llamatrain.gguf.file import nonfinite_tensors, verify_gguf
from llamatrain.lora import apply_lora
from llamatrain.model import Llama
from llamatrain.model_source import build_model, with_base
from llamatrain.optim import build_optimizer

pytestmark = pytest.mark.fuzz

BASES = ["checkpoint-full", "checkpoint-lora"]
STATE_KEYS = [
    "training.iteration_count", "training.sample_count", "training.token_count",
    "training.epoch_count", "training.data_state", "training.convergence", "training.config",
    "training.rng.layout", "training.file_version", "optimizer.type",
    "optimizer.adam.iteration_count", "training.lora.base", "training.lora.base_sha256",
    "training.state_sha256", "training.tensor_sha256", "optimizer.lbfgs.layout",
    "training.rng_state", "adapter.lora.alpha", "general.type",
]  # fmt: skip
STATE_TENSORS = [
    "optimizer.adam.first_moments", "optimizer.adam.second_moments", "training.seen_tokens",
    "training.rng.0", "blk.0.attn_q.weight.lora_a", "blk.1.ffn_down.weight.lora_b",
]  # fmt: skip
state_edits = st.tuples(
    st.sampled_from(
        [
            "delete",
            "retype",
            "set",
            "set",
            "json_field",
            "t_drop",
            "t_retype",
            "t_dims",
            "t_cut",
            "t_rename",
        ]
    ),  # fmt: skip
    st.sampled_from(STATE_KEYS + STATE_TENSORS),
    edits.map(lambda e: e[2]),
    edits.map(lambda e: e[3]),
    st.integers(0, 1 << 18).map(lambda n: 3 * n + 1),  # "set" the key named, not another
)


def resume(path: Path, n_windows: int) -> None:
    """What a resume does with a checkpoint (``Trainer.load_state``), on a model built as
    ``llamatrain.build.resumed_run`` builds it."""
    checkpoint = load_checkpoint(path)
    if checkpoint.adapter is None:
        model = Llama(checkpoint.config)
    else:
        model = build_model(with_base(checkpoint))
        adapter = checkpoint.adapter
        apply_lora(model, adapter.rank, adapter.alpha, targets=adapter.targets)
    checkpoint.restore_weights(model)
    optimizer = build_optimizer(model, OptimSection())
    checkpoint.restore_optimizer(model, optimizer)
    rng = torch.get_rng_state()
    try:
        checkpoint.restore_rng()
    finally:
        torch.set_rng_state(rng)
    ConvergenceTests(OptimSection()).load_state_dict(checkpoint.state.convergence)
    sampler = BatchSampler(range(n_windows), 1)
    sampler.load_state_dict(checkpoint.state.data_state)
    sampler.next_indices()


def verified(path: Path) -> None:
    verify_gguf(path)
    nonfinite_tensors(path)
    describe_gguf(path)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Bases:
    files = base_files(tmp_path_factory.getbasetemp() / "fuzz_files", cache_dir)
    return Bases({name: read_layout(files[name]) for name in BASES})


@pytest.fixture(scope="module")
def windows(layouts: Bases) -> dict[str, int]:
    """Each run's training window count: the data a resume would have, which a checkpoint's
    claim is checked against."""
    return {
        name: json.loads(layout.keys["training.data_state"].value)["n_windows"]
        for name, layout in layouts.items()
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_checkpoint_cases")


def case(base: str, *changes: tuple, signed: bool = True, reader: str = "resume") -> Any:
    """A seeded case: a crash the fuzzing found, kept."""
    return example(base=base, changes=list(changes), signed=signed, reader=reader)


@given(
    base=st.sampled_from(BASES),
    changes=st.lists(state_edits | state_edits | edits, min_size=1, max_size=3),
    signed=st.booleans(),
    reader=st.sampled_from(["resume", "resume", "verify"]),
)
@case("checkpoint-full", ("set", "training.data_state", _V.STRING, "[]", 1))
@case("checkpoint-full", ("set", "training.iteration_count", _V.STRING, "x", 1))
@case("checkpoint-full", ("json_field", "training.convergence", _V.STRING, "x", 0))
@case("checkpoint-full", ("t_drop", "optimizer.adam.first_moments", _V.UINT32, 0, 0))
@case("checkpoint-full", ("t_cut", "optimizer.adam.second_moments", _V.UINT32, 0, 4))
@case("checkpoint-full", ("t_retype", "training.seen_tokens", _V.UINT32, 0, 0))
@case("checkpoint-lora", ("delete", "training.lora.base_sha256", _V.UINT32, 0, 0))
def test_edited_checkpoint_resumes_or_is_refused_in_one_line(
    layouts: Bases, windows: dict, folder: Path, base: str, changes: list, signed: bool, reader: str
) -> None:
    layout = layouts[base].copy()
    for change in changes:
        edit(layout, change)
    path = write(resign(layout) if signed else layout, folder / "c.gguf")
    use = verified if reader == "verify" else lambda p: resume(p, windows[base])
    bounded(lambda: use(path), f"{reader} of {base} after {changes}")


def test_the_base_checkpoints_resume(layouts: Bases, windows: dict, folder: Path) -> None:
    for base in BASES:
        path = write(layouts[base], folder / f"{base}.gguf")
        resume(path, windows[base])
        verified(path)
