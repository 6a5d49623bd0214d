"""The rules that tie several config values together, checked once on the whole config.

Per-field rules (ranges, choices) are the fields' own metadata (``settings.check_rules``);
what is written out here is only what one field alone cannot say: n_batch must be a multiple
of n_ctx, lr_min must not exceed lr, a quantized export needs block-sized rows …
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from llamatrain.config.paths import make_output_paths_absolute
from llamatrain.config.sections import CHAT_TEMPLATE_NAMES, SECTIONS, Config, TrainSection
from llamatrain.errors import ConfigError
from llamatrain.gguf.adapter import lora_settings_problem
from llamatrain.gguf.quantize import require_quantizer
from llamatrain.sampling import SamplingError, SamplingParams
from llamatrain.settings import check_rules, divisors
from llamatrain.trackers import TRACKERS

__all__ = ["check_sampler", "sample_params", "set_in", "validate"]


def set_in(cfg: Config, *keys: str) -> str:
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
_COMPLETION_DERIVED = "the default (256, at most half of data.n_ctx)"


def _default_max_completion_length(cfg: Config) -> None:
    """``train.max_completion_length`` unset: GRPOConfig's 256, but never more than half of
    ``data.n_ctx``, so the defaults leave a prompt room (the default n_ctx is 128);
    followed again when an earlier validate filled it and n_ctx changed."""
    t = cfg.train
    derived = cfg.origins.get("train.max_completion_length") == _COMPLETION_DERIVED
    if t.max_completion_length is None or derived:
        t.max_completion_length = max(1, min(256, cfg.data.n_ctx // 2))
        cfg.origins["train.max_completion_length"] = _COMPLETION_DERIVED


def _validate_model(cfg: Config) -> None:
    """The [model] section's own rules, plus what the export type needs of its shapes."""
    m = cfg.model
    if m.init_from is not None:  # the architecture comes from the file; only choices count
        check_rules(m, "model", lambda key: f" in {cfg.origin(key)}")
        return
    m.validate(lambda key: " " + set_in(cfg, "model.dim", key))
    quantized = cfg.output.export_type in ("q8_0", "q4_0")
    if quantized and (m.dim % 32 or m.hidden_dim % 32):
        raise ConfigError(
            f"output.export_type = {cfg.output.export_type!r} needs model.dim and the "
            f"ffn width to be multiples of 32 (quant blocks), got dim {m.dim}, "
            f"ffn {m.hidden_dim} {set_in(cfg, 'output.export_type', 'model.dim')}; "
            "use export_type 'f16' or change the sizes"
        )


def _validate_lora(cfg: Config) -> None:
    """A LoRA run adapts a trained base; its targets are projections a block has, once each
    (unset: all of them); a base kept as blocks is not traced by train.compile (the blocks'
    byte views are beyond what AOTAutograd takes)."""
    lora = cfg.lora
    if lora.rank > 0 and cfg.model.init_from is None:
        raise ConfigError(
            f"lora.rank = {lora.rank} {set_in(cfg, 'lora.rank')} adapts a base model, but "
            "model.init_from is unset (LoRA on a random model learns nothing useful); set "
            "model.init_from to a GGUF, run folder or HF folder, or lora.rank = 0"
        )
    if lora.targets is not None and (problem := lora_settings_problem(targets=lora.targets)):
        raise ConfigError(f"{problem} {set_in(cfg, 'lora.targets')}")
    if lora.init_from is not None:
        start = Path(lora.init_from).expanduser()
        if not (lora.rank > 0 and start.is_file()):
            raise ConfigError(
                f"lora.init_from = {lora.init_from!r} {set_in(cfg, 'lora.init_from', 'lora.rank')} "
                + ("is not a file; name an adapter GGUF" if lora.rank else "needs lora.rank > 0")
            )
        lora.init_from = str(start.absolute())  # as the output paths: read again on a resume
    if lora.rank > 0 and lora.base_dtype == "quantized" and cfg.train.compile:
        raise ConfigError(
            f"train.compile = true {set_in(cfg, 'train.compile', 'lora.base_dtype')} cannot "
            "trace a base kept as its GGUF blocks (lora.base_dtype = 'quantized'); set "
            "train.compile = false: the blocks' decoders are compiled on their own "
            "(lora.decode)"
        )


def _validate_parallel(cfg: Config) -> None:
    """What sharded or replicated training does not run: L-BFGS (its line search needs every
    weight in one place) and LoRA under FSDP (adapters are trained under DDP)."""
    mode = cfg.train.parallel
    if mode != "none" and cfg.optim.name == "lbfgs":
        raise ConfigError(
            f"train.parallel = {mode!r} {set_in(cfg, 'train.parallel', 'optim.name')} trains "
            "with AdamW only; set optim.name = 'adamw' or train.parallel = 'none'"
        )
    if mode == "fsdp" and cfg.lora.rank > 0:
        raise ConfigError(
            f"train.parallel = 'fsdp' {set_in(cfg, 'train.parallel', 'lora.rank')} does not "
            "shard LoRA runs (their adapters are small); use train.parallel = 'ddp'"
        )


