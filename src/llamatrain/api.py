"""The Python API: what the CLI calls and what notebooks use directly.

``fit`` assembles one run from a config (tokenizer → data → model → checkpointing → trainer
→ export); ``load`` opens a checkpoint or any llama GGUF; ``generate_text`` and
``perplexity`` use a loaded model. Everything here only builds and wires objects from the
lower modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llamatrain import parallel
from llamatrain.allocator import release_freed_memory
from llamatrain.build import (
    PreparedModel,
    RunModel,
    fresh_run,
    prepare,
    resumed_run,
)
from llamatrain.chat_template import BUILTIN_TEMPLATES, ChatTemplate, resolve_chat_template
from llamatrain.checkpoint import load_checkpoint
from llamatrain.config import Config, apply_overrides, apply_values, config_to_toml, read_config
from llamatrain.config import validate as validate_config
from llamatrain.data import TrainData, build_train_data, resolve_inputs
from llamatrain.denormals import denormals_flushed
from llamatrain.device import configure_process, resolve_device, resolve_run_settings
from llamatrain.entry_points import API
from llamatrain.errors import CheckpointError, ConfigError
from llamatrain.evaluate import PerplexityResult as PerplexityResult
from llamatrain.evaluate import perplexity as perplexity
from llamatrain.files import write_text_atomically
from llamatrain.generate import Conversation as Conversation
from llamatrain.generate import chat as chat
from llamatrain.generate import generate_text as generate_text
from llamatrain.generate import reply_stops as reply_stops
from llamatrain.gguf.adapter import read_lora_adapter, target_suffixes, write_lora_adapter
from llamatrain.gguf.describe import describe_gguf as describe_gguf
from llamatrain.gguf.export_types import AUTO_EXPORT_TYPE, QUANTIZER_TYPES, merged_export_type
from llamatrain.gguf.file import verify_gguf
from llamatrain.gguf.llama import read_model, write_model
from llamatrain.gguf.mapped_files import check_mapped_files
from llamatrain.gguf.quantize import require_quantizer, write_quantized_model
from llamatrain.hf.folder import CHAT_TEMPLATE_KEY, write_hf_folder
from llamatrain.hf.peft import write_peft_adapter
from llamatrain.lora import merged_tensors
from llamatrain.memory import out_of_memory_in
from llamatrain.model import Llama
from llamatrain.model_card.facts import ModelCard, conversion_card, export_card
from llamatrain.model_card.general_keys import with_general_keys
from llamatrain.model_card.readme import readme
from llamatrain.model_config import tensor_shapes
from llamatrain.model_path import checkpoint_dir, is_lora_checkpoint, model_file
from llamatrain.model_source import (
    build_model,
    export_type_of,
    inference_model,
    model_to_export,
    open_source,
    with_base,
)

# Re-exported as the public API (``llamatrain.API``; ``X as X`` marks a re-export)
from llamatrain.model_source import load_tokenizer as load_tokenizer
from llamatrain.objectives import Objective, ObjectiveInputs, objective_for
from llamatrain.objectives import check as check_objective
from llamatrain.objectives.grpo.rewards import RewardFunction
from llamatrain.objectives.grpo.rules import check_given_tools
from llamatrain.ops.decode_kernels import compiled_decoding
from llamatrain.plot import METRICS_FILE, can_plot, plot_metrics
from llamatrain.runlock import run_lock, set_aside_previous_run
from llamatrain.tokenizer import (
    Tokenizer,
)
from llamatrain.trainer import History, Trainer

__all__ = list(API)  # the one list: llamatrain.entry_points

RUN_CONFIG = "config.toml"
"""The config a run was trained with, in its folder (what ``--resume`` and ``load`` read)."""


@dataclass
class FitResult:
    """What ``fit`` returns: the trained model and tokenizer, metrics and file locations."""

    config: Config
    model: Llama
    tokenizer: Tokenizer
    history: History
    run_dir: Path
    export_path: Path | None
    curves_path: Path | None = None  # curves.png, when matplotlib is installed
    adapter_path: Path | None = None  # a LoRA run's adapter-f32.gguf (llama.cpp's --lora)


# ---- building a run ----------------------------------------------------------------------


def _configure(
    config: Config | str | Path | None,
    overrides: Sequence[str],
    dotted: Mapping,
    rewards: Sequence[str | RewardFunction] | None = None,
    custom: bool = False,
) -> Config:
    """The run's validated config: a file, a built-in name or a Config, plus overrides and
    keywords, validated once as a whole with its objective's rules (``rewards``: GRPO's
    functions given in Python, in place of train.rewards; ``custom``: a notebook's own
    objective, whose rules are its own), with its ``auto`` choices made for the device
    (``llamatrain.device.resolve_run_settings``) before anything reads them."""
    values = {key.replace("__", "."): value for key, value in dotted.items()}
    if isinstance(config, Config):
        cfg = apply_overrides(config, overrides)
    else:
        cfg = read_config(config, overrides)
    cfg = apply_values(cfg, values, "fit(...) keyword")
    cfg = validate_config(cfg)
    return resolve_run_settings(cfg if custom else check_objective(cfg, rewards))


def fit(
    config: Config | str | Path | None = None,
    *,
    overrides: Sequence[str] = (),
    resume: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    rewards: Sequence[str | RewardFunction] | None = None,
    objective: Objective | None = None,
    tools: Sequence[str | Callable[..., Any]] | None = None,
    **dotted: object,
) -> FitResult:
    """Train a model as the config says; evaluate, sample, save and export it.

    ``config`` is a path to a TOML file, a built-in config's name (``"tiny"``,
    ``"shakespeare"``, ``"ggml-2023"``), a ``Config`` or None (defaults). Overrides come as
    ``overrides=["optim.lr=3e-4"]`` or as keywords with ``__`` for the dot:
    ``fit("tiny", train__steps=20)``. ``resume`` is a checkpoint path or ``"latest"``.
    ``auto`` choices (``model.ops``, ``model.attention``, ``train.dtype``) are made for the
    device: on CUDA PyTorch's ops, SDPA and bf16 autocast; on the CPU ggml's ops, the blockwise
    flash attention and float32 (``llamatrain.device.resolve_run_settings``); the result's
    ``config`` and the run's ``config.toml`` hold the choices made.
    Applies the device's process-wide settings (``llamatrain.device.configure_process``);
    the CPU flushes denormal floats while the trainer runs (``llamatrain.denormals``).
    One process at a time trains into a run folder: another's ``fit`` into the same
    ``output.dir`` raises RunInUseError naming this one's PID (``llamatrain.runlock``). A new
    run (no ``resume``) into a folder that holds one raises OutputError, unless ``overwrite``,
    which moves the old run aside to ``<output.dir>.old-<n>`` (nothing is deleted).
    Under torchrun (``train.parallel``) every rank calls it: the ranks join for the run and
    part after it, rank 0 holds the lock and writes; the others' result has no files.

    ``rewards``: GRPO's reward functions as Python callables (or specs as train.rewards
    takes them), in place of ``train.rewards``: ``fit(cfg, train__objective="grpo",
    rewards=[correct])`` with ``def correct(prompts, completions, completion_ids, **columns)``
    returning one float (or None) per completion, TRL's signature; its metrics are named by
    its ``__name__`` (``rewards/correct/mean``), ``train.reward_weights`` weighs them in
    order. The run's config.toml cannot name a Python object, so it records no rewards: a
    resume passes the same ``rewards`` again.

    ``tools``: GRPO's tools as Python functions (or specs as train.tools takes them), in
    place of ``train.tools``, as TRL's ``tools=``: ``fit(cfg, rewards=[correct],
    tools=[multiply])``; like ``rewards``, the run's config.toml records none, so a resume
    passes them again.

    ``objective``: a notebook's own training objective (``llamatrain.objectives.Objective``,
    e.g. a subclass of ``ObjectiveBase`` with ``step`` and ``accumulate``) in place of
    ``train.objective``'s; it gets the same batching, DDP, checkpoints, stop/resume and
    trackers. A resume passes it again.
    """
    cfg = _configure(config, overrides, dotted, rewards, custom=objective is not None)
    check_given_tools(cfg, tools)
    device = resolve_device(cfg.train.device)
    with parallel.process_group(cfg.train.parallel, device, cfg.train.dist_timeout_s):
        with parallel.main_first():  # rank 0 fetches a corpus the others then find in the cache
            paths = resolve_inputs(cfg.data.path, cfg.data.cache_dir, format=cfg.data.format)
        lock = run_lock(cfg.output.dir) if parallel.is_main() else contextlib.nullcontext()
        with lock:
            if parallel.is_main() and not resume:
                _claim_run_folder(Path(cfg.output.dir), overwrite)
            shown = progress and parallel.is_main()
            return _fit_locked(cfg, paths, resume, shown, rewards, objective, tools)


def _claim_run_folder(run_dir: Path, overwrite: bool) -> None:
    """A new run starts in a folder holding no other: see ``set_aside_previous_run``."""
    markers = (RUN_CONFIG, METRICS_FILE, checkpoint_dir(run_dir).name)
    aside = set_aside_previous_run(run_dir, markers, overwrite=overwrite)
    if aside is not None:
        warnings.warn(f"moved the run that was in {run_dir} to {aside}", stacklevel=3)


_EXPORT_LATER = (
    "the run's checkpoints are written: export it later in a process of its own "
    "(llamatrain export RUN_DIR -o model.gguf), or set output.export = false"
)
"""What lowers an export's memory: a process that holds no training state beside it."""


