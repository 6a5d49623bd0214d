"""Token stream → training and validation windows → batches.

:func:`split_windows` holds out the *last* ``val_fraction`` of the stream for validation;
training windows end before that point, so no validation token is ever a training input or
target. Each window yields ``inputs``/``targets`` of ``n_ctx`` tokens. With a BOS prefix
(the default, as the 2023 ``train-text-from-scratch``) a window is BOS followed by ``n_ctx``
stream tokens, inputs = window[:-1], targets = window[1:]; the model thus always sees BOS at
position 0, exactly like a llama.cpp prompt. Without it (llama-finetune, nanoGPT) a window is
``n_ctx + 1`` consecutive stream tokens. Training windows start at any token, after a line end
(see :func:`line_end_ids`), or every ``stride`` tokens; validation windows are spaced
``n_ctx`` apart so every held-out token is scored once.

:class:`BatchSampler` shuffles the training windows per epoch (epoch ``e`` uses
``numpy.random.default_rng(seed + e)``, so a permutation is a pure function of seed and
epoch) and its whole state is ``(epoch, cursor)``: a resumed run draws exactly the batches
the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch

from llamatrain.errors import DataError

if TYPE_CHECKING:
    from llamatrain.tokenizer import Tokenizer

__all__ = [
    "Batch",
    "BatchSampler",
    "Rows",
    "TokenWindows",
    "line_end_ids",
    "split_windows",
    "val_batches",
]


class Batch(NamedTuple):
    """One batch of rows, each ``(n_seq, n_ctx)``: what the model reads and what it is scored
    against (``IGNORE_INDEX`` where a target is not scored)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    documents: torch.Tensor | None = None
    """Packed rows only: each token's document id, which masks attention between documents
    and restarts positions — or (rows, ctx, 2) document and branch ids for preference pairs,
    whose prompt both replies see (``llamatrain.ops.layout``); None for windows of one text."""


class Rows(Protocol):
    """What the sampler draws batches from: :class:`TokenWindows`, or the rows of JSONL
    examples (``llamatrain.data.examples.ExampleRows``, whose batches add ``documents``)."""

    def __len__(self) -> int: ...

    def batch(self, indices: np.ndarray) -> Batch:
        """The rows ``indices``."""
        ...


class TokenWindows:
    """Fixed-length windows over a token stream, each ``n_ctx + 1`` ids long.

    ``starts`` is either an array of stream offsets or a ``range`` (for ``any``/``stride``,
    so a billion-token corpus needs no billion-entry start table). With ``bos_id`` set, a
    window is BOS + ``n_ctx`` stream tokens; else ``n_ctx + 1`` stream tokens. Either way
    its inputs are ``window[:-1]`` and its targets ``window[1:]``.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        starts: np.ndarray | range,
        n_ctx: int,
        bos_id: int | None = None,
    ) -> None:
        self.tokens, self.starts, self.n_ctx, self.bos_id = tokens, starts, n_ctx, bos_id
        self.span = n_ctx if bos_id is not None else n_ctx + 1
        """Stream tokens one window covers."""

    def __len__(self) -> int:
        return len(self.starts)

    def start_positions(self, indices: np.ndarray) -> np.ndarray:
        """Stream offsets of the windows ``indices``."""
        indices = np.asarray(indices, dtype=np.int64)
        if isinstance(self.starts, range):
            return self.starts.start + self.starts.step * indices
        return np.asarray(self.starts, dtype=np.int64)[indices]

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """``(len(indices), n_ctx + 1)`` int64 windows."""
        starts = self.start_positions(indices)
        rows = np.asarray(self.tokens[starts[:, None] + np.arange(self.span)], dtype=np.int64)
        if self.bos_id is not None:
            rows = np.concatenate([np.full((len(rows), 1), self.bos_id, np.int64), rows], 1)
        return rows

    def batch(self, indices: np.ndarray) -> Batch:
        """Inputs and targets, LongTensors of shape ``(len(indices), n_ctx)``."""
        w = torch.from_numpy(self.windows(indices))
        return Batch(w[:, :-1].contiguous(), w[:, 1:].contiguous())


def line_end_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Sorted ids after which ``sample_start = "newline"`` may start a window.

    Those are the tokens whose text ends in a newline (byte-fallback ``<0x0A>`` included)
    plus EOS, so that document starts count as line starts. Empty when no token ends in a
    newline: :func:`split_windows` then refuses ``"newline"`` rather than start windows at
    document starts only.
    """
    newline = np.unique(np.asarray(list(tokenizer.newline_ids()), dtype=np.int64))
    return np.union1d(newline, [tokenizer.eos_id]) if len(newline) else newline


