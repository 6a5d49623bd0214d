"""GRPO's KL reference over a full finetune (``train.beta > 0``, ``lora.rank = 0``): the base
``model.init_from`` names, frozen and held as its GGUF stores it (``objectives.grpo.reference``).

The base is a random tiny llama of the tiny config's vocabulary exported Q8_0, so the
reference's projections and tables are the file's blocks, mapped, while the trained model is
their float32 decoding (and exported F32, whose projections are mapped as they are and whose
tables are read as float32). Checked: the reference's tensors lie in the file's pages; its
log-probs are those of a separately loaded, dequantized copy of the base; the memory plan
counts exactly the bytes it holds; a run trains, its logged KL 0 at the first step (the policy
is the base) and growing after updates; a resume rebuilds the same reference and goes on bit
for bit; its checkpoints record the base's sha256, and a resume over a replaced base is
refused in one line; an HF folder, which has no file to map,
is refused in one line naming the conversion that gives one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from file_mappings import mapped_ranges
from random_models import tiny_llama
from user_errors import error_of

from llamatrain import api
from llamatrain.build import build_tokenizer
from llamatrain.checkpoint import load_checkpoint
from llamatrain.config import load_config
from llamatrain.data import resolve_inputs
from llamatrain.gguf.file import read_gguf
from llamatrain.lora import FrozenLinear, FrozenTable
from llamatrain.memory import plan_memory
from llamatrain.model import Llama
from llamatrain.model_path import base_sha256
from llamatrain.objectives.grpo.reference import build_base_reference
from llamatrain.objectives.grpo.rollout import scored_logps, training_rows
from llamatrain.trainer import Trainer, held_types

pytestmark = pytest.mark.usefixtures("decoded_products_module")
"""The reference's log-probs are the dequantized base's to float32 rounding (LOGP_TOL) and the
KL starts at 0 over the decoded path's float32 products; the quantized kernels round x to 8 bits
(ops.quantized_matmul; ~1e-3 in a log-prob here) and are tested on their own."""

WORDS = ["love", "beauty", "time", "summer", "rose", "heart", "eye", "youth"]
REWARD_FILE = """
def vowels(prompts, completions, completion_ids, **columns):
    return [float(sum(ch in "aeiou" for ch in text)) for text in completions]
"""
"""A reward that differs between a random model's completions, so the first step updates."""
LOGP_TOL = 1e-6
"""|Δ log-prob| between the reference and the dequantized base: measured 0 (bit for bit) on
log-probs down to -6.3 for Q8_0, Q4_0 and F32 bases, the same float32 values through the same
matmuls; the limit leaves room for another summation order only."""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("grpo_full")
    model, tokenizer = tiny_llama(cache_dir)
    base = api.export_gguf(model, tokenizer, folder / "base.gguf", type="q8_0")
    f32 = api.export_gguf(model, tokenizer, folder / "base-f32.gguf", type="f32")
    prompts = folder / "prompts.jsonl"
    rows = [{"prompt": f"Say {w}.", "answer": w} for w in WORDS * 2]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewards = folder / "vowel_rewards.py"
    rewards.write_text(REWARD_FILE)
    return {"base": base, "f32": f32, "prompts": prompts, "rewards": rewards, "cache": cache_dir}


