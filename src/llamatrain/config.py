"""Run configuration: one dataclass per TOML section, ``--set`` overrides, validation.

A run is fully described by a TOML file with the sections ``[model]``, ``[tokenizer]``,
``[data]``, ``[optim]``, ``[train]`` and ``[output]``; every key is optional and falls back to
the dataclass default. ``--set section.key=value`` overrides are applied on top, then the whole
config is validated once, so a file that is only valid *after* its overrides still works.

Why dataclasses driven by type hints: one generic checker (:func:`_check_type`) covers every
field, the help text lives next to the default (``field(metadata={"help": ...})``) and the
README's reference table is generated from the same place (:func:`config_reference`), so the
three never drift apart. Per-field value rules (``choices``, ``gt``, ``ge``, ``lt``, ``le``)
are metadata too; only rules that tie several fields together are written out in
:func:`validate`.

Every problem is a :class:`~llamatrain.errors.ConfigError` whose message names the key, where
its value came from (file or ``--set``) and what would be accepted.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w

from llamatrain.errors import ConfigError
from llamatrain.gguf.file import EXPORT_TYPES
from llamatrain.model import ModelConfig
from llamatrain.settings import check_rules, divisors, is_config_key, setting, show

__all__ = [
    "BUILTIN_CONFIGS",
    "Config",
    "DataSection",
    "OptimSection",
    "OutputSection",
    "TokenizerSection",
    "TrainSection",
    "apply_overrides",
    "apply_values",
    "config_from_dict",
    "config_reference",
    "config_to_dict",
    "config_to_toml",
    "load_config",
    "validate",
]

# ---- sections ------------------------------------------------------------------------------


@dataclass
class TokenizerSection:
    """Where the vocabulary comes from."""

    path: str | None = setting(
        None,
        "unset = train a sentencepiece model on the corpus; a .model file = load it; "
        "a .gguf file = use its tokenizer.* keys (like 2023's --vocab-model)",
    )
    vocab_size: int = setting(1024, "vocabulary size when training a tokenizer", ge=8)
    model_type: str = setting(
        "bpe", "sentencepiece algorithm when training", choices=("bpe", "unigram")
    )
    max_sentence_length: int = setting(
        16384, "longest line (bytes) sentencepiece trains on; longer lines are skipped", gt=0
    )
    input_sentence_size: int = setting(
        200_000, "lines sampled to train the tokenizer (0 = all); caps training time", ge=0
    )


@dataclass
class DataSection:
    """Training text and how it is cut into windows."""

    path: str | list[str] = setting(
        "shakespeare",
        "file, folder (all *.txt, recursive), glob, or a list of them, relative to the "
        "working directory; 'shakespeare' = the embedded default corpus",
    )
    n_ctx: int = setting(128, "training sequence length in tokens (llama.context_length)", ge=2)
    val_fraction: float = setting(
        0.05, "last fraction of the token stream held out for validation (0 = none)", ge=0, lt=0.5
    )
    sample_start: str = setting(
        "any",
        "where training windows may start: 'any' token, right after a 'newline', "
        "or every 'stride' tokens",
        choices=("any", "newline", "stride"),
    )
    stride: int | None = setting(
        None, "window spacing for sample_start = 'stride'; unset = n_ctx / 2", gt=0
    )
    bos_prefix: bool = setting(
        True,
        "start every window with BOS as the 2023 trainer and llama.cpp prompts do; "
        "false = plain n_ctx+1 slices of the stream (llama-finetune, nanoGPT)",
    )
    cache_dir: str = setting(
        ".cache/llamatrain",
        "where the downloaded corpus and tokenized data are kept (relative to the "
        "working directory unless absolute)",
    )


@dataclass
class OptimSection:
    """Optimizer and learning-rate schedule (2023 train-text-from-scratch's knobs)."""

    name: str = setting("adamw", "optimizer", choices=("adamw", "lbfgs"))
    lr: float = setting(1e-3, "peak learning rate", gt=0)
    lr_min: float = setting(1e-4, "learning rate at the end of each cosine decay (absolute)", ge=0)
    weight_decay: float = setting(0.1, "AdamW decoupled weight decay", ge=0)
    decay_min_ndim: int = setting(
        2, "decay only tensors with at least this many dims (matrices, not norms)", ge=0
    )
    beta1: float = setting(0.9, "AdamW first-moment decay", ge=0, lt=1)
    beta2: float = setting(0.999, "AdamW second-moment decay", ge=0, lt=1)
    eps: float = setting(1e-8, "AdamW epsilon", gt=0)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this (0 = off)", ge=0)
    warmup_steps: int = setting(100, "linear warmup steps", ge=0)
    cos_decay_steps: int = setting(1000, "length of the (first) cosine decay after warmup", gt=0)
    cos_decay_restart: float = setting(
        1.1,
        "0 = no restarts (hold lr_min after one decay); >= 1 = restart the cosine, each "
        "period this factor longer than the last (1.0 = constant period)",
        ge=0,
    )
    lbfgs_history: int = setting(10, "L-BFGS history size", gt=0)
    lbfgs_max_iter: int = setting(20, "L-BFGS iterations per optimizer step", gt=0)
    opt_past: int = setting(
        0,
        "delta convergence test: stop when the loss changed by less than opt_delta (relative) "
        "against the loss this many steps earlier (0 = off; 1 = ggml's AdamW eps_f test)",
        ge=0,
    )
    opt_delta: float = setting(1e-5, "relative loss change the delta test stops below", gt=0)
    opt_max_no_improvement: int = setting(
        0, "stop after this many steps without a new best loss (0 = off)", ge=0
    )
    opt_no_improvement_on: str = setting(
        "train",
        "the loss opt_max_no_improvement watches: every step's 'train' loss, or the 'val' "
        "loss at each evaluation (train.eval_every)",
        choices=("train", "val"),
    )
    adam_epsf: float = setting(
        0.0, "stop when the gradient norm (before clipping) falls below this (0 = off)", ge=0
    )


@dataclass
class TrainSection:
    """The loop: batch sizes, steps, saving, evaluation, device."""

    steps: int = setting(
        1000, "optimizer steps to train (a resumed run continues up to this)", gt=0
    )
    n_batch: int = setting(1024, "tokens per optimizer step; a multiple of data.n_ctx", gt=0)
    n_ubatch: int | None = setting(
        None,
        "tokens computed at once (gradient accumulation over n_batch / n_ubatch); unset = n_batch",
        gt=0,
    )
    seed: int = setting(42, "seed for initialisation, shuffling and sampling")
    save_every: int = setting(
        200, "save a checkpoint every this many steps (0 = only at the end)", ge=0
    )
    eval_every: int = setting(
        200, "evaluate and print a sample every this many steps (0 = only at the end)", ge=0
    )
    eval_batches: int = setting(8, "validation batches per evaluation (0 = all)", ge=0)
    keep_checkpoints: int = setting(3, "checkpoints kept in the run folder (0 = keep all)", ge=0)
    checkpointing: str = setting(
        "none",
        "gradient checkpointing: 'none', 'full' (every block), 'every_n' blocks, or "
        "'auto' (the 2023 sqrt(n·v/u) spacing)",
        choices=("none", "full", "every_n", "auto"),
    )
    checkpoint_every_n: int = setting(2, "blocks per checkpointed segment for 'every_n'", gt=0)
    device: str = setting(
        "auto", "'auto' = CUDA when available, else CPU", choices=("auto", "cpu", "cuda")
    )
    dtype: str = setting(
        "float32",
        "compute dtype; 'bfloat16' = autocast (fast on CUDA, slow on most CPUs)",
        choices=("float32", "bfloat16"),
    )
    compile: bool = setting(
        False,
        "torch.compile the training loss (static shapes; compiles for 0.5-2 min on 2 CPU cores)",
    )
    sample_prompt: str = setting("Romeo.\n", "prompt of the samples printed at each evaluation")
    sample_tokens: int = setting(64, "tokens generated per sample (0 = no sample)", ge=0)
    sample_temperature: float = setting(0.8, "sampling temperature (0 = greedy)", ge=0)
    sample_seen_tokens_only: bool = setting(
        False,
        "samples draw only tokens that occur in the training data (the 2023 trainer's option); "
        "the set is stored in each checkpoint for `llamatrain generate --seen-tokens-only`",
    )
    log_every: int = setting(10, "write a metrics line every this many steps", gt=0)


@dataclass
class OutputSection:
    """Where results go and what the final export is."""

    dir: str = setting("runs/default", "run folder: checkpoints, metrics.jsonl, exported model")
    export: bool = setting(True, "write a llama.cpp GGUF model at the end of training")
    export_type: str = setting(
        "f32",
        "tensor type of the exported model (norms stay f32)",
        choices=EXPORT_TYPES,
    )


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "tokenizer": TokenizerSection,
    "data": DataSection,
    "optim": OptimSection,
    "train": TrainSection,
    "output": OutputSection,
}


