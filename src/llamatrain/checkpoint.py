"""Training checkpoints: one GGUF file that resumes everything.

As in llama.cpp's 2023 trainer, a checkpoint is the model GGUF (tensors, hyper-parameters,
tokenizer keys) plus ``training.*`` counters and ``optimizer.*`` state. AdamW moments are
stored as two flat F32 vectors over all parameters in ``state_dict`` order
(``optimizer.adam.first_moments`` / ``second_moments``), exactly the 2023 layout. What GGUF
has no tensor type for (the data cursor, counters) travels as JSON strings, and nested state
(RNG states, L-BFGS history) as a JSON layout plus tensors (:mod:`llamatrain.plain_state`):
nothing in a checkpoint is a pickle, so reading one can never run code. Files are written
through ``llamatrain.gguf`` atomically (temp file, fsync, rename), so a crash never leaves a
half-written checkpoint, and a full disk leaves the last good one and ``latest.gguf`` as they
were. Each tensor's sha256 travels along (``training.tensor_sha256``)
and is checked when a run resumes, so a damaged file is refused by name, not trained on.

A LoRA run's checkpoint is its adapter GGUF (``llamatrain.gguf.adapter``) with the same
``training.*`` / ``optimizer.*`` keys and tensors (the moments over the adapters alone), plus
the frozen base's path and content hash (``training.lora.base`` / ``.base_sha256``): the base
is not copied into every checkpoint, and a run is never resumed or loaded over another base.
This module never reads the base; ``llamatrain.model_source.with_base`` does, and checks its
hash.
A full finetune's DPO/IPO checkpoint records its reference model the same way
(``training.reference.model`` / ``.model_sha256``), checked on resume by the same rule
(``llamatrain.model_path.check_same_model``).

Loading a checkpoint builds no model: it returns the weights and the state, and the trainer
restores them onto its own model and optimizer (``Trainer.load_state``). Today's llama.cpp
refuses a model file with extra tensors, so hand it ``llamatrain export``'s output;
``llamatrain.load`` opens checkpoints as models (``llamatrain.model_source``, which applies a
LoRA run's adapter over its base).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llamatrain.errors import CheckpointError
from llamatrain.gguf.adapter import LoraAdapter, read_lora_adapter, write_lora_adapter
from llamatrain.gguf.file import (
    PICKLED_STATE_KEYS,
    GGUFContents,
    GGUFSource,
    load_tensor_data,
    read_gguf,
    verify_gguf,
)
from llamatrain.gguf.llama import read_model, write_model
from llamatrain.hf.folder import CHAT_TEMPLATE_KEY
from llamatrain.lora import load_lora_state_dict, lora_modules, lora_state_dict
from llamatrain.model import Llama, ModelConfig
from llamatrain.model_path import (
    BASE_PATH_KEY,
    BASE_SHA256_KEY,
    REFERENCE_PATH_KEY,
    REFERENCE_SHA256_KEY,
    LoraBase,
    records_a_base,
)
from llamatrain.optim import AdamW, Optimizer, trained_parameters
from llamatrain.parallel import gathered, is_main, reshard, shard_like
from llamatrain.plain_state import StateFormatError, decode_state, encode_state
from llamatrain.tokenizer import Tokenizer

FILE_VERSION = 2
"""2: RNG and L-BFGS state as JSON layouts + tensors (:mod:`llamatrain.plain_state`); version 1
stored them as pickles, which are never read."""
RNG_LAYOUT_KEY, RNG_TENSORS = "training.rng.layout", "training.rng"
LBFGS_LAYOUT_KEY, LBFGS_TENSORS = "optimizer.lbfgs.layout", "optimizer.lbfgs"
ADAM_TENSORS = ("optimizer.adam.first_moments", "optimizer.adam.second_moments")
"""AdamW's two moments, each one flat vector of every trained parameter in the model's order."""
OPTIMIZER_PREFIX = "optimizer."
"""A checkpoint's optimizer-state tensors: read only when a resume restores them."""
DIVERGED_FIX = "Lower optim.lr, keep optim.grad_clip on, or check the data"
"""The advice for a run whose loss or weights stopped being finite."""
CHAT_TEMPLATE_RUN_KEY = "training.lora.chat_template"
"""The chat template a LoRA run's conversations were rendered with. An adapter keeps only the
base's ``general.*`` keys, so a template the run chose (the base had none) is recorded here and
the run then loads, chats and exports with it."""


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
    reference_model: LoraBase | None = None
    """Set for a full finetune's DPO/IPO: the file its reference log-probs are of, which a
    resume checks is unchanged (``model_path.check_same_model``)."""


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as a bitmap (8 tokens a byte), stored as GGUF I8 bytes."""
    return torch.from_numpy(np.packbits(mask.cpu().numpy()).view(np.int8))


def _unpack_bits(packed: torch.Tensor, n: int | None) -> torch.Tensor:
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


def _adam_tensors(model: Llama, optimizer: Optimizer) -> dict[str, torch.Tensor]:
    """AdamW's moments in the 2023 layout, two flat vectors (zeros before the first step):
    the optimizer's own storage where it keeps them so (no copy), else concatenated; FSDP's
    shards are gathered (every rank takes part) and only rank 0 gets them."""
    flat = optimizer.flat_moments(trained_parameters(model))
    if flat is not None:
        return dict(zip(ADAM_TENSORS, flat, strict=True)) if is_main() else {}
    first, second = [], []
    for p in trained_parameters(model):
        state = optimizer.state.get(p, {})
        first.append(gathered(state.get("exp_avg", torch.zeros_like(p))))
        second.append(gathered(state.get("exp_avg_sq", torch.zeros_like(p))))
    if not is_main():
        return {}
    moments = (torch.cat([t.flatten() for t in m]) for m in (first, second))
    return dict(zip(ADAM_TENSORS, moments, strict=True))


def _restore_adam(model: Llama, optimizer: AdamW, tensors: dict, step: int) -> None:
    """Rebuild AdamW's per-parameter state from the flat moment vectors."""
    first, second = (tensors.get(name) for name in ADAM_TENSORS)
    size = sum(p.numel() for p in trained_parameters(model))
    if not all(_is_moments(m, size) for m in (first, second)):
        raise CheckpointError(
            "checkpoint optimizer state does not match the model's size (optimizer.adam.* "
            f"must be two float vectors of {size:,} values); resume from another checkpoint "
            "or start a new run from its weights with model.init_from"
        )
    if step == 0:
        return
    offset = 0
    for p in trained_parameters(model):
        n = p.numel()
        moments = [shard_like(m[offset : offset + n], p) for m in (first, second)]
        optimizer.set_state(p, step, *moments)
        offset += n


