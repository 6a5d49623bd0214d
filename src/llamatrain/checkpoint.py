"""Training checkpoints: one GGUF file that resumes everything.

As in llama.cpp's 2023 trainer, a checkpoint is the model GGUF (tensors, hyper-parameters,
tokenizer keys) plus ``training.*`` counters and ``optimizer.*`` state. AdamW moments are
stored as two flat F32 vectors over all parameters in ``state_dict`` order
(``optimizer.adam.first_moments`` / ``second_moments``), exactly the 2023 layout. What GGUF
has no tensor type for (RNG states, the data cursor, L-BFGS history) travels as JSON/base64
strings. Files are written through ``llamatrain.gguf`` atomically (temp file, fsync, rename),
so a crash never leaves a half-written checkpoint, and a full disk leaves the last good one and
``latest.gguf`` as they were. Each tensor's sha256 travels along (``training.tensor_sha256``)
and is checked when a run resumes, so a damaged file is refused by name, not trained on.

A LoRA run's checkpoint is its adapter GGUF (``llamatrain.gguf.adapter``) with the same
``training.*`` / ``optimizer.*`` keys and tensors (the moments over the adapters alone), plus
the frozen base's path and content hash (``training.lora.base`` / ``.base_sha256``): the base
is not copied into every checkpoint, and a run is never resumed or loaded over another base.

Loading a checkpoint builds no model: it returns the weights and the state, and the trainer
restores them onto its own model and optimizer (``Trainer.load_state``). Today's llama.cpp
refuses a model file with extra tensors, so hand it ``llamatrain export``'s output;
``llamatrain.load`` reads checkpoints as models (:func:`read_model_source`, which merges a
LoRA run's adapter into its base).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from llamatrain.errors import CheckpointError, ConfigError
from llamatrain.gguf.adapter import LoraAdapter, read_lora_adapter, write_lora_adapter
from llamatrain.gguf.file import (
    read_gguf_metadata,
    read_stored_into,
    read_tensors_into,
    verify_gguf,
)
from llamatrain.gguf.llama import LlamaFile, read_model, write_model
from llamatrain.hf.folder import CHAT_TEMPLATE_KEY, read_hf_folder
from llamatrain.hf.weights import weight_files
from llamatrain.lora import (
    apply_lora,
    load_lora_state_dict,
    lora_modules,
    lora_state_dict,
    merge_lora,
    store_frozen_targets,
    stored_type,
)
from llamatrain.model import Llama, ModelConfig
from llamatrain.optim import AdamW, Optimizer
from llamatrain.parallel import any_rank, gathered, is_main, local_tensor, reshard, shard_like
from llamatrain.plain_state import StateFormatError, decode_state, encode_state
from llamatrain.tokenizer import Tokenizer

FILE_VERSION = 2
"""2: RNG and L-BFGS state as JSON layouts + tensors (:mod:`llamatrain.plain_state`); version 1
stored them as pickles, which are never read."""
RNG_LAYOUT_KEY, RNG_TENSORS = "training.rng.layout", "training.rng"
LBFGS_LAYOUT_KEY, LBFGS_TENSORS = "optimizer.lbfgs.layout", "optimizer.lbfgs"
PICKLED_KEYS = ("training.rng_state", "optimizer.lbfgs.state")
"""Where version-1 checkpoints kept pickles."""
LATEST = "latest.gguf"
DIVERGED_FIX = "Lower optim.lr, keep optim.grad_clip on, or check the data"
"""The advice for a run whose loss or weights stopped being finite."""
BASE_PATH_KEY = "training.lora.base"
BASE_SHA256_KEY = "training.lora.base_sha256"
CHAT_TEMPLATE_RUN_KEY = "training.lora.chat_template"
"""The chat template a LoRA run's conversations were rendered with. An adapter keeps only the
base's ``general.*`` keys, so a template the run chose (the base had none) is recorded here and
the run then loads, chats and exports with it."""


@dataclass(frozen=True)
class LoraBase:
    """The frozen model a LoRA run adapts: its absolute path and the sha256 of its content
    (:func:`base_sha256`), which a resume or load checks before using the adapter on it."""

    path: str
    sha256: str


@dataclass
class TrainingState:
    """Counters and cursors that, with the weights and optimizer, define a run's position."""

    step: int = 0
    samples: int = 0
    tokens: int = 0
    epochs: int = 0
    data_state: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    convergence: dict = field(default_factory=dict)
    seen_tokens: torch.Tensor | None = None
    """(vocab,) bool: the tokens of the training data, for seen-tokens-only sampling."""
    inherited: dict = field(default_factory=dict)
    """The base model's keys every checkpoint and export keep (``inherited_metadata``)."""
    lora_base: LoraBase | None = None
    """Set for a LoRA run: its checkpoints then hold the adapter, not the model."""


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as a bitmap (8 tokens a byte), stored as GGUF I8 bytes."""
    return torch.from_numpy(np.packbits(mask.cpu().numpy()).view(np.int8))


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(packed.numpy().view(np.uint8))[:n].astype(bool))


def _rng_states() -> dict[str, torch.Tensor]:
    states = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return states


def _restore_rng_states(states: object) -> None:
    if not (isinstance(states, dict) and isinstance(states.get("torch"), torch.Tensor)):
        raise StateFormatError("it holds no torch generator state")
    try:
        torch.set_rng_state(states["torch"])
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(states["cuda"]))
    except (RuntimeError, TypeError) as err:
        raise StateFormatError(f"the generator refused it ({err})") from None


def _trained(model: Llama) -> list[torch.nn.Parameter]:
    """The parameters the optimizer updates: all of them, or a LoRA run's adapters."""
    return [p for p in model.parameters() if p.requires_grad]