_REEXPORT = (
    "the run's last checkpoint holds every step, but nothing was exported: put the file back "
    "and export the run (llamatrain export RUN_DIR -o model.gguf)"
)
"""What to do when a mapped base changed after the last step, before the export read it."""


def _fit_locked(
    cfg: Config,
    paths: Sequence[Path],
    resume: str | Path | None,
    progress: bool,
    rewards: Sequence[str | RewardFunction] | None,
    objective: Objective | None,
    tools: Sequence[str | Callable[..., Any]] | None = None,
) -> FitResult:
    """``fit``'s run, while it holds the run folder's lock."""
    configure_process(resolve_device(cfg.train.device), bf16=cfg.train.dtype == "bfloat16")
    with out_of_memory_in("while loading the model and data", cfg):
        with parallel.main_first():  # tokenizer and token caches are written by rank 0 alone
            run = resumed_run(cfg, resume, paths) if resume else fresh_run(cfg, paths)
            data = build_train_data(
                cfg,
                run.tokenizer,
                paths=paths,
                progress=progress,
                model_template=run.inherited.get(CHAT_TEMPLATE_KEY),
                tools=tools,
            )
        inherited = _with_chat_template(run.inherited, data.chat_template)
        cfg = _with_export_type(cfg, run)
        prepared = prepare(run.model, cfg)
        if objective is None:
            with parallel.main_first():  # rank 0 writes a DPO/IPO reference cache, if any
                objective = _objective(cfg, prepared, data, run, rewards, tools)

    run_dir = Path(cfg.output.dir)
    if parallel.is_main():
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomically(run_dir / RUN_CONFIG, config_to_toml(cfg), "run config")
    trainer = Trainer(
        prepared,
        cfg,
        data=data,
        tokenizer=run.tokenizer,
        progress=progress,
        inherited=inherited,
        lora_base=run.lora_base,
        objective=objective,
    )
    if run.checkpoint is not None:
        trainer.load_state(run.checkpoint)
    plan = trainer.memory_plan  # for an out-of-memory message: what the run holds
    with (
        out_of_memory_in("in a training step, an evaluation or a save", cfg, plan),
        denormals_flushed(),
        compiled_decoding(cfg.lora.decode, prepared.device),
    ):
        history = trainer.fit()
    model = parallel.whole_model(trainer.model)
    _release_training_state(trainer)
    if not parallel.is_main():
        return FitResult(cfg, model, run.tokenizer, history, run_dir, export_path=None)
    adapter_path = None
    export_path = None
    check_mapped_files(fix=_REEXPORT)  # before the export reads the base
    inherited = with_general_keys(inherited, export_card(run_dir, inherited))
    with out_of_memory_in("while exporting the trained model", cfg, plan, remedy=_EXPORT_LATER):
        if run.lora_base is not None:  # a LoRA run: its adapter, and the merged model
            adapter_path = write_lora_adapter(
                run_dir / "adapter-f32.gguf", model, alpha=cfg.lora.alpha, inherited=inherited
            )
        if cfg.output.export:
            export_path = export_gguf(
                model,
                run.tokenizer,
                run_dir / f"model-{cfg.output.export_type}.gguf",
                type=cfg.output.export_type,
                inherited=inherited,
            )
    curves = _write_curves(run_dir)
    return FitResult(cfg, model, run.tokenizer, history, run_dir, export_path, curves, adapter_path)


