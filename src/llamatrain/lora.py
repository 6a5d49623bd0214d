"""LoRA adapters, applied to a model from outside.

:func:`apply_lora` replaces the chosen projections of every block with a :class:`LoraLinear`
that holds the base projection's own parameters under their own names (``weight``, ``bias``),
frozen, beside two trainable low-rank factors ``lora_a`` (r, in) and ``lora_b`` (out, r).
Like ``llamatrain.activation_checkpointing``, it swaps modules and leaves the model's code
alone, so ``state_dict()`` keeps llama.cpp's names (``blk.0.attn_q.weight``) and adds
``blk.0.attn_q.lora_a`` / ``.lora_b``, which are llama.cpp's adapter tensor names minus the
``.weight`` (``llamatrain.gguf.adapter`` adds it).

The adapted matmul is the model's op set's ``lora_linear`` (``llamatrain.ops.sets``): the
written-out backward of ``ops.lora_linear`` for ``ggml``, ``ops.torch_lora_linear`` for
``torch``. Initialisation is PEFT's (A
kaiming-uniform with a = sqrt(5), as ``nn.Linear`` does; B zero), so a freshly adapted model
computes exactly what the base computes. Everything else in the model is frozen too: a LoRA
run trains the adapters alone.

The frozen base may be kept narrower than float32 (``[lora] base_dtype``):
:func:`store_frozen_targets` puts a :class:`FrozenLinear` — bf16/f16 floats, or the GGUF
file's own blocks (QLoRA) — in place of each target before the weights are read, and
:class:`LoraLinear` adapts it as it adapts a ``Linear``; the matmul widens it a chunk of rows
at a time (``ops.lora``). Adapters stay float32. A QLoRA run keeps the token table and an
untied lm head as stored too (:class:`FrozenTable`: rows decoded on lookup, the head a chunk
of vocabulary rows at a time, ``ops.table_head``), so it holds about its file's size.

:func:`merged_tensors` gives the plain model's tensors with each merged weight (W + s·B·A,
what llama.cpp's ``llama-export-lora`` writes) computed only when a writer reads it;
:func:`merge_lora` builds that model whole; :func:`lora_state_dict` and
:func:`load_lora_state_dict` move the adapter tensors alone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from llamatrain.errors import ConfigError, GGUFError
from llamatrain.gguf.adapter import ALL_TARGETS, LORA_SUFFIXES, lora_settings_problem
from llamatrain.gguf.write import DeferredTensor
from llamatrain.model import Linear, Llama
from llamatrain.model_config import VOCAB_TABLES
from llamatrain.ops.dequantize import DEQUANTIZABLE, row_bytes
from llamatrain.ops.lora import base_forward, dense_weight
from llamatrain.ops.quantized_matmul import kernel_rows
from llamatrain.ops.sets import IGNORE_INDEX, OpSet
from llamatrain.ops.table_head import (
    table_cross_entropy,
    table_logits,
    table_logps,
    table_logps_and_entropy,
)

__all__ = [
    "ALL_TARGETS",
    "BASE_DTYPES",
    "FrozenLinear",
    "FrozenTable",
    "LoraLinear",
    "adapters_disabled",
    "apply_lora",
    "decoded_base",
    "kernels_serve",
    "load_lora_state_dict",
    "lora_modules",
    "lora_state_dict",
    "merge_lora",
    "merged_tensors",
    "store_frozen_targets",
    "stored_type",
    "trainable_parameter_count",
]

_FLOAT_TYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
}
"""ggml float types, kept as torch floats (their bytes as they are) rather than as blocks."""

BASE_DTYPES: dict[str, str | None] = {"f32": "F32", "bf16": "BF16", "f16": "F16", "quantized": None}
"""``[lora] base_dtype`` -> the ggml type the frozen targets are kept in (None: the file's)."""


def stored_type(base_dtype: str, file_type: str, name: str) -> str:
    """The ggml type a frozen target ``name`` is kept in: ``base_dtype``'s, or for
    ``quantized`` the file's own if ``ops.dequantize`` reads it (GGUFError otherwise)."""
    wanted = BASE_DTYPES[base_dtype]
    if wanted is not None:
        return wanted
    if file_type not in DEQUANTIZABLE:
        readable = ", ".join(sorted(DEQUANTIZABLE))
        raise GGUFError(
            f"lora.base_dtype = 'quantized' cannot keep {name}, stored as {file_type}; "
            f"requantize the base with llama-quantize to one of {readable} (e.g. Q4_K_M)"
        )
    return file_type


def _empty_stored(like: torch.Tensor, stored: str) -> tuple[torch.Tensor, str | None]:
    """An uninitialised weight of ``like``'s (rows, cols) kept as ``stored`` (a ggml type
    name), and its qtype: a float tensor for F32, BF16 and F16 (qtype None), uint8 blocks
    (rows, row_bytes) for a quantized type."""
    rows, cols = like.shape
    if stored in _FLOAT_TYPES:
        return torch.empty(rows, cols, dtype=_FLOAT_TYPES[stored], device=like.device), None
    shape = (rows, row_bytes(stored, cols))
    return torch.empty(shape, dtype=torch.uint8, device=like.device), stored


class FrozenLinear(nn.Module):
    """A frozen projection kept as ``stored`` (:func:`_empty_stored`). Buffers, since no
    optimizer may touch them and a quantized one cannot hold a gradient; an uninitialised
    shell meant to be filled from a file (``model_source.build_lora_base``)."""

    def __init__(self, base: Linear, stored: str) -> None:
        super().__init__()
        weight, self.qtype = _empty_stored(base.weight, stored)
        self.register_buffer("weight", weight)
        self.bias = None if base.bias is None else base.bias.requires_grad_(False)
        self.in_features = base.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x·Wᵀ (+ bias), W widened a chunk of rows at a time (``ops.lora.base_forward``):
        never the whole weight as float32 beside the stored one."""
        rows = x.reshape(-1, x.shape[-1])
        y = base_forward(rows, self.weight, self.qtype, self.in_features, None)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias

    def decoded(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of the weight (all by default) as float32: for an export."""
        return dense_weight(self.weight[start:stop], self.qtype, self.in_features)


class FrozenTable(nn.Module):
    """A frozen vocabulary table (vocab, dim) — the token table, an untied lm head, or both
    when tied — kept as ``stored`` (:func:`_empty_stored`): its rows decoded when looked up,
    the lm head's calls (``model.LmHead``) decoding a chunk of its rows at a time
    (``ops.table_head``). Why: as float32 Llama-3.2-1B's 128k x 2048 table is 1 GB, its Q4_0
    0.14 GB. A buffer, like :class:`FrozenLinear`'s, and an uninitialised shell meant to be
    filled from a file (``model_source.build_lora_base``)."""

    def __init__(self, base: nn.Embedding | Linear, stored: str) -> None:
        super().__init__()
        self.dim = base.weight.shape[1]
        weight, self.qtype = _empty_stored(base.weight, stored)
        self.register_buffer("weight", weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` name as float32: the decoded table's rows, bit for bit."""
        rows = dense_weight(self.weight[ids.reshape(-1)], self.qtype, self.dim)
        return rows.reshape(*ids.shape, self.dim)

    def decoded(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of the table (all by default) as float32: for an export."""
        return dense_weight(self.weight[start:stop], self.qtype, self.dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return table_logits(hidden, self.weight, qtype=self.qtype)

    def logps(
        self, hidden: torch.Tensor, targets: torch.Tensor, softcap: float | None
    ) -> torch.Tensor:
        return table_logps(
            hidden, self.weight, targets, qtype=self.qtype, ignore_index=IGNORE_INDEX,
            softcap=softcap,
        )  # fmt: skip

    def logps_and_entropy(
        self, hidden: torch.Tensor, targets: torch.Tensor, softcap: float | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return table_logps_and_entropy(
            hidden, self.weight, targets, qtype=self.qtype, ignore_index=IGNORE_INDEX,
            softcap=softcap,
        )  # fmt: skip

    def loss(
        self, hidden: torch.Tensor, targets: torch.Tensor, softcap: float | None
    ) -> torch.Tensor:
        return table_cross_entropy(
            hidden, self.weight, targets, qtype=self.qtype, ignore_index=IGNORE_INDEX,
            softcap=softcap,
        )  # fmt: skip


def store_frozen_targets(model: Llama, types: Mapping[str, str]) -> None:
    """Replace each weight named in ``types`` (``{"blk.0.attn_q.weight": "Q4_K", …}``) with an
    empty :class:`FrozenLinear` of that type, or a :class:`FrozenTable` for one of
    ``VOCAB_TABLES``, to read the base's weights into."""
    for name, stored in types.items():
        parent_name, _, target = name.removesuffix(".weight").rpartition(".")
        parent = model.get_submodule(parent_name)
        kind = FrozenTable if name in VOCAB_TABLES else FrozenLinear
        setattr(parent, target, kind(getattr(parent, target), stored))


class LoraLinear(nn.Module):
    """A frozen projection plus a trainable low-rank update: y = x·Wᵀ + s·B·A·x' (+ bias).

    ``weight`` and ``bias`` are the base's own tensors (not copies), so optimizers, state
    dicts and exports see the same tensors under the same names: a ``Linear``'s parameters,
    or a :class:`FrozenLinear`'s buffer (bf16/f16, or blocks of ``qtype``). x' is x after
    dropout on the adapter path, while training (PEFT's placement).
    """

    def __init__(
        self, base: Linear | FrozenLinear, rank: int, alpha: float, dropout: float, ops: OpSet
    ) -> None:
        super().__init__()
        self.qtype = getattr(base, "qtype", None)
        if isinstance(base.weight, nn.Parameter):
            self.weight = base.weight.requires_grad_(False)
            n_out, n_in = self.weight.shape
        else:
            self.register_buffer("weight", base.weight)
            n_out, n_in = self.weight.shape[0], base.in_features
        self.bias = None if base.bias is None else base.bias.requires_grad_(False)
        # adapters of a Linear's dtype (as before any storage choice); float32 beside a
        # narrower frozen base
        dtype = self.weight.dtype if isinstance(base, Linear) else torch.float32
        like = {"device": self.weight.device, "dtype": dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, n_in, **like))
        self.lora_b = nn.Parameter(torch.zeros(n_out, rank, **like))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.scale = alpha / rank
        self.ops = ops
        self.disabled = False
        """Set by :func:`adapters_disabled`: compute the frozen base alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.disabled:  # the base's product through the same matmul, the update scaled by 0
            y = self.ops.lora_linear(
                x, self.weight, self.lora_a, self.lora_b, 0.0, None, qtype=self.qtype
            )
            return y if self.bias is None else y + self.bias
        dropped = F.dropout(x, self.dropout, self.training) if self.dropout else None
        y = self.ops.lora_linear(
            x, self.weight, self.lora_a, self.lora_b, self.scale, dropped, qtype=self.qtype
        )
        return y if self.bias is None else y + self.bias

    @torch.no_grad()
    def merged_weight(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (all by default) of W + s·B·A in the adapters' dtype, summed in
        float32 at least (one rounding): a Linear's own dtype; float32 over a bf16/f16/quantized
        base, which is widened, so the merged model is a plain float32 one. One addmm: no
        weight-sized B·A beside the base and the result. Rows, because a streaming writer
        encodes a chunk of them at a time: a 7B's largest merged weight is 180 MB of float32,
        twice that while summed, the export's peak when produced whole."""
        dtype = torch.promote_types(self.lora_a.dtype, torch.float32)
        base = dense_weight(self.weight[start:stop], self.qtype, self.lora_a.shape[1], dtype)
        a, b = self.lora_a.to(dtype), self.lora_b[start:stop].to(dtype)
        return torch.addmm(base, b, a, alpha=self.scale).to(self.lora_a.dtype)

    def extra_repr(self) -> str:
        n_out, n_in = self.lora_b.shape[0], self.lora_a.shape[1]
        settings = f"rank={self.rank}, alpha={self.alpha}, dropout={self.dropout}"
        stored = "" if self.qtype is None else f", base={self.qtype}"
        return f"in={n_in}, out={n_out}, {settings}{stored}"


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    """(name, module) of every adapted projection: ``("blk.0.attn_q", LoraLinear)`` …"""
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield name, module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within it, every adapted projection of ``model`` computes its frozen base alone (no
    update, no dropout, no random numbers drawn): the model is its base, without a second
    copy of it — the reference model of DPO over a LoRA run. Restored on exit."""
    modules = [module for _, module in lora_modules(model)]
    if not modules:
        raise ConfigError("the model has no LoRA adapters to switch off; apply_lora first")
    for module in modules:
        module.disabled = True
    try:
        yield
    finally:
        for module in modules:
            module.disabled = False


def _columns(module: FrozenTable | FrozenLinear) -> int:
    """The width of a stored weight's rows in values (its bytes say only the blocks')."""
    return module.dim if isinstance(module, FrozenTable) else module.in_features


def _narrow_frozen(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """(module, columns) of each frozen weight kept narrower than float32: blocks (QLoRA's
    projections and vocabulary tables) or bf16/f16 floats; a float32 one is as wide as it gets."""
    found = []
    for module in model.modules():
        if isinstance(module, LoraLinear):
            columns = module.lora_a.shape[1]
        elif isinstance(module, FrozenLinear | FrozenTable):
            columns = _columns(module)
        else:
            continue
        stored = not isinstance(module.weight, nn.Parameter)  # a Linear's own: as trained
        if stored and (module.qtype is not None or module.weight.dtype != torch.float32):
            found.append((module, columns))
    return found


def kernels_serve(model: nn.Module, rows: int) -> bool:
    """Whether every frozen weight kept narrower than float32 is multiplied over its stored
    blocks (``ops.quantized_matmul``) by products of ``rows`` activation rows, under the
    autocast in force: then token-by-token decoding reads ~0.6 bytes a weight (Q4) where a
    :func:`decoded_base` reads 4, and holds nothing beside the file. Measured over SmolLM2-135M
    Q4_1, 8 rows decoding together, one thread: 71-76 tokens/s over the blocks, 43-45 over
    the decoded float32 base (2-core Xeon, AVX-512/AMX, float32)."""
    narrow = _narrow_frozen(model)
    return bool(narrow) and all(
        kernel_rows(module.weight, module.qtype, columns, rows) for module, columns in narrow
    )


@contextlib.contextmanager
def decoded_base(model: nn.Module, budget: int | None) -> Iterator[int]:
    """Within it, the frozen weights kept narrower than float32 (:func:`_narrow_frozen`) are
    held decoded to float32 — all of them if they fit in ``budget`` bytes, else none (None:
    unknown, none) — and put back as stored on exit; yields the bytes held.

    Why: decoding token by token (a GRPO rollout, generation) runs the model once per token,
    and a stored weight is decoded again at every forward: for a QLoRA model that is a training
    step's decoding paid per token (61% of a rollout's time over a Q4_1 SmolLM2). Decoded once,
    each token is a float32 matmul. All or none, so the same machine always samples through
    the same arithmetic (a float32 matmul and a chunked decode+matmul round differently in the
    last bits). For no-grad use: the decoded weights are plain tensors, not the stored ones a
    gradient or an export must see."""
    narrow = _narrow_frozen(model)
    size = sum(4 * m.weight.shape[0] * columns for m, columns in narrow)
    if not narrow or budget is None or size > budget:
        yield 0
        return
    kept = [(m, m.weight, m.qtype) for m, _ in narrow]
    for module, columns in narrow:
        module.weight = dense_weight(module.weight, module.qtype, columns)
        module.qtype = None
    try:
        yield size
    finally:
        for module, weight, qtype in kept:
            module.weight, module.qtype = weight, qtype


def apply_lora(
    model: Llama,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: Iterable[str] = ALL_TARGETS,
) -> Llama:
    """Freeze ``model`` and adapt ``targets`` of every block with rank-``rank`` LoRA; returns
    the same model. Raises ConfigError (one line) for an unknown or repeated target, a rank
    that is not in 1..min(in, out) of every target, alpha ≤ 0, dropout outside [0, 1), or a
    model that has adapters already. Works before or after activation checkpointing."""
    targets = tuple(targets)
    problem = lora_settings_problem(rank, alpha, dropout, targets)
    if problem:
        raise ConfigError(problem)
    if any(True for _ in lora_modules(model)):
        raise ConfigError(
            "the model has LoRA adapters already; apply_lora once per model (merge_lora gives a "
            "plain model to adapt again)"
        )
    blocks = list(model.blk)
    for target in targets:
        n_out, n_in = getattr(blocks[0], target).weight.shape[0], _in_features(blocks[0], target)
        if rank > min(n_in, n_out):
            raise ConfigError(
                f"lora.rank = {rank} exceeds {target}'s smaller side min({n_in}, {n_out}) = "
                f"{min(n_in, n_out)}; choose a rank of at most {min(n_in, n_out)}"
            )
    model.requires_grad_(False)
    for block in blocks:
        for target in targets:
            adapted = LoraLinear(getattr(block, target), rank, alpha, dropout, model.ops)
            setattr(block, target, adapted)
    return model


def _in_features(block: nn.Module, target: str) -> int:
    base = getattr(block, target)
    return base.in_features if isinstance(base, FrozenLinear) else base.weight.shape[1]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors alone, ``{"blk.0.attn_q.lora_a": A, "blk.0.attn_q.lora_b": B, …}``
    (detached, not copied)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, module in lora_modules(model):
        tensors[f"{name}.lora_a"] = module.lora_a.detach()
        tensors[f"{name}.lora_b"] = module.lora_b.detach()
    return tensors


def load_lora_state_dict(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy adapter tensors (:func:`lora_state_dict`'s names) into an adapted model.

    Exactly the model's adapter tensors, of their shapes, or a ConfigError naming the first
    difference: an adapter of another rank or other targets does not belong to the model.
    """
    own = lora_state_dict(model)
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    if missing or unexpected:
        first = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise ConfigError(
            f"the LoRA tensors do not match the model's adapters ({first}; {len(missing)} "
            f"missing, {len(unexpected)} unexpected); apply_lora with the adapter's targets"
        )
    for name, target in own.items():
        if tensors[name].shape != target.shape:
            raise ConfigError(
                f"LoRA tensor {name} has shape {tuple(tensors[name].shape)} but the model's is "
                f"{tuple(target.shape)}; apply_lora with the adapter's rank"
            )
    with torch.no_grad():
        for name, target in own.items():
            target.copy_(tensors[name])


def merged_tensors(model: nn.Module) -> dict[str, torch.Tensor | DeferredTensor]:
    """Every tensor of the plain model ``model`` stands for, in its state-dict order, without
    building it: an adapted weight as a :class:`DeferredTensor` whose ``read()`` computes
    W + s·B·A then (:meth:`LoraLinear.merged_weight`; its ``rows`` a chunk of rows of it),
    every other tensor as it is (detached, not copied); the adapter factors are left out. A
    model without adapters gives its own tensors.

    Why deferred: merged weights are float32 over any base, so merging a 7B model at once
    would hold 27 GB beside the base; a streaming writer (``llamatrain.gguf.write.write_gguf``)
    reads one at a time, as llama.cpp's ``llama-export-lora`` merges one tensor at a time.
    A :class:`FrozenTable` or :class:`FrozenLinear` is deferred too, decoded when read, or a
    chunk of rows at a time by a writer that reads it so (the 1 GB float32 table of a 128k
    vocabulary never whole).
    """
    adapted = {f"{name}.weight": module for name, module in lora_modules(model)}
    frozen = {
        f"{name}.weight": module
        for name, module in model.named_modules()
        if isinstance(module, FrozenTable | FrozenLinear)
    }
    tensors: dict[str, torch.Tensor | DeferredTensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(LORA_SUFFIXES):
            continue
        if name in adapted:
            module = adapted[name]
            shape = (module.lora_b.shape[0], module.lora_a.shape[1])
            merged = module.merged_weight
            tensors[name] = DeferredTensor(shape, module.lora_a.dtype, merged, merged)
        elif name in frozen:
            kept = frozen[name]
            shape = (kept.weight.shape[0], _columns(kept))
            tensors[name] = DeferredTensor(shape, torch.float32, kept.decoded, kept.decoded)
        else:
            tensors[name] = tensor.detach()
    return tensors


def merge_lora(model: Llama) -> Llama:
    """A new plain ``Llama`` whose adapted weights are W + s·B·A (llama.cpp's
    ``llama-export-lora``), built from :func:`merged_tensors`; ``model`` is left as it is
    (training may go on). Holds the merged model whole: to write one, hand
    :func:`merged_tensors` to a writer instead, which merges a tensor at a time."""
    state = {
        name: tensor.read() if isinstance(tensor, DeferredTensor) else tensor.clone()
        for name, tensor in merged_tensors(model).items()
    }
    with torch.device("meta"):
        merged = Llama(model.cfg)
    merged.load_state_dict(state, strict=True, assign=True)
    return merged.train(model.training)


def trainable_parameter_count(model: nn.Module) -> int:
    """Elements of the parameters an optimizer would update (``requires_grad``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
