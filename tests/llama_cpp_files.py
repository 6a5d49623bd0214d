"""llama.cpp's vendored test files, for any test module: ``from llama_cpp_files import vocab_dir``.

llama.cpp ships ``models/ggml-vocab-*.gguf``: vocab-only files of real models (with ``.inp`` /
``.out`` tokenizer test vectors), the one source of real vocabularies a test can use without
downloading a model. They come from the llama-cpp-python sdist (which vendors llama.cpp),
downloaded once with pip into a cache folder shared by every checkout. Without them the tests
fail (they never skip): pip must reach the package index once.

A module beside the top ``conftest.py``, whose folder pytest puts on ``sys.path``; import the
fixture as ``from llama_cpp_files import vocab_dir as vocab_dir`` (the redundant alias marks a
deliberate import, so linters do not take the test arguments of that name for a redefinition).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SDIST = "llama-cpp-python==0.3.36"
CACHE = Path.home() / ".cache" / "llamatrain-test" / SDIST.replace("==", "-")
MODELS = "/vendor/llama.cpp/models/ggml-vocab-"
OFFLINE = (
    "NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
    "No matching distribution found", "Could not fetch URL", "Network is unreachable",
)  # fmt: skip
"""What pip prints when it cannot reach the index, which the failure then says plainly."""


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    """The sdist's ggml-vocab files, downloaded and extracted once into :data:`CACHE`."""
    done = CACHE / "complete"
    if not done.exists():
        _download_and_extract(CACHE)
        done.touch()
    return CACHE


def _download_and_extract(folder: Path) -> None:
    download = folder / "download"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", SDIST, "-d", str(download)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        output = result.stdout + result.stderr
        if any(marker in output for marker in OFFLINE):
            pytest.fail(
                f"pip cannot reach the package index to fetch {SDIST} (llama.cpp's test "
                f"vocabularies); connect once, or put the sdist's models/ggml-vocab-* files in "
                f"{folder} and create {folder / 'complete'}",
                pytrace=False,
            )
        pytest.fail(f"pip download {SDIST} failed:\n{output[-2000:]}", pytrace=False)
    (archive,) = download.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = member.name
            if member.isfile() and MODELS in name:
                source = tar.extractfile(member)
                assert source is not None
                (folder / Path(name).name).write_bytes(source.read())
    archive.unlink()
