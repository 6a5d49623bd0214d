"""Data-parallel (DDP) and sharded (FSDP2) training on torch.distributed, applied from outside.

A run launched by ``torchrun`` has one process per rank. :func:`process_group` joins them (gloo
on CPU, nccl on CUDA) for the length of a run; :func:`apply` then wraps the model as the field
does, without the model knowing:

* ``ddp`` — ``DistributedDataParallel``: every rank holds the whole model and optimizer, and
  gradients are averaged across ranks during the backward pass of the last micro-step;
* ``fsdp`` — torchtitan's ``fully_shard`` pattern: each block, then the root, so every rank
  holds 1/N of the weights, gradients and AdamW moments, and a block's weights are gathered
  only while it runs.

The global batch is the same as one process's: every rank draws the same ``n_batch`` rows from
the (global) sampler and computes its own contiguous share of them (:meth:`Parallel.rows`).
Equal shares and each rank's mean loss make the ranks' averaged gradient the gradient of the
whole batch's mean, so N ranks take the same optimizer steps as one process.

Checkpoints stay one file: :func:`full_tensor` gathers a sharded tensor (every rank takes part,
rank 0 writes) and :func:`shard_like` cuts a full tensor read from the file back into this
rank's shard.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from llamatrain.errors import ConfigError, TrainingError, shown
from llamatrain.model import Llama

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "MODES",
    "Parallel",
    "any_rank",
    "apply",
    "average",
    "barrier",
    "check_launch",
    "each_rank",
    "full_tensor",
    "gathered",
    "is_main",
    "launched",
    "local_tensor",
    "main_first",
    "process_group",
    "rank",
    "reshard",
    "root_weights",
    "shard_like",
    "sharded",
    "summed",
    "whole_model",
    "world_size",
]

MODES = ("none", "ddp", "fsdp")
LAUNCH_HINT = "torchrun --nproc_per_node N -m llamatrain fit ..."


# ---- who we are ------------------------------------------------------------------------


def launched() -> bool:
    """Whether this process was started by torchrun (which sets WORLD_SIZE and RANK)."""
    return "WORLD_SIZE" in os.environ


def _joined() -> bool:
    return dist.is_available() and dist.is_initialized()


def _launch_number(name: str, low: int, high: int) -> int:
    """torchrun's variable ``name`` as a whole number in [low, high]; anything else (set by
    hand, or by another launcher) is refused in one line naming it, never int()'s traceback."""
    text = os.environ.get(name, "")
    digits = text.strip()
    value = int(digits) if digits.isdecimal() and len(digits) < 10 else -1
    if not low <= value <= high:
        raise ConfigError(
            f"environment variable {name} = {shown(repr(text))} must be a whole number from "
            f"{low} to {high}; launch with `{LAUNCH_HINT}` (which sets it), or unset WORLD_SIZE, "
            "RANK and LOCAL_RANK to train in one process"
        )
    return value


def rank() -> int:
    """This process's rank (0 outside torchrun); the launcher's, before and after the group."""
    if _joined():
        return dist.get_rank()
    return _launch_number("RANK", 0, world_size() - 1) if launched() else 0


def world_size() -> int:
    """How many ranks train together (1 outside torchrun)."""
    if _joined():
        return dist.get_world_size()
    return _launch_number("WORLD_SIZE", 1, 1 << 20) if launched() else 1


def is_main() -> bool:
    """Rank 0: the one process that prints, logs, samples and writes files."""
    return rank() == 0


# ---- the process group -------------------------------------------------------------------


def check_launch(mode: str) -> None:
    """Refuse a ``train.parallel`` the launch cannot run, with the fix in one line."""
    if mode not in MODES:
        raise ConfigError(f"unknown train.parallel {mode!r}; choose one of {MODES}")
    if mode != "none" and not launched():
        raise ConfigError(
            f"train.parallel = {mode!r} needs one process per rank: launch with "
            f"`{LAUNCH_HINT}`, or set train.parallel = 'none'"
        )
    if mode == "none" and world_size() > 1:
        raise ConfigError(
            f"torchrun started {world_size()} ranks but train.parallel = 'none' would train "
            "the same model on each; set train.parallel = 'ddp' or 'fsdp', or launch one process"
        )


