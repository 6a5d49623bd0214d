"""A run's model, built in one place and prepared in one order.

Building (:func:`fresh_run`, :func:`resumed_run`): the model a run starts from — new and
seeded, read from a GGUF or HF folder (``model.init_from``, opened by
``llamatrain.model_source``), or shaped like the checkpoint it resumes — with its tokenizer,
the base's keys its files keep (``inherited``) and, for a LoRA run, the base it adapts. A
frozen base's narrow storage (bf16/f16, or the GGUF's own quantized blocks) is chosen while it
is read (``model_source.build_lora_base``), so a float32 copy of it never exists.

Preparing (:func:`prepare`), as torchtitan's ``parallelize`` step does, in this one order:
LoRA adapters over the frozen base → activation checkpointing (measured on the adapted block,
before sharding) → the device → DDP/FSDP → a compiled loss. The model's code knows none of
it; each capability wraps the model from outside.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llamatrain import activation_checkpointing, parallel
from llamatrain.checkpoint import Checkpoint, check_compatible, load_checkpoint
from llamatrain.config import Config, LoraSection
from llamatrain.data.cache import sha256_file
from llamatrain.device import resolve_device
from llamatrain.errors import CheckpointError, ConfigError
from llamatrain.gguf.adapter import read_lora_adapter
from llamatrain.gguf.llama import LlamaFile, read_tokenizer, write_vocab
from llamatrain.lora import apply_lora, load_lora_state_dict
from llamatrain.memory import check_fits
from llamatrain.model import Llama, ModelConfig
from llamatrain.model_path import (
    LoraBase,
    checkpoint_dir,
    describe_base,
)
from llamatrain.model_source import (
    build_lora_base,
    load_tokenizer,
    read_model_source,
    with_base,
)
from llamatrain.parallel import Parallel
from llamatrain.run_checkpoints import CheckpointManager
from llamatrain.tokenizer import Tokenizer, train_byte_bpe, train_spm

__all__ = [
    "PreparedModel",
    "RunModel",
    "build_tokenizer",
    "fresh_run",
    "model_from_base",
    "prepare",
    "resumed_run",
    "run_choices",
    "start_adapters_from",
]


# ---- tokenizers --------------------------------------------------------------------------


def _tokenizer_cache_key(cfg: Config, paths: Sequence[Path]) -> str:
    """Tokenizer training is deterministic, so identical inputs+settings reuse the result.
    Each input counts by its sha256, as the token cache's do: a file rewritten with its old
    size and mtime is another input, a copied or touched one the same."""
    settings = {**vars(cfg.tokenizer), "seed": cfg.train.seed}  # all that training depends on
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for p in paths:
        h.update(sha256_file(p).encode())
    return h.hexdigest()[:16]


def build_tokenizer(cfg: Config, paths: Sequence[Path]) -> Tokenizer:
    """The run's vocabulary: from ``tokenizer.path`` or trained on the data (and cached)."""
    t = cfg.tokenizer
    if t.path:
        return load_tokenizer(t.path)
    cached = Path(cfg.data.cache_dir) / "tokenizers" / f"{_tokenizer_cache_key(cfg, paths)}.gguf"
    if cached.is_file():
        return read_tokenizer(cached)
    if t.model_type == "byte_bpe":
        tokenizer: Tokenizer = train_byte_bpe(paths, t.vocab_size)
    else:
        tokenizer = train_spm(
            paths,
            t.vocab_size,
            t.model_type,
            max_sentence_length=t.max_sentence_length,
            input_sentence_size=t.input_sentence_size,
            seed=cfg.train.seed,
        )
    write_vocab(cached, tokenizer)
    return tokenizer


# ---- a run's model -----------------------------------------------------------------------


@dataclass
class RunModel:
    """What a run trains and what travels with it into every checkpoint and export."""

    model: Llama
    tokenizer: Tokenizer
    inherited: dict[str, Any] = field(default_factory=dict)
    """The base model's keys its checkpoints and exports keep (``inherited_metadata``)."""
    lora_base: LoraBase | None = None
    """Set for a LoRA run: the frozen base its checkpoints name."""
    lora_base_types: Mapping[str, str] | None = None
    """Set for a LoRA run: the ggml type of each tensor in its base's file (none for an HF
    folder), from the header already read (what its merged export defaults to)."""
    checkpoint: Checkpoint | None = None
    """The checkpoint a resumed run continues from (its weights are not yet in ``model``:
    ``Trainer.load_state`` restores them onto the prepared model)."""