def _objective(
    cfg: Config,
    prepared: PreparedModel,
    data: TrainData,
    run: RunModel,
    rewards: Sequence[str | RewardFunction] | None,
    tools: Sequence[str | Callable[..., Any]] | None = None,
) -> Objective:
    """``train.objective``'s objective over the prepared model, what it scores against
    built once: a full finetune's DPO/IPO table from ``model.init_from`` (cached), GRPO's
    frozen base; a resumed run's checkpoint record checked first."""
    inputs = ObjectiveInputs(
        prepared.model,
        prepared.device,
        prepared.parallel.ranks,
        data,
        run.tokenizer,
        rewards,
        tools=tools,
        checkpoint=run.checkpoint,
        reference_from_file=True,
    )
    return objective_for(cfg, inputs)


def _with_export_type(cfg: Config, run: RunModel) -> Config:
    """``cfg`` with ``output.export_type = "auto"`` made the type this run's model is written
    as (``merged_export_type``: f32 for a model trained whole, the base's float type or q8_0
    for a LoRA run), so the file name and the run's config.toml say what was written."""
    if cfg.output.export_type != AUTO_EXPORT_TYPE:
        return cfg
    shapes = tensor_shapes(run.model.cfg).items()
    base_types = None
    if run.lora_base_types is not None:
        suffixes = target_suffixes(cfg.lora.adapted)
        adapted = (name for name, _ in shapes if name.endswith(suffixes))
        base_types = [run.lora_base_types[name] for name in adapted if name in run.lora_base_types]
    rows = [shape[-1] for _, shape in shapes if len(shape) == 2]
    chosen = merged_export_type(base_types, rows)
    return dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, export_type=chosen))


