"""Windows over the token stream, the train/validation split, and the batch sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from user_errors import error_of

from llamatrain.data import BatchSampler, TokenWindows, split_windows, val_batches
from llamatrain.data.windows import line_end_ids
from llamatrain.errors import DataError


def stream(n: int) -> np.ndarray:
    return (np.arange(n) % 50 + 3).astype(np.uint16)


def all_starts(windows: TokenWindows) -> list[int]:
    return windows.start_positions(np.arange(len(windows))).tolist()


# ---- windows and the split ---------------------------------------------------------------------


@pytest.mark.parametrize("bos_id", [None, 1])
@pytest.mark.parametrize("mode", ["any", "stride", "newline"])
def test_no_train_window_touches_validation(mode, bos_id):
    tokens = stream(1000)
    train, val = split_windows(
        tokens,
        n_ctx=16,
        val_fraction=0.1,
        sample_start=mode,
        bos_id=bos_id,
        line_ends=np.array([10, 20]),
    )
    split = 900
    assert max(all_starts(train)) + train.span <= split  # every training window ends before
    vstarts = all_starts(val)
    assert min(vstarts) == split and max(vstarts) + val.span <= 1000
    assert np.all(np.diff(vstarts) == 16)  # validation targets do not overlap
    assert len(val) == (1000 - split - val.span) // 16 + 1  # and miss no full window
    if mode == "any":
        assert len(train) == split - train.span + 1


def test_window_inputs_targets_and_bos():
    tokens = stream(200)
    plain, _ = split_windows(tokens, n_ctx=8, val_fraction=0.0)
    x, y, _ = plain.batch(np.array([5]))
    assert x.dtype == torch.long and x.shape == (1, 8)
    assert x[0].tolist() == tokens[5:13].tolist() and y[0].tolist() == tokens[6:14].tolist()
    bos, _ = split_windows(tokens, n_ctx=8, val_fraction=0.0, bos_id=1)
    x, y, _ = bos.batch(np.array([5]))
    assert x[0].tolist() == [1, *tokens[5:12].tolist()] and y[0].tolist() == tokens[5:13].tolist()


def test_line_end_ids_are_newlines_and_eos(char_tokenizer):
    class Tok(char_tokenizer):
        def newline_ids(self) -> list[int]:
            return [7, 3, 7]

    class NoNewline(char_tokenizer):
        def newline_ids(self) -> list[int]:
            return []

    assert line_end_ids(Tok()).tolist() == [2, 3, 7]  # sorted, unique, EOS (2) included
    assert line_end_ids(NoNewline()).tolist() == []  # no EOS alone: "newline" is refused


def test_newline_starts_follow_line_ends(char_tokenizer):
    tok = char_tokenizer()
    doc = "first line\nsecond\n\nthird one here\nx"
    tokens = np.array((tok.encode(doc) + [tok.eos_id]) * 20, dtype=np.uint16)
    train, _ = split_windows(
        tokens, n_ctx=8, val_fraction=0.0, sample_start="newline", line_ends=line_end_ids(tok)
    )
    starts = all_starts(train)
    line_starts = [0] + [i + 1 for i, t in enumerate(tokens) if t in (tok.index["\n"], 2)]
    assert starts == [s for s in line_starts if s <= len(tokens) - 9]


def test_stride_starts():
    train, _ = split_windows(stream(100), n_ctx=10, val_fraction=0.0, sample_start="stride")
    assert all_starts(train) == list(range(0, 90, 5))  # n_ctx / 2 by default
    train, _ = split_windows(
        stream(100), n_ctx=10, val_fraction=0.0, sample_start="stride", stride=40
    )
    assert all_starts(train) == [0, 40, 80]


def test_split_errors():
    msg = error_of(split_windows, stream(50), n_ctx=64, val_fraction=0.05)
    assert "50 tokens" in msg and "needs 65" in msg and "smaller data.n_ctx" in msg
    msg = error_of(split_windows, stream(100), n_ctx=64, val_fraction=0.45)
    assert "leaves 55 training tokens" in msg
    msg = error_of(split_windows, stream(1000), n_ctx=64, val_fraction=0.05)
    assert "validation part" in msg and "50" in msg and "at least 0.065" in msg
    msg = error_of(split_windows, stream(100), n_ctx=8, val_fraction=0.0, sample_start="newline",
                   line_ends=np.array([], dtype=np.int64))  # fmt: skip
    assert "sample_start = 'any'" in msg
    msg = error_of(split_windows, stream(100), n_ctx=8, val_fraction=0.0, sample_start="odd")
    assert "unknown data.sample_start 'odd'" in msg


# ---- the sampler -------------------------------------------------------------------------------


def sampler(n_windows: int = 37, n_seq: int = 4, seed: int = 7) -> BatchSampler:
    windows = TokenWindows(stream(n_windows + 8), range(n_windows), n_ctx=8)
    return BatchSampler(windows, n_seq, seed)


def test_each_epoch_is_a_permutation_and_reshuffled():
    s = sampler(n_windows=12, n_seq=4)
    epochs = [np.concatenate([s.next_indices() for _ in range(3)]) for _ in range(3)]
    for e in epochs:
        assert sorted(e.tolist()) == list(range(12))
    assert epochs[0].tolist() != epochs[1].tolist()
    assert s.epoch == 3 and s.cursor == 0 and s.samples == 36


def test_epoch_order_is_a_function_of_seed_and_epoch():
    s = sampler(n_windows=12, n_seq=12, seed=5)
    s.next_indices()
    assert s.next_indices().tolist() == np.random.default_rng(5 + 1).permutation(12).tolist()


def test_batches_across_epoch_boundary():
    s = sampler(n_windows=5, n_seq=4)
    first, second = s.next_indices(), s.next_indices()
    assert len(first) == len(second) == 4
    assert s.epoch == 1 and s.cursor == 3
    assert sorted([*first.tolist(), second[0]]) == list(range(5))


def test_shuffle_is_reproducible_from_seed():
    a, b, c = sampler(seed=1), sampler(seed=1), sampler(seed=2)
    xa = [a.next_batch()[0] for _ in range(5)]
    xb = [b.next_batch()[0] for _ in range(5)]
    xc = [c.next_batch()[0] for _ in range(5)]
    assert all(torch.equal(p, q) for p, q in zip(xa, xb, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(xa, xc, strict=True))


def test_resume_gives_identical_batches():
    n = 13  # several epochs of 37 windows with 4 per batch, resumed mid-epoch
    straight = sampler()
    expected = [straight.next_batch() for _ in range(2 * n)]
    first = sampler()
    got = [first.next_batch() for _ in range(n)]
    state = first.state_dict()
    resumed = sampler(seed=999)  # the stored seed wins
    resumed.load_state_dict(dict(state))
    got += [resumed.next_batch() for _ in range(n)]
    for (x1, y1, _), (x2, y2, _) in zip(expected, got, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert resumed.state_dict() == straight.state_dict() | {"seed": 7}


def test_resume_with_changed_data_is_refused():
    state = sampler(n_windows=37).state_dict()
    msg = error_of(sampler(n_windows=40).load_state_dict, state)
    assert "37" in msg and "40" in msg
    msg = error_of(sampler().load_state_dict, state | {"cursor": 37})
    assert "cursor 37 outside 0..36" in msg


def test_empty_state_means_a_fresh_start():
    s, reference = sampler(), sampler()
    fresh = [reference.next_batch()[0] for _ in range(3)]
    s.next_batch()
    s.load_state_dict({})
    assert (s.epoch, s.cursor, s.samples) == (0, 0, 0)
    assert all(torch.equal(s.next_batch()[0], x) for x in fresh)


def test_sampler_rejects_nothing_to_sample():
    with pytest.raises(DataError, match="no training windows"):
        BatchSampler(TokenWindows(stream(8), range(0), n_ctx=8), 4)
    with pytest.raises(ValueError, match="n_seq must be >= 1"):
        sampler(n_seq=0)


def test_validation_batches_are_deterministic():
    windows = TokenWindows(stream(200), range(0, 180, 10), n_ctx=8)  # 18 windows
    all_batches = list(val_batches(windows, 4))
    assert [b[0].shape[0] for b in all_batches] == [4, 4, 4, 4, 2]
    assert torch.equal(torch.cat([b[0] for b in all_batches]), windows.batch(np.arange(18))[0])
    two = list(val_batches(windows, 4, max_batches=2))
    assert len(two) == 2 and torch.equal(two[1][0], all_batches[1][0])
    assert list(val_batches(None, 4)) == []
