"""The reference of DPO/IPO over a full finetune: a :class:`ReferenceTable` of the initial
model's log-probs of every row.

A full finetune has no frozen base to switch back to (a LoRA run's reference is its base with
the adapters off), so every row's per-pair reference sums and token counts are computed once
before training by the initial model (:func:`reference_table`) and kept in the cache
(:func:`cached_reference_table`) keyed by the model file's sha256 and the rows, as the token
cache is (written atomically, checked on every use); a resume reads the same entry. The run's
checkpoints record that file and its sha256 (:attr:`ReferenceTable.model`), and a resume over a
file whose content changed is refused, as a LoRA run's over another base is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from llamatrain import parallel
from llamatrain.build import model_from_base
from llamatrain.config import Config
from llamatrain.data import TrainData
from llamatrain.data.cache import read_description
from llamatrain.data.examples import ExampleRows
from llamatrain.errors import LlamatrainWarning, TrainingError
from llamatrain.files import write_text_atomically, written_atomically
from llamatrain.gguf.file import read_tensors_into
from llamatrain.gguf.llama import LlamaFile
from llamatrain.model import Llama
from llamatrain.model_path import LoraBase
from llamatrain.model_source import is_header_only, read_model_source
from llamatrain.objectives.preference.losses import PairLogps, pair_slots, slot_pairs

__all__ = [
    "ReferenceTable",
    "cached_reference_table",
    "checked_slots",
    "file_reference",
    "reference_table",
]

_REFERENCE_VERSION = 3
"""Part of every reference cache key: bump it when what a key describes changes (2: pairs
share their prompt, one document of branches a pair; 3: log-probs by the chunked head)."""

REFERENCE_KIND = "reference log-prob cache"
"""How the cache's files are named in a refusal (see :mod:`llamatrain.files`)."""


@dataclass
class ReferenceTable:
    """The reference's log-probs of every row of a run's pairs: ``train`` and ``val``, each
    (rows, slots, 4) float32 — per pair slot of a row (document j's branches) the chosen and
    the rejected reply's summed log-probs and their scored token counts (:func:`pair_slots`),
    zeros where a row has no more pairs. ``slots`` is the most pairs any row holds."""

    train: np.ndarray
    val: np.ndarray | None
    model: LoraBase | None = None
    """The model file the log-probs are of, which the run's checkpoints record so that a
    resume refuses a changed one; None for log-probs of a model in memory."""

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        """The training rows ``indices``' slots, as a batch of them (the sampler's indices)."""
        return torch.from_numpy(self.train[indices])

    def batches(self, n_seq: int, max_batches: int = 0) -> Iterator[torch.Tensor]:
        """The validation rows' slots cut as ``llamatrain.data.windows.val_batches`` cuts the
        rows: the first ``max_batches`` (0 = all) batches of ``n_seq`` rows, in order."""
        if self.val is None:
            return
        n = len(self.val)
        limit = n if max_batches <= 0 else min(n, max_batches * n_seq)
        for lo in range(0, limit, n_seq):
            yield torch.from_numpy(self.val[lo : min(lo + n_seq, limit)])


def checked_slots(slots: torch.Tensor, targets: torch.Tensor, documents: torch.Tensor) -> PairLogps:
    """``slots``' pairs, after checking its token counts are these rows' (a table used with
    other rows than it was computed on fails here, not silently)."""
    zeros = torch.zeros(targets.shape, dtype=slots.dtype, device=targets.device)
    counts = pair_slots(zeros, targets, documents)[..., 2:]
    width = max(counts.shape[1], slots.shape[1])
    pad = (0, 0, 0, width - slots.shape[1])
    mine = F.pad(slots[..., 2:], pad)
    theirs = F.pad(counts, (0, 0, 0, width - counts.shape[1]))
    if not torch.equal(mine, theirs):
        raise TrainingError(
            "the cached reference log-probs are not this batch's pairs (their token counts "
            "differ): the data changed under the run; start it again to recompute them"
        )
    return slot_pairs(slots)


def _row_slots(rows: ExampleRows) -> int:
    """The most pairs one of ``rows`` holds."""
    if rows.documents is None or not len(rows):
        return 1
    pairs = np.where(rows.filled, rows.documents[..., 0], -1).max(axis=1) + 1
    return max(1, int(pairs.max()))