def _release_training_state(trainer: Trainer) -> None:
    """Free what only training needed (the optimizer's moments: twice the weights with AdamW;
    the trainer frees gradients after every update) and give the freed memory back to the
    system before exporting and plotting, so they do not raise the run's peak memory above
    its training steps'. The last checkpoint holds the optimizer state for a resume."""
    trainer.optimizer.state.clear()
    release_freed_memory()


def _with_chat_template(
    inherited: Mapping[str, Any], template: ChatTemplate | None
) -> Mapping[str, Any]:
    """``inherited`` with the chat template the run's conversations were rendered with (the
    model's own, or the built-in one ``data.chat_template`` chose in its place): checkpoints and
    exports then carry it, so llama.cpp chats with the model the way it was trained."""
    if template is None:
        return inherited
    return {**inherited, CHAT_TEMPLATE_KEY: template.source}


def _write_curves(run_dir: Path) -> Path | None:
    """``curves.png`` in the run folder when matplotlib is importable, else nothing.

    The picture is a convenience next to results that are already saved, so a missing
    optional dependency or a plotting failure only warns: it must never turn a finished
    training run into an error.
    """
    if not can_plot():
        return None
    try:
        return plot_metrics(run_dir)
    except Exception as err:  # broad on purpose: see the docstring
        warnings.warn(f"could not draw {run_dir}/curves.png: {err}", stacklevel=2)
        return None