def _adam_tensors(model: Llama, optimizer: Optimizer) -> dict[str, torch.Tensor]:
    """Flatten AdamW's moments into the 2023 layout (zeros before the first step); FSDP's
    shards are gathered (every rank takes part) and only rank 0 gets them."""
    first, second = [], []
    for p in _trained(model):
        state = optimizer.state.get(p, {})
        first.append(gathered(state.get("exp_avg", torch.zeros_like(p))))
        second.append(gathered(state.get("exp_avg_sq", torch.zeros_like(p))))
    if not is_main():
        return {}
    return {
        "optimizer.adam.first_moments": torch.cat([t.flatten() for t in first]),
        "optimizer.adam.second_moments": torch.cat([t.flatten() for t in second]),
    }


def _restore_adam(model: Llama, optimizer: AdamW, tensors: dict, step: int) -> None:
    """Rebuild AdamW's per-parameter state from the flat moment vectors."""
    first = tensors["optimizer.adam.first_moments"]
    second = tensors["optimizer.adam.second_moments"]
    if first.numel() != sum(p.numel() for p in _trained(model)):
        raise CheckpointError("checkpoint optimizer state does not match the model's size")
    if step == 0:
        return
    offset = 0
    for p in _trained(model):
        n = p.numel()
        moments = [shard_like(m[offset : offset + n], p).clone() for m in (first, second)]
        optimizer.set_state(p, step, *moments)
        offset += n


def save_checkpoint(
    path: str | Path,
    model: Llama,
    tokenizer: Tokenizer,
    optimizer: Optimizer,
    state: TrainingState,
) -> Path:
    """Write one resumable GGUF checkpoint atomically: the model, or for a LoRA run
    (``state.lora_base``) the adapter, with the training state.

    Under torch.distributed every rank calls it: an FSDP model's shards are gathered, and rank
    0 alone writes the file.
    """
    reshard(model)
    extra_kv, extra_tensors = _training_extras(model, optimizer, state)
    if state.lora_base is not None:  # DDP at most (validate): every rank holds the adapters
        return _save_lora_checkpoint(path, model, state, extra_kv, extra_tensors)
    tensors = {k: gathered(v) for k, v in model.state_dict().items()}
    if not is_main():
        return Path(path)
    return write_model(
        path,
        model.cfg,
        tensors,
        tokenizer,
        type="f32",
        inherited=state.inherited,
        extra_kv=extra_kv,
        extra_tensors=extra_tensors,
        checksums=True,
    )


