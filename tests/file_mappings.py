"""Where this process maps a file, for tests that prove a tensor lies in the file's own pages
(a QLoRA base, a GRPO reference: ``gguf.file.map_stored``) rather than in a copy.

A module beside the top ``conftest.py`` (pytest puts its folder on ``sys.path``)."""

from __future__ import annotations

from pathlib import Path


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges this process maps from ``path`` (Linux's /proc/self/maps)."""
    ranges, inode = [], path.stat().st_ino
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and int(fields[4]) == inode and fields[5] == str(path.resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges
