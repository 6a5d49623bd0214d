"""What a path opens to: the models and tokenizers built from the files a user names.

``llamatrain.model_path`` says what a path names; here it is opened (:func:`open_source`),
once, into a :class:`ModelSource`: a GGUF model or a full finetune's checkpoint (its header:
the weights are read or mapped into what is built from it, never held twice), an HF checkpoint
folder (its tensors, float32), or a LoRA run — its folder or one of its checkpoints — whose
base, checked against the sha256 the run recorded, carries the run's adapter. ``lora=`` puts
an adapter GGUF over any base, as llama.cpp's ``-m base.gguf --lora adapter.gguf`` does. Each
file is opened once (``gguf.file.GGUFContents.file``): a base's header, the hash that checks
it, its tensors and its mapped blocks all come through one open.

What is built from a source, in this one place:

- :func:`inference_model` (``generate``, ``chat``, ``eval``): every projection and vocabulary
  table the file stores narrower than float32 kept in its GGUF type, mapped from the file
  (``lora.FrozenLinear`` / ``FrozenTable``, decoded a chunk at a time as a product needs it),
  and the adapter applied unmerged, y = W·x + s·B(A·x), as llama.cpp applies ``--lora``: the
  model costs about its file's size, where widening a Q4_K_M 1.5B to float32 to merge an
  adapter costs 14 GB. ``dequantize=True``: the float32 model an f32 export would hold.
- :func:`model_to_export`: that same model, for a writer that merges and decodes it a tensor
  at a time (``lora.merged_tensors``).
- :func:`read_model_source`: the float32 weights a run starts from (``model.init_from``); a
  LoRA run's with its adapter merged in. :func:`build_model` and :func:`build_lora_base` read a
  file into a model with a run's choices and a LoRA run's narrow base storage;
  :func:`with_base` completes a LoRA checkpoint with the base it records (``fit --resume``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llamatrain.checkpoint import (
    CHAT_TEMPLATE_RUN_KEY,
    Checkpoint,
    load_checkpoint,
    recorded_export_type,
)
from llamatrain.errors import ConfigError, TokenizerError
from llamatrain.fused_decode import fuse_decoding
from llamatrain.gguf.adapter import LoraAdapter, read_lora_adapter
from llamatrain.gguf.export_types import ALL_EXPORT_TYPES
from llamatrain.gguf.file import GGUFContents, map_stored, read_tensors_into, verify_gguf
from llamatrain.gguf.llama import LlamaFile, read_model, read_tokenizer
from llamatrain.hf.folder import CHAT_TEMPLATE_KEY, read_hf_folder
from llamatrain.lora import (
    ALL_TARGETS,
    apply_lora,
    load_lora_state_dict,
    merge_lora,
    store_frozen_targets,
    stored_type,
)
from llamatrain.model import Llama
from llamatrain.model_config import VOCAB_TABLES, tensor_shapes
from llamatrain.model_path import (
    BASE_PATH_KEY,
    BASE_ROLE,
    checked_model,
    existing_base,
    read_header,
    records_a_base,
)
from llamatrain.ops.dequantize import DEQUANTIZABLE
from llamatrain.tokenizer import Tokenizer, load_sentencepiece, read_hf_tokenizer

__all__ = [
    "ModelSource",
    "build_lora_base",
    "build_model",
    "export_type_of",
    "inference_model",
    "is_header_only",
    "load_tokenizer",
    "model_to_export",
    "open_source",
    "read_model_source",
    "with_base",
]


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


# ---- opening a path ----------------------------------------------------------------------


@dataclass
class ModelSource:
    """What a path opens to (:func:`open_source`), its headers read and nothing built yet."""

    base: LlamaFile
    """The model file: a GGUF read header-only (its weights are read, or mapped, into the model
    built from it) or an HF folder's tensors; a LoRA run's base. Its tokenizer is the model's."""
    contents: GGUFContents | None
    """The GGUF the path itself names, parsed and open: a LoRA run's checkpoint, else the model
    file (None for an HF folder)."""
    adapter: LoraAdapter | None = None
    """LoRA adapters applied over ``base``: a LoRA run's, or a ``lora=`` file's."""
    inherited: dict[str, Any] = field(default_factory=dict)
    """The keys an export keeps, the chat template among them."""


