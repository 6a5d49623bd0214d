"""A run's model, built in one place and prepared in one order.

Building (:func:`fresh_run`, :func:`resumed_run`, :func:`read_model_source`): the model a run
starts from — new and seeded, read from a GGUF or HF folder (``model.init_from``), or shaped
like the checkpoint it resumes — with its tokenizer, the base's keys its files keep
(``inherited``) and, for a LoRA run, the base it adapts. A frozen base's narrow storage
(bf16/f16, or the GGUF's own quantized blocks) is chosen while it is read
(:func:`build_lora_base`), so a float32 copy of it never exists.

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
from llamatrain.checkpoint import (
    CHAT_TEMPLATE_RUN_KEY,
    Checkpoint,
    CheckpointManager,
    check_compatible,
    load_checkpoint,
    recorded_export_type,
)
from llamatrain.config import Config
from llamatrain.data.cache import sha256_file
from llamatrain.device import resolve_device
from llamatrain.errors import CheckpointError, ConfigError, TokenizerError
from llamatrain.gguf.adapter import target_suffixes
from llamatrain.gguf.export_types import ALL_EXPORT_TYPES
from llamatrain.gguf.file import map_stored, read_gguf, read_tensors_into, verify_gguf
from llamatrain.gguf.llama import LlamaFile, read_model, read_tokenizer, write_vocab
from llamatrain.hf.folder import CHAT_TEMPLATE_KEY, read_hf_folder
from llamatrain.lora import (
    apply_lora,
    merge_lora,
    store_frozen_targets,
    stored_type,
)
from llamatrain.memory import check_fits
from llamatrain.model import Llama, ModelConfig
from llamatrain.model_config import VOCAB_TABLES
from llamatrain.model_source import (
    BASE_ROLE,
    LoraBase,
    check_same_model,
    checkpoint_dir,
    describe_base,
    is_hf_folder,
    model_file,
    records_a_base,
)
from llamatrain.ops.dequantize import DEQUANTIZABLE
from llamatrain.parallel import Parallel
from llamatrain.tokenizer import (
    Tokenizer,
    load_sentencepiece,
    read_hf_tokenizer,
    train_byte_bpe,
    train_spm,
)

__all__ = [
    "PreparedModel",
    "RunModel",
    "build_lora_base",
    "build_model",
    "build_tokenizer",
    "export_type_of",
    "fresh_run",
    "header_only",
    "load_tokenizer",
    "lora_run_model",
    "model_from_base",
    "model_to_export",
    "prepare",
    "read_model_source",
    "resumed_run",
    "run_choices",
    "with_base",
]


# ---- tokenizers --------------------------------------------------------------------------


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The vocabulary of a GGUF (model, checkpoint or vocab-only), a sentencepiece .model, or
    an HF tokenizer.json or model folder holding one (read as llama.cpp's converter would)."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".json":
        return read_hf_tokenizer(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist; fix the path")
    with path.open("rb") as f:
        is_gguf = f.read(4) == b"GGUF"
    return read_tokenizer(path) if is_gguf else load_sentencepiece(path)


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


# ---- models from files -------------------------------------------------------------------


def read_model_source(path: str | Path) -> LlamaFile:
    """A run folder (its latest checkpoint), a checkpoint, a llama GGUF, or an HF checkpoint
    folder (any other folder: one without ``checkpoints/``). A checkpoint's tensors are checked
    against the sha256 recorded when it was written (``verify_gguf``), so nothing built from
    it uses silently damaged weights; a LoRA run's is its base with the adapter merged in."""
    opened = _open_source(path)
    if isinstance(opened, LlamaFile):
        return opened
    checkpoint, base = opened
    merged = merge_lora(lora_run_model(checkpoint, base))
    state = {name: t.detach() for name, t in merged.state_dict().items()}
    return LlamaFile(merged.cfg, state, checkpoint.tokenizer, checkpoint.state.inherited)


