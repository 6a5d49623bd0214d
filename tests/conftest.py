"""Shared fixtures: runs of configs/tiny.toml in temporary folders."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.toml"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the whole session, so each run does not retrain it."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def tiny_overrides(cache_dir, tmp_path):
    """Overrides that make configs/tiny.toml run anywhere (absolute data path, temp output)."""

    def make(**extra: object) -> list[str]:
        values = {
            "data.path": f'"{REPO / "tests" / "data" / "tiny.txt"}"',
            "data.cache_dir": f'"{cache_dir}"',
            "output.dir": f'"{tmp_path / "run"}"',
        }
        values.update({k: v for k, v in extra.items()})
        return [f"{k}={v}" for k, v in values.items()]

    return make
