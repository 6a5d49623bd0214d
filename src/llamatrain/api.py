"""The Python API: what the CLI calls and what notebooks use directly.

``fit`` assembles one run from a config (tokenizer → data → model → trainer → export);
``load`` opens a checkpoint or any llama GGUF; ``generate_text`` and ``evaluate_text`` use a
loaded model. Everything here only builds and wires objects from the lower modules.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from llamatrain import gguf_io
from llamatrain.checkpoint import (
    LATEST,
    Checkpoint,
    CheckpointManager,
    check_compatible,
    checkpoint_dir,
    load_checkpoint,
)
from llamatrain.config import Config, apply_overrides, config_to_toml, load_config, validate
from llamatrain.data import build_train_data, check_text_file, read_text, resolve_inputs
from llamatrain.errors import CheckpointError, DataError
from llamatrain.gguf_io import export_gguf, load_gguf
from llamatrain.model import Llama, ModelConfig
from llamatrain.sampling import SamplingParams
from llamatrain.tokenizer import Tokenizer
from llamatrain.trainer import History, Trainer

__all__ = [
    "FitResult",
    "PerplexityResult",
    "describe_gguf",
    "evaluate_text",
    "export_gguf",
    "fit",
    "generate_text",
    "load",
    "load_gguf",
]


@dataclass
class FitResult:
    """What ``fit`` returns: the trained model and tokenizer, metrics and file locations."""

    model: Llama
    tokenizer: Tokenizer
    history: History
    run_dir: Path
    export_path: Path | None
    curves_path: Path | None = None  # curves.png, when matplotlib is installed


# ---- building a run ----------------------------------------------------------------------


def _tokenizer_cache_key(cfg: Config, paths: Sequence[Path]) -> str:
    """Tokenizer training is deterministic, so identical inputs+settings reuse the result."""
    h = hashlib.sha256(json.dumps(vars(cfg.tokenizer), sort_keys=True, default=str).encode())
    for p in paths:
        stat = p.stat()
        h.update(f"{p.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def build_tokenizer(cfg: Config, paths: Sequence[Path]) -> Tokenizer:
    """The run's vocabulary: from ``tokenizer.path`` (.model or .gguf) or trained on the data."""
    t = cfg.tokenizer
    if t.path:
        path = Path(t.path)
        if not path.is_file():
            raise DataError(f"tokenizer.path {path} does not exist; fix the path or unset it")
        if path.suffix == ".gguf":
            return Tokenizer.from_gguf(path)
        return Tokenizer.from_file(path)
    cached = Path(cfg.data.cache_dir) / "tokenizers" / f"{_tokenizer_cache_key(cfg, paths)}.gguf"
    if cached.is_file():
        return Tokenizer.from_gguf(cached)
    tokenizer = Tokenizer.train(
        paths,
        t.vocab_size,
        t.model_type,
        max_sentence_length=t.max_sentence_length,
        input_sentence_size=t.input_sentence_size,
        seed=cfg.train.seed,
    )
    cached.parent.mkdir(parents=True, exist_ok=True)
    gguf_io.write_vocab_gguf(cached, tokenizer)
    return tokenizer


def build_model_config(cfg: Config, vocab_size: int) -> ModelConfig:
    m = cfg.model
    return ModelConfig(
        vocab_size=vocab_size,
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        ffn_dim=m.ffn_dim,
        multiple_of=m.multiple_of,
        max_seq_len=cfg.data.n_ctx,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        tie_embeddings=m.tie_embeddings,
    )


def _start_model(cfg: Config, paths: Sequence[Path]) -> tuple[Llama, Tokenizer]:
    """A fresh model (seeded), or the one named by ``model.init_from`` with its tokenizer."""
    if cfg.model.init_from:
        model, tokenizer = load_gguf(cfg.model.init_from, ops=cfg.model.ops)
        model.cfg.max_seq_len = max(model.cfg.max_seq_len, cfg.data.n_ctx)
        return model, tokenizer
    tokenizer = build_tokenizer(cfg, paths)
    torch.manual_seed(cfg.train.seed)
    return Llama(build_model_config(cfg, tokenizer.vocab_size), ops=cfg.model.ops), tokenizer