# ---- models as files ---------------------------------------------------------------------


def load_gguf(path: str | Path, ops: str = "ggml") -> tuple[Llama, Tokenizer]:
    """A llama GGUF (ours or llama.cpp's, any type we can dequantize) as a model + tokenizer,
    every weight float32 (trainable parameters, as a run holds a model it trains whole)."""
    source = read_model(path, tensor_data=False)
    return build_model(source, ops=ops), source.tokenizer


def load(
    path: str | Path,
    ops: str = "ggml",
    *,
    lora: str | Path | None = None,
    dequantize: bool = False,
) -> tuple[Llama, Tokenizer]:
    """A model and tokenizer to generate, chat and score with, from a run folder (its latest
    checkpoint), a checkpoint, any llama GGUF file or an HF checkpoint folder (config.json,
    safetensors, tokenizer.json); ``lora``: an adapter GGUF to apply over it (llama.cpp's
    ``--lora``). The weights stay as the file stores them (quantized blocks, f16…, mapped from
    it) and a LoRA run's adapter, or ``lora``'s, is applied unmerged: the model costs about its
    file's size. ``dequantize=True``: every weight float32 and an adapter merged in, the model
    an f32 export holds (4 bytes a weight)."""
    source = open_source(path, lora)
    return inference_model(source, ops, dequantize=dequantize), source.base.tokenizer


def seen_tokens(path: str | Path) -> torch.Tensor:
    """(vocab,) bool: the tokens a run's training data held, from its checkpoint (or folder)."""
    path = model_file(path)
    seen = load_checkpoint(path).state.seen_tokens
    if seen is None:
        raise CheckpointError(
            f"{path} holds no seen-token set (training checkpoints store it, exported models "
            "do not); pass the run folder or a checkpoint, or drop --seen-tokens-only"
        )
    return seen


def export_gguf(
    model: Llama,
    tokenizer: Tokenizer,
    path: str | Path,
    type: str = "f32",
    inherited: Mapping[str, Any] | None = None,
) -> Path:
    """Write a model llama.cpp runs (``type``: one of
    ``llamatrain.gguf.export_types.ALL_EXPORT_TYPES``; the ``QUANTIZER_TYPES`` among them, such
    as q4_k_m, go through llama.cpp's quantizer and need ``pip install 'llamatrain[quantize]'``).

    ``inherited``: the base model's keys to keep (name, license, chat template …), as
    ``export`` passes them from a checkpoint.

    A LoRA-adapted model is written merged (W + s·B·A), and every model is written a tensor
    at a time (``llamatrain.lora.merged_tensors``): the export costs one tensor beside the
    model, whatever its size, never a merged or float32 copy of it.
    """
    write = write_quantized_model if type in QUANTIZER_TYPES else write_model
    return write(path, model.cfg, merged_tensors(model), tokenizer, type=type, inherited=inherited)


def export_hf(
    model: Llama,
    tokenizer: Tokenizer,
    directory: str | Path,
    inherited: Mapping[str, Any] | None = None,
    card: ModelCard | None = None,
) -> Path:
    """Write an HF checkpoint folder transformers loads as ``LlamaForCausalLM`` (config.json,
    float32 model.safetensors, tokenizer.json and tokenizer_config.json with ``inherited``'s
    chat template) and its README.md model card (``card``, as ``export`` reads it from a run;
    unset: what ``inherited`` says of the model); the vocabulary must be byte-level BPE. A
    LoRA-adapted model is written merged, a shard at a time
    (``llamatrain.hf.folder.SHARD_BYTES``)."""
    text = readme(card or conversion_card(inherited or {}), "model")
    return write_hf_folder(
        directory, model.cfg, merged_tensors(model), tokenizer, inherited, card=text
    )


EXPORT_FORMATS = ("gguf", "hf")
"""``export``'s formats: a GGUF llama.cpp runs, or an HF folder transformers loads."""