def _is_moments(tensor: torch.Tensor | None, size: int) -> bool:
    return (
        tensor is not None
        and tensor.is_floating_point()
        and tensor.dim() == 1
        and tensor.numel() == size
    )


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
    extra_kv |= _record(state.lora_base, BASE_PATH_KEY, BASE_SHA256_KEY)
    if CHAT_TEMPLATE_KEY in state.inherited:
        extra_kv[CHAT_TEMPLATE_RUN_KEY] = state.inherited[CHAT_TEMPLATE_KEY]
    _, first = next(lora_modules(model))
    return write_lora_adapter(
        path,
        lora_state_dict(model),
        alpha=first.alpha,
        base_architecture=model.cfg.arch,
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
    extra_kv |= _record(state.reference_model, REFERENCE_PATH_KEY, REFERENCE_SHA256_KEY)
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


def _record(model: LoraBase | None, path_key: str, sha256_key: str) -> dict[str, str]:
    """The keys a checkpoint records a model it depends on under (none for None)."""
    return {} if model is None else {path_key: model.path, sha256_key: model.sha256}


def _recorded(meta: dict, path_key: str, sha256_key: str) -> LoraBase | None:
    """The model :func:`_record` recorded (None when neither key is there); a damaged or
    half record is refused, never read as "no model to check"."""
    path, sha256 = meta.get(path_key), meta.get(sha256_key)
    if path is None and sha256 is None:
        return None
    if not (isinstance(path, str) and isinstance(sha256, str)):
        raise _damaged_key(sha256_key, "or its model's path is missing or not text")
    return LoraBase(path, sha256)


@dataclass
class Checkpoint:
    """What a checkpoint file holds, read but not yet applied to a run."""

    config: ModelConfig | None
    """The model's; a LoRA run's base's, once ``llamatrain.model_source.with_base`` read it."""
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    state: TrainingState
    metadata: dict
    tensors: dict[str, torch.Tensor]  # every tensor in the file, optimizer state included
    adapter: LoraAdapter | None = None  # a LoRA run's: ``weights`` are then its tensors
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
        self._read_optimizer_tensors()
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

    def _read_optimizer_tensors(self) -> None:
        """A LoRA checkpoint leaves its optimizer state unread until a resume asks for it: an
        export or a load needs only the adapter (AdamW's moments are twice its size: 152 MB
        of a 7B export's peak)."""
        if self.adapter is not None:
            load_tensor_data(self.adapter.contents)

    def restore_rng(self) -> None:
        """Put the random generators where they were (files without the state: left as is)."""
        if RNG_LAYOUT_KEY in self.metadata or any(k in self.metadata for k in PICKLED_STATE_KEYS):
            try:
                _restore_rng_states(self._decoded(RNG_LAYOUT_KEY, "RNG state"))
            except StateFormatError as err:
                raise self._damaged("RNG state", str(err)) from None

    def _decoded(self, key: str, what: str) -> object:
        """The state stored under ``key`` (JSON layout + tensors), never a pickle: a file from an
        older llamatrain that holds one is refused with the way to keep its weights."""
        if any(k in self.metadata for k in PICKLED_STATE_KEYS):
            raise CheckpointError(
                f"{self.path} stores its training state as a Python pickle (llamatrain before "
                "checkpoint version 2), which can run code when read, so it is not read; "
                f"start a new run from its weights instead: --set model.init_from={self.path} "
                "without --resume"
            )
        self._read_optimizer_tensors()
        try:
            return decode_state(self.metadata.get(key), self.tensors)
        except StateFormatError as err:
            raise self._damaged(what, str(err)) from None

    def _damaged(self, what: str, why: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {self.path}'s {what} is damaged: {why}; resume from an earlier "
            "checkpoint, or start a new run from its weights with model.init_from"
        )


def _seen_tokens(tensors: dict[str, torch.Tensor], vocab_size: int | None) -> torch.Tensor | None:
    """The bitmap of seen tokens: ``vocab_size`` long (None: whole bytes, for a LoRA run whose
    base, not yet read, says the size)."""
    packed = tensors.get("training.seen_tokens")
    if packed is None:
        return None
    if packed.dtype != torch.int8 or packed.dim() != 1 or 8 * packed.numel() < (vocab_size or 0):
        raise _damaged_key(
            "training.seen_tokens", f"is not a bitmap of the {vocab_size}-token vocabulary"
        )
    return _unpack_bits(packed, vocab_size)


def load_checkpoint(source: GGUFSource) -> Checkpoint:
    """Read a checkpoint (or a plain model GGUF: its counters are then zero), from its path or
    its already parsed header; its tensors are first checked against their recorded sha256.

    A LoRA run's checkpoint holds its adapter and records its base, which is not read here:
    ``llamatrain.model_source.with_base`` reads and checks it and completes the checkpoint with the
    base's config, tokenizer and keys.
    """
    if not isinstance(source, GGUFContents):
        if not Path(source).exists():
            raise CheckpointError(f"checkpoint {source} does not exist")
        source = read_gguf(source, tensor_data=False)
    path, meta = source.path, source.metadata
    verify_gguf(source)
    if records_a_base(meta):
        return _load_lora_checkpoint(source)
    model_file = read_model(source)
    meta, tensors = model_file.contents.metadata, model_file.contents.tensors
    state = _training_state(meta, tensors, model_file.config.vocab_size, model_file.inherited)
    return Checkpoint(
        model_file.config, model_file.tensors, model_file.tokenizer, state, meta, tensors,
        path=path,
    )  # fmt: skip


def _load_lora_checkpoint(contents: GGUFContents) -> Checkpoint:
    """A LoRA run's checkpoint: its adapter and state, and the base it records (not read: the
    model builder reads and checks it, ``llamatrain.model_source.with_base``)."""
    adapter = read_lora_adapter(contents)
    load_tensor_data(contents, skip=(OPTIMIZER_PREFIX,))  # the optimizer's when resumed
    meta, tensors = contents.metadata, contents.tensors
    state = _training_state(meta, tensors, None, {})
    state.lora_base = _recorded(meta, BASE_PATH_KEY, BASE_SHA256_KEY)
    return Checkpoint(None, adapter.tensors, None, state, meta, tensors, adapter, contents.path)


def _training_state(
    meta: dict, tensors: dict[str, torch.Tensor], vocab_size: int | None, inherited: dict
) -> TrainingState:
    """The ``training.*`` counters, cursors and seen tokens of a checkpoint's file, each
    checked to be what llamatrain writes (a damaged value is one CheckpointError, not a
    traceback later in the resumed run)."""
    return TrainingState(
        step=_counter(meta, "training.iteration_count"),
        samples=_counter(meta, "training.sample_count"),
        tokens=_counter(meta, "training.token_count"),
        epochs=_counter(meta, "training.epoch_count"),
        data_state=_json_state(meta, "training.data_state"),
        config=_json_state(meta, "training.config"),
        convergence=_json_state(meta, "training.convergence"),
        seen_tokens=_seen_tokens(tensors, vocab_size),
        inherited=inherited,
        reference_model=_recorded(meta, REFERENCE_PATH_KEY, REFERENCE_SHA256_KEY),
    )


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _is_number(value: object) -> bool:
    return type(value) in (int, float)


def _is_convergence(state: dict) -> bool:
    recent = state.get("recent", [])
    return (
        isinstance(recent, list)
        and all(_is_number(v) for v in recent)
        and _is_number(state.get("best", 0))
        and _is_count(state.get("best_step", 0))
    )


_JSON_STATES = {
    "training.data_state": lambda state: all(_is_count(v) for v in state.values()),
    "training.config": lambda state: True,
    "training.convergence": _is_convergence,
}
"""The JSON objects a checkpoint stores, and what each must hold: the data sampler's counters
(``BatchSampler.state_dict``), the run's config (read by people) and the convergence tests'
history (``ConvergenceTests.state_dict``)."""


def _counter(meta: dict, key: str) -> int:
    value = meta.get(key, 0)
    if not _is_count(value):
        raise _damaged_key(key, "is not a non-negative integer")
    return value


def recorded_export_type(meta: Mapping[str, Any]) -> str | None:
    """The ``output.export_type`` a checkpoint's run recorded (already made concrete from
    ``auto`` when the run started), or None: not a checkpoint, or none recorded."""
    if "training.config" not in meta:
        return None
    output = _json_state(dict(meta), "training.config").get("output")
    chosen = output.get("export_type") if isinstance(output, dict) else None
    return chosen if isinstance(chosen, str) else None


def _json_state(meta: dict, key: str) -> dict:
    text = meta.get(key, "{}")
    try:
        state = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        state = None
    if not isinstance(state, dict) or not _JSON_STATES[key](state):
        raise _damaged_key(key, "is not the JSON object llamatrain writes there")
    return state


def _damaged_key(key: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"this checkpoint's {key} {why}; the file was edited or damaged — resume from an "
        "earlier checkpoint, or start a new run from its weights with model.init_from"
    )


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
