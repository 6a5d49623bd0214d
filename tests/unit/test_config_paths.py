"""The paths a run writes are absolute once its config is validated (``config.paths``), so
code that changes the working directory later cannot move the run's outputs."""

from __future__ import annotations

import os
from pathlib import Path

from llamatrain.config import load_config, validate


def test_relative_output_paths_become_absolute_under_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny", ['output.dir="runs/a"', 'data.cache_dir="../cache"'])
    assert cfg.output.dir == str(tmp_path / "runs" / "a")
    assert cfg.data.cache_dir == str(tmp_path / ".." / "cache")  # as named: no link resolved
    os.chdir("/")
    assert validate(cfg).output.dir == str(tmp_path / "runs" / "a")  # once, at the first


def test_a_home_relative_path_is_under_home_and_an_absolute_one_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config("tiny", ['output.dir="~/runs/a"', f'data.cache_dir="{tmp_path}/c"'])
    assert cfg.output.dir == str(tmp_path / "home" / "runs" / "a")
    assert cfg.data.cache_dir == str(tmp_path / "c")
    assert Path(cfg.output.dir).is_absolute()