def _validate_data_format(cfg: Config) -> None:
    """Table data (Parquet, HF datasets) has no text files to train a tokenizer on; the
    trackers of output.loggers are ones llamatrain knows (installed or not: checked when a
    run opens them, so a run folder's config stays readable without them)."""
    d = cfg.data
    if d.format in ("parquet", "hf") and not (cfg.tokenizer.path or cfg.model.init_from):
        raise ConfigError(
            f"data.format = {d.format!r} {set_in(cfg, 'data.format')} reads rows, not text "
            "files a tokenizer could be trained on; set tokenizer.path (a .gguf, .model or "
            "tokenizer.json) or model.init_from"
        )
    unknown = [name for name in cfg.output.loggers or () if name not in TRACKERS]
    if unknown:
        raise ConfigError(
            f"output.loggers {set_in(cfg, 'output.loggers')} has {unknown[0]!r}, which is not "
            f"a tracker; choose any of {', '.join(map(repr, TRACKERS))}"
        )


def _validate_chat_template(cfg: Config) -> None:
    """``data.chat_template``: a name it knows, or a file that exists, made absolute (as the
    output paths are: before code a config names can change directory)."""
    d = cfg.data
    if d.chat_template in CHAT_TEMPLATE_NAMES:
        return
    path = Path(d.chat_template).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"data.chat_template {set_in(cfg, 'data.chat_template')} is {d.chat_template!r}, "
            f"neither one of {', '.join(map(repr, CHAT_TEMPLATE_NAMES))} nor a template file; "
            "name one of those or the path of a Jinja file"
        )
    d.chat_template = str(path.absolute())


def sample_params(train: TrainSection) -> SamplingParams:
    """The sampler of the evaluations' samples: one home, so that :func:`validate` checks the
    very settings the trainer samples with, before the first step rather than at the first
    sample (SamplingError naming the field)."""
    return SamplingParams(temperature=train.sample_temperature)


def _validate_sampling(cfg: Config) -> None:
    """Every sampler the run will build, built now: a value SamplingParams refuses (a
    temperature of 2e6) is refused before the first step, naming its key."""
    check_sampler(cfg, "train.sample_", sample_params)


def check_sampler(
    cfg: Config, prefix: str, sampler: Callable[[TrainSection], SamplingParams]
) -> None:
    """The sampler ``sampler`` builds from ``cfg.train``, built now: a value SamplingParams
    refuses (a temperature of 2e6) is refused before the first step, naming its key
    (``prefix`` + the field)."""
    try:
        sampler(cfg.train)
    except SamplingError as e:
        key = prefix + e.field
        raise ConfigError(f"{key} {set_in(cfg, key)} must be {e.rule}, got {e.value!r}") from e


def validate(cfg: Config) -> Config:
    """Check every value and the rules that tie fields together; fill derived defaults.

    Filled here: ``train.n_ubatch`` (unset = ``train.n_batch``) and
    ``train.max_completion_length`` (unset = 256, at most half of ``data.n_ctx``), so later
    code never meets ``None`` there. The objective's own rules (and ``train.beta``'s
    default, which is the objective's) are ``llamatrain.objectives.check``'s: config/ knows
    no objective. Marks ``cfg`` validated (``Config.validated``), which the trainer trusts.
    Returns ``cfg``.
    """
    _default_max_completion_length(cfg)
    for sec_name in SECTIONS:
        if sec_name != "model":
            check_rules(getattr(cfg, sec_name), sec_name, lambda key: f" in {cfg.origin(key)}")
    _validate_model(cfg)
    _validate_lora(cfg)
    _validate_parallel(cfg)
    _validate_data_format(cfg)
    _validate_chat_template(cfg)
    _validate_sampling(cfg)
    require_quantizer(cfg.output.export_type)
    make_output_paths_absolute(cfg)  # before any code a config names can change directory

    d, o, t = cfg.data, cfg.optim, cfg.train
    if cfg.origins.get("train.n_ubatch") == _DERIVED:
        t.n_ubatch = None  # filled by an earlier validate: follow a changed n_batch

    if o.lr_min > o.lr:
        raise ConfigError(
            f"optim.lr_min = {o.lr_min} must not exceed optim.lr = {o.lr} "
            f"{set_in(cfg, 'optim.lr_min', 'optim.lr')}; lr_min is absolute (e.g. lr / 10)"
        )
    if o.opt_max_no_improvement and o.opt_no_improvement_on == "val" and d.val_fraction == 0:
        raise ConfigError(
            "optim.opt_no_improvement_on = 'val' watches the validation loss, but "
            f"data.val_fraction = 0 holds none out {set_in(cfg, 'optim.opt_no_improvement_on')}"
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
            f"{d.n_ctx} {set_in(cfg, 'train.n_batch', 'data.n_ctx')}; e.g. n_batch = "
            f"{_nearest_multiples(t.n_batch, d.n_ctx)}"
        )
    if t.n_ubatch is not None:
        if t.n_ubatch % d.n_ctx:
            raise ConfigError(
                f"train.n_ubatch = {t.n_ubatch} must be a multiple of data.n_ctx = {d.n_ctx} "
                f"{set_in(cfg, 'train.n_ubatch', 'data.n_ctx')}; e.g. "
                f"{_nearest_multiples(t.n_ubatch, d.n_ctx)}"
            )
        if t.n_batch % t.n_ubatch:
            ok = [k * d.n_ctx for k in divisors(cfg.seqs_per_batch)]
            raise ConfigError(
                f"train.n_ubatch = {t.n_ubatch} must divide train.n_batch = {t.n_batch} "
                f"{set_in(cfg, 'train.n_ubatch', 'train.n_batch')}; choose one of {ok}"
            )
    else:
        t.n_ubatch = t.n_batch
        cfg.origins["train.n_ubatch"] = _DERIVED
    cfg.validated = True
    return cfg