@contextlib.contextmanager
def process_group(mode: str, device: torch.device, timeout_s: float) -> Iterator[None]:
    """Join torchrun's ranks for the ``with`` block (nothing to join outside torchrun).

    The backend follows the device: nccl between GPUs, gloo between CPU processes. A rank
    that dies or hangs makes the others' next collective fail after ``timeout_s`` seconds
    instead of waiting for ever. A group that already exists (a notebook's) is used as is.
    """
    check_launch(mode)
    if not launched() or _joined():
        yield
        return
    address = _rendezvous()
    if device.type == "cuda":
        torch.cuda.set_device(_launch_number("LOCAL_RANK", 0, torch.cuda.device_count() - 1))
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    except dist.DistError as e:  # a peer that never came, or an address nobody listens at
        raise TrainingError(
            f"rank {rank()} of {world_size()} could not meet the others at {address} within "
            f"train.dist_timeout_s = {timeout_s:g} s ({shown(str(e))}); start every rank with "
            f"`{LAUNCH_HINT}`, or check MASTER_ADDR and MASTER_PORT"
        ) from e
    try:
        yield
        leave_together()
    finally:
        dist.destroy_process_group()


def _rendezvous() -> str:
    """``MASTER_ADDR:MASTER_PORT``, where the ranks meet (torchrun sets both), checked with
    the rank and world size before a group is joined."""
    rank()
    port = _launch_number("MASTER_PORT", 1, 65535)
    address = os.environ.get("MASTER_ADDR", "")
    if not address.strip():
        raise ConfigError(
            f"environment variable MASTER_ADDR is not set: WORLD_SIZE = {world_size()} says "
            f"this is rank {rank()} of a launch, but not where the ranks meet; launch with "
            f"`{LAUNCH_HINT}`, or unset WORLD_SIZE to train in one process"
        )
    return f"{shown(address)}:{port}"


def leave_together() -> None:
    """Wait for every rank, then drop what still holds the group, before it is destroyed.

    A rank that destroys its group while a peer still talks to it, or whose DDP/FSDP wrapper
    (kept alive by a reference cycle) outlives the group, can have gloo's threads torn down
    at interpreter exit: the process aborts ("terminate called without an active
    exception") after the run has finished. Not on the way out of an error: a rank that
    failed must not wait for peers that may be gone.
    """
    dist.barrier()
    gc.collect()


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first, then the others: a cache rank 0 writes (tokenizer,
    token stream) is then read, not written again at the same time, by the rest."""
    if is_main():
        yield
        barrier()
    else:
        barrier()
        yield


def barrier() -> None:
    """Wait for every rank (nothing outside torchrun)."""
    if _joined():
        dist.barrier()


# ---- reductions --------------------------------------------------------------------------


def _all_reduce(values: Sequence[float], op: dist.ReduceOp) -> list[float]:
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def summed(values: Sequence[float]) -> list[float]:
    """Each of ``values`` summed over the ranks, in one collective (the values themselves
    outside torchrun)."""
    if not _joined():
        return list(values)
    return _all_reduce(values, dist.ReduceOp.SUM)


def average(value: float) -> float:
    """The mean of ``value`` over the ranks (the value itself outside torchrun)."""
    return summed([value])[0] / world_size() if _joined() else value


def each_rank(value: object) -> list:
    """``value`` from every rank, in rank order, on every rank (a collective: all call it);
    ``[value]`` outside torchrun. Pickled between the ranks of one launch, so for small
    things: what a GRPO rollout's ranks sampled and scored, a step's metrics."""
    if not _joined():
        return [value]
    values: list = [None] * world_size()
    dist.all_gather_object(values, value)
    return values


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank: a signal one rank received stops them all at the
    same step, so none is left waiting in a collective."""
    if not _joined():
        return flag
    return _all_reduce([float(flag)], dist.ReduceOp.MAX)[0] > 0


# ---- full and sharded tensors (checkpoints) ----------------------------------------------


def _is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is an FSDP shard (a DTensor). Only ``fsdp`` mode imports
    torch.distributed.tensor (about 40 MB of modules, a sixth of a small run's peak RSS), and
    without it no DTensor can exist: a run that does not shard never pays for the import."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` wrapped ``model``: its forward is then a collective (see
    :func:`_is_sharded` for the lookup)."""
    module = sys.modules.get("torch.distributed.fsdp")
    return module is not None and isinstance(model, module.FSDPModule)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind an FSDP shard (a collective: every rank must call it, in the
    same order); any other tensor as it is."""
    return tensor.full_tensor() if _is_sharded(tensor) else tensor