def _resume_checkpoint(cfg: Config, resume: str | Path) -> Checkpoint:
    manager = CheckpointManager(checkpoint_dir(cfg.output.dir), cfg.train.keep_checkpoints)
    return load_checkpoint(manager.resolve(resume), ops=cfg.model.ops)


def fit(
    config: Config | str | Path | None = None,
    *,
    overrides: Sequence[str] = (),
    resume: str | Path | None = None,
    progress: bool = True,
    **dotted: object,
) -> FitResult:
    """Train a model as the config says; evaluate, sample, save and export it.

    ``config`` is a path to a TOML file, a ``Config`` or None (defaults). Overrides come as
    ``overrides=["optim.lr=3e-4"]`` or as keywords with ``__`` for the dot:
    ``fit("configs/tiny.toml", train__steps=20)``. ``resume`` is a checkpoint path or
    ``"latest"``.
    """
    extra = [f"{k.replace('__', '.')}={_toml_literal(v)}" for k, v in dotted.items()]
    if isinstance(config, Config):
        cfg = validate(apply_overrides(config, [*overrides, *extra]))
    else:
        cfg = load_config(config, [*overrides, *extra])
    paths = resolve_inputs(cfg.data.path, cfg.data.cache_dir)
    checkpoint = _resume_checkpoint(cfg, resume) if resume else None
    if checkpoint is not None:
        model, tokenizer = checkpoint.model, checkpoint.tokenizer
        expected_tokenizer = tokenizer if cfg.model.init_from else build_tokenizer(cfg, paths)
        check_compatible(checkpoint, _expected_model_config(cfg, checkpoint), expected_tokenizer)
    else:
        model, tokenizer = _start_model(cfg, paths)
    data = build_train_data(cfg, tokenizer, paths=paths, progress=progress)
    run_dir = Path(cfg.output.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(config_to_toml(cfg))
    trainer = Trainer(model, tokenizer, data, cfg, resume=checkpoint, progress=progress)
    history = trainer.fit()
    export_path = None
    if cfg.output.export:
        export_path = export_gguf(
            trainer.model,
            tokenizer,
            run_dir / f"model-{cfg.output.export_type}.gguf",
            type=cfg.output.export_type,
        )
    curves = _write_curves(run_dir)
    return FitResult(trainer.model, tokenizer, history, run_dir, export_path, curves)


def _write_curves(run_dir: Path) -> Path | None:
    """``curves.png`` in the run folder when matplotlib is importable, else nothing.

    The picture is a convenience next to results that are already saved, so a missing
    optional dependency or a plotting failure only warns: it must never turn a finished
    training run into an error.
    """
    if importlib.util.find_spec("matplotlib") is None:
        return None
    from llamatrain.plot import plot_metrics

    try:
        return plot_metrics(run_dir)
    except Exception as err:  # broad on purpose: see the docstring
        warnings.warn(f"could not draw {run_dir}/curves.png: {err}", stacklevel=2)
        return None


def _expected_model_config(cfg: Config, checkpoint: Checkpoint) -> ModelConfig:
    """The architecture the config asks for (a finetune keeps its base model's)."""
    if cfg.model.init_from:
        return checkpoint.model.cfg
    return build_model_config(cfg, checkpoint.tokenizer.vocab_size)


def _toml_literal(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


# ---- using a model -----------------------------------------------------------------------


def load(path: str | Path, ops: str = "ggml") -> tuple[Llama, Tokenizer]:
    """A model and tokenizer from a training checkpoint or any llama GGUF file."""
    path = Path(path)
    if path.is_dir():
        path = checkpoint_dir(path) / LATEST
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a checkpoint, a GGUF or a run folder")
    return load_gguf(path, ops=ops)


def generate_text(
    model: Llama,
    tokenizer: Tokenizer,
    prompt: str,
    *,
    max_tokens: int = 128,
    temperature: float = 0.8,
    top_k: int | None = 40,
    top_p: float | None = 0.95,
    repeat_penalty: float = 1.1,
    seed: int | None = None,
) -> Iterator[str]:
    """Stream the decoded continuation of ``prompt`` piece by piece (stops at EOS)."""
    params = SamplingParams(temperature, top_k, top_p, repeat_penalty)
    prompt_ids = tokenizer.encode(prompt, bos=True)
    model.eval()
    stop = frozenset({tokenizer.eos_id})
    stream = model.generate_stream(torch.tensor([prompt_ids]), max_tokens, params, seed, stop)
    new: list[int] = []
    shown = tokenizer.decode(prompt_ids)
    for token in stream:
        if token.item() == tokenizer.eos_id:
            break
        new.append(token.item())
        text = tokenizer.decode(prompt_ids + new)
        if text.endswith("\ufffd"):
            continue  # a multi-byte character is still arriving byte token by byte token
        yield text[len(shown) :]
        shown = text


@dataclass
class PerplexityResult:
    """Two views of how well a model predicts a text."""

    perplexity: float  # llama-perplexity's method
    mean_loss: float  # every next-token prediction inside the chunks
    mean_ppl: float
    n_tokens: int
    n_chunks: int
    n_ctx: int


@torch.no_grad()
def evaluate_text(
    model: Llama, tokenizer: Tokenizer, path: str | Path, n_ctx: int | None = None
) -> PerplexityResult:
    """Perplexity computed exactly as llama.cpp's ``llama-perplexity`` does.

    The text is tokenized with BOS and cut into non-overlapping chunks of ``n_ctx``; each
    chunk's first token is replaced by BOS and only the second half of each chunk is scored,
    so every scored token has at least n_ctx/2 tokens of context. ``mean_loss`` also scores
    the first half (plain mean next-token loss over the chunks).
    """
    path = Path(path)
    check_text_file(path)
    n_ctx = n_ctx or model.cfg.max_seq_len
    tokens = tokenizer.encode(read_text(path), bos=True)
    n_chunks = len(tokens) // n_ctx
    if n_chunks < 1:
        raise DataError(
            f"{path} has {len(tokens)} tokens, fewer than one chunk of n_ctx = {n_ctx}; "
            "use a longer text or a smaller --n-ctx"
        )
    model.eval()
    first = n_ctx // 2
    nll_second_half, nll_all = 0.0, 0.0
    for i in range(n_chunks):
        chunk = torch.tensor(tokens[i * n_ctx : (i + 1) * n_ctx])
        chunk[0] = tokenizer.bos_id
        logits = model(chunk[None])[0].double()
        nll = -torch.log_softmax(logits[:-1], dim=-1).gather(1, chunk[1:, None]).squeeze(1)
        nll_second_half += nll[first:].sum().item()
        nll_all += nll.sum().item()
    scored = n_chunks * (n_ctx - 1 - first)
    mean_loss = nll_all / (n_chunks * (n_ctx - 1))
    return PerplexityResult(
        perplexity=math.exp(nll_second_half / scored),
        mean_loss=mean_loss,
        mean_ppl=math.exp(mean_loss),
        n_tokens=len(tokens),
        n_chunks=n_chunks,
        n_ctx=n_ctx,
    )


# GGML token types (llama.cpp's llama_token_type), for the tokenizer summary.
_TOKEN_TYPES = {1: "normal", 2: "unknown", 3: "control", 4: "user-defined", 5: "unused", 6: "byte"}
# Keys too bulky to print that ``info`` leaves out (RNG bytes, serialized optimizer state).
_HIDDEN_KEYS = ("training.config", "training.rng_state", "optimizer.lbfgs.state")


def _short(value: object, width: int = 100) -> str:
    text = str(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _tokenizer_summary(meta: dict) -> list[str]:
    """One line for the vocabulary (size, token kinds, special ids) instead of 3 long arrays."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if "tokenizer.ggml.model" not in meta and tokens is None:
        return ["tokenizer: none (this file cannot be run on its own)"]
    parts = [f"model {meta.get('tokenizer.ggml.model', '?')!r}"]
    if isinstance(tokens, list):
        kinds: dict[str, int] = {}
        for t in meta.get("tokenizer.ggml.token_type", []):
            name = _TOKEN_TYPES.get(t, str(t))
            kinds[name] = kinds.get(name, 0) + 1
        detail = ", ".join(f"{n} {k}" for k, n in kinds.items())
        parts.append(f"{len(tokens)} tokens" + (f" ({detail})" if detail else ""))
    for special in ("bos", "eos", "unknown", "padding"):
        tid = meta.get(f"tokenizer.ggml.{special}_token_id")
        if isinstance(tid, int):
            text = tokens[tid] if isinstance(tokens, list) and 0 <= tid < len(tokens) else "?"
            parts.append(f"{special} {tid} {text!r}")
    flags = [
        f"{flag} {str(meta[f'tokenizer.ggml.{flag}']).lower()}"
        for flag in ("add_bos_token", "add_eos_token", "add_space_prefix")
        if f"tokenizer.ggml.{flag}" in meta
    ]
    lines = ["tokenizer: " + "; ".join(parts)]
    if flags:
        lines.append("  " + ", ".join(flags))
    return lines


def describe_gguf(path: str | Path) -> str:
    """A human-readable summary: architecture, hyper-parameters, tokenizer, tensors, counters.

    Keys are printed under their full GGUF names (``llama.block_count: 2``) so what ``info``
    shows can be searched for in llama.cpp's sources and logs; the tokenizer's arrays are
    summarised in one line, and a checkpoint's training counters and optimizer state get
    their own sections.
    """
    contents = gguf_io.read_gguf(path)
    meta = contents.metadata
    arch = meta.get("general.architecture")
    is_checkpoint = any(k.startswith(("training.", "optimizer.")) for k in meta)
    kind = meta.get("general.type") or ("training checkpoint" if is_checkpoint else "model")
    if not contents.tensors and "tokenizer.ggml.tokens" in meta:
        kind = "vocabulary only"
    total = sum(gguf_io.stored_nbytes(contents, name) for name in contents.tensors)
    lines = [
        f"{path}: {arch or 'no architecture'} {kind}, {len(contents.tensors)} tensors, "
        f"{total:,} bytes of tensor data"
    ]
    sections: dict[str, list[str]] = {
        "general": [],
        "hyper-parameters": [],
        "training counters": [],
        "optimizer": [],
        "other keys": [],
    }
    for key, value in meta.items():
        if key in _HIDDEN_KEYS or key.startswith("tokenizer."):
            continue
        if key.startswith("general."):
            section = "general"
        elif arch and key.startswith(f"{arch}."):
            section = "hyper-parameters"
        elif key.startswith("training."):
            section = "training counters"
        elif key.startswith("optimizer."):
            section = "optimizer"
        else:
            section = "other keys"
        shown = f"[{len(value)} entries]" if isinstance(value, list) else _short(value)
        sections[section].append(f"  {key}: {shown}")
    for title, entries in sections.items():
        if entries:
            lines += [f"{title}:", *entries]
            if title == "hyper-parameters":
                lines += _tokenizer_summary(meta)
    if not sections["hyper-parameters"]:
        lines += _tokenizer_summary(meta)
    for key, value in meta.items():  # tokenizer keys the summary does not cover
        if key.startswith("tokenizer.") and not key.startswith("tokenizer.ggml."):
            shown = f"[{len(value)} entries]" if isinstance(value, list) else _short(value)
            lines.append(f"  {key}: {shown}")
    if contents.tensors:
        width = max(len(name) for name in contents.tensors)
        lines.append(f"tensors ({len(contents.tensors)}):")
        lines.append(f"  {'name':<{width}} {'shape':>14} {'type':>6} {'bytes':>12}")
        for name, tensor in contents.tensors.items():
            shape = "x".join(str(d) for d in tensor.shape)
            nbytes = gguf_io.stored_nbytes(contents, name)
            lines.append(
                f"  {name:<{width}} {shape:>14} {contents.tensor_types[name]:>6} {nbytes:>12,}"
            )
        lines.append(f"  {'total':<{width}} {'':>14} {'':>6} {total:>12,}")
    return "\n".join(lines)
