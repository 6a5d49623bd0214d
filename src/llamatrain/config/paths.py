"""The paths a run writes, made absolute once, when the config is validated.

Why: a run's outputs (checkpoints, ``metrics.jsonl``, ``completions.jsonl``, the adapter, the
export, plots, trackers, the token caches) are opened over hours, some of them after user
code has run: a reward function that calls ``os.chdir`` would otherwise send every later
file into another folder, one never locked or checked for a run, while ``output.dir`` gets
nothing and the printed paths point at the wrong files. Resolved here, every consumer of the
config sees the same absolute folder, and the run's ``config.toml`` records where it wrote.
``~`` is the home folder, as a shell would read it.
"""

from __future__ import annotations

from pathlib import Path

from llamatrain.config.sections import Config

__all__ = ["OUTPUT_PATHS", "make_output_paths_absolute"]

OUTPUT_PATHS = (("output", "dir"), ("data", "cache_dir"))
"""(section, key) of every path a run writes under."""


def make_output_paths_absolute(cfg: Config) -> None:
    """Resolve :data:`OUTPUT_PATHS` of ``cfg`` against the working directory, in place (links
    are kept as named: the run folder's own checks see them)."""
    for section, key in OUTPUT_PATHS:
        values = getattr(cfg, section)
        setattr(values, key, str(Path(getattr(values, key)).expanduser().absolute()))
