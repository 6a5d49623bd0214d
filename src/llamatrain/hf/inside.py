"""The files of an HF folder, kept inside it: a folder from a stranger names its files
(``model.safetensors.index.json`` names the shards) and may hold links, and neither may lead
the reader to a file elsewhere (``../outside.safetensors``, ``/etc/passwd``, a link to
``~/.ssh``).

A file of the folder is named by a plain file name (no path separator, not ``.`` or ``..``)
and, links followed, lies in the folder — or, for a folder inside the Hugging Face cache
(``…/models--org--name/snapshots/<revision>/``), in that model's ``blobs/``, where the
cache's own links point.
"""

from __future__ import annotations

import os
from pathlib import Path

from llamatrain.errors import CheckpointError

__all__ = ["file_in_folder", "plain_file_name"]


def plain_file_name(name: object, folder: Path, what: str) -> str:
    """``name`` if it is a plain file name, else a CheckpointError naming ``what`` (the
    file that names it) and the name."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or os.path.isabs(name)
        or len(name) > 255
    ):
        shown = repr(name) if not isinstance(name, str) or len(name) <= 80 else repr(name[:80])
        raise CheckpointError(
            f"{folder}: {what} names the file {shown}, which is not a plain file name of the "
            "folder (a path, or a name leading out of it); refusing to read outside the "
            "folder — re-save the model"
        )
    return name


def file_in_folder(folder: Path, name: str, what: str | None = None) -> Path:
    """``folder / name``, refused in one line (CheckpointError) when ``name`` is not a plain
    file name or the file, links followed, lies outside the folder (and its Hugging Face
    cache's ``blobs/``). A file that does not exist is returned as it is (callers say what is
    missing)."""
    plain_file_name(name, folder, what or "the folder")
    path = folder / name
    if not path.is_symlink():
        return path
    try:
        target = path.resolve()
    except (OSError, RuntimeError) as e:  # a loop of links
        raise CheckpointError(f"{path} is a link that leads nowhere ({e}); copy the file") from e
    if not any(target.is_relative_to(root) for root in _roots(folder)):
        raise CheckpointError(
            f"{path} is a link to {target}, outside {folder}; refusing to read outside the "
            "folder — copy the file into it"
        )
    return path


def _roots(folder: Path) -> list[Path]:
    """Where the files of ``folder`` may lie: the folder, and the blobs of the Hugging Face
    cache it is a snapshot of."""
    here = folder.resolve()
    roots = [here]
    for ancestor in (here, *here.parents):
        if ancestor.parent.name == "snapshots":
            roots.append(ancestor.parent.parent / "blobs")
            break
    return roots