def export(
    source: str | Path, path: str | Path, type: str = AUTO_EXPORT_TYPE, format: str = "gguf"
) -> Path:
    """Export a run folder (its latest checkpoint), a checkpoint, a GGUF model or an HF folder
    as a GGUF llama.cpp runs (its tensors stored as ``type``) or, with ``format="hf"``, as an
    HF folder (float32), keeping the keys of the model it was finetuned from; what the run did
    goes into the GGUF's ``general.*`` keys or the folder's README.md model card
    (``llamatrain.model_card``). ``type="auto"``: the type a run chose for its own export (q8_0
    for a QLoRA run), f32 for anything else (``model_source.export_type_of``)."""
    if format not in EXPORT_FORMATS:
        raise ConfigError(f"unknown export format {format!r}; choose one of {EXPORT_FORMATS}")
    if format == "hf" and type not in ("f32", AUTO_EXPORT_TYPE):
        raise ConfigError(
            f"an HF export stores float32 safetensors; the type {type!r} is for GGUF exports"
        )
    if type == AUTO_EXPORT_TYPE:
        type = "f32" if format == "hf" else export_type_of(source)
    require_quantizer(type)
    model, tokenizer, inherited = model_to_export(source)
    card = export_card(source, inherited)
    if format == "hf":
        return export_hf(model, tokenizer, path, inherited=inherited, card=card)
    kept = with_general_keys(inherited, card)
    return export_gguf(model, tokenizer, path, type=type, inherited=kept)


def export_adapter(source: str | Path, path: str | Path, format: str = "gguf") -> Path:
    """Write a LoRA run's adapter (its folder's latest checkpoint, or a LoRA checkpoint): the
    adapter GGUF llama.cpp applies with ``--lora`` over the base (the base is not read), or
    with ``format="hf"`` a PEFT adapter folder for the HF export of the base (the base is read,
    and checked against the sha256 the run recorded, for the layout of its q/k rows), with its
    README.md model card; the GGUF carries the same facts in its ``general.*`` keys."""
    if format not in EXPORT_FORMATS:
        raise ConfigError(f"unknown export format {format!r}; choose one of {EXPORT_FORMATS}")
    checkpoint_file = model_file(source)
    if not is_lora_checkpoint(checkpoint_file):
        raise ConfigError(
            f"{source} holds no LoRA adapter (not a run with lora.rank > 0); export the model "
            "without --adapter"
        )
    verify_gguf(checkpoint_file)
    if format == "hf":
        checkpoint = load_checkpoint(checkpoint_file)
        with_base(checkpoint)  # the base's config says how its q/k rows are laid out
        adapter = checkpoint.adapter
        card = readme(export_card(source, checkpoint.state.inherited), "adapter")
        return write_peft_adapter(
            path, adapter.tensors, checkpoint.config, alpha=adapter.alpha, card=card
        )
    adapter = read_lora_adapter(checkpoint_file)
    return write_lora_adapter(
        path,
        adapter.tensors,
        alpha=adapter.alpha,
        base_architecture=adapter.architecture,
        inherited=with_general_keys(adapter.inherited, export_card(source, adapter.inherited)),
    )


# ---- using a model -----------------------------------------------------------------------


def load_chat(
    path: str | Path,
    template: str = "auto",
    ops: str = "ggml",
    *,
    lora: str | Path | None = None,
    dequantize: bool = False,
) -> tuple[Llama, Tokenizer, ChatTemplate]:
    """:func:`load` (``lora``, ``dequantize`` as there) plus the chat template to talk to the
    model with: its own (``tokenizer.chat_template``, which a chat run's checkpoints and
    exports carry), or a built-in one by name (chatml, llama-3, llama-2)."""
    source = open_source(path, lora)
    model, tokenizer = inference_model(source, ops, dequantize=dequantize), source.base.tokenizer
    chosen = resolve_chat_template(template, source.inherited.get(CHAT_TEMPLATE_KEY), tokenizer)
    if chosen is None:
        raise ConfigError(
            f"{path} has no chat template (tokenizer.chat_template); choose one of "
            f"{', '.join(BUILTIN_TEMPLATES)} (--chat-template NAME)"
        )
    return model, tokenizer, chosen