def reference_table(
    model: torch.nn.Module,
    train: ExampleRows,
    val: ExampleRows | None,
    n_seq: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
) -> ReferenceTable:
    """Every row's reference slots by ``model`` as it is (the run's initial weights), in
    eval mode and without gradients, ``n_seq`` rows a forward; float32 sums, as a live
    reference forward computes them."""
    was_training = model.training
    model.eval()
    try:
        tables = [
            None if rows is None else _rows_table(model, rows, n_seq, device, autocast)
            for rows in (train, val)
        ]
    finally:
        model.train(was_training)
    return ReferenceTable(tables[0], tables[1])


def _rows_table(
    model: torch.nn.Module,
    rows: ExampleRows,
    n_seq: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
) -> np.ndarray:
    slots = _row_slots(rows)
    out = np.zeros((len(rows), slots, 4), dtype=np.float32)
    for lo in range(0, len(rows), n_seq):
        batch = rows.batch(np.arange(lo, min(lo + n_seq, len(rows))))
        inputs, targets = batch.inputs.to(device), batch.targets.to(device)
        documents = batch.documents.to(device)
        with torch.no_grad(), autocast:
            logps = model(inputs, documents=documents, logps_of=targets)
        part = pair_slots(logps, targets, documents)
        out[lo : lo + len(inputs)] = part[:, :slots].float().cpu().numpy()
    return out


def _rows_digest(rows: ExampleRows | None) -> str | None:
    """sha256 of what a row is: its tokens, scored mask and documents."""
    if rows is None:
        return None
    digest = hashlib.sha256()
    for array in (rows.tokens, rows.scored, rows.documents):
        if array is not None:
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def cached_reference_table(
    cache_dir: str | Path,
    key: dict[str, Any],
    train: ExampleRows,
    val: ExampleRows | None,
    compute: Callable[[], ReferenceTable],
) -> tuple[ReferenceTable, bool]:
    """The reference table of ``train``/``val`` from the cache, or ``compute()``d and written
    to it; also whether it was computed now.

    ``key``: what else the log-probs depend on — the model file's sha256, the run's forward
    choices (ops, attention, dtype); the rows' own content is added here. The entry is a
    float32 ``.bin`` and its ``.json`` description (key, shapes, sha256 of the bytes), each
    written atomically; on every use the description must be this run's, the file its size
    and sha256, every value finite and every token count the rows' (else it is recomputed,
    with a warning naming what was wrong).
    """
    expected = {
        "version": _REFERENCE_VERSION,
        **key,
        "train_rows": _rows_digest(train),
        "val_rows": _rows_digest(val),
        "train_shape": [len(train), _row_slots(train), 4],
        "val_shape": None if val is None else [len(val), _row_slots(val), 4],
    }
    name = hashlib.sha256(json.dumps(expected, sort_keys=True).encode()).hexdigest()[:24]
    folder = Path(cache_dir).expanduser() / "reference"
    bin_path, meta_path = folder / f"{name}.bin", folder / f"{name}.json"
    if meta_path.is_file() and bin_path.is_file():
        problem, table = _read_table(bin_path, meta_path, expected, train, val)
        if table is not None:
            return table, False
        warnings.warn(
            f"reference cache {bin_path} {problem}; computing it again",
            LlamatrainWarning,
            stacklevel=3,
        )
    table = compute()
    folder.mkdir(parents=True, exist_ok=True)
    parts = [table.train] + ([] if table.val is None else [table.val])
    data = b"".join(np.ascontiguousarray(a, dtype="<f4").tobytes() for a in parts)
    with written_atomically(bin_path, REFERENCE_KIND) as tmp:
        tmp.write_bytes(data)
    meta = {**expected, "sha256": hashlib.sha256(data).hexdigest()}
    write_text_atomically(meta_path, json.dumps(meta, indent=1), REFERENCE_KIND)
    return table, True