def model_to_export(path: str | Path) -> tuple[Llama, Tokenizer, dict[str, Any]]:
    """What ``export`` writes from ``path`` (as :func:`read_model_source` names it): the model,
    its tokenizer and the keys it keeps. A LoRA run's is its adapted model, the base held as its
    file stores it: a writer merges it a tensor at a time (``lora.merged_tensors``), so a 7B
    run's export never holds its 27 GB merged float32 copy."""
    opened = _open_source(path)
    if isinstance(opened, LlamaFile):
        return build_model(opened), opened.tokenizer, dict(opened.inherited)
    checkpoint, base = opened
    return lora_run_model(checkpoint, base), checkpoint.tokenizer, checkpoint.state.inherited


def export_type_of(path: str | Path) -> str:
    """The ggml type ``export`` writes ``path`` as when none is named (``--type auto``).

    A run's checkpoint (or run folder): the type the run chose for its own export, which its
    config records (``gguf.export_types.merged_export_type``: q8_0 over a quantized base, the
    base's float type, f32 for a model trained whole), so a QLoRA run exported later is not
    silently widened to float32 (27 GB for a 7B over a 3.5 GB Q4_0 base). Anything else (a
    GGUF model, an HF folder, a checkpoint from before runs recorded it): f32, its weights as
    they are computed.
    """
    if is_hf_folder(path):
        return "f32"
    recorded = recorded_export_type(read_gguf(model_file(path), tensor_data=False).metadata)
    return recorded if recorded in ALL_EXPORT_TYPES else "f32"


def _open_source(path: str | Path) -> LlamaFile | tuple[Checkpoint, LlamaFile]:
    """A model file's contents (header only for a GGUF), or a LoRA checkpoint with its base."""
    if is_hf_folder(path):
        return read_hf_folder(path)
    header = read_gguf(model_file(path), tensor_data=False)  # parsed once, handed down
    if records_a_base(header.metadata):
        checkpoint = load_checkpoint(header)
        return checkpoint, with_base(checkpoint)
    verify_gguf(header)
    return read_model(header, tensor_data=False)


def with_base(checkpoint: Checkpoint, base: str | Path | None = None) -> LlamaFile:
    """Read a LoRA run's base (``base``, default: the path its checkpoint records), which must
    have the content the run was trained on, and complete ``checkpoint`` with the base's
    config, tokenizer and keys; returns the base as read (its header: the weights are read
    into the model that is built from it)."""
    recorded = checkpoint.state.lora_base
    used = describe_base(base or recorded.path, checkpoint.path)
    check_same_model(used, recorded, BASE_ROLE, checkpoint.path)
    base_file = read_model_source(used.path)
    inherited = dict(base_file.inherited)
    if CHAT_TEMPLATE_RUN_KEY in checkpoint.metadata:
        inherited[CHAT_TEMPLATE_KEY] = checkpoint.metadata[CHAT_TEMPLATE_RUN_KEY]
    checkpoint.config, checkpoint.tokenizer = base_file.config, base_file.tokenizer
    state = checkpoint.state
    state.inherited, state.lora_base = inherited, used
    if state.seen_tokens is not None:  # the bitmap is whole bytes; the vocabulary decides
        state.seen_tokens = state.seen_tokens[: base_file.config.vocab_size]
    return base_file


def lora_run_model(checkpoint: Checkpoint, base: LlamaFile) -> Llama:
    """A LoRA checkpoint's model as its run held it: the base (checked by :func:`with_base`)
    with each adapted projection kept as its GGUF stores it where ``ops.dequantize`` reads the
    type (float32 otherwise, and from an HF folder), and the checkpoint's adapters on it."""
    adapter = checkpoint.adapter
    types = base.contents.tensor_types if header_only(base) and base.contents else {}
    names = [name for name in types if name.endswith(target_suffixes(adapter.targets))]
    stored = "quantized" if names and all(types[n] in DEQUANTIZABLE for n in names) else "f32"
    model = build_lora_base(base, stored, adapter.targets)
    apply_lora(model, adapter.rank, adapter.alpha, targets=adapter.targets)
    checkpoint.restore_weights(model)
    return model


