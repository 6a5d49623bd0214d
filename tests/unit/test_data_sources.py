"""Input resolution: files, folders, globs, built-in corpora, and the checks on every file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from user_errors import error_of

from llamatrain.data import SONNETS_PATH, check_text_file, read_text, resolve_inputs


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def test_resolve_file_folder_glob_and_list(tmp_path):
    a = write(tmp_path / "c" / "b.txt", "bee\n")
    b = write(tmp_path / "c" / "sub" / "a.txt", "ay\n")
    write(tmp_path / "c" / "skip.md", "not txt\n")
    c = write(tmp_path / "d.txt", "dee\n")
    assert resolve_inputs(str(c)) == [c]
    assert resolve_inputs(tmp_path / "c") == [a, b]  # recursive, sorted, only *.txt
    assert resolve_inputs(str(tmp_path / "c" / "**" / "*.md")) == [tmp_path / "c" / "skip.md"]
    assert resolve_inputs([str(c), str(tmp_path / "c"), str(c)]) == [c, a, b]  # order, dedupe


def test_relative_paths_start_at_the_working_directory(tmp_path, monkeypatch):
    write(tmp_path / "corpus" / "a.txt", "ay\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_inputs("corpus/a.txt") == [Path("corpus/a.txt")]
    assert resolve_inputs("corpus/*.txt") == [Path("corpus/a.txt")]


def test_sonnets_resolve_to_the_packaged_file_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_inputs("sonnets") == [SONNETS_PATH]
    assert resolve_inputs(["sonnets", SONNETS_PATH]) == [SONNETS_PATH]  # one file, once
    text = read_text(SONNETS_PATH)
    assert text.startswith("THE SONNETS\nby William Shakespeare\n")
    assert "From fairest creatures we desire increase," in text
    headings = [line for line in text.splitlines() if line and set(line) <= set("IVXL")]
    assert headings[0] == "I" and headings[-1] == "L" and len(headings) == 50  # I to L
    assert not list(tmp_path.iterdir())  # nothing downloaded or written


@pytest.mark.parametrize(
    "make, fragments",
    [
        (lambda p: p / "missing.txt", ["missing.txt", "does not exist", "'sonnets'"]),
        (lambda p: str(p / "*.nothing"), ["matched no files"]),
        (lambda p: (p / "empty_dir").mkdir() or p / "empty_dir", ["no *.txt files"]),
        (lambda p: write(p / "e.txt", ""), ["e.txt is empty"]),
        (lambda p: write(p / "w.txt", " \n\n\t"), ["w.txt is empty"]),
        (lambda p: write(p / "n.bin", b"abc\0def"), ["n.bin looks binary", "offset 3"]),
        (lambda p: write(p / "l.txt", b"caf\xe9 au lait"), ["0xe9 at offset 3"]),
        (lambda p: write(p / "t.txt", "ok \u00e9".encode()[:-1]), ["ends inside", "offset 4"]),
        (lambda p: [], ["empty list"]),
        # issue 37: a FIFO (or a socket, a device) "did not exist"
        (lambda p: os.mkfifo(p / "fifo") or p / "fifo", ["fifo", "not a regular file", "pipe"]),
        (lambda p: Path("/dev/null"), ["/dev/null", "not a regular file"]),
    ],
)
def test_resolve_errors(tmp_path, make, fragments):
    msg = error_of(resolve_inputs, make(tmp_path))
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_check_text_file_reports_offsets_across_blocks(tmp_path):
    good = write(tmp_path / "g.txt", "ab\u00e9\u00e9\u00e9 fine\n")  # 2-byte chars cross blocks
    check_text_file(good, block_size=4)
    bad = write(tmp_path / "b.txt", "abc\u00e9".encode() + b"xy\xffz")
    assert "0xff at offset 7" in error_of(check_text_file, bad, block_size=4)
    nul = write(tmp_path / "n.txt", b"abcdefg\0")
    assert "NUL byte at offset 7" in error_of(check_text_file, nul, block_size=4)
    cut = write(tmp_path / "c.txt", "abc\u00e9".encode()[:-1])  # ends in a block's middle
    assert "ends inside a multi-byte character at offset 4" in error_of(
        check_text_file, cut, block_size=4
    )
    blank_blocks = write(tmp_path / "s.txt", " " * 9 + "x")  # text only in the last block
    check_text_file(blank_blocks, block_size=4)


def test_read_text_normalises(tmp_path):
    path = write(tmp_path / "x.txt", "\ufeffone\r\ntwo\rthree\n".encode())
    assert read_text(path) == "one\ntwo\nthree\n"


@pytest.mark.parametrize("format", ["text", "parquet"])
@pytest.mark.parametrize("named", ["folder", "glob", "recursive glob"])
def test_a_link_out_of_a_folder_is_refused_naming_it(tmp_path, format, named):
    """Issue 37: a text or Parquet folder (or a glob's folder) read a file a link in it points
    at outside it, as the HF folder reader no longer does; a file named itself may be a link."""
    suffix = ".parquet" if format == "parquet" else ".txt"
    content = b"PAR1" + b"\0" * 8 + b"PAR1" if format == "parquet" else b"secret\n"
    outside = write(tmp_path / "elsewhere" / f"secret{suffix}", content)
    corpus = tmp_path / "corpus"
    write(corpus / "sub" / f"a{suffix}", content)
    (corpus / "sub" / f"link{suffix}").symlink_to(outside)
    spec = {"folder": corpus, "glob": corpus / "sub" / f"*{suffix}"}
    spec["recursive glob"] = corpus / "**" / f"*{suffix}"
    message = error_of(resolve_inputs, str(spec[named]), format=format)
    assert f"link{suffix}', a link leading out of" in message and "copy the file in" in message
    assert resolve_inputs(str(corpus / "sub" / f"link{suffix}"), format=format) == [
        corpus / "sub" / f"link{suffix}"
    ]
    inner = corpus / "sub" / f"inner{suffix}"  # a link that stays inside is a file of it
    (corpus / "sub" / f"link{suffix}").unlink()
    inner.symlink_to(corpus / "sub" / f"a{suffix}")
    assert inner in resolve_inputs(str(spec[named]), format=format)
