"""An HF llama's safetensors weights ⇄ our tensors: names, q/k row order, reading shards.

Names: HF's ``model.layers.N.self_attn.q_proj.weight`` is our (llama.cpp's)
``blk.N.attn_q.weight``, and so on (``_BLOCK`` / ``_TOP``); the map is built from
``tensor_shapes``, the one list of a model's tensors, so it cannot drift from the model.

Row order: HF applies rope with ``rotate_half`` (NEOX: element i of a head pairs with element
i + head_dim/2), llama.cpp's ``llama`` (and ``smollm3``) architecture and our model rotate
adjacent pairs (2i, 2i+1); the NEOX families (qwen2, qwen3) rotate as HF does and keep HF's
order. The two are the same network once the rows of q_proj and k_proj (and their biases) are
reordered within each head, which is what llama.cpp's converter does on import
(``LlamaModel.permute``): :func:`to_adjacent_pairs`; export undoes it with
:func:`to_rotate_half`.

Gemma 3: HF's ``post_attention_layernorm`` is llama.cpp's ``post_attention_norm`` (the sandwich
norm), ``pre_feedforward_layernorm`` its ``ffn_norm`` and ``post_feedforward_layernorm`` its
``post_ffw_norm`` (``_BLOCK_OF``). HF's Gemma RMSNorm multiplies by ``1 + w``; llama.cpp's GGUF
and our model hold ``1 + w`` itself (llama.cpp's converter adds 1 to every ``*norm.weight``), so
import adds 1 and export subtracts it (``NORM_SHIFT``), in float32: a GGUF value g >= 0.5 goes
to HF and back bit for bit (g - 1 is exact there, Sterbenz), an HF value w comes back within
one float32 rounding of 1 + w.

Reading opens one shard at a time and converts one tensor at a time, so the float32 tensors
returned are the only copy of the model in memory. The folder is untrusted: the index may only
name plain file names of the folder (``hf.inside``), a bounded number of them, each tensor in
the shard the index says and in no other; safetensors itself checks each shard's header
against its size (a header of at most 100 MB, offsets within the file, byte counts that match
dtype and shape) before any tensor is read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from llamatrain.errors import CheckpointError
from llamatrain.hf.inside import file_in_folder
from llamatrain.model_config import ModelConfig, tensor_shapes

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "check_weights_fit",
    "hf_names",
    "hf_state_dict",
    "hf_tensor",
    "hf_tensor_name",
    "read_hf_weights",
    "to_adjacent_pairs",
    "to_rotate_half",
    "weight_files",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
COMPUTED = ("rope_freqs.weight",)
"""Our tensors HF has no tensor for: a config.json's rope scaling encodes them."""
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_OF = {
    "gemma3": {
        **_BLOCK,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
"""A family's block names where they are not llama's."""
NORM_SHIFT = {"gemma3": 1.0}
"""What HF's norm weights of a family lack of ours (Gemma's ``1 + w``)."""
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers older transformers saved with the weights; they are recomputed, never loaded."""
MAX_INDEX_BYTES = 64 << 20
"""The largest index read (the largest published ones, with ~10^5 tensors, are ~10 MB)."""
MAX_SHARDS = 4096
"""The most shards an index may name (published models have at most a few hundred)."""


def hf_tensor_name(name: str, arch: str = "llama") -> str:
    """The HF name of one of our tensors in a model of family ``arch``: ``blk.3.attn_q.weight``
    -> ``model.layers.3.self_attn.q_proj.weight``."""
    stem, _, kind = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, module = stem.split(".")
        return f"model.layers.{layer}.{_BLOCK_OF.get(arch, _BLOCK)[module]}.{kind}"
    return f"{_TOP[stem]}.{kind}"


def _norm_shift(name: str, cfg: ModelConfig) -> float:
    """What to add to an HF tensor to get ours (0 but for a Gemma norm weight)."""
    return NORM_SHIFT.get(cfg.arch, 0.0) if name.endswith("norm.weight") else 0.0


def _rope_heads(name: str, cfg: ModelConfig) -> int | None:
    """How many rope heads a tensor's rows hold (q: n_heads, k: kv_heads) when they need
    permuting; None if not q/k, or when the family's rope is NEOX (HF's own order)."""
    if cfg.family.rope_mode == "neox":
        return None
    module = name.rpartition(".")[0].rpartition(".")[2]
    return {"attn_q": cfg.n_heads, "attn_k": cfg.kv_heads}.get(module)


def to_adjacent_pairs(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of q/k (or a bias) from HF's rotate-half order to adjacent rope pairs.

    Within each head, row i and row i + head_dim/2 (a NEOX pair) become rows 2i and 2i+1.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`to_adjacent_pairs`: adjacent pairs back to HF's order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ------------------------------------------------------------------------------------ reading


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding a folder's weights: the index's shards, or the one file.

    Raises CheckpointError when there are none (naming what an HF folder holds instead).
    """
    return _files(folder, _weight_map(folder))


def _files(folder: Path, weight_map: Mapping[str, Path] | None) -> list[Path]:
    if weight_map is None:
        return [folder / SINGLE_FILE]
    return sorted(set(weight_map.values()))


def _weight_map(folder: Path) -> dict[str, Path] | None:
    """The index's tensor -> shard map, its shards checked (plain names of files inside the
    folder, at most :data:`MAX_SHARDS`, all present); None when the folder has one
    ``model.safetensors`` and no index. CheckpointError when it has neither."""
    index = file_in_folder(folder, INDEX_FILE)
    if index.is_file():
        if index.stat().st_size > MAX_INDEX_BYTES:
            raise CheckpointError(
                f"{index} is {index.stat().st_size:,} bytes, more than any safetensors index "
                f"({MAX_INDEX_BYTES >> 20} MiB at most); re-save the model"
            )
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}")
            names = set(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(
                f"{index} is not a safetensors index (no weight_map: {e}); re-save the model"
            ) from e
        if len(names) > MAX_SHARDS:
            raise CheckpointError(
                f"{index} names {len(names):,} shards, more than any model has "
                f"({MAX_SHARDS:,} at most); re-save the model"
            )
        shards = {name: file_in_folder(folder, name, INDEX_FILE) for name in names}
        missing = sorted(name for name, path in shards.items() if not path.is_file())
        if missing:
            raise CheckpointError(f"{folder} lacks the shard(s) {', '.join(missing)}; copy them")
        return {tensor: shards[name] for tensor, name in weight_map.items()}
    if file_in_folder(folder, SINGLE_FILE).is_file():
        return None
    legacy = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
    hint = (
        f"; it has PyTorch pickles ({legacy[0]}…) — re-save it with save_pretrained(..., "
        "safe_serialization=True)"
        if legacy
        else ""
    )
    raise CheckpointError(f"{folder} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


_LAYER = re.compile(r"model\.layers\.(\d{1,10})\.")
"""A block tensor's HF name, capturing its layer (a longer number is no layer of ours)."""


def check_weights_fit(folder: Path, cfg: ModelConfig) -> None:
    """config.json's claims checked against the tensors the safetensors headers hold, before
    anything is built from them: the layers the names number must be ``num_hidden_layers``,
    and the embedding's shape ``(vocab_size, hidden_size)``. A config claiming 10^9 layers or
    a 10^8 vocabulary is then one CheckpointError instead of gigabytes of name maps and
    tokenizer tables; every other shape is checked, tensor by tensor, as it is read."""
    shapes = _stored_shapes(folder)
    layers = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if len(layers) != cfg.n_layers or max(layers, default=-1) != cfg.n_layers - 1:
        held = f"layers 0 to {max(layers)}" if layers else "no layers"
        raise CheckpointError(
            f"{folder}: config.json's num_hidden_layers is {cfg.n_layers:,} but the weights "
            f"hold {held} ({len(layers):,} numbered); the config does not belong to these "
            "weights — fix num_hidden_layers or use the model's own config.json"
        )
    embedding = shapes.get(hf_tensor_name("token_embd.weight", cfg.arch))
    if embedding is not None and embedding != (cfg.vocab_size, cfg.dim):
        raise CheckpointError(
            f"{folder}: config.json's vocab_size {cfg.vocab_size:,} and hidden_size "
            f"{cfg.dim:,} need an embedding of shape ({cfg.vocab_size}, {cfg.dim}), but "
            f"model.embed_tokens.weight is {embedding}; use the model's own config.json"
        )


def _stored_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's shape, from the safetensors headers alone (nothing loaded)."""
    shapes = {}
    for path in _files(folder, _weight_map(folder)):
        with _open(path) as f:
            shapes |= {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    return shapes


def read_hf_weights(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our float32 tensors (minus ``COMPUTED``) from a folder's safetensors, q/k permuted.

    The tensor names and shapes are checked against ``cfg`` before anything is loaded: a
    missing or unexpected tensor is one CheckpointError naming it (with HF's name).
    """
    check_weights_fit(folder, cfg)  # before tensor_shapes builds a name map of cfg's size
    ours = {
        hf_tensor_name(name, cfg.arch): name for name in tensor_shapes(cfg) if name not in COMPUTED
    }
    listed = _weight_map(folder)
    stored = {path: _tensor_names(path) for path in _files(folder, listed)}
    _check_tensor_places(folder, stored, listed or {})
    present = {name for names in stored.values() for name in names}
    if cfg.tie_embeddings:  # transformers ties lm_head to the embedding and ignores a stored one
        present.discard(hf_tensor_name("output.weight"))
    missing = sorted(set(ours) - present)
    unexpected = sorted(n for n in present - set(ours) if not n.endswith(_IGNORED_SUFFIXES))
    if missing or unexpected:
        raise CheckpointError(
            f"{folder}: the weights are not those of the {cfg.arch} config.json describes "
            f"(missing: "
            f"{_first_few(missing)}; unexpected: {_first_few(unexpected)}); re-save the model"
        )
    shapes = tensor_shapes(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in stored.items():
        with _open(path) as f:
            for hf_name in names:
                if hf_name in ours:
                    name = ours[hf_name]
                    tensors[name] = _converted(f.get_tensor(hf_name), name, shapes[name], cfg, path)
    return tensors


def _check_tensor_places(
    folder: Path, stored: Mapping[Path, list[str]], listed: Mapping[str, Path]
) -> None:
    """Each tensor is in one shard, the one the index names (a tensor in two shards, or
    elsewhere than the index says, makes which one is read a guess)."""
    seen: dict[str, Path] = {}
    for path, names in stored.items():
        for name in names:
            if name in seen:
                raise CheckpointError(
                    f"{folder}: the tensor {name} is in both {seen[name].name} and {path.name}; "
                    "re-save the model"
                )
            seen[name] = path
    for name, path in seen.items():
        if listed.get(name, path) != path:
            raise CheckpointError(
                f"{folder}: {INDEX_FILE} puts {name} in {listed[name].name} but it is in "
                f"{path.name}; re-save the model"
            )


def _tensor_names(path: Path) -> list[str]:
    with _open(path) as f:
        return list(f.keys())


def _open(path: Path) -> safe_open:
    """A safetensors file opened for reading; a damaged one is a CheckpointError."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file ({e}); re-save it") from e


def _converted(
    tensor: torch.Tensor, name: str, shape: tuple[int, ...], cfg: ModelConfig, path: Path
) -> torch.Tensor:
    """One HF tensor as ours: shape checked, float32, q/k rows in adjacent-pair order."""
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"{path}: {hf_tensor_name(name, cfg.arch)} has shape {tuple(tensor.shape)} but "
            f"config.json needs {shape}; the weights do not belong to this config"
        )
    if not tensor.is_floating_point():
        raise CheckpointError(
            f"{path}: {hf_tensor_name(name, cfg.arch)} is {tensor.dtype}, not a float"
        )
    tensor = tensor.float()
    shift = _norm_shift(name, cfg)
    if shift:
        tensor = tensor + shift
    heads = _rope_heads(name, cfg)
    return tensor if heads is None else to_adjacent_pairs(tensor, heads)


def _first_few(names: list[str], n: int = 6) -> str:
    return f"{names[:n]}{' …' if len(names) > n else ''}"


# ------------------------------------------------------------------------------------ writing


def hf_state_dict(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's names and row order for our tensors (``COMPUTED`` ones left out), ready for
    ``safetensors.torch.save_file``; a tied model has no ``lm_head.weight``, as transformers
    saves it."""
    return dict(hf_tensor(cfg, name, tensors[name]) for name in hf_names(cfg))


def hf_names(cfg: ModelConfig) -> list[str]:
    """Our names of the tensors an HF folder stores, in our order."""
    return [name for name in tensor_shapes(cfg) if name not in COMPUTED]


def hf_tensor(cfg: ModelConfig, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One of our tensors under its HF name, float32, in HF's row order and norm convention."""
    tensor = tensor.detach().float().cpu()
    shift = _norm_shift(name, cfg)
    if shift:
        tensor = tensor - shift
    heads = _rope_heads(name, cfg)
    converted = tensor if heads is None else to_rotate_half(tensor, heads)
    return hf_tensor_name(name, cfg.arch), converted.contiguous()