def fresh_run(cfg: Config, paths: Sequence[Path]) -> RunModel:
    """A new model (seeded) with its tokenizer, or the one ``model.init_from`` names."""
    if cfg.model.init_from:
        base = read_model_source(cfg.model.init_from)
        lora_base, types = None, None
        if cfg.lora.rank:  # hashed through the file the base was opened from
            lora_base = describe_base(cfg.model.init_from, contents=base.contents)
            types = _types(base)
        model = model_from_base(cfg, base)
        return RunModel(model, base.tokenizer, dict(base.inherited), lora_base, types)
    tokenizer = build_tokenizer(cfg, paths)
    torch.manual_seed(cfg.train.seed)
    model_cfg = dataclasses.replace(
        cfg.model, vocab_size=tokenizer.vocab_size, max_seq_len=cfg.data.n_ctx
    )
    _check_memory(cfg, model_cfg)
    return RunModel(Llama(model_cfg), tokenizer)


def _check_memory(cfg: Config, model: ModelConfig, base: LlamaFile | None = None) -> None:
    """Refuse a run that cannot fit this machine before any weight is allocated or read
    (``llamatrain.memory``: planned from the config and the base's header). The plan is of a
    CPU process's memory, so a run on an accelerator is not checked here."""
    if resolve_device(cfg.train.device).type != "cpu":
        return
    header = None if base is None else base.contents
    check_fits(cfg, model, None if header is None else header.tensor_types)


def _types(base: LlamaFile) -> dict[str, str]:
    """The ggml types ``base``'s file stores its tensors as (none for an HF folder)."""
    return {} if base.contents is None else dict(base.contents.tensor_types)


def model_from_base(cfg: Config, base: LlamaFile) -> Llama:
    """The model of ``base`` with the run's choices; its context stays the base's unless the
    run trains on longer windows."""
    _check_memory(cfg, base.config, base)
    base_dtype = cfg.lora.base_dtype if cfg.lora.rank else "f32"
    return build_lora_base(base, base_dtype, cfg.lora.adapted, **run_choices(cfg, base))


def run_choices(cfg: Config, base: LlamaFile) -> dict[str, object]:
    """The config changes a model built from ``base`` takes: the run's ops and attention,
    and a context that stays the base's unless the run trains on longer windows."""
    context = max(base.config.max_seq_len, cfg.data.n_ctx)
    return {"ops": cfg.model.ops, "attention": cfg.model.attention, "max_seq_len": context}


def resumed_run(cfg: Config, resume: str | Path, paths: Sequence[Path]) -> RunModel:
    """A model shaped like the checkpoint ``resume`` names (a path, or ``latest`` of the run
    folder), after checking it is the run the config asks for.

    Its weights are still the initial ones: ``Trainer.load_state`` restores them; a LoRA run's
    model is its base (checked to be the one trained on), adapted by :func:`prepare`.
    """
    manager = CheckpointManager(checkpoint_dir(cfg.output.dir), cfg.train.keep_checkpoints)
    checkpoint = load_checkpoint(manager.resolve(resume))
    _check_same_kind(cfg, checkpoint)
    if checkpoint.adapter is not None:
        base = with_base(checkpoint, cfg.model.init_from or None)
        state = checkpoint.state
        model = model_from_base(cfg, base)
        return RunModel(
            model, base.tokenizer, state.inherited, state.lora_base, _types(base), checkpoint
        )
    if cfg.model.init_from:  # a finetune keeps its base model's architecture and vocabulary
        expected, tokenizer = checkpoint.config, checkpoint.tokenizer
    else:
        tokenizer = build_tokenizer(cfg, paths)
        expected = dataclasses.replace(
            cfg.model, vocab_size=tokenizer.vocab_size, max_seq_len=cfg.data.n_ctx
        )
    check_compatible(checkpoint, expected, tokenizer)
    run_choices = {"ops": cfg.model.ops, "attention": cfg.model.attention}
    _check_memory(cfg, checkpoint.config)
    model = Llama(dataclasses.replace(checkpoint.config, **run_choices))
    return RunModel(model, checkpoint.tokenizer, checkpoint.state.inherited, checkpoint=checkpoint)


