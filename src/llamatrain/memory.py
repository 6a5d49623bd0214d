"""How much memory a run will need, said before it loads anything, and whether the machine has it.

A run that trains for an hour and then cannot write its result is a lost run; one that cannot
even hold its weights should be refused in one line before its first byte is read.
:func:`plan_memory` is a pure function of the config and the base file's header (its tensor
types): the weights as the run holds them (a LoRA run's frozen targets as ``lora.base_dtype``
keeps them, and a quantized run's vocabulary tables as stored; everything else float32), what
training adds (trained parameters, their gradients
and the optimizer's moments), one micro-batch's activations, the frozen base a full finetune's
GRPO scores its KL against, and what the export adds on top of the weights (it streams: one
merged tensor at a time). :func:`available_memory` is what the
process may still take: the machine's available memory, a cgroup's limit and an address-space
limit (``prlimit --as``), whichever is smallest.

The activation figure is calibrated, not derived: a ggml-op llama step on the CPU held
~8.8k floats per token per block at dim 512, ffn 1536 without activation checkpointing
(peak RSS 580 vs 688 MB at 256 vs 1,024 tokens a micro-batch, 4 blocks), which
``_floats_per_token`` (6·dim + 2·kv + 3·ffn) reproduces. The constant part is a CPU process
with PyTorch imported (~234 MB measured) plus its allocator's slack. The figures are
estimates within ~20%: the refusal is for runs that cannot fit, not a tight budget.
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from llamatrain.config import Config
from llamatrain.errors import MemoryBudgetError, shown
from llamatrain.gguf.adapter import target_suffixes
from llamatrain.gguf.export_types import QUANTIZER_TYPES
from llamatrain.gguf.file import CHUNK_VALUES
from llamatrain.model_config import VOCAB_TABLES, ModelConfig, tensor_shapes
from llamatrain.ops.dequantize import DEQUANTIZABLE, row_bytes
from llamatrain.ops.fused import CHUNK_BYTES as HEAD_CHUNK_BYTES

__all__ = [
    "MemoryPlan",
    "available_memory",
    "check_fits",
    "out_of_memory_in",
    "plan_memory",
    "resident_bytes",
]

GB = 1 << 30
FRAMEWORK_BYTES = 350 << 20
"""PyTorch, llamatrain and the data in a CPU process (234 MB measured after imports, plus the
allocator's slack and the token cache's pages)."""
VOCAB_BYTES_PER_TOKEN = 1536
"""The vocabulary as Python objects: a 128k byte-level BPE tokenizer measured 1.0 KB a token
(its merges), a 32k SentencePiece one 0.24 KB, and the header's token lists beside them."""
_FLOAT_BYTES = {"f32": 4, "bf16": 2, "f16": 2}
_FLOAT_TYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
"""The ggml float types a file may store a frozen weight in, and their bytes a value."""


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes a run will hold, by what a user can change."""

    weights: int
    """The model as held: frozen targets (and a QLoRA run's tables) as stored, the rest
    float32. Those kept as the file stores them are mapped from it (page cache the kernel
    can drop), counted all the same: every step reads every page."""
    training: int
    """Trained parameters, their gradients and the optimizer's state."""
    activations: int
    """One micro-batch's saved activations and the lm head's chunk."""
    export: int
    """The streaming export's addition to the weights (its largest tensor, widened)."""
    reference: int = 0
    """GRPO's KL reference over a full finetune (``Config.holds_base_reference``): the base
    as its file stores it, mapped like a QLoRA base and counted alike; 0 for any other run."""
    batch: int = 0
    """One step's token ids (inputs, targets and a document id or mask each, 8 bytes a
    token), ``train.n_batch`` of them whatever ``n_ubatch`` is: the sampler draws the whole."""
    decoding: int = 0
    """The KV cache of the largest generation between steps, allocated up front for every
    token (``generate``): the evaluation's sample (``train.sample_tokens`` after its prompt) or
    a GRPO rollout (every row of the step, ``data.n_ctx`` tokens each)."""
    framework: int = FRAMEWORK_BYTES
    """PyTorch, the process and the vocabulary (``FRAMEWORK_BYTES`` + the tokenizer)."""

    @property
    def peak(self) -> int:
        """Training and the export do not overlap: the trainer frees the moments first."""
        held = self.framework + self.weights + self.reference
        step = max(self.activations + self.batch, self.decoding)
        return held + max(self.training + step, self.export)

    def line(self) -> str:
        """The opening summary's memory line."""
        return (
            f"memory: about {_size(self.peak)} at peak ({self.parts()}; the export adds "
            f"{_size(self.export)})"
        )

    def parts(self) -> str:
        """The parts a user can change, the batch and the decoding cache when they outgrow
        the activations (they rarely do)."""
        reference = f", KL reference {_size(self.reference)}" if self.reference else ""
        batch = f", batch {_size(self.batch)}" if self.batch > self.activations else ""
        decoding = f", decoding {_size(self.decoding)}" if self.decoding > self.activations else ""
        return (
            f"weights {_size(self.weights)}{reference}, trained state {_size(self.training)}, "
            f"activations {_size(self.activations)}{batch}{decoding}"
        )

    def remedy(self, cfg: Config) -> str:
        """What to change, for the part that dominates."""
        t = cfg.train
        if self.decoding > max(self.activations + self.batch, self.weights, self.training):
            if _rollout_tokens(cfg) > _sample_tokens(cfg):
                return (
                    f"lower train.n_batch (= {t.n_batch}) or data.n_ctx: a rollout's KV cache "
                    "holds every row of the step, n_ctx tokens each"
                )
            return (
                f"lower train.sample_tokens (= {t.sample_tokens}): a sample's KV cache holds "
                "every token it may generate"
            )
        if self.batch > max(self.activations, self.weights, self.training):
            return f"lower train.n_batch (= {t.n_batch}): a step draws all its tokens at once"
        if cfg.lora.rank == 0 and self.training >= max(self.activations, self.weights // 2):
            return "train LoRA adapters instead (lora.rank = 16) or a smaller base"
        if self.activations > self.weights:
            return "lower train.n_ubatch or data.n_ctx, or set train.checkpointing = 'full'"
        if cfg.lora.rank and cfg.lora.base_dtype != "quantized":
            return "keep the base as its file stores it (lora.base_dtype = 'quantized')"
        return "use a smaller or more quantized base, or a machine with more memory"


def plan_memory(
    cfg: Config, model: ModelConfig, stored_types: Mapping[str, str] | None = None
) -> MemoryPlan:
    """The memory ``cfg`` will need to train and export ``model`` (its base's ``stored_types``,
    name -> ggml type, decide what a quantized LoRA base, or a full finetune's GRPO reference,
    holds; None: none known)."""
    shapes = tensor_shapes(model)
    targets = _adapted(cfg, shapes)
    stored = targets | _kept_tables(cfg, shapes)
    weights = sum(
        _held_bytes(cfg, name, shape, (stored_types or {}).get(name))
        if name in stored
        else 4 * _count(shape)
        for name, shape in shapes.items()
    )
    trained = sum(
        cfg.lora.rank * (shape[0] + shape[1]) if cfg.lora.rank else _count(shape)
        for name, shape in shapes.items()
        if not cfg.lora.rank or name in targets
    )
    return MemoryPlan(
        weights=weights,
        training=4 * trained * (1 + _moments(cfg)),  # the parameters' f32 grads and moments
        activations=_activation_bytes(cfg, model),
        export=_export_bytes(cfg, shapes, targets),
        reference=_reference_bytes(cfg, shapes, stored_types or {}),
        framework=FRAMEWORK_BYTES + VOCAB_BYTES_PER_TOKEN * model.vocab_size,
        batch=BATCH_BYTES_PER_TOKEN * cfg.train.n_batch,
        decoding=max(_sample_tokens(cfg), _rollout_tokens(cfg)) * kv_cache_bytes(model, 1),
    )


BATCH_BYTES_PER_TOKEN = 24
"""A step's batch: inputs and targets (int64) and a document id or a mask a token."""


def kv_cache_bytes(model: ModelConfig, tokens: int, value_bytes: int = 4) -> int:
    """The KV cache ``generate`` allocates up front for ``tokens`` (keys and values of every
    layer, in the model's float32 unless ``value_bytes`` says otherwise)."""
    return 2 * model.n_layers * model.kv_heads * model.head_dim * tokens * value_bytes


def _sample_tokens(cfg: Config) -> int:
    """The evaluation sample's tokens: its prompt (at most a token a byte, and BOS) and the
    tokens it may generate; none without a sample."""
    t = cfg.train
    return t.sample_tokens + len(t.sample_prompt.encode("utf-8")) + 1 if t.sample_tokens else 0


def _rollout_tokens(cfg: Config) -> int:
    """A GRPO rollout's cache: every row of the step (the whole step's, an upper bound for
    one rank's share), ``data.n_ctx`` tokens each (prompt and completion fit in it)."""
    return cfg.seqs_per_batch * cfg.data.n_ctx if cfg.train.objective == "grpo" else 0


def _reference_bytes(
    cfg: Config, shapes: Mapping[str, tuple[int, ...]], stored_types: Mapping[str, str]
) -> int:
    """The frozen base of a full finetune's GRPO
    (``objectives.grpo.reference.build_base_reference``): every matrix as its file stores it
    (float32 where no type is known), the rest float32."""
    if not cfg.holds_base_reference:
        return 0
    return sum(
        _stored_bytes(shape, stored_types.get(name)) if len(shape) == 2 else 4 * _count(shape)
        for name, shape in shapes.items()
    )


def _adapted(cfg: Config, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    if not cfg.lora.rank:
        return set()
    suffixes = target_suffixes(cfg.lora.adapted)
    return {name for name in shapes if name.endswith(suffixes)}


def _kept_tables(cfg: Config, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    """The vocabulary tables a QLoRA run keeps as its file stores them (``lora.FrozenTable``;
    an F32 one stays float32, which :func:`_held_bytes` counts alike)."""
    if not cfg.lora.rank or cfg.lora.base_dtype != "quantized":
        return set()
    return {name for name in VOCAB_TABLES if name in shapes}


def _held_bytes(cfg: Config, name: str, shape: tuple[int, ...], stored: str | None) -> int:
    """A frozen target's (or kept table's) bytes as ``lora.base_dtype`` keeps it."""
    if cfg.lora.base_dtype in _FLOAT_BYTES:
        return _FLOAT_BYTES[cfg.lora.base_dtype] * _count(shape)
    return _stored_bytes(shape, stored)


def _stored_bytes(shape: tuple[int, ...], stored: str | None) -> int:
    """A matrix's bytes as its file stores it (``stored``, a ggml type)."""
    if stored in _FLOAT_TYPE_BYTES:
        return _FLOAT_TYPE_BYTES[stored] * _count(shape)
    if stored in DEQUANTIZABLE and shape[1] % 32 == 0:
        return shape[0] * row_bytes(stored, shape[1])
    return 4 * _count(shape)  # unknown: as float32, never an underestimate


def _export_bytes(cfg: Config, shapes: Mapping[str, tuple[int, ...]], targets: set[str]) -> int:
    """A merged weight is its decoded base and the sum (float32); llama.cpp's quantizer reads a
    tensor and writes its encoding; otherwise the writer's chunk of rows and its encoding."""
    widened = targets or (shapes if cfg.output.export_type in QUANTIZER_TYPES else ())
    if not widened:
        return 4 * CHUNK_VALUES * 2
    return 2 * 4 * max(_count(shapes[name]) for name in widened)


def _moments(cfg: Config) -> int:
    """Parameter-sized float32 tensors the optimizer keeps per trained parameter."""
    return 2 if cfg.optim.name == "adamw" else 2 * cfg.optim.lbfgs_history + 2


def _floats_per_token(model: ModelConfig) -> int:
    kv = model.kv_heads * model.head_dim
    return 6 * model.dim + 2 * kv + 3 * model.hidden_dim


def _activation_bytes(cfg: Config, model: ModelConfig) -> int:
    """Saved activations of one micro-batch, plus the lm head's chunk of logits and its
    gradient. Activation checkpointing keeps each block's input and recomputes one segment."""
    tokens = cfg.train.n_ubatch or cfg.train.n_batch
    per_block = 4 * tokens * _floats_per_token(model)
    if cfg.train.checkpointing == "full":
        blocks = 4 * tokens * model.dim * model.n_layers + per_block
    elif cfg.train.checkpointing == "every_n":
        segment = min(cfg.train.checkpoint_every_n, model.n_layers)
        blocks = 4 * tokens * model.dim * model.n_layers + segment * per_block
    else:  # none, or auto before it has measured: the upper bound
        blocks = per_block * model.n_layers
    rows = min(tokens, max(HEAD_CHUNK_BYTES // (4 * model.vocab_size), model.dim))
    return blocks + 2 * 4 * rows * model.vocab_size


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def available_memory() -> int | None:
    """Bytes this process may still allocate (None where nothing says): the smallest of the
    machine's available memory (``MemAvailable``), a cgroup v2 limit less its usage, and an
    address-space limit (``RLIMIT_AS``) less the address space already taken. Memory the
    process holds already (PyTorch itself) counts as taken."""
    candidates = [
        _meminfo("MemAvailable"),
        _cgroup_headroom(),
        _address_space_headroom(),
    ]
    known = [c for c in candidates if c is not None]
    return min(known) if known else None


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def _address_space_headroom() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        status = Path(f"/proc/{os.getpid()}/status").read_text()
        return soft - _status_bytes(status, "VmSize")
    except (OSError, StopIteration, ValueError):
        return None


def _status_bytes(status: str, key: str) -> int:
    """A ``/proc/<pid>/status`` figure (kB) in bytes."""
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith(key)) * 1024


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc does not say)."""
    try:
        return _status_bytes(Path(f"/proc/{os.getpid()}/status").read_text(), "VmRSS")
    except (OSError, StopIteration, ValueError):
        return 0


def check_fits(cfg: Config, model: ModelConfig, stored_types: Mapping[str, str] | None) -> None:
    """Refuse, in one line, a run whose plan (:func:`plan_memory`) needs more than this process
    can still take (what it holds now, PyTorch itself, counts as already had), naming the least
    change that would fit and its size (:func:`_what_fits`)."""
    plan = plan_memory(cfg, model, stored_types)
    available = available_memory()
    held = resident_bytes()
    if available is None or plan.peak - held <= available:
        return
    raise MemoryBudgetError(
        f"this run needs about {_size(plan.peak)} ({plan.parts()}) but about "
        f"{_size(available + held)} is available; "
        f"{_what_fits(cfg, model, stored_types, available + held) or plan.remedy(cfg)}"
    )


_LORA_RANK = 16
"""The rank an alternative LoRA run is planned (and suggested) with."""
_VALUE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "quantized": 1}
"""``lora.base_dtype`` -> about the bytes a frozen value takes, to order the alternatives."""


def _what_fits(
    cfg: Config, model: ModelConfig, stored_types: Mapping[str, str] | None, available: int
) -> str | None:
    """The least change of ``cfg`` whose plan fits in ``available`` bytes, with its size."""
    for change, changed in _alternatives(cfg, stored_types):
        peak = plan_memory(changed, model, stored_types).peak
        if peak <= available:
            return f"it would fit with {change} (about {_size(peak)})"
    return None


def _alternatives(
    cfg: Config, stored_types: Mapping[str, str] | None
) -> Iterator[tuple[str, Config]]:
    """Changes of ``cfg`` that need less memory, the least change first: activation
    checkpointing, then (over a base) LoRA adapters instead of the whole model, with their
    frozen base ever narrower: float32, bf16, and as a quantized file stores it."""
    train, lora = cfg.train, cfg.lora
    if train.checkpointing != "full":
        yield (
            "train.checkpointing = 'full'",
            replace(cfg, train=replace(train, checkpointing="full")),
        )
    if not cfg.model.init_from:
        return
    held = _VALUE_BYTES[lora.base_dtype] if lora.rank else 2 * _VALUE_BYTES["f32"]
    for base_dtype in ("f32", "bf16", "quantized"):
        if _VALUE_BYTES[base_dtype] >= held or (
            base_dtype == "quantized" and not _quantized(stored_types)
        ):
            continue
        rank = "" if lora.rank else f"lora.rank = {_LORA_RANK} and "
        changed = replace(lora, rank=lora.rank or _LORA_RANK, base_dtype=base_dtype)
        yield f"{rank}lora.base_dtype = '{base_dtype}'", replace(cfg, lora=changed)


def _quantized(stored_types: Mapping[str, str] | None) -> bool:
    """Whether a base file stores its matrices in a type QLoRA keeps as its blocks."""
    return any(t in DEQUANTIZABLE - _FLOAT_TYPE_BYTES.keys() for t in (stored_types or {}).values())


@contextlib.contextmanager
def out_of_memory_in(
    phase: str,
    cfg: Config | None = None,
    plan: Callable[[], MemoryPlan | None] = lambda: None,
    remedy: str | None = None,
) -> Iterator[None]:
    """Running out of memory in the ``with`` block (PyTorch's OutOfMemoryError on a device,
    Python's MemoryError on the CPU) as one MemoryBudgetError naming ``phase``, what the run
    needs by its ``plan`` and the setting that lowers it (``remedy``, else the plan's): an
    allocation's traceback says none of that. Files already written are left as they are
    (every one is written atomically). ``cfg``: the run's, whose plan names a setting; a
    command that runs no config (``export``, ``generate``, ``eval``) gives ``remedy``."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if not _allocation_failed(e):
            raise
        raise MemoryBudgetError(_out_of_memory(phase, cfg, plan(), remedy, e)) from None


CPU_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"
"""What PyTorch's CPU allocator says (as a plain RuntimeError) when the system refuses it."""


def _allocation_failed(error: BaseException) -> bool:
    """Whether ``error`` is memory running out: on a device, in Python, or in PyTorch's CPU
    allocator (a tensor larger than the machine: a plain RuntimeError)."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return CPU_ALLOCATION_FAILED in str(error)


def _out_of_memory(
    phase: str,
    cfg: Config | None,
    plan: MemoryPlan | None,
    remedy: str | None,
    error: BaseException,
) -> str:
    said = str(error).strip().split("\n")[0] or type(error).__name__
    if plan is None or cfg is None:
        needs = f"about {_size(resident_bytes())} was held"
        remedy = remedy or "use a smaller or more quantized base, or a machine with more memory"
    else:
        needs = f"the run needs about {_size(plan.peak)} ({plan.parts()})"
        remedy = remedy or plan.remedy(cfg)
    return f"out of memory {phase} ({shown(said, 120)}): {needs}; {remedy}"


def _size(n: int) -> str:
    return f"{n / GB:,.1f} GB" if n >= GB else f"{n / (1 << 20):,.0f} MB"
