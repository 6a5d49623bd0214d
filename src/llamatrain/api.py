"""The Python API: what the CLI calls and what notebooks use directly.

``fit`` assembles one run from a config (tokenizer → data → model → trainer → export);
``load`` opens a checkpoint or any llama GGUF; ``generate_text`` and ``evaluate_text`` use a
loaded model. Everything here only builds and wires objects from the lower modules.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from llamatrain import gguf_io
from llamatrain.checkpoint import Checkpoint, check_compatible, load_checkpoint
from llamatrain.config import Config, config_to_toml, load_config
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
    if str(resume) == "latest":
        latest = Path(cfg.output.dir) / "checkpoints" / "latest.gguf"
        if not latest.exists():
            raise CheckpointError(
                f"no checkpoint to resume in {latest.parent}; run without --resume first "
                "or check output.dir"
            )
        resume = latest.resolve()
    return load_checkpoint(resume, ops=cfg.model.ops)


def _as_config(config: Config | str | Path | None, overrides: Sequence[str]) -> Config:
    if isinstance(config, Config):
        return load_config(None, overrides) if overrides else config
    return load_config(config, overrides)


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
    if isinstance(config, Config) and (overrides or extra):
        from llamatrain.config import apply_overrides, validate

        cfg = validate(apply_overrides(config, [*overrides, *extra]))
    else:
        cfg = _as_config(config, [*overrides, *extra])
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
    return FitResult(trainer.model, tokenizer, history, run_dir, export_path)


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
        path = path / "checkpoints" / "latest.gguf"
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


def describe_gguf(path: str | Path) -> str:
    """A human-readable summary: architecture, hyper-parameters, tokenizer, tensors, counters."""
    contents = gguf_io.read_gguf(path)
    meta = contents.metadata
    lines = [f"{path}: {meta.get('general.type', 'model')} ({meta.get('general.architecture')})"]
    for key, value in meta.items():
        if key.startswith("tokenizer.ggml.") and isinstance(value, list):
            lines.append(f"  {key}: [{len(value)} entries]")
        elif key not in ("training.config", "training.rng_state", "optimizer.lbfgs.state"):
            lines.append(f"  {key}: {value}")
    total = 0
    lines.append(f"  tensors ({len(contents.tensors)}):")
    for name, tensor in contents.tensors.items():
        nbytes = gguf_io.stored_nbytes(contents, name)
        total += nbytes
        shape = "x".join(str(d) for d in tensor.shape)
        lines.append(f"    {name:<40} {shape:>14} {contents.tensor_types[name]:>6} {nbytes:>12,}")
    lines.append(f"  tensor data: {total:,} bytes")
    return "\n".join(lines)