def gathered(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole tensor as float32 on the CPU, on rank 0, for a checkpoint to write; None on
    the other ranks, which only take part in gathering an FSDP shard."""
    full = full_tensor(tensor).detach()
    return full.float().cpu() if is_main() else None


def reshard(model: nn.Module) -> None:
    """Put an FSDP model's gathered weights back into shards: FSDP keeps the root's gathered
    after a forward without backward (an evaluation), and a checkpoint reads or loads shards."""
    if sharded(model):
        model.reshard()


@contextlib.contextmanager
def root_weights(model: nn.Module) -> Iterator[None]:
    """An FSDP model's root weights (embeddings, output norm, lm head) gathered for code that
    reads them outside a forward (evaluation takes the lm head a chunk of rows at a time),
    and put back into shards after; for any other model, nothing. The blocks gather their
    own weights when called, as in any forward."""
    if not sharded(model):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of an FSDP shard; any other tensor as it is."""
    return tensor.to_local() if _is_sharded(tensor) else tensor


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` (read from a checkpoint, the same on every rank) laid out as ``param`` is: this
    rank's shard of it for an FSDP parameter, else on ``param``'s device and dtype (no copy
    when they are already the same)."""
    full = full.view(param.shape)
    if _is_sharded(param):
        from torch.distributed.tensor import distribute_tensor

        local = full.to(param.to_local().device, param.dtype)
        return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)
    return full.to(param.device, param.dtype)


# ---- wrapping the model ------------------------------------------------------------------


class _Training(nn.Module):
    """What the trainer computes as one module's forward, which DDP needs: it prepares the
    gradient all-reduce in ``forward``, and one module's parameters have one DDP wrapper.
    ``model.loss`` given ``targets`` (SFT's fused loss); without them ``model``'s forward
    (with ``logps_of``: the targets' log-probs from the chunked head, what a preference
    objective scores)."""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, **options: torch.Tensor
    ) -> torch.Tensor:
        if targets is None:
            return self.model(tokens, **options)
        return self.model.loss(tokens, targets, **options)


@dataclass
class Parallel:
    """How a wrapped model trains: which rows of a batch this rank computes, the loss (or the
    logits) to call, and when gradients are synchronised."""

    mode: str
    loss: Callable[..., torch.Tensor]
    _ddp: DistributedDataParallel | None = None
    _fsdp: FSDPModule | None = None

    @property
    def ranks(self) -> int:
        """How many ranks share each batch (1 without ``train.parallel``)."""
        return 1 if self.mode == "none" else world_size()

    def logits(self, model: Llama, tokens: torch.Tensor, **options: torch.Tensor) -> torch.Tensor:
        """``model``'s logits through its wrapper (as :attr:`loss` is): DDP's forward, so the
        backward of a loss on them averages the gradients; an FSDP model's own forward."""
        if self._ddp is not None:
            return self._ddp(tokens, **options)
        return model(tokens, **options)

    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's contiguous, equal share of a global batch's rows."""
        n = self.ranks
        if n == 1:
            return batch
        if len(batch) % n:
            n_ctx = batch.shape[-1]
            raise ConfigError(
                f"train.n_batch = {len(batch) * n_ctx} holds {len(batch)} sequences a step, "
                f"which {n} ranks cannot share equally; make it a multiple of {n} x "
                f"data.n_ctx = {n * n_ctx}"
            )
        return batch.chunk(n)[rank()]

    def gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """The context of one micro-step's backward: gradients are exchanged only when
        ``sync`` (the last micro-step), and accumulate locally before it (nanoGPT's
        ``require_backward_grad_sync``, FSDP2's ``set_requires_gradient_sync``)."""
        if self._ddp is not None and not sync:
            return self._ddp.no_sync()
        if self._fsdp is not None:
            self._fsdp.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()


def whole_model(model: Llama) -> Llama:
    """An FSDP model as a plain one with its whole weights on the CPU, on rank 0 (every rank
    takes part in gathering them; the others get ``model`` back); any other model as it is.
    What a run returns and exports is then the model a single process would have trained."""
    if not sharded(model):
        return model
    reshard(model)
    weights = {name: gathered(tensor) for name, tensor in model.state_dict().items()}
    if not is_main():
        return model
    with torch.device("meta"):
        plain = Llama(model.cfg)
    plain.load_state_dict(weights, assign=True)
    return plain


def apply(model: Llama, mode: str, *, mixed_precision: bool = False) -> Parallel:
    """Wrap ``model`` (already on its device, checkpointing applied) for ``mode``.

    ``fsdp`` shards every block, then the root (embeddings, output norm and head), and makes
    ``model.loss`` an FSDP forward, so it gathers the root's weights as ``forward`` does.
    ``mixed_precision`` (FSDP on CUDA with ``train.dtype = 'bfloat16'``): weights gathered and
    computed in bf16, gradients reduced in float32.
    """
    if mode == "none":
        return Parallel(mode, model.loss)
    if mode == "ddp":
        device = next(model.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        ddp = DistributedDataParallel(_Training(model), device_ids=ids)
        return Parallel(mode, ddp, _ddp=ddp)
    from torch.distributed.fsdp import (  # only here: see _is_sharded
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    policy = MixedPrecisionPolicy()
    if mixed_precision:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blk:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    register_fsdp_forward_method(model, "loss")
    return Parallel(mode, model.loss, _fsdp=model)