def split_windows(
    tokens: np.ndarray,
    *,
    n_ctx: int,
    val_fraction: float,
    sample_start: str = "any",
    stride: int | None = None,
    bos_id: int | None = None,
    line_ends: np.ndarray | None = None,
) -> tuple[TokenWindows, TokenWindows | None]:
    """Training and validation windows; validation = the last ``val_fraction`` of the stream.

    ``bos_id`` set = BOS-prefixed windows. ``line_ends`` (from :func:`line_end_ids`) is
    needed for ``sample_start = "newline"``. Returns ``val = None`` when ``val_fraction ==
    0``.
    """
    n = len(tokens)
    span = n_ctx if bos_id is not None else n_ctx + 1
    if n < span:
        raise DataError(
            f"the corpus has {n} tokens but one training window needs {span} "
            f"(data.n_ctx = {n_ctx}{' + 1' if bos_id is None else ''}); use a smaller "
            "data.n_ctx or more text"
        )
    n_val = int(round(n * val_fraction))
    split = n - n_val
    if split < span:
        raise DataError(
            f"holding out data.val_fraction = {val_fraction} ({n_val} of {n} tokens) leaves "
            f"{split} training tokens, fewer than one window of {span}; lower val_fraction "
            "or data.n_ctx"
        )
    last = split - span  # the last allowed training start: windows end at or before split
    starts = _train_starts(tokens, last, n_ctx, sample_start, stride, line_ends)
    train = TokenWindows(tokens, starts, n_ctx, bos_id)
    if val_fraction == 0:
        return train, None
    val_starts = range(split, n - span + 1, n_ctx)
    if len(val_starts) == 0:
        raise DataError(
            f"the validation part (last {val_fraction:g} of {n} tokens = {n_val}) is shorter "
            f"than one window of {span} tokens; raise data.val_fraction to at least "
            f"{span / n:.3g}, lower data.n_ctx, or set val_fraction = 0 to train without "
            "validation"
        )
    return train, TokenWindows(tokens, val_starts, n_ctx, bos_id)


def _train_starts(
    tokens: np.ndarray,
    last: int,
    n_ctx: int,
    sample_start: str,
    stride: int | None,
    line_ends: np.ndarray | None,
) -> np.ndarray | range:
    """Where training windows may start, up to and including stream offset ``last``."""
    if sample_start == "any":
        return range(0, last + 1)
    if sample_start == "stride":
        return range(0, last + 1, stride or max(1, n_ctx // 2))
    if sample_start == "newline":
        if line_ends is None or len(line_ends) == 0:
            raise DataError(
                "data.sample_start = 'newline' but the tokenizer has no token ending in a "
                "newline; use sample_start = 'any'"
            )
        after = np.flatnonzero(np.isin(np.asarray(tokens[:last]), line_ends)) + 1
        return np.concatenate([[0], after]).astype(np.int64)
    raise DataError(f"unknown data.sample_start {sample_start!r}: use any, newline or stride")


class BatchSampler:
    """Shuffled training batches whose position is ``(epoch, cursor)``.

    Every epoch visits each window once in the order ``default_rng(seed + epoch)`` gives; a
    batch that runs past the end of an epoch continues into the next. Because the
    permutation is recomputed from ``(seed, epoch)``, :meth:`state_dict` is a few integers,
    and restoring them reproduces the remaining batches exactly.
    """

    def __init__(self, windows: Rows, n_seq: int, seed: int = 0) -> None:
        if len(windows) == 0:
            raise DataError("no training windows: the corpus is too short for data.n_ctx")
        if n_seq < 1:
            raise ValueError(f"n_seq must be >= 1, got {n_seq}")
        self.windows, self.n_seq, self.seed = windows, n_seq, seed
        self.epoch = 0
        """Completed passes over the training windows."""
        self.cursor = 0
        """Windows of the current epoch already drawn."""
        self.samples = 0
        """Windows drawn since the start of training (2023's ``training.sample_count``)."""
        self._perm: tuple[int, np.ndarray] | None = None

    def next_indices(self) -> np.ndarray:
        """Window indices of the next batch (advances the sampler)."""
        parts, need, n = [], self.n_seq, len(self.windows)
        while need:
            take = min(need, n - self.cursor)
            parts.append(self._permutation(self.epoch)[self.cursor : self.cursor + take])
            self.cursor += take
            need -= take
            if self.cursor == n:
                self.epoch, self.cursor = self.epoch + 1, 0
        self.samples += self.n_seq
        return np.concatenate(parts)

    def next_batch(self) -> Batch:
        """The next ``n_seq`` rows (``documents`` set for packed JSONL rows)."""
        return self.windows.batch(self.next_indices())

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint stores: the position, the seed, and the window count to check."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "samples": self.samples,
            "seed": self.seed,
            "n_windows": len(self.windows),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off (``{}`` = from the start).

        The stored seed wins over the constructor's, so a resumed run keeps the original
        shuffle even if ``train.seed`` was edited.
        """
        n = state.get("n_windows", len(self.windows))
        if n != len(self.windows):
            raise DataError(
                f"the checkpoint's data had {n} training windows, the current data has "
                f"{len(self.windows)}: the corpus, tokenizer or data.* settings changed since "
                "it was saved. Restore them, or start a new run (model.init_from = the "
                "exported model) to train on the new data"
            )
        self.seed = int(state.get("seed", self.seed))
        self.epoch, self.cursor = int(state.get("epoch", 0)), int(state.get("cursor", 0))
        if not 0 <= self.cursor < len(self.windows):
            raise DataError(f"sampler state has cursor {self.cursor} outside 0..{n - 1}")
        self.samples = int(state.get("samples", 0))
        self._perm = None

    def _permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s window order; the current epoch's is kept, not recomputed."""
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng((self.seed + epoch) % (1 << 63))
            self._perm = (epoch, rng.permutation(len(self.windows)))
        return self._perm[1]


def val_batches(windows: Rows | None, n_seq: int, max_batches: int = 0) -> Iterator[Batch]:
    """The first ``max_batches`` (0 = all) validation batches, always the same ones, in order.

    The last batch may hold fewer than ``n_seq`` windows: weight batch losses by their scored
    targets (``targets != -100``; all of them for text) when averaging.
    """
    if windows is None:
        return
    n = len(windows)
    limit = n if max_batches <= 0 else min(n, max_batches * n_seq)
    for lo in range(0, limit, n_seq):
        yield windows.batch(np.arange(lo, min(lo + n_seq, limit)))