def overrides(files: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return [
        f'data.cache_dir="{files["cache"]}"',
        f'output.dir="{run_dir}"',
        f'model.init_from="{files["base"]}"',
        f'data.path="{files["prompts"]}"',
        'data.format="jsonl"',
        "data.val_fraction=0.125",
        'train.objective="grpo"',
        f'train.rewards=["{files["rewards"]}:vowels"]',
        "train.beta=0.04",
        "train.num_generations=4",
        "train.max_completion_length=8",
        "train.steps=3",
        "train.n_batch=512",  # 8 completions a step: 2 prompts x 4 ...
        "train.n_ubatch=256",  # ... in 2 micro-batches
        "train.save_every=1",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.log_every=1",
        "optim.lr=1e-2",
        "optim.warmup_steps=1",
        "output.export=false",
        *extra,
    ]


def reference_config(files: dict[str, Path], tmp_path: Path, *extra: str):
    return load_config("tiny", overrides(files, tmp_path / "run", *extra))


@pytest.mark.parametrize(("base", "kept"), [("base", 2 * 7 + 2), ("f32", 2 * 7)])
def test_the_reference_is_the_bases_blocks_mapped_from_its_file(base, kept, files, tmp_path):
    """Every projection of the reference (and a Q8_0 file's token table and output) is a view
    of the file's own pages holding its stored bytes at their offset; nothing of it trains."""
    path = files[base]
    cfg = reference_config({**files, "base": path}, tmp_path)
    reference = build_base_reference(cfg, torch.device("cpu"))
    contents = read_gguf(path, tensor_data=False)
    frozen = {
        f"{name}.weight": module.weight
        for name, module in reference.model.named_modules()
        if isinstance(module, FrozenLinear | FrozenTable)
    }
    assert len(frozen) == kept  # 7 projections a block (the tables of a quantized file)
    ranges, data = mapped_ranges(path), path.read_bytes()
    for name, weight in frozen.items():
        start, end = weight.data_ptr(), weight.data_ptr() + weight.nbytes
        assert any(lo <= start and end <= hi for lo, hi in ranges), name
        info = contents.infos[name]
        assert weight.numpy().tobytes() == data[info.offset : info.offset + info.n_bytes]
    assert not any(p.requires_grad for p in reference.model.parameters())
    assert reference.source.sha256 == base_sha256(path)


@pytest.mark.parametrize("base", ["base", "f32"])
def test_the_references_log_probs_are_the_dequantized_bases(base, files, tmp_path) -> None:
    """Scored as the rollout scores it (micro-batches, temperature), the reference gives the
    log-probs of the base loaded on its own and decoded to float32 (``api.load_gguf``)."""
    cfg = reference_config({**files, "base": files[base]}, tmp_path)
    reference = build_base_reference(cfg, torch.device("cpu"))
    loaded, tokenizer = api.load_gguf(files[base])
    generator = torch.Generator().manual_seed(0)
    prompts = [tokenizer.encode(f"Say {w}.") for w in WORDS[:4]]
    completions = [
        torch.randint(3, tokenizer.vocab_size, (n,), generator=generator).tolist()
        for n in (3, 8, 5, 8)
    ]
    inputs, targets = training_rows(prompts, completions, tokenizer.eos_id)
    nothing = contextlib.nullcontext()
    ours = scored_logps(reference.model, inputs, targets, 0.7, 2, nothing)
    theirs = scored_logps(loaded.eval(), inputs, targets, 0.7, 2, nothing)
    scored = targets != -100
    assert scored.sum() == 24 and ours[scored].min() < -3
    assert (ours - theirs)[scored].abs().max() < LOGP_TOL


def test_the_memory_plan_counts_the_reference_it_holds(files, tmp_path) -> None:
    """Exactly the bytes of the reference's tensors (its file's blocks, float32 norms); a
    LoRA run's reference, and a run without a KL term, hold none."""
    cfg = reference_config(files, tmp_path)
    reference = build_base_reference(cfg, torch.device("cpu"))
    model_cfg = reference.model.cfg
    plan = plan_memory(cfg, model_cfg, held_types(reference.model))
    held = {t.data_ptr(): t.nbytes for t in reference.model.state_dict().values()}
    assert plan.reference == sum(held.values())
    assert f"KL reference {plan.reference / (1 << 20):,.0f} MB" in plan.line()
    types = read_gguf(files["base"], tensor_data=False).tensor_types
    assert plan_memory(cfg, model_cfg, types).reference == plan.reference  # from the header
    model, tokenizer = api.load_gguf(files["base"])
    trainer = Trainer(model, cfg, tokenizer=tokenizer, progress=False)  # builds its reference
    assert trainer.memory_plan().reference == plan.reference  # the opening summary's
    for other in (["lora.rank=4"], ["train.beta=0"]):
        changed = reference_config(files, tmp_path, *other)
        assert plan_memory(changed, model_cfg, types).reference == 0
        assert build_base_reference(changed, torch.device("cpu")) is None


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory, files):
    run_dir = tmp_path_factory.mktemp("grpo_full_run") / "run"
    return api.fit("tiny", overrides=overrides(files, run_dir), progress=False)