@dataclass
class Config:
    """A whole run. ``origins`` remembers where each non-default value came from."""

    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    output: OutputSection = field(default_factory=OutputSection)
    origins: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def origin(self, key: str) -> str:
        """Where ``key`` (dotted) was set: a file, a ``--set`` item, or the defaults."""
        return self.origins.get(key, "the defaults")


# ---- generic field checking ----------------------------------------------------------------


def _fields(section_cls: type) -> dict[str, dataclasses.Field]:
    """The fields of a section that are config keys (derived ones are filled by the run)."""
    return {f.name: f for f in dataclasses.fields(section_cls) if is_config_key(f)}


def _hints(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _union_args(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _describe(hint: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    parts = []
    for arg in _union_args(hint):
        if arg is type(None):
            continue
        if typing.get_origin(arg) is list:
            parts.append(f"a list of {_describe(typing.get_args(arg)[0]).split(' ', 1)[1]}s")
        else:
            parts.append(names[arg])
    text = " or ".join(parts)
    if type(None) in _union_args(hint):
        text += " (or left out for the default)"
    return text


_NO = object()


def _convert(value: Any, hint: Any) -> Any:
    """``value`` as the type ``hint`` asks for, or ``_NO``. Ints pass as floats; bools never
    pass as numbers (TOML ``true`` for a size is a mistake, not a 1)."""
    for arg in _union_args(hint):
        if arg is type(None):
            if value is None:
                return None
        elif arg is bool:
            if isinstance(value, bool):
                return value
        elif arg is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif arg is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        elif arg is str:
            if isinstance(value, str):
                return value
        elif typing.get_origin(arg) is list:
            (item,) = typing.get_args(arg)
            if isinstance(value, list):
                items = [_convert(v, item) for v in value]
                if all(v is not _NO for v in items):
                    return items
        else:  # pragma: no cover - a new hint kind needs a branch here
            raise TypeError(f"config field type {arg!r} is not supported")
    return _NO


def _check_type(section: str, name: str, value: Any, hint: Any, where: str) -> Any:
    converted = _convert(value, hint)
    if converted is _NO:
        raise ConfigError(
            f"{section}.{name} in {where} must be {_describe(hint)}, got {show(value)}"
        )
    return converted


def _unknown_key(section: str, name: str, where: str) -> ConfigError:
    derived = {f.name: f for f in dataclasses.fields(SECTIONS[section])}.get(name)
    if derived is not None:
        return ConfigError(
            f"{section}.{name} in {where} is not a config key: it is the "
            f"{derived.metadata['help']}; remove it"
        )
    for other, cls in SECTIONS.items():
        if other != section and name in _fields(cls):
            return ConfigError(
                f"unknown key {section}.{name} in {where}: {name} belongs in [{other}] "
                f"(use {other}.{name})"
            )
    valid = list(_fields(SECTIONS[section]))
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f"did you mean {section}.{close[0]}? " if close else ""
    return ConfigError(
        f"unknown key {section}.{name} in {where}; {hint}valid keys in [{section}]: "
        + ", ".join(valid)
    )


def _unknown_section(name: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(SECTIONS), n=1, cutoff=0.5)
    hint = f"did you mean [{close[0]}]? " if close else ""
    for sec, cls in SECTIONS.items():
        if name in _fields(cls):
            hint = f"{name} is a key of [{sec}]: put it under [{sec}] (or use {sec}.{name}); "
    return ConfigError(
        f"unknown section [{name}] in {where}; {hint}sections are: "
        + ", ".join(f"[{s}]" for s in SECTIONS)
    )


# ---- building, overriding, dumping ---------------------------------------------------------


def _set(cfg: Config, sec_name: str, name: str, value: Any, where: str, *, raw: bool) -> None:
    """Type-check one value and store it, remembering where it came from.

    ``raw``: ``value`` is the text of a ``--set`` item, parsed as the field's type wants.
    """
    if sec_name not in SECTIONS:
        raise _unknown_section(sec_name, where)
    section = getattr(cfg, sec_name)
    if name not in _fields(type(section)):
        raise _unknown_key(sec_name, name, where)
    hint = _hints(type(section))[name]
    if raw:
        value = _parse_override(value, hint)
    setattr(section, name, _check_type(sec_name, name, value, hint, where))
    cfg.origins[f"{sec_name}.{name}"] = where


def config_from_dict(d: dict[str, Any], source: str = "the config") -> Config:
    """Build a Config from ``{section: {key: value}}``, type-checking every value.

    Value rules (ranges, choices, cross-field) are left to :func:`validate`, so that
    overrides can still fix a file before it is judged. ``None`` is accepted for keys whose
    default is unset, so :func:`config_to_dict` output round-trips.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"{source} must be a table of sections, got {show(d)}")
    cfg = Config()
    for sec_name, table in d.items():
        if sec_name in SECTIONS and not isinstance(table, dict):
            raise ConfigError(
                f"{sec_name} in {source} must be a section ([{sec_name}] with keys below it), "
                f"got {show(table)}"
            )
        if sec_name not in SECTIONS:
            raise _unknown_section(sec_name, source)
        for name, value in table.items():
            _set(cfg, sec_name, name, value, source, raw=False)
    return cfg


def _split_key(key: str, where: str) -> tuple[str, str]:
    sec_name, dot, name = key.partition(".")
    if not dot:
        owners = [s for s, cls in SECTIONS.items() if key in _fields(cls)]
        hint = f"did you mean {owners[0]}.{key}?" if owners else "keys look like optim.lr"
        raise ConfigError(f"{where}: the key needs its section; {hint}")
    return sec_name, name


def _parse_override(raw: str, hint: Any) -> Any:
    """A ``--set`` value: a TOML value when it parses as one the field accepts, else the bare
    string (so ``data.path=a.txt`` needs no quotes), ``none``/``null`` unsets a field whose
    default is unset."""
    accepts_none = type(None) in _union_args(hint)
    if accepts_none and raw.lower() in ("none", "null", ""):
        return None
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    if _convert(value, hint) is _NO and _convert(raw, hint) is not _NO:
        return raw  # e.g. train.sample_prompt=1984 is the string "1984"
    return value


def apply_overrides(cfg: Config, overrides: typing.Iterable[str]) -> Config:
    """Apply ``section.key=value`` strings in order (later wins); returns ``cfg``."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        where = f"--set {item}"
        if not sep or not key.strip():
            raise ConfigError(f"--set expects section.key=value (like optim.lr=3e-4), got {item!r}")
        sec_name, name = _split_key(key.strip(), where)
        _set(cfg, sec_name, name, raw.strip(), where, raw=True)
    return cfg


def apply_values(cfg: Config, values: typing.Mapping[str, Any], where: str) -> Config:
    """Set ``{"section.key": value}`` pairs given as Python values (the API's keywords)."""
    for key, value in values.items():
        sec_name, name = _split_key(key, f"{where} {key}")
        _set(cfg, sec_name, name, value, f"{where} {key}", raw=False)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain ``{section: {key: value}}`` (JSON-able; unset keys are ``None``), for storing
    the exact configuration in checkpoints and metrics."""
    return {
        name: {key: getattr(getattr(cfg, name), key) for key in _fields(cls)}
        for name, cls in SECTIONS.items()
    }


def config_to_toml(cfg: Config) -> str:
    """The config as a TOML file that :func:`load_config` reads back to an equal Config
    (written into each run folder so a run can be repeated). Unset keys are commented out."""
    parts = []
    for sec_name, table in config_to_dict(cfg).items():
        values = {key: value for key, value in table.items() if value is not None}
        unset = "".join(f"# {key} = (unset)\n" for key, value in table.items() if value is None)
        parts.append(tomli_w.dumps({sec_name: values}) + unset)
    return "\n".join(parts)


BUILTIN_CONFIGS = resources.files("llamatrain") / "configs"
"""Configs shipped inside the package: ``--config shakespeare`` works from any folder."""


def builtin_config_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".toml") for p in BUILTIN_CONFIGS.iterdir() if p.name.endswith(".toml")
    )


def _config_path(spec: str | Path) -> Path:
    """A config file path: the file named, else the built-in config of that name."""
    path = Path(spec)
    if path.is_file():
        return path
    builtin = BUILTIN_CONFIGS / f"{Path(spec).name.removesuffix('.toml')}.toml"
    if not path.is_dir() and builtin.is_file():
        return Path(str(builtin))
    what = "is a folder, not a file" if path.is_dir() else "not found"
    raise ConfigError(
        f"config file {path} {what} (working directory {Path.cwd()}); built-in configs: "
        + ", ".join(builtin_config_names())
    )


def load_config(spec: str | Path | None, overrides: typing.Iterable[str] = ()) -> Config:
    """Read a TOML config (a path or a built-in name; ``None`` = all defaults), apply
    overrides, validate."""
    if spec is None:
        cfg = Config()
    else:
        path = _config_path(spec)
        try:
            with path.open("rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(
                f"{path} is not valid TOML: {e}. Fix the syntax (strings need quotes: "
                'key = "value"; sections look like [model])'
            ) from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text ({e}); save it as UTF-8") from None
        cfg = config_from_dict(data, source=str(spec))
    apply_overrides(cfg, overrides)
    return validate(cfg)


# ---- validation ----------------------------------------------------------------------------


def _set_in(cfg: Config, *keys: str) -> str:
    """'(from X and Y)' for error messages: where the keys involved came from."""
    places: list[str] = []
    for key in keys:
        where = cfg.origin(key)
        if where not in places:
            places.append(where)
    return "(from " + " and ".join(places) + ")"


def _nearest_multiples(value: int, unit: int) -> str:
    lo = max(unit, value // unit * unit)
    hi = lo + unit if lo <= value else lo
    return f"{lo}" if lo == hi else f"{lo} or {hi}"


_DERIVED = "the default (= train.n_batch)"


def _validate_model(cfg: Config) -> None:
    """The [model] section's own rules, plus what the export type needs of its shapes."""
    m = cfg.model
    if m.init_from is not None:  # the architecture comes from the file; only choices count
        check_rules(m, "model", lambda key: f" in {cfg.origin(key)}")
        return
    m.validate(lambda key: " " + _set_in(cfg, "model.dim", key))
    quantized = cfg.output.export_type in ("q8_0", "q4_0")
    if quantized and (m.dim % 32 or m.hidden_dim % 32):
        raise ConfigError(
            f"output.export_type = {cfg.output.export_type!r} needs model.dim and the "
            f"ffn width to be multiples of 32 (quant blocks), got dim {m.dim}, "
            f"ffn {m.hidden_dim} {_set_in(cfg, 'output.export_type', 'model.dim')}; "
            "use export_type 'f16' or change the sizes"
        )


def validate(cfg: Config) -> Config:
    """Check every value and the rules that tie fields together; fill derived defaults.

    Filled here: ``train.n_ubatch`` (unset = ``train.n_batch``), so later code never meets
    ``None`` there. Returns ``cfg``.
    """
    for sec_name in SECTIONS:
        if sec_name != "model":
            check_rules(getattr(cfg, sec_name), sec_name, lambda key: f" in {cfg.origin(key)}")
    _validate_model(cfg)

    d, o, t = cfg.data, cfg.optim, cfg.train
    if cfg.origins.get("train.n_ubatch") == _DERIVED:
        t.n_ubatch = None  # filled by an earlier validate: follow a changed n_batch

    if o.lr_min > o.lr:
        raise ConfigError(
            f"optim.lr_min = {o.lr_min} must not exceed optim.lr = {o.lr} "
            f"{_set_in(cfg, 'optim.lr_min', 'optim.lr')}; lr_min is absolute (e.g. lr / 10)"
        )
    if o.opt_max_no_improvement and o.opt_no_improvement_on == "val" and d.val_fraction == 0:
        raise ConfigError(
            "optim.opt_no_improvement_on = 'val' watches the validation loss, but "
            f"data.val_fraction = 0 holds none out {_set_in(cfg, 'optim.opt_no_improvement_on')}"
            "; set data.val_fraction > 0 or watch the 'train' loss"
        )
    if 0 < o.cos_decay_restart < 1:
        raise ConfigError(
            f"optim.cos_decay_restart = {o.cos_decay_restart} in "
            f"{cfg.origin('optim.cos_decay_restart')} must be 0 (no restarts) or >= 1 "
            "(each cosine period that many times longer than the last)"
        )

    if t.n_batch % d.n_ctx:
        raise ConfigError(
            f"train.n_batch = {t.n_batch} (tokens per step) must be a multiple of data.n_ctx = "
            f"{d.n_ctx} {_set_in(cfg, 'train.n_batch', 'data.n_ctx')}; e.g. n_batch = "
            f"{_nearest_multiples(t.n_batch, d.n_ctx)}"
        )
    if t.n_ubatch is not None:
        if t.n_ubatch % d.n_ctx:
            raise ConfigError(
                f"train.n_ubatch = {t.n_ubatch} must be a multiple of data.n_ctx = {d.n_ctx} "
                f"{_set_in(cfg, 'train.n_ubatch', 'data.n_ctx')}; e.g. "
                f"{_nearest_multiples(t.n_ubatch, d.n_ctx)}"
            )
        if t.n_batch % t.n_ubatch:
            n_seq = t.n_batch // d.n_ctx
            ok = [k * d.n_ctx for k in divisors(n_seq)]
            raise ConfigError(
                f"train.n_ubatch = {t.n_ubatch} must divide train.n_batch = {t.n_batch} "
                f"{_set_in(cfg, 'train.n_ubatch', 'train.n_batch')}; choose one of {ok}"
            )
    else:
        t.n_ubatch = t.n_batch
        cfg.origins["train.n_ubatch"] = _DERIVED
    return cfg


# ---- reference -----------------------------------------------------------------------------


def config_reference() -> list[tuple[str, object, str]]:
    """Every key as ``(dotted key, default, help)``, in section order, for the README."""
    rows: list[tuple[str, object, str]] = []
    for sec_name, cls in SECTIONS.items():
        for f in _fields(cls).values():
            help_text = f.metadata["help"]
            if "choices" in f.metadata:
                help_text += " (" + " | ".join(repr(c) for c in f.metadata["choices"]) + ")"
            rows.append((f"{sec_name}.{f.name}", f.default, help_text))
    return rows
