"""What a run is about to do, said before its first step (:class:`RunPlan`), and what it cost:
the time and memory report printed at the end of ``fit`` (:class:`RunReport`).

The 2023 trainer told its user how long training took and how much memory it held; this is
that report. Memory is the process's peak — resident set size on CPU (what the machine had to
give), the allocator's peak on CUDA — split into the parts a user can change: weights,
gradients (one per trained weight, held from a step's backward to its update) and optimizer
state are counted from the tensors themselves, and "the rest" is the
peak minus those three: activations and temporaries, the allocator's cache, and on CPU the
framework (PyTorch itself) and the data. That last part is what activation checkpointing, the
fused loss and a smaller ``n_ubatch`` shrink.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

MB = 1 << 20


@dataclass(frozen=True)
class RunPlan:
    """The first screen of ``fit``: the model, the data, the work per step and in all, where
    it runs and where the run goes — so a user knows before the first step whether this is
    the run they meant (a wrong model, a tiny corpus or an hour per step shows at once)."""

    model: str  # e.g. "qwen3, 8 layers x 256"
    params: int
    trained: int
    device: str
    dtype: str
    stream_tokens: int | None  # a text corpus's tokens; None for rows of examples (JSONL)
    train_rows: int  # windows of a text stream, or rows of examples
    val_rows: int
    n_ctx: int
    seqs_per_step: int
    micro_batches: int
    steps: int
    done: int  # steps a resumed run has already made
    run_dir: str
    memory: str = ""  # what the run will hold at peak (llamatrain.memory.MemoryPlan.line)

    @property
    def epochs(self) -> float:
        """How many times the run reads its training data, as people count it: rows of
        examples read over the rows there are; for a text stream, tokens read over the
        stream's training tokens (its windows overlap — one may start at every line — so
        counting them would say 0.01 of a run that reads most of its text once)."""
        rows = (self.steps - self.done) * self.seqs_per_step
        if self.stream_tokens is None:
            return rows / max(self.train_rows, 1)
        return rows * self.n_ctx / max(self.stream_tokens - self.val_rows * self.n_ctx, 1)

    def lines(self) -> list[str]:
        trained = "" if self.trained == self.params else f", {self.trained:,} of them trained"
        epochs = self.epochs
        resumed = f" from step {self.done}" if self.done else ""
        return [
            f"model: {self.model}, {self.params:,} parameters{trained}; {self.device}, "
            f"{self.dtype}",
            self._data_line(),
            f"steps: {self.steps}{resumed}, each {self.seqs_per_step} rows of {self.n_ctx} = "
            f"{self.seqs_per_step * self.n_ctx:,} tokens in {self.micro_batches} "
            f"micro-batch(es); about {epochs:.2f} epochs",
            *([self.memory] if self.memory else []),
            f"run folder: {self.run_dir}",
        ]

    def _data_line(self) -> str:
        if self.stream_tokens is None:
            return (
                f"data: {self.train_rows:,} training rows of {self.n_ctx} tokens, "
                f"{self.val_rows:,} held out"
            )
        return (
            f"data: {self.stream_tokens:,} tokens; {self.train_rows:,} training windows of "
            f"{self.n_ctx}, {self.val_rows:,} held out"
        )


@dataclass
class RunReport:
    """Time and peak memory of a run's training (the steps of this ``fit`` call)."""

    steps: int
    seconds: float  # the training steps' time, evaluations and saves excluded
    tokens: int
    peak_bytes: int
    peak_kind: str
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    checkpoint_segment: int  # blocks per recomputed segment, 0 = no activation checkpointing

    @property
    def rest_bytes(self) -> int:
        return self.peak_bytes - self.weights_bytes - self.gradients_bytes - self.optimizer_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "rest_bytes": self.rest_bytes}

    def lines(self) -> list[str]:
        per_step = self.seconds / max(self.steps, 1)
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        segment = f"every {self.checkpoint_segment} block(s)" if self.checkpoint_segment else "off"
        return [
            f"trained {self.steps} steps in {self.seconds:.1f} s ({per_step:.3f} s/step, "
            f"{rate:,.0f} tokens/s)",
            f"peak memory {self.peak_bytes / MB:,.0f} MB ({self.peak_kind}): weights "
            f"{self.weights_bytes / MB:,.1f} MB, gradients {self.gradients_bytes / MB:,.1f} MB, "
            f"optimizer state {self.optimizer_bytes / MB:,.1f} MB, activations, cache and "
            f"framework {self.rest_bytes / MB:,.1f} MB",
            f"activation checkpointing: {segment}",
        ]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def peak_memory(device: torch.device) -> tuple[int, str]:
    """The process's peak memory so far in bytes, and what it is."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA allocator peak"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return peak * scale, "peak RSS"


class HasState(Protocol):
    """An optimizer as far as a report reads it: ``torch.optim``'s per-parameter state."""

    state: Mapping[Any, Mapping[str, Any]]


def measure(
    model: torch.nn.Module,
    optimizer: HasState,
    device: torch.device,
    *,
    steps: int,
    seconds: float,
    tokens: int,
    checkpoint_segment: int,
) -> RunReport:
    """The report for a run whose training just ended."""
    params = list(model.parameters())
    state = [value for per_param in optimizer.state.values() for value in per_param.values()]
    peak, kind = peak_memory(device)
    return RunReport(
        steps=steps,
        seconds=seconds,
        tokens=tokens,
        peak_bytes=peak,
        peak_kind=kind,
        weights_bytes=_bytes(params),
        gradients_bytes=_bytes(p for p in params if p.requires_grad),
        optimizer_bytes=_bytes(state),
        checkpoint_segment=checkpoint_segment,
    )