def open_source(path: str | Path, lora: str | Path | None = None) -> ModelSource:
    """What ``path`` opens to: a run folder (its latest checkpoint), a checkpoint, a llama GGUF
    or an HF checkpoint folder (any folder without ``checkpoints/``); ``lora``: an adapter GGUF
    to apply over it. A checkpoint's tensors are checked against the sha256 recorded when it
    was written (``verify_gguf``), a LoRA run's base against the one the run recorded, so
    nothing built from it uses silently damaged or swapped weights."""
    header = read_header(path)  # parsed once, handed down
    if header is not None and records_a_base(header.metadata):
        if lora is not None:
            raise ConfigError(
                f"{path} is a LoRA run, which applies its own adapter; to apply {lora} "
                f"instead, pass its base ({header.metadata[BASE_PATH_KEY]}) with --lora"
            )
        checkpoint = load_checkpoint(header)
        base = with_base(checkpoint)
        return ModelSource(base, header, checkpoint.adapter, checkpoint.state.inherited)
    if header is None:
        base = read_hf_folder(path)
    else:
        verify_gguf(header)
        base = read_model(header, tensor_data=False)
    adapter = None if lora is None else _adapter_over(base, lora)
    return ModelSource(base, header, adapter, dict(base.inherited))


def _adapter_over(base: LlamaFile, lora: str | Path) -> LoraAdapter:
    """The adapter GGUF ``lora``, checked to fit ``base`` (its architecture, and each A and B
    the shape of the projection it adapts, in every block) as llama.cpp checks ``--lora``."""
    adapter = read_lora_adapter(lora)
    if adapter.architecture and adapter.architecture != base.config.arch:
        raise ConfigError(
            f"{lora} adapts a {adapter.architecture} model but the base is {base.config.arch}; "
            "pass the base model the adapter was trained on"
        )
    shapes = tensor_shapes(base.config)
    for name, tensor in adapter.tensors.items():
        stem, _, half = name.rpartition(".")
        out_in = shapes.get(f"{stem}.weight", (0, 0))
        wanted = (adapter.rank, out_in[-1]) if half == "lora_a" else (out_in[0], adapter.rank)
        if tuple(tensor.shape) != wanted:
            raise ConfigError(
                f"{lora}'s {name} is {tuple(tensor.shape)}, where the base takes {wanted}; "
                "pass the base model the adapter was trained on"
            )
    adapted = 2 * base.config.n_layers * len(adapter.targets)
    if len(adapter.tensors) != adapted:
        raise ConfigError(
            f"{lora} adapts {', '.join(adapter.targets)} in only some of the base's "
            f"{base.config.n_layers} blocks; llamatrain applies an adapter to every block"
        )
    return adapter


def with_base(checkpoint: Checkpoint, base: str | Path | None = None) -> LlamaFile:
    """Open a LoRA run's base (``base``, default: the path its checkpoint records), which must
    have the content the run was trained on, and complete ``checkpoint`` with the base's
    config, tokenizer and keys; returns the base as opened (a GGUF's header: its weights are
    read into the model built from it; a LoRA run's result, merged)."""
    recorded = checkpoint.state.lora_base
    path = existing_base(base or recorded.path, checkpoint.path)
    opened = open_source(path)
    base_file = _merged(opened)  # a plain model file as it is: merged only over a LoRA run
    used = checked_model(path, recorded, BASE_ROLE, checkpoint.path, opened.contents)
    inherited = dict(base_file.inherited)
    if CHAT_TEMPLATE_RUN_KEY in checkpoint.metadata:
        inherited[CHAT_TEMPLATE_KEY] = checkpoint.metadata[CHAT_TEMPLATE_RUN_KEY]
    checkpoint.config, checkpoint.tokenizer = base_file.config, base_file.tokenizer
    state = checkpoint.state
    state.inherited, state.lora_base = inherited, used
    if state.seen_tokens is not None:  # the bitmap is whole bytes; the vocabulary decides
        state.seen_tokens = state.seen_tokens[: base_file.config.vocab_size]
    return base_file