def _save_lora_checkpoint(
    path: str | Path,
    model: Llama,
    state: TrainingState,
    extra_kv: dict[str, object],
    extra_tensors: dict[str, torch.Tensor],
) -> Path:
    """The adapter GGUF plus the training state and the base it adapts (rank 0 writes)."""
    if not is_main():
        return Path(path)
    extra_kv[BASE_PATH_KEY] = state.lora_base.path
    extra_kv[BASE_SHA256_KEY] = state.lora_base.sha256
    if CHAT_TEMPLATE_KEY in state.inherited:
        extra_kv[CHAT_TEMPLATE_RUN_KEY] = state.inherited[CHAT_TEMPLATE_KEY]
    _, first = next(lora_modules(model))
    return write_lora_adapter(
        path,
        lora_state_dict(model),
        alpha=first.alpha,
        inherited=state.inherited,
        extra_kv=extra_kv,
        extra_tensors=extra_tensors,
        checksums=True,
    )


def _training_extras(
    model: Llama, optimizer: Optimizer, state: TrainingState
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """A checkpoint's ``training.*`` / ``optimizer.*`` keys and tensors (any kind of run)."""
    is_adam = isinstance(optimizer, AdamW)
    extra_kv: dict[str, object] = {
        "training.file_version": FILE_VERSION,
        "training.iteration_count": state.step,
        "training.sample_count": state.samples,
        "training.token_count": state.tokens,
        "training.epoch_count": state.epochs,
        "training.config": json.dumps(state.config),
        "training.convergence": json.dumps(state.convergence),
        "training.data_state": json.dumps(state.data_state),
        "optimizer.type": "adam" if is_adam else "lbfgs",
        "optimizer.lr_schedule.step": state.step,
    }
    extra_kv[RNG_LAYOUT_KEY], extra_tensors = encode_state(_rng_states(), RNG_TENSORS)
    if state.seen_tokens is not None:
        extra_tensors["training.seen_tokens"] = _pack_bits(state.seen_tokens)
    if is_adam:
        extra_kv["optimizer.adam.iteration_count"] = state.step
        extra_tensors.update(_adam_tensors(model, optimizer))
    else:
        layout, tensors = encode_state(optimizer.state_dict(), LBFGS_TENSORS)
        extra_kv[LBFGS_LAYOUT_KEY] = layout
        extra_tensors.update(tensors)
    return extra_kv, extra_tensors


@dataclass
class Checkpoint:
    """What a checkpoint file holds, read but not yet applied to a run."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    state: TrainingState
    metadata: dict
    tensors: dict[str, torch.Tensor]  # every tensor in the file, optimizer state included
    adapter: LoraAdapter | None = None  # a LoRA run's: ``weights`` are then its tensors
    base: LlamaFile | None = None
    """A LoRA run's base as read to check it (a GGUF's header only), so that building the
    model does not read it a second time (an HF base's weights would be)."""
    path: Path | None = None

    def restore_weights(self, model: Llama) -> None:
        """Load the weights into ``model``: all of them, or a LoRA run's adapters (``model``
        is then the base, adapted as the run was)."""
        if self.adapter is None:
            reshard(model)
            params = model.state_dict()
            model.load_state_dict({k: shard_like(v, params[k]) for k, v in self.weights.items()})
        else:
            load_lora_state_dict(model, self.weights)

    def restore_optimizer(self, model: Llama, optimizer: Optimizer) -> None:
        """Load the optimizer state into ``optimizer``, whose parameters are ``model``'s."""
        kind = self.metadata.get("optimizer.type")
        if kind == "adam" and isinstance(optimizer, AdamW):
            _restore_adam(model, optimizer, self.tensors, self.state.step)
        elif kind == "lbfgs" and isinstance(optimizer, torch.optim.LBFGS):
            state = self._decoded(LBFGS_LAYOUT_KEY, "L-BFGS state")
            try:
                optimizer.load_state_dict(state)
            except (KeyError, ValueError, TypeError) as err:
                raise self._damaged("L-BFGS state", f"the optimizer refused it ({err})") from None
        else:
            wanted = "adamw" if isinstance(optimizer, AdamW) else "lbfgs"
            raise CheckpointError(
                f"checkpoint holds {kind!r} optimizer state but the config asks for "
                f"optim.name = {wanted!r}; resume with the optimizer it was trained with"
            )

    def restore_rng(self) -> None:
        """Put the random generators where they were (files without the state: left as is)."""
        if RNG_LAYOUT_KEY in self.metadata or any(k in self.metadata for k in PICKLED_KEYS):
            try:
                _restore_rng_states(self._decoded(RNG_LAYOUT_KEY, "RNG state"))
            except StateFormatError as err:
                raise self._damaged("RNG state", str(err)) from None

    def _decoded(self, key: str, what: str) -> object:
        """The state stored under ``key`` (JSON layout + tensors), never a pickle: a file from an
        older llamatrain that holds one is refused with the way to keep its weights."""
        if any(k in self.metadata for k in PICKLED_KEYS):
            raise CheckpointError(
                f"{self.path} stores its training state as a Python pickle (llamatrain before "
                "checkpoint version 2), which can run code when read, so it is not read; "
                f"start a new run from its weights instead: --set model.init_from={self.path} "
                "without --resume"
            )
        try:
            return decode_state(self.metadata.get(key), self.tensors)
        except StateFormatError as err:
            raise self._damaged(what, str(err)) from None

    def _damaged(self, what: str, why: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {self.path}'s {what} is damaged: {why}; resume from an earlier "
            "checkpoint, or start a new run from its weights with model.init_from"
        )


def _seen_tokens(tensors: dict[str, torch.Tensor], vocab_size: int) -> torch.Tensor | None:
    packed = tensors.get("training.seen_tokens")
    return None if packed is None else _unpack_bits(packed, vocab_size)


def load_checkpoint(path: str | Path, base: str | Path | None = None) -> Checkpoint:
    """Read a checkpoint (or a plain model GGUF: its counters are then zero).

    A LoRA run's checkpoint is read with its base's config, tokenizer and keys, from ``base``
    (default: the path it records), which must have the content it was trained on.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    verify_gguf(path)
    if is_lora_checkpoint(path):
        return _load_lora_checkpoint(path, base)
    model_file = read_model(path)
    meta, tensors = model_file.contents.metadata, model_file.contents.tensors
    state = _training_state(meta, tensors, model_file.config.vocab_size, model_file.inherited)
    return Checkpoint(
        model_file.config, model_file.tensors, model_file.tokenizer, state, meta, tensors,
        path=path,
    )  # fmt: skip


def is_lora_checkpoint(path: str | Path) -> bool:
    """Whether a GGUF is a LoRA run's checkpoint (an adapter that records its base)."""
    meta = read_gguf_metadata(path)
    return meta.get("general.type") == "adapter" and BASE_PATH_KEY in meta


def _load_lora_checkpoint(path: Path, base: str | Path | None) -> Checkpoint:
    adapter = read_lora_adapter(path)
    meta, tensors = adapter.contents.metadata, adapter.contents.tensors
    recorded = LoraBase(str(meta[BASE_PATH_KEY]), str(meta[BASE_SHA256_KEY]))
    used = describe_base(base or recorded.path, path)
    if used.sha256 != recorded.sha256:
        raise CheckpointError(
            f"{used.path} is not the base model LoRA checkpoint {path} was trained on (sha256 "
            f"{used.sha256[:12]}… vs {recorded.sha256[:12]}…); point model.init_from at that "
            f"base, unchanged ({recorded.path})"
        )
    base_file = read_model_source(used.path)
    inherited = dict(base_file.inherited)
    if CHAT_TEMPLATE_RUN_KEY in meta:
        inherited[CHAT_TEMPLATE_KEY] = meta[CHAT_TEMPLATE_RUN_KEY]
    state = _training_state(meta, tensors, base_file.config.vocab_size, inherited)
    state.lora_base = used
    return Checkpoint(
        base_file.config, adapter.tensors, base_file.tokenizer, state, meta, tensors, adapter,
        base_file, path,
    )  # fmt: skip


def _training_state(
    meta: dict, tensors: dict[str, torch.Tensor], vocab_size: int, inherited: dict
) -> TrainingState:
    """The ``training.*`` counters, cursors and seen tokens of a checkpoint's file."""
    return TrainingState(
        step=int(meta.get("training.iteration_count", 0)),
        samples=int(meta.get("training.sample_count", 0)),
        tokens=int(meta.get("training.token_count", 0)),
        epochs=int(meta.get("training.epoch_count", 0)),
        data_state=json.loads(meta.get("training.data_state", "{}")),
        config=json.loads(meta.get("training.config", "{}")),
        convergence=json.loads(meta.get("training.convergence", "{}")),
        seen_tokens=_seen_tokens(tensors, vocab_size),
        inherited=inherited,
    )


# ---- the models a run starts from or is loaded as -----------------------------------------


def base_sha256(path: str | Path) -> str:
    """sha256 of a model source's content: a GGUF file's bytes (a run folder's latest
    checkpoint's), or an HF folder's weight files' in order."""
    path = Path(path)
    if path.is_dir() and not checkpoint_dir(path).is_dir():
        files = weight_files(path)
    else:
        files = [model_file(path).resolve()]
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def describe_base(path: str | Path, adapter: str | Path = "the LoRA run") -> LoraBase:
    """The base ``adapter`` adapts, as its checkpoints record it; CheckpointError if it is
    gone."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"the base model {path} of {adapter} does not exist; put it back or point "
            "model.init_from at a copy of it"
        )
    return LoraBase(str(path.resolve()), base_sha256(path))


def model_file(path: str | Path) -> Path:
    """A run folder means its latest checkpoint; anything else names a file."""
    path = Path(path)
    if path.is_dir():
        path = checkpoint_dir(path) / LATEST
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a checkpoint, a GGUF or a run folder")
    return path


def read_model_source(path: str | Path) -> LlamaFile:
    """A run folder (its latest checkpoint), a checkpoint, a llama GGUF, or an HF checkpoint
    folder (any other folder: one without ``checkpoints/``). A checkpoint's tensors are checked
    against the sha256 recorded when it was written (``verify_gguf``), so nothing built from
    it uses silently damaged weights; a LoRA run's is its base with the adapter merged in."""
    path = Path(path)
    if path.is_dir() and not checkpoint_dir(path).is_dir():
        return read_hf_folder(path)
    path = model_file(path)
    if is_lora_checkpoint(path):
        return _merged_lora_run(load_checkpoint(path))
    verify_gguf(path)
    return read_model(path, tensor_data=False)


def _merged_lora_run(checkpoint: Checkpoint) -> LlamaFile:
    """A LoRA checkpoint as the plain model it stands for: base W + s·B·A."""
    adapter = checkpoint.adapter
    model = build_model(checkpoint.base)
    apply_lora(model, adapter.rank, adapter.alpha, targets=adapter.targets)
    checkpoint.restore_weights(model)
    merged = merge_lora(model)
    state = {name: t.detach() for name, t in merged.state_dict().items()}
    return LlamaFile(merged.cfg, state, checkpoint.tokenizer, checkpoint.state.inherited)


def build_model(source: LlamaFile, **changes: object) -> Llama:
    """The model a file describes, with its weights; ``changes`` to its config (run choices).

    A file read without its tensor data (``read_model(path, tensor_data=False)``) is read
    straight into the model's parameters, a tensor at a time: the import then holds the model
    once, where loading a state dict holds a float copy of every weight beside it.
    """
    model = Llama(dataclasses.replace(source.config, **changes))
    if _header_only(source) and source.contents is not None:
        read_tensors_into(source.contents.path, model.state_dict())
    else:
        model.load_state_dict(source.tensors, strict=True)
    return model


def build_lora_base(
    source: LlamaFile, base_dtype: str, targets: Sequence[str], **changes: object
) -> Llama:
    """:func:`build_model` for a LoRA run whose frozen ``targets`` are kept as ``base_dtype``
    (``[lora] base_dtype``): bf16/f16, or ``quantized`` (each as the GGUF stores it).

    The model is laid out on the meta device, the targets are given their narrow storage, and
    only then is memory allocated and the file read into it (stored bytes as they are, or
    one float32 tensor at a time for a cast): a float32 copy of the targets never exists, so
    loading peaks at the model's final size. Anything else stays float32.
    """
    if base_dtype == "f32":
        return build_model(source, **changes)
    from_gguf = _header_only(source) and source.contents is not None
    if base_dtype == "quantized" and not from_gguf:
        raise ConfigError(
            "lora.base_dtype = 'quantized' keeps a GGUF's blocks, but the base is not a GGUF "
            "file; point model.init_from at a quantized GGUF or choose bf16 or f16"
        )
    cfg = dataclasses.replace(source.config, **changes)
    file_types = source.contents.tensor_types if from_gguf else {}
    names = [f"blk.{i}.{target}.weight" for i in range(cfg.n_layers) for target in targets]
    types = {name: stored_type(base_dtype, file_types.get(name, "F32"), name) for name in names}
    with torch.device("meta"):
        model = Llama(cfg)
        store_frozen_targets(model, types)
    model.to_empty(device="cpu")
    if not from_gguf:
        model.load_state_dict(source.tensors, strict=True)  # copy_ rounds to the storage
        return model
    state, path = model.state_dict(), source.contents.path
    read_tensors_into(path, {name: t for name, t in state.items() if name not in types})
    as_stored = [name for name in names if types[name] == file_types.get(name)]
    read_stored_into(path, {name: state[name] for name in as_stored})
    for name in set(names) - set(as_stored):  # cast: a tensor's float32 copy at a time
        wide = torch.empty(state[name].shape, dtype=torch.float32)
        read_tensors_into(path, {name: wide})
        state[name].copy_(wide)
    return model


def _header_only(source: LlamaFile) -> bool:
    """Whether ``source`` was read without its tensor data (``read_model(tensor_data=False)``)."""
    return any(tensor.is_meta for tensor in source.tensors.values())


def check_compatible(checkpoint: Checkpoint, model_cfg: ModelConfig, tokenizer: Tokenizer) -> None:
    """Refuse to resume a checkpoint into a run whose model or tokenizer differ."""
    if checkpoint.tokenizer.fingerprint() != tokenizer.fingerprint():
        raise CheckpointError(
            "checkpoint tokenizer differs from the one the config gives (tokenizer.* or the "
            "corpus changed); resume with the config it was trained with"
        )
    ours, theirs = model_cfg.architecture(), checkpoint.config.architecture()
    ours.pop("max_seq_len"), theirs.pop("max_seq_len")
    diffs = [
        f"{k}: checkpoint {theirs[k]!r} vs config {ours[k]!r}" for k in ours if ours[k] != theirs[k]
    ]
    if diffs:
        raise CheckpointError(
            "checkpoint model does not match the config (" + "; ".join(diffs) + "); "
            "resume with the config it was trained with or start a new output.dir"
        )


def checkpoint_dir(run_dir: str | Path) -> Path:
    """Where a run folder keeps its checkpoints."""
    return Path(run_dir) / "checkpoints"


def _write_failure(err: OSError) -> str:
    """The errno text; numpy's short tensor writes carry none, only the byte counts."""
    if err.strerror:
        return err.strerror
    return f"{err} (the disk is full or a file size limit was reached)"


def _check_finite_weights(model: Llama, step: int, kept: str) -> None:
    """Refuse to save a diverged model: the update after a NaN gradient can leave NaN weights
    while the loss that step reported was still finite. Every rank checks its shard and all
    refuse together, so none waits for a save that is not coming."""
    bad = next(
        (n for n, w in model.named_parameters() if not torch.isfinite(local_tensor(w)).all()),
        None,
    )
    if any_rank(bad is not None):
        raise CheckpointError(
            f"weight {bad or 'on another rank'} is not finite at step {step}, so it is not "
            f"saved; {kept}. " + DIVERGED_FIX
        )


class CheckpointManager:
    """Numbered checkpoints in ``<run>/checkpoints``, the last K kept (0 = all), ``latest.gguf``
    a stable name for the newest."""

    def __init__(self, directory: str | Path, keep: int) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def path_for(self, step: int) -> Path:
        return self.directory / f"step-{step:07d}.gguf"

    @property
    def latest(self) -> Path:
        return self.directory / LATEST

    def kept(self) -> str:
        """What survives a failed run: the checkpoint ``latest.gguf`` points at, if any."""
        if self.latest.exists():
            return f"the last good checkpoint {self.latest.resolve()} is intact"
        return "no checkpoint was written yet"

    def save(self, model, tokenizer, optimizer, state: TrainingState) -> Path:
        """Write step ``state.step``'s checkpoint, point ``latest.gguf`` at it, prune old ones.

        Raises CheckpointError, leaving the previous checkpoints and ``latest.gguf`` as they
        were, when the weights are not finite or the folder cannot be written (full, read-only).
        """
        _check_finite_weights(model, state.step, self.kept())
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = save_checkpoint(self.path_for(state.step), model, tokenizer, optimizer, state)
            if not is_main():
                return path  # rank 0 writes, points latest.gguf and prunes
            self._point_latest_at(path)
        except OSError as err:
            raise CheckpointError(
                f"cannot write the step-{state.step} checkpoint in {self.directory}: "
                f"{_write_failure(err)}; {self.kept()}. Free space or choose another output.dir"
            ) from err
        self._prune(state.step)
        return path

    def _point_latest_at(self, path: Path) -> None:
        """Swap the ``latest.gguf`` symlink atomically (symlink to a temp name, rename)."""
        tmp = self.directory / f".{LATEST}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.symlink(path.name, tmp)
            os.replace(tmp, self.latest)
        finally:
            tmp.unlink(missing_ok=True)  # gone after the rename; left over if it failed

    def numbered(self) -> dict[int, Path]:
        """The folder's checkpoints by the step their name says (``step-<n>.gguf``, read as a
        number: names stop sorting by step once a step has more digits than the padding)."""
        found = {}
        for path in self.directory.glob("step-*.gguf"):
            digits = path.name.removeprefix("step-").removesuffix(".gguf")
            if digits.isascii() and digits.isdigit() and path.is_file():
                found[int(digits)] = path
        return found

    def _prune(self, step: int) -> None:
        """Keep step ``step``'s checkpoint (``latest.gguf``'s) and the ``keep - 1`` newest before
        it. Checkpoints of later steps belong to a trajectory a resume from an earlier one
        abandoned, so they go first."""
        if self.keep == 0:
            return
        found = self.numbered()
        current = self.path_for(step)
        others = sorted((s for s, p in found.items() if p != current), key=lambda s: (s < step, s))
        for old in others[: max(0, len(others) - (self.keep - 1))]:  # abandoned, then oldest
            found[old].unlink(missing_ok=True)

    def resolve(self, spec: str | Path) -> Path:
        """``latest`` means this run's newest checkpoint; anything else is a path."""
        if str(spec) == "latest":
            if not self.latest.exists():
                raise CheckpointError(
                    f"no checkpoint to resume in {self.directory}; run without --resume first "
                    "or check output.dir"
                )
            return self.latest.resolve()
        return Path(spec)