def _read_table(
    bin_path: Path,
    meta_path: Path,
    expected: dict[str, Any],
    train: ExampleRows,
    val: ExampleRows | None,
) -> tuple[str | None, ReferenceTable | None]:
    """(what is wrong with an entry, or None; its table when nothing is)."""
    problem, meta = read_description(meta_path, expected)
    if problem:
        return problem, None
    shapes = [expected["train_shape"]] + ([] if val is None else [expected["val_shape"]])
    sizes = [int(np.prod(shape)) for shape in shapes]
    if bin_path.stat().st_size != 4 * sum(sizes):  # before reading it: it may be any size
        return "does not hold the number of values its description says", None
    data = bin_path.read_bytes()
    if len(data) != 4 * sum(sizes):  # it changed since
        return "does not hold the number of values its description says", None
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        return "does not match its recorded sha256", None
    flat = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if not np.isfinite(flat).all():
        return "holds a value that is not finite", None
    arrays = np.split(flat, np.cumsum(sizes)[:-1])
    tables = [a.reshape(shape) for a, shape in zip(arrays, shapes, strict=True)]
    for rows, table in zip((train, val), tables, strict=False):
        if not np.array_equal(table[..., 2:], _row_counts(rows, table.shape[1])):
            return "holds token counts other than the rows'", None
    return None, ReferenceTable(tables[0], tables[1] if val is not None else None)


def _row_counts(rows: ExampleRows, slots: int) -> np.ndarray:
    """(rows, slots, 2) the scored tokens of each slot's chosen and rejected reply."""
    batch = rows.batch(np.arange(len(rows)))
    zeros = torch.zeros(batch.targets.shape, dtype=torch.float32)
    counts = pair_slots(zeros, batch.targets, batch.documents)[:, :slots, 2:]
    return counts.numpy()


# ---- the table of a run's base file ---------------------------------------------------------


def file_reference(
    model: Llama,
    cfg: Config,
    data: TrainData,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
    source: LoraBase,
    *,
    initial: bool,
) -> ReferenceTable:
    """The reference log-probs of ``data``'s rows for DPO/IPO over a full finetune, those of
    ``source`` (``model.init_from`` with its sha256).

    They are the initial model's — ``model.init_from``'s weights — read from the cache in
    ``data.cache_dir`` (keyed by that file's sha256, the run's ops, attention and dtype, and
    the rows; see :func:`cached_reference_table`) or computed by ``model`` on
    ``device`` and cached. ``initial``: ``model`` holds those weights (a fresh run); a
    resumed run's model does not yet hold its checkpoint's, so when its cache entry is gone
    the base's weights are read into it, a tensor at a time, to recompute it (the checkpoint's
    are restored afterwards).
    """
    t = cfg.train
    key = {
        "model_sha256": source.sha256,
        "ops": cfg.model.ops,
        "attention": cfg.model.attention,
        "dtype": t.dtype,
    }

    def compute() -> ReferenceTable:
        if not initial:
            warnings.warn(
                f"no cached reference log-probs for this resumed run; computing them again "
                f"from {cfg.model.init_from}",
                stacklevel=3,
            )
        scorer = _initial_model(model, cfg, device, initial=initial)
        return reference_table(scorer, data.train, data.val, cfg.seqs_per_ubatch, device, autocast)

    table, _ = cached_reference_table(cfg.data.cache_dir, key, data.train, data.val, compute)
    return dataclasses.replace(table, model=source)


def _initial_model(model: Llama, cfg: Config, device: torch.device, *, initial: bool) -> Llama:
    """A model with the run's initial weights to compute the reference table by: ``model``
    when it holds them; ``model`` with ``model.init_from``'s weights read into it (a resumed
    run's own are restored afterwards); for an FSDP model, a whole copy read from
    ``model.init_from``, since a sharded forward needs every rank and rank 0 computes the
    cache alone (``parallel.main_first``). That copy is freed after the table; every rank
    held the whole model before sharding it, so the copy raises no peak."""
    if parallel.sharded(model):
        return model_from_base(cfg, read_model_source(cfg.model.init_from)).to(device)
    if not initial:
        _read_weights_into(model, read_model_source(cfg.model.init_from))
    return model


def _read_weights_into(model: Llama, source: LlamaFile) -> None:
    """``source``'s weights into ``model`` (same architecture, any device), one tensor at a
    time: no second copy of the model is ever held."""
    lazily = is_header_only(source) and source.contents is not None
    with torch.no_grad():
        for name, target in model.state_dict().items():
            if lazily:
                wide = target.dtype if not target.is_floating_point() else torch.float32
                value = torch.empty(target.shape, dtype=wide)
                read_tensors_into(source.contents, {name: value})
            else:
                value = source.tensors[name]
            target.copy_(value)