# ---- models built from it ----------------------------------------------------------------


def inference_model(source: ModelSource, ops: str = "ggml", *, dequantize: bool = False) -> Llama:
    """The model to generate, chat and score with: the file's frozen weights as it stores them
    and its adapter unmerged (:func:`_adapted`; ``ops``: the op set); with ``dequantize``, the
    plain float32 model its f32 export holds (the adapter merged in), at 4 bytes a weight."""
    if not dequantize:  # decoding steps through one C++ call where it computes them
        return fuse_decoding(_adapted(source, ops=ops))
    if source.adapter is None:
        return build_model(source.base, ops=ops)
    return merge_lora(_adapted(source, ops=ops))


def model_to_export(path: str | Path) -> tuple[Llama, Tokenizer, dict[str, Any]]:
    """What ``export`` writes from ``path`` (as :func:`open_source` opens it): the model, its
    tokenizer and the keys it keeps. The model is :func:`inference_model`'s, its weights held
    as the file stores them: a writer merges and decodes it a tensor at a time
    (``lora.merged_tensors``), so a 7B run's export never holds its 27 GB float32 copy."""
    source = open_source(path)
    return _adapted(source), source.base.tokenizer, dict(source.inherited)


def read_model_source(path: str | Path) -> LlamaFile:
    """The model ``path`` opens to (:func:`open_source`) as the float32 weights a run starts
    from: a GGUF's header (read into the run's model later), an HF folder's tensors, a LoRA
    run's base with its adapter merged in."""
    return _merged(open_source(path))


def export_type_of(path: str | Path) -> str:
    """The ggml type ``export`` writes ``path`` as when none is named (``--type auto``).

    A run's checkpoint (or run folder): the type the run chose for its own export, which its
    config records (``gguf.export_types.merged_export_type``: q8_0 over a quantized base, the
    base's float type, f32 for a model trained whole), so a QLoRA run exported later is not
    silently widened to float32 (27 GB for a 7B over a 3.5 GB Q4_0 base). Anything else (a
    GGUF model, an HF folder, a checkpoint from before runs recorded it): f32, its weights as
    they are computed.
    """
    header = read_header(path)
    recorded = None if header is None else recorded_export_type(header.metadata)
    return recorded if recorded in ALL_EXPORT_TYPES else "f32"


def _merged(source: ModelSource) -> LlamaFile:
    """``source``'s model as a file of float32 weights: its base, or with its adapter merged."""
    if source.adapter is None:
        return source.base
    merged = merge_lora(_adapted(source))
    state = {name: t.detach() for name, t in merged.state_dict().items()}
    return LlamaFile(merged.cfg, state, source.base.tokenizer, source.inherited)


def _adapted(source: ModelSource, **changes: object) -> Llama:
    """``source``'s base (:func:`_stored_base`) with its adapter, if any, applied unmerged."""
    model = _stored_base(source.base, **changes)
    adapter = source.adapter
    if adapter is not None:
        apply_lora(model, adapter.rank, adapter.alpha, targets=adapter.targets)
        load_lora_state_dict(model, adapter.tensors)
    return model