def test_a_full_finetunes_kl_starts_at_zero_and_grows_with_the_updates(full_run, files):
    """The whole model trains; at the first step the policy is the base, so its KL to the
    reference is 0 (up to float32 rounding of two matmul orders), and it grows after."""
    assert full_run.config.lora.rank == 0
    kls = [r["kl"] for r in full_run.history.train]
    assert len(kls) == 3
    assert abs(kls[0]) < 1e-9, kls
    assert kls[1] > 1e-4 and kls[2] > kls[1], kls
    recorded = load_checkpoint(full_run.run_dir / "checkpoints" / "latest.gguf")
    assert recorded.state.reference_model.sha256 == base_sha256(files["base"])


def test_a_resume_rebuilds_the_same_reference_and_refuses_a_replaced_base(
    full_run, files, tmp_path
):
    """Cut after step 1 and resumed, the run rebuilds its reference from the base and goes on
    as the uninterrupted one did, bit for bit (a copy of the base at another path is the same
    reference: its sha256 is what counts). Another model written over the base's file stops
    the next resume in one line before anything is built, as the LoRA and DPO paths do."""
    base = tmp_path / "base.gguf"
    base.write_bytes(files["base"].read_bytes())
    run = overrides({**files, "base": base}, tmp_path / "run")
    api.fit("tiny", overrides=[*run, "train.steps=1"], progress=False)
    resumed = api.fit("tiny", overrides=run, resume="latest", progress=False)
    for name in ("kl", "reward", "loss"):
        whole = [r[name] for r in full_run.history.train[1:]]
        assert [r[name] for r in resumed.history.train] == whole, name
    for name, tensor in full_run.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name
    model, tokenizer = tiny_llama(files["cache"], seed=1)
    api.export_gguf(model, tokenizer, base, type="q8_0")  # the same path, other weights
    further = [*run, "train.steps=4"]
    message = error_of(api.fit, "tiny", overrides=further, resume="latest", progress=False)
    assert f"{base} is not the GRPO KL reference model of checkpoint" in message
    assert "its content changed" in message and "point model.init_from at that model" in message


def test_an_hf_folder_base_is_refused_with_the_conversion_that_maps(files, tmp_path):
    """An HF folder's weights are read into memory (safetensors, widened): a reference of it
    would be a float copy beside the trained model, so the run stops before building either,
    naming the export to a GGUF whose blocks the reference maps."""
    byte_bpe = [f'data.cache_dir="{files["cache"]}"', 'tokenizer.model_type="byte_bpe"']
    cfg = load_config("tiny", [*byte_bpe, "tokenizer.vocab_size=320"])
    tokenizer = build_tokenizer(cfg, resolve_inputs(cfg.data.path, cfg.data.cache_dir))
    shape = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size, max_seq_len=64)
    folder = api.export_hf(Llama(shape), tokenizer, tmp_path / "hf")
    run = overrides({**files, "base": folder}, tmp_path / "run", *byte_bpe)
    message = error_of(api.fit, "tiny", overrides=[*run, "tokenizer.vocab_size=320"])
    assert f"model.init_from = {folder} is not a GGUF model file" in message
    assert f"llamatrain export {folder} -o base.gguf --type bf16" in message
    assert not (tmp_path / "run" / "config.toml").exists()
    converted = api.export(folder, tmp_path / "base.gguf", type="bf16")  # what it names
    cfg = load_config("tiny", overrides({**files, "base": converted}, tmp_path / "run"))
    reference = build_base_reference(cfg, torch.device("cpu"))
    assert reference.model.get_submodule("blk.0.attn_q").weight.dtype == torch.bfloat16