def _check_same_kind(cfg: Config, checkpoint: Checkpoint) -> None:
    """A LoRA run resumes as a LoRA run and a full finetune as one: the checkpoint holds
    adapters or the whole model, and the config must ask for the same."""
    lora_checkpoint = checkpoint.adapter is not None
    if lora_checkpoint != (cfg.lora.rank > 0):
        held = "a LoRA adapter" if lora_checkpoint else "a whole model (no LoRA)"
        asked = "0 (full finetuning)" if cfg.lora.rank == 0 else str(cfg.lora.rank)
        raise CheckpointError(
            f"the checkpoint holds {held} but the config has lora.rank = {asked}; resume "
            "with the config it was trained with"
        )


# ---- preparing it to train ---------------------------------------------------------------


@dataclass
class PreparedModel:
    """A model made ready to train by :func:`prepare`, and how to compute its loss."""

    model: Llama
    """Adapted and checkpointed, on its device; under FSDP its parameters are shards."""
    device: torch.device
    parallel: Parallel
    """How the ranks share the work (``train.parallel``), or nothing to share."""
    loss_fn: Callable[..., torch.Tensor]
    """The training loss: through DDP/FSDP when they wrap the model, compiled when asked."""
    logits_fn: Callable[..., torch.Tensor]
    """The model's forward (with ``logps_of``: the targets' log-probs, what a preference
    objective's loss is computed on): likewise through DDP/FSDP and compiled when asked."""
    checkpoint_segment: int
    """Blocks per activation-checkpointed segment (0 = none)."""


def prepare(model: Llama, cfg: Config) -> PreparedModel:
    """Apply the run's capabilities to ``model``, in this one order (why each where it is):

    1. LoRA (``lora.rank > 0``): freeze the base and add seeded adapters, so a run's adapters
       start alike however the base was read, or ``lora.init_from``'s (a resume then loads its
       own).
    2. Activation checkpointing: after LoRA, so ``auto`` measures the block that will run.
    3. The device: after the module tree is final, so every tensor moves once.
    4. DDP/FSDP: wrap (or shard) the model on its device, as torch.distributed requires.
    5. Compile: the loss (and the logits) of the wrapped model, with static shapes (training
       batches all have one shape, and dynamic-shape tracing of the ggml ops' blockwise loops
       is slower to compile and less robust). Each compiles on its first call, so a run
       compiles the one its objective calls.
    """
    if cfg.lora.rank:
        torch.manual_seed(cfg.train.seed)
        apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.adapted)
        if cfg.lora.init_from:
            start_adapters_from(model, cfg.lora)
    bf16 = cfg.train.dtype == "bfloat16"
    segment = activation_checkpointing.apply(
        model,
        cfg.train.checkpointing,
        every_n=cfg.train.checkpoint_every_n,
        n_seq=cfg.train.n_ubatch // cfg.data.n_ctx,
        n_ctx=cfg.data.n_ctx,
        autocast=torch.bfloat16 if bf16 else None,
    )
    device = resolve_device(cfg.train.device)
    model = model.to(device)
    wrapped = parallel.apply(
        model, cfg.train.parallel, mixed_precision=bf16 and device.type == "cuda"
    )
    loss, logits = wrapped.loss, functools.partial(wrapped.logits, model)
    if cfg.train.compile:
        loss, logits = torch.compile(loss, dynamic=False), torch.compile(logits, dynamic=False)
    return PreparedModel(model, device, wrapped, loss, logits, segment)


def start_adapters_from(model: Llama, lora: LoraSection) -> None:
    """The fresh adapters set to ``lora.init_from``'s (an SFT warm-up's, say), B rescaled from
    the file's alpha / rank to the run's, so the model computes what base + that adapter does
    (in llama.cpp too) and the run's adapter goes on from it: one file over the same base."""
    adapter = read_lora_adapter(Path(lora.init_from))
    if adapter.rank != lora.rank:
        raise ConfigError(
            f"lora.init_from {adapter.path} has rank {adapter.rank} but lora.rank = "
            f"{lora.rank}; set lora.rank = {adapter.rank}"
        )
    if set(adapter.targets) != set(lora.adapted):
        raise ConfigError(
            f"lora.init_from {adapter.path} adapts {', '.join(adapter.targets)} but the run "
            f"adapts {', '.join(lora.adapted)}; set lora.targets = {list(adapter.targets)}"
        )
    scale = (adapter.alpha / adapter.rank) / (lora.alpha / lora.rank)
    tensors = {
        name: tensor * scale if name.endswith(".lora_b") else tensor
        for name, tensor in adapter.tensors.items()
    }
    load_lora_state_dict(model, tensors)