def _stored_base(base: LlamaFile, **changes: object) -> Llama:
    """``base``'s model with each projection and vocabulary table its GGUF stores narrower
    than float32, in a type ``ops.dequantize`` reads, kept so (mapped from the file:
    :func:`_built_keeping`); the rest float32, as all of a model from an HF folder or a merge."""
    if not is_header_only(base):
        return build_model(base, **changes)
    blocks = range(base.config.n_layers)
    frozen = [f"blk.{i}.{target}.weight" for i in blocks for target in ALL_TARGETS]
    types = _narrow(base.contents.tensor_types, [*frozen, *VOCAB_TABLES])
    return _built_keeping(base, types, **changes)


def build_model(source: LlamaFile, **changes: object) -> Llama:
    """The model a file describes, with its weights; ``changes`` to its config (run choices).

    A file read without its tensor data (``read_model(path, tensor_data=False)``) is read
    straight into the model's parameters, a tensor at a time: the import then holds the model
    once, where loading a state dict holds a float copy of every weight beside it.
    """
    model = Llama(dataclasses.replace(source.config, **changes))
    if is_header_only(source):
        read_tensors_into(source.contents, model.state_dict())
    else:
        model.load_state_dict(source.tensors, strict=True)
    return model


def build_lora_base(
    source: LlamaFile, base_dtype: str, targets: Sequence[str], **changes: object
) -> Llama:
    """:func:`build_model` for a LoRA run whose frozen ``targets`` are kept as ``base_dtype``
    (``[lora] base_dtype``): bf16/f16, or ``quantized`` (each as the GGUF stores it; then the
    vocabulary tables too, :func:`_kept_tables`), read as :func:`_built_keeping` reads them.
    """
    if base_dtype == "f32":
        return build_model(source, **changes)
    from_gguf = is_header_only(source)
    if base_dtype == "quantized" and not from_gguf:
        raise ConfigError(
            "lora.base_dtype = 'quantized' keeps a GGUF's blocks, but the base is not a GGUF "
            "file; point model.init_from at a quantized GGUF or choose bf16 or f16"
        )
    n_layers = dataclasses.replace(source.config, **changes).n_layers
    file_types = source.contents.tensor_types if from_gguf else {}
    names = [f"blk.{i}.{target}.weight" for i in range(n_layers) for target in targets]
    types = {name: stored_type(base_dtype, file_types.get(name, "F32"), name) for name in names}
    types |= _kept_tables(base_dtype, file_types)
    return _built_keeping(source, types, **changes)


def _built_keeping(source: LlamaFile, types: Mapping[str, str], **changes: object) -> Llama:
    """:func:`build_model` with the weights named in ``types`` kept in those ggml types
    (``lora.store_frozen_targets``).

    The model is laid out on the meta device, the weights are given their narrow storage, and
    only then is memory allocated and the file read into it (one float32 tensor at a time for
    a cast): a float32 copy of them never exists, so loading peaks at the model's final size.
    Those kept as the file stores them are not read at all but mapped
    (``gguf.file.map_stored``): their pages are the file's, as llama.cpp holds a model. Anything
    else stays float32.
    """
    cfg = dataclasses.replace(source.config, **changes)
    with torch.device("meta"):
        model = Llama(cfg)
        store_frozen_targets(model, types)
    model.to_empty(device="cpu")
    if not is_header_only(source):
        model.load_state_dict(source.tensors, strict=True)  # copy_ rounds to the storage
        return model
    state, header = model.state_dict(), source.contents
    file_types = header.tensor_types
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
    return _narrow(file_types, VOCAB_TABLES) if base_dtype == "quantized" else {}


def _narrow(file_types: Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    """The stored types of those of ``names`` the file holds narrower than float32 in a type
    ``ops.dequantize`` reads (F32 is float32 already)."""
    return {
        name: file_types[name]
        for name in names
        if file_types.get(name, "F32") in DEQUANTIZABLE - {"F32"}
    }


def is_header_only(source: LlamaFile) -> bool:
    """Whether ``source`` is a GGUF read without its tensor data
    (``read_model(tensor_data=False)``): its weights are still to be read from its file."""
    return source.contents is not None and any(t.is_meta for t in source.tensors.values())
