"""Fuzz the LoRA adapter reader, and what is done with an adapter read, property-based.

LoRA adapter GGUFs llamatrain writes over a model of each family, and a LoRA run's checkpoint,
are edited at the key and tensor level (``fuzz_gguf_layout``): ``general.type`` /
``adapter.type`` / ``adapter.lora.alpha`` deleted, retyped or set to telling values (0, NaN,
negative), A/B tensors dropped, renamed (to model weights, to pairs of other layers), given
other shapes or ranks, relabelled as other ggml types. Each adapter is then read
(``read_lora_adapter``) and applied to its base model (``apply_lora`` +
``load_lora_state_dict``, then a forward pass); the checkpoint is exported as llama.cpp's
adapter GGUF and as a PEFT folder (``export_adapter``). Each ends in a LlamatrainError in one
line or succeeds, within ``fuzz_bounds.bounded``'s time and memory.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fuzz_bounds import bounded
from fuzz_gguf_layout import Bases, edit, edits, read_layout, resign, write
from fuzz_models import FAMILIES, base_files
from gguf import GGUFValueType as _V
from hypothesis import example, given
from hypothesis import strategies as st

from llamatrain import api
from llamatrain.gguf.adapter import read_lora_adapter
from llamatrain.gguf.llama import read_model
from llamatrain.lora import apply_lora, load_lora_state_dict
from llamatrain.model import Llama

pytestmark = pytest.mark.fuzz

ADAPTER_KEYS = ["general.type", "adapter.type", "adapter.lora.alpha", "general.architecture"]
ADAPTER_TENSORS = [
    "blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b", "blk.1.ffn_down.weight.lora_a",
    "blk.1.attn_v.weight.lora_b", "token_embd.weight", "blk.2.attn_q.weight.lora_a",
]  # fmt: skip
adapter_edits = st.tuples(
    st.sampled_from(
        [
            "delete",
            "retype",
            "set",
            "t_drop",
            "t_rename",
            "t_dims",
            "t_retype",
            "t_duplicate",
            "t_cut",
        ]
    ),  # fmt: skip
    st.sampled_from(ADAPTER_KEYS + ADAPTER_TENSORS),
    edits.map(lambda e: e[2]),
    st.sampled_from([0, -1.0, float("nan"), float("inf"), 1e-30, 2**32 - 1, "lora", "adapter"])
    | edits.map(lambda e: e[3]),
    st.integers(0, 1 << 18).map(lambda n: 3 * n + 1),  # "set" the key named, not another
)
BASES = [f"lora-{arch}" for arch in FAMILIES] + ["checkpoint-lora"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Path]:
    return base_files(tmp_path_factory.getbasetemp() / "fuzz_files", cache_dir)


@pytest.fixture(scope="module")
def models(files: dict) -> dict[str, Llama]:
    """Each family's base model (the f32 export), which its adapter is applied to."""
    out = {}
    for arch in FAMILIES:
        source = read_model(files[f"{arch}-f32"])
        out[arch] = Llama(source.config).eval()
        out[arch].load_state_dict(source.tensors)
    return out


@pytest.fixture(scope="module")
def layouts(files: dict) -> Bases:
    return Bases({name: read_layout(files[name]) for name in BASES})


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_adapter_cases")


def applied(path: Path, base: Llama) -> None:
    """The adapter read and applied to (a copy of) its base, which then runs."""
    adapter = read_lora_adapter(path)
    model = Llama(base.cfg).eval()
    model.load_state_dict(base.state_dict())
    apply_lora(model, adapter.rank, adapter.alpha, targets=adapter.targets)
    load_lora_state_dict(model, adapter.tensors)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))


def exported(path: Path, out: Path) -> None:
    for kind in ("gguf", "hf"):
        target = out / f"adapter-{kind}"
        shutil.rmtree(target, ignore_errors=True)
        target.unlink(missing_ok=True)
        api.export_adapter(path, target, format=kind)


def case(base: str, *changes: tuple, signed: bool = True) -> Any:
    """A seeded case: a crash the fuzzing found, kept."""
    return example(base=base, changes=list(changes), signed=signed)


@given(
    base=st.sampled_from(BASES),
    changes=st.lists(adapter_edits | adapter_edits | edits, min_size=1, max_size=3),
    signed=st.booleans(),
)
@case("lora-qwen3", ("set", "adapter.lora.alpha", _V.FLOAT32, float("nan"), 1))
@case("lora-llama", ("set", "adapter.lora.alpha", _V.STRING, "lora", 1))
@case("lora-gemma3", ("set", "adapter.lora.alpha", _V.ARRAY, [1.0], 1))
def test_edited_adapter_is_applied_or_refused_in_one_line(
    models: dict, layouts: Bases, folder: Path, base: str, changes: list, signed: bool
) -> None:
    layout = layouts[base].copy()
    for change in changes:
        edit(layout, change)
    path = write(resign(layout) if signed else layout, folder / "a.gguf")
    if base == "checkpoint-lora":
        use = lambda: exported(path, folder)  # noqa: E731
    else:
        use = lambda: applied(path, models[base.removeprefix("lora-")])  # noqa: E731
    bounded(use, f"{base} after {changes}")


def test_the_base_adapters_apply(models: dict, layouts: Bases, folder: Path) -> None:
    for base in BASES:
        path = write(layouts[base], folder / f"{base}.gguf")
        if base == "checkpoint-lora":
            exported(path, folder)
        else:
            applied(path, models[base.removeprefix("lora-")])