def build_model(source: LlamaFile, **changes: object) -> Llama:
    """The model a file describes, with its weights; ``changes`` to its config (run choices).

    A file read without its tensor data (``read_model(path, tensor_data=False)``) is read
    straight into the model's parameters, a tensor at a time: the import then holds the model
    once, where loading a state dict holds a float copy of every weight beside it.
    """
    model = Llama(dataclasses.replace(source.config, **changes))
    if header_only(source) and source.contents is not None:
        read_tensors_into(source.contents, model.state_dict())
    else:
        model.load_state_dict(source.tensors, strict=True)
    return model


def build_lora_base(
    source: LlamaFile, base_dtype: str, targets: Sequence[str], **changes: object
) -> Llama:
    """:func:`build_model` for a LoRA run whose frozen ``targets`` are kept as ``base_dtype``
    (``[lora] base_dtype``): bf16/f16, or ``quantized`` (each as the GGUF stores it; then the
    vocabulary tables too, :func:`_kept_tables`).

    The model is laid out on the meta device, the targets are given their narrow storage, and
    only then is memory allocated and the file read into it (one float32 tensor at a time for
    a cast): a float32 copy of the targets never exists, so loading peaks at the model's final
    size. Those kept as the file stores them are not read at all but mapped
    (``gguf.file.map_stored``): their pages are the file's, as llama.cpp holds a model. Anything
    else stays float32.
    """
    if base_dtype == "f32":
        return build_model(source, **changes)
    from_gguf = header_only(source) and source.contents is not None
    if base_dtype == "quantized" and not from_gguf:
        raise ConfigError(
            "lora.base_dtype = 'quantized' keeps a GGUF's blocks, but the base is not a GGUF "
            "file; point model.init_from at a quantized GGUF or choose bf16 or f16"
        )
    cfg = dataclasses.replace(source.config, **changes)
    file_types = source.contents.tensor_types if from_gguf else {}
    names = [f"blk.{i}.{target}.weight" for i in range(cfg.n_layers) for target in targets]
    types = {name: stored_type(base_dtype, file_types.get(name, "F32"), name) for name in names}
    types |= _kept_tables(base_dtype, file_types)
    with torch.device("meta"):
        model = Llama(cfg)
        store_frozen_targets(model, types)
    model.to_empty(device="cpu")
    if not from_gguf:
        model.load_state_dict(source.tensors, strict=True)  # copy_ rounds to the storage
        return model
    state, header = model.state_dict(), source.contents
    read_tensors_into(header, {name: t for name, t in state.items() if name not in types})
    as_stored = [name for name in types if types[name] == file_types.get(name)]
    for name, mapped in map_stored(header, {name: state[name] for name in as_stored}).items():
        _replace_tensor(model, name, mapped)
    for name in set(types) - set(as_stored):  # cast: a tensor's float32 copy at a time
        wide = torch.empty(state[name].shape, dtype=torch.float32)
        read_tensors_into(header, {name: wide})
        state[name].copy_(wide)
    return model


def _replace_tensor(model: Llama, name: str, tensor: torch.Tensor) -> None:
    """Point the buffer ``name`` of ``model`` at ``tensor`` (the one it held is freed)."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, tensor)


def _kept_tables(base_dtype: str, file_types: Mapping[str, str]) -> dict[str, str]:
    """The vocabulary tables a QLoRA run keeps as its file stores them (``lora.FrozenTable``):
    those of a type ``ops.dequantize`` reads, but F32, which is the float32 table already."""
    if base_dtype != "quantized":
        return {}
    return {
        name: file_types[name]
        for name in VOCAB_TABLES
        if file_types.get(name, "F32") in DEQUANTIZABLE - {"F32"}
    }


def header_only(source: LlamaFile) -> bool:
    """Whether ``source`` was read without its tensor data (``read_model(tensor_data=False)``)."""
    return any(tensor.is_meta for tensor in source.tensors.values())


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
        lora_base = describe_base(cfg.model.init_from) if cfg.lora.rank else None
        types = _types(base) if cfg.lora.rank else None
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
