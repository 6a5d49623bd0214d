"""A run's model, built in one place and prepared in one order.

Building (:func:`fresh_run`, :func:`resumed_run`): the model a run starts from — new and
seeded, read from a GGUF or HF folder (``model.init_from``, opened by
``llamatrain.model_source``), or shaped like the checkpoint it resumes — with its tokenizer,
the base's keys its files keep (``inherited``) and, for a LoRA run, the base it adapts. A
frozen base's narrow storage (bf16/f16, or the GGUF's own quantized blocks) is chosen while it
is read (``model_source.build_lora_base``), so a float32 copy of it never exists.

The reference of DPO/IPO over a full finetune (:func:`reference_of`): the initial model's
log-probs of every row, read from the cache or computed once before training. GRPO's over a
full finetune (:func:`build_base_reference`): the base itself, frozen and held as its GGUF
stores it, which scores each rollout's completions.

Preparing (:func:`prepare`), as torchtitan's ``parallelize`` step does, in this one order:
LoRA adapters over the frozen base → activation checkpointing (measured on the adapted block,
before sharding) → the device → DDP/FSDP → a compiled loss. The model's code knows none of
it; each capability wraps the model from outside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llamatrain import activation_checkpointing, parallel
from llamatrain.checkpoint import Checkpoint, CheckpointManager, check_compatible, load_checkpoint
from llamatrain.config import Config
from llamatrain.data import TrainData
from llamatrain.data.cache import sha256_file
from llamatrain.device import resolve_device
from llamatrain.errors import CheckpointError, ConfigError
from llamatrain.gguf.file import read_tensors_into
from llamatrain.gguf.llama import LlamaFile, read_tokenizer, write_vocab
from llamatrain.lora import ALL_TARGETS, apply_lora
from llamatrain.memory import check_fits
from llamatrain.model import Llama, ModelConfig
from llamatrain.model_path import (
    REFERENCE_ROLE,
    LoraBase,
    check_same_model,
    checkpoint_dir,
    describe_base,
)
from llamatrain.model_source import (
    build_lora_base,
    is_header_only,
    load_tokenizer,
    read_model_source,
    with_base,
)
from llamatrain.parallel import Parallel
from llamatrain.preference import ReferenceTable, cached_reference_table, reference_table
from llamatrain.tokenizer import Tokenizer, train_byte_bpe, train_spm

__all__ = [
    "GRPO_REFERENCE_ROLE",
    "FrozenReference",
    "PreparedModel",
    "RunModel",
    "build_base_reference",
    "build_tokenizer",
    "fresh_run",
    "prepare",
    "reference_of",
    "resumed_run",
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
        if cfg.holds_base_reference:  # refused before anything is built from it
            _check_mappable(cfg, base)
        lora_base, types = None, None
        if cfg.lora.rank:  # hashed through the file the base was opened from
            lora_base = describe_base(cfg.model.init_from, contents=base.contents)
            types = _types(base)
        model = _from_base(cfg, base)
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


def _from_base(cfg: Config, base: LlamaFile) -> Llama:
    """The model of ``base`` with the run's choices; its context stays the base's unless the
    run trains on longer windows."""
    _check_memory(cfg, base.config, base)
    base_dtype = cfg.lora.base_dtype if cfg.lora.rank else "f32"
    return build_lora_base(base, base_dtype, cfg.lora.adapted, **_run_choices(cfg, base))


def _run_choices(cfg: Config, base: LlamaFile) -> dict[str, object]:
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
        model = _from_base(cfg, base)
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
    reference, role = checkpoint.state.reference_model, _reference_role(cfg)
    if reference is not None and role is not None:  # before the reference is read
        used = describe_base(cfg.model.init_from, checkpoint.path)
        check_same_model(used, reference, role, checkpoint.path)
    run_choices = {"ops": cfg.model.ops, "attention": cfg.model.attention}
    _check_memory(cfg, checkpoint.config)
    model = Llama(dataclasses.replace(checkpoint.config, **run_choices))
    return RunModel(model, checkpoint.tokenizer, checkpoint.state.inherited, checkpoint=checkpoint)


def _reference_role(cfg: Config) -> str | None:
    """How the run names ``model.init_from`` when it scores against it (a full finetune's
    DPO/IPO table, GRPO's frozen base); None when it scores against no file."""
    if _scores_against_a_table(cfg):
        return REFERENCE_ROLE
    return GRPO_REFERENCE_ROLE if cfg.holds_base_reference else None


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
       start alike however the base was read (a resume then loads its own).
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


# ---- the reference of a full finetune's DPO/IPO ----------------------------------------------


def reference_of(
    model: Llama, cfg: Config, data: TrainData, device: torch.device, *, initial: bool
) -> ReferenceTable | None:
    """The reference log-probs of ``data``'s rows for DPO/IPO over a full finetune (None for
    any other run: a LoRA run's reference is its base with the adapters off).

    They are the initial model's — ``model.init_from``'s weights — read from the cache in
    ``data.cache_dir`` (keyed by that file's sha256, the run's ops, attention and dtype, and
    the rows; see ``llamatrain.preference.cached_reference_table``) or computed by ``model``
    on ``device`` and cached. ``initial``: ``model`` holds those weights (a fresh run); a
    resumed run's model does not yet hold its checkpoint's, so when its cache entry is gone
    the base's weights are read into it, a tensor at a time, to recompute it (the checkpoint's
    are restored afterwards).
    """
    t = cfg.train
    if not _scores_against_a_table(cfg):
        return None
    autocast: contextlib.AbstractContextManager = contextlib.nullcontext()
    if t.dtype == "bfloat16":
        autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    source = describe_base(cfg.model.init_from, "this DPO/IPO run")
    key = {
        "model_sha256": source.sha256,
        "ops": cfg.model.ops,
        "attention": cfg.model.attention,
        "dtype": t.dtype,
    }

    def compute() -> ReferenceTable:
        if not initial:
            warnings.warn(
                f"no cached reference log-probs for this resumed run; computing them again "
                f"from {cfg.model.init_from}",
                stacklevel=3,
            )
        scorer = _initial_model(model, cfg, device, initial=initial)
        return reference_table(scorer, data.train, data.val, cfg.seqs_per_ubatch, device, autocast)

    table, _ = cached_reference_table(cfg.data.cache_dir, key, data.train, data.val, compute)
    return dataclasses.replace(table, model=source)


def _scores_against_a_table(cfg: Config) -> bool:
    """DPO/IPO over a full finetune: its reference is ``model.init_from``'s log-probs, a
    table (a LoRA run's is its base with the adapters off)."""
    return cfg.train.objective in ("dpo", "ipo") and not cfg.lora.rank


def _initial_model(model: Llama, cfg: Config, device: torch.device, *, initial: bool) -> Llama:
    """A model with the run's initial weights to compute the reference table by: ``model``
    when it holds them; ``model`` with ``model.init_from``'s weights read into it (a resumed
    run's own are restored afterwards); for an FSDP model, a whole copy read from
    ``model.init_from``, since a sharded forward needs every rank and rank 0 computes the
    cache alone (``parallel.main_first``). That copy is freed after the table; every rank
    held the whole model before sharding it, so the copy raises no peak."""
    if parallel.sharded(model):
        return _from_base(cfg, read_model_source(cfg.model.init_from)).to(device)
    if not initial:
        _read_weights_into(model, read_model_source(cfg.model.init_from))
    return model


def _read_weights_into(model: Llama, source: LlamaFile) -> None:
    """``source``'s weights into ``model`` (same architecture, any device), one tensor at a
    time: no second copy of the model is ever held."""
    header_only = is_header_only(source) and source.contents is not None
    with torch.no_grad():
        for name, target in model.state_dict().items():
            if header_only:
                wide = target.dtype if not target.is_floating_point() else torch.float32
                value = torch.empty(target.shape, dtype=wide)
                read_tensors_into(source.contents, {name: value})
            else:
                value = source.tensors[name]
            target.copy_(value)


# ---- the reference of a full finetune's GRPO -----------------------------------------------

GRPO_REFERENCE_ROLE = "GRPO KL reference model"
"""How a resume refusing a changed ``model.init_from`` names GRPO's frozen base."""


@dataclass(frozen=True)
class FrozenReference:
    """GRPO's KL reference over a full finetune (``Config.holds_base_reference``): the base
    the run started from, frozen, and the file it was read from."""

    model: Llama
    """On the run's device, in eval mode, without gradients; its projections and vocabulary
    tables held as the file stores them (:func:`build_lora_base`, ``quantized``)."""
    source: LoraBase
    """``model.init_from`` and its sha256, which the run's checkpoints record, so a resume
    over a changed base is refused (:func:`resumed_run`)."""


def build_base_reference(cfg: Config, device: torch.device) -> FrozenReference | None:
    """GRPO's KL reference over a full finetune, or None for a run that needs none (a LoRA
    run's is its base with the adapters off; ``beta = 0`` has no KL).

    It is ``model.init_from`` as :func:`build_lora_base` keeps a QLoRA base, every
    projection adapted: each matrix and vocabulary table a view of the GGUF's copy-on-write
    map (``gguf.file.map_stored``), the norms float32. On the CPU it costs about the file's
    size in page cache the kernel can drop, never a float32 copy; on an accelerator, the
    file's size of device memory. Each block is decoded to float32 as a forward needs it,
    so its log-probs are those of the dequantized base. An HF folder (or a LoRA run, read
    merged) has no file to map: it is refused with the conversion that gives one.
    """
    if not cfg.holds_base_reference:
        return None
    source = describe_base(cfg.model.init_from, "this GRPO run")
    base = read_model_source(cfg.model.init_from)
    _check_mappable(cfg, base)
    model = build_lora_base(base, "quantized", ALL_TARGETS, **_run_choices(cfg, base))
    model.requires_grad_(False).eval()
    return FrozenReference(model.to(device), source)


def _check_mappable(cfg: Config, base: LlamaFile) -> None:
    """Refuse a GRPO reference that would be a float copy: ``base`` was not read from a
    GGUF model file (an HF folder; a LoRA run, read merged), so nothing maps it."""
    if base.contents is None or not is_header_only(base):
        raise ConfigError(
            f"model.init_from = {cfg.model.init_from} is not a GGUF model file, which GRPO's "
            "KL reference over a full finetune is mapped from; convert it (llamatrain export "
            f"{cfg.model.init_from} -o base.gguf --type bf16) and point model.init_from at "
            "base.gguf, or set lora.rank > 0 or train.beta = 0"
        )
