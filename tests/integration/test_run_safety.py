"""Run safety: no file runs code, nothing is written where it was not asked, a forgotten
``--resume`` never costs a run, and a count a file claims costs only what the file holds
(docs/guides/safety.md)."""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from random_models import BYTE_BPE, tiny_llama

from llamatrain import api, cli
from llamatrain.checkpoint import load_checkpoint
from llamatrain.errors import CheckpointError, LlamatrainError, LlamatrainWarning, OutputError
from llamatrain.gguf.file import (
    PICKLED_STATE_KEYS,
    STATE_SHA256_KEY,
    TENSOR_SHA256_KEY,
    read_gguf,
    read_gguf_metadata,
    typed_value,
)
from llamatrain.gguf.llama import write_model
from llamatrain.gguf.write import write_gguf
from llamatrain.run_checkpoints import CheckpointManager

SRC = Path(api.__file__).parent
QUICK = {"train.steps": 2, "train.save_every": 2, "train.eval_every": 0, "output.export": "false"}


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (links as their target text) by its sha256."""
    digests = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            digests[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            digests[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


@pytest.fixture
def quick_run(tiny_overrides) -> api.FitResult:
    """Two steps of the tiny config with a checkpoint at the end, no export."""
    return api.fit("tiny", overrides=tiny_overrides(**QUICK), progress=False)


# ---- 1. no code from data ------------------------------------------------------------------


class _WritesMarker:
    """A pickle that, when loaded, creates the file it names (as a real payload would run a
    command)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def with_keys(path: Path, extra: dict[str, object], digests: str = "drop") -> None:
    """Rewrite the GGUF at ``path`` with ``extra`` keys added (the rest as stored). Its sha256
    keys: ``drop`` both (a version-1 checkpoint, from before they existed), ``keep`` the old
    ones (an edit then shows as damage), or ``renew`` them (as a writer that knows the format
    would: the edit reaches the reader's own checks)."""
    contents = read_gguf(path)
    metadata = {k: typed_value(contents, k) for k in contents.metadata}
    arch = metadata.pop("general.architecture")
    if digests != "keep":
        metadata.pop(STATE_SHA256_KEY)
        metadata.pop(TENSOR_SHA256_KEY)
    metadata.update(extra)
    tensors = {name: (t, "f32") for name, t in contents.tensors.items()}
    path.unlink()
    write_gguf(path, arch, metadata, tensors, checksums=digests == "renew")


@pytest.mark.parametrize("key", PICKLED_STATE_KEYS)
def test_a_pickled_checkpoint_is_refused_without_running_it(quick_run, tiny_overrides, key):
    """A version-1 checkpoint's pickled state (here a payload that would create a file) is
    never unpickled: the resume is refused in one line that says how to keep the weights, and
    those weights still load as a model."""
    marker = quick_run.run_dir.parent / "pwned"
    latest = (quick_run.run_dir / "checkpoints" / "latest.gguf").resolve()
    payload = base64.b64encode(pickle.dumps(_WritesMarker(marker))).decode("ascii")
    with_keys(latest, {key: payload, "optimizer.type": "lbfgs" if "lbfgs" in key else "adam"})
    overrides = tiny_overrides(**{**QUICK, "train.steps": 4})
    if "lbfgs" in key:
        overrides += ['optim.name="lbfgs"']
    with pytest.raises(CheckpointError, match="pickle.*not read.*model.init_from") as err:
        api.fit("tiny", overrides=overrides, resume="latest", progress=False)
    assert "\n" not in str(err.value)
    assert not marker.exists()
    model, _ = api.load(latest)  # the weights are still there for a new run
    assert sum(p.numel() for p in model.parameters()) > 0
    assert not marker.exists()


def test_resume_reads_no_pickle(quick_run, tiny_overrides, monkeypatch):
    """Resuming a checkpoint this version wrote touches no unpickler at all."""

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint reader reached pickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    result = api.fit(
        "tiny", overrides=tiny_overrides(**{**QUICK, "train.steps": 3}), resume="latest",
        progress=False,
    )  # fmt: skip
    assert result.history.train[-1]["step"] == 3


def test_no_reader_can_reach_pickle():
    """No module of the package imports pickle or calls torch.load / numpy.load in a way that
    can unpickle (weights_only=False, allow_pickle=True, or torch.load at all)."""
    offenders = []
    for path in SRC.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for pattern in (
            r"^\s*(import|from)\s+(c?pickle|dill|joblib|marshal|shelve)\b",
            r"torch\.load\(",
            r"weights_only\s*=\s*False",
            r"allow_pickle\s*=\s*True",
            r"\bnp\.load\(|\bnumpy\.load\(",
        ):
            offenders += [f"{path.name}: {m.group(0)}" for m in re.finditer(pattern, text, re.M)]
    assert offenders == []


def test_lbfgs_state_resumes_bit_identically_without_pickle(tiny_overrides, tmp_path):
    """L-BFGS's history (lists of tensors, counters, floats) travels as JSON + tensors: 2 steps,
    then a resume to 4, ends on the weights 4 straight steps reach."""
    lbfgs = {**QUICK, "optim.name": '"lbfgs"', "optim.lr": 1, "optim.lr_min": 1,
             "optim.lbfgs_max_iter": 3, "optim.warmup_steps": 0}  # fmt: skip
    straight = api.fit(
        "tiny", overrides=tiny_overrides(**{**lbfgs, "train.steps": 4,
        "output.dir": f'"{tmp_path / "straight"}"'}), progress=False,
    )  # fmt: skip
    api.fit("tiny", overrides=tiny_overrides(**lbfgs), progress=False)
    resumed = api.fit(
        "tiny", overrides=tiny_overrides(**{**lbfgs, "train.steps": 4}), resume="latest",
        progress=False,
    )  # fmt: skip
    ckpt = load_checkpoint(resumed.run_dir / "checkpoints" / "latest.gguf")
    assert not any(k in ckpt.metadata for k in PICKLED_STATE_KEYS)
    assert "optimizer.lbfgs.layout" in ckpt.metadata
    theirs = straight.model.state_dict()
    for name, weight in resumed.model.state_dict().items():
        assert torch.equal(weight, theirs[name]), name


def test_damaged_rng_layout_is_one_checkpoint_error(quick_run, tiny_overrides):
    latest = (quick_run.run_dir / "checkpoints" / "latest.gguf").resolve()
    damaged = {"training.rng.layout": '{"dict": [[{"value": "torch"}, {"tensor": 7}]]}'}
    with_keys(latest, damaged, digests="renew")
    with pytest.raises(CheckpointError, match="RNG state is damaged"):
        api.fit("tiny", overrides=tiny_overrides(**{**QUICK, "train.steps": 4}),
                resume="latest", progress=False)  # fmt: skip


@pytest.mark.parametrize(
    "edit",
    [{"training.iteration_count": 7}, {"training.data_state": '{"epoch": 3}'},
     {"optimizer.type": "lbfgs"}, {"training.rng.layout": '{"value": 1}'}],
)  # fmt: skip
def test_an_edited_training_key_is_damage_named_in_one_line(quick_run, tiny_overrides, edit):
    """The checksum covers the training.*/optimizer.* keys: an edit (or a flipped byte) in the
    state is refused on resume and by ``info --verify``, never believed."""
    latest = (quick_run.run_dir / "checkpoints" / "latest.gguf").resolve()
    with_keys(latest, edit, digests="keep")
    with pytest.raises(LlamatrainError, match="training state keys .* do not match the sha256"):
        api.fit("tiny", overrides=tiny_overrides(**{**QUICK, "train.steps": 4}),
                resume="latest", progress=False)  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "llamatrain", "info", "--verify", str(latest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "training state keys" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_info_verify_says_what_it_covers(quick_run):
    latest = quick_run.run_dir / "checkpoints" / "latest.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "llamatrain", "info", "--verify", str(latest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0
    assert "verify: every value finite; the training.*/optimizer.* keys and all" in done.stdout


def test_info_escapes_what_a_file_supplies_and_verify_names_nan_weights(quick_run, tmp_path):
    """A key or value holding ESC/CR/newlines is shown escaped, one line per key; a model with
    a NaN weight is named by info --verify in one line."""
    model = tmp_path / "model.gguf"
    assert export_cli(str(quick_run.run_dir), "-o", str(model)).returncode == 0
    contents = read_gguf(model)
    metadata = {k: typed_value(contents, k) for k in contents.metadata}
    arch = metadata.pop("general.architecture")
    metadata["general.name"] = "evil\x1b[2J\rforged line\nverify: all fine"
    tensors = {name: (t, "f32") for name, t in contents.tensors.items()}
    tensors["output_norm.weight"][0][3] = float("nan")
    model.unlink()
    write_gguf(model, arch, metadata, tensors)
    done = subprocess.run(
        [sys.executable, "-m", "llamatrain", "info", "--verify", str(model)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "\x1b" not in done.stdout and "\r" not in done.stdout
    assert "general.name: evil\\x1b[2J\\rforged line\\nverify: all fine" in done.stdout
    assert done.returncode == 1
    assert "output_norm.weight holds NaN or infinite values" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    done = subprocess.run(
        [sys.executable, "-m", "llamatrain", "generate", str(model), "--prompt", "From",
         "--max-tokens", "8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "logits are NaN" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


# ---- 2. writes only where owned ------------------------------------------------------------


def export_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llamatrain", "export", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_export_never_writes_through_a_pipe_a_link_or_over_another_file(
    quick_run, tmp_path, capsys, monkeypatch
):
    """The command as a user runs it once (its own process: exit status, no traceback), the
    other targets through the same ``cli.main`` in this process (seconds, not a Python start
    each)."""
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main sets it

    def export(target: Path) -> tuple[int, str]:
        status = cli.main(["export", str(quick_run.run_dir), "-o", str(target)])
        return status, capsys.readouterr().err

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me\n")
    link = tmp_path / "link.gguf"
    link.symlink_to(notes)
    dangling = tmp_path / "dangling.gguf"
    dangling.symlink_to(tmp_path / "elsewhere.gguf")
    done = export_cli(str(quick_run.run_dir), "-o", str(fifo))
    assert done.returncode == 1 and "named pipe" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    for target, what in ((link, "symbolic link"), (dangling, "symbolic link"),
                         (notes, "not a GGUF file"), (Path("/dev/null"), "device")):  # fmt: skip
        status, err = export(target)
        assert status == 1 and what in err and len(err.strip().splitlines()) == 1, target
    assert notes.read_text() == "keep me\n" and link.is_symlink() and fifo.is_fifo()
    assert not (tmp_path / "elsewhere.gguf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["pipe.gguf", "notes.txt", "link.gguf", "dangling.gguf", "run"]
    )  # no temporary file left behind
    good = tmp_path / "model.gguf"
    for _ in range(2):  # an existing GGUF is replaced
        assert export(good)[0] == 0


@pytest.mark.parametrize("planted", [".lock", "config.toml", "metrics.jsonl"])
def test_a_link_planted_in_a_run_folder_is_never_written_through(
    quick_run, tiny_overrides, tmp_path, planted
):
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    entry = quick_run.run_dir / planted
    entry.unlink()
    entry.symlink_to(victim)
    with pytest.raises(OutputError, match="symbolic link"):
        api.fit("tiny", overrides=tiny_overrides(**{**QUICK, "train.steps": 4}),
                resume="latest", progress=False)  # fmt: skip
    assert victim.read_text() == "untouched\n"


# ---- 3. a forgotten --resume never loses a run ----------------------------------------------


def test_a_second_fit_into_a_run_folder_leaves_the_first_run_intact(quick_run, tiny_overrides):
    before = tree_digest(quick_run.run_dir)
    with pytest.raises(OutputError, match="already holds a run.*--resume latest.*--overwrite"):
        api.fit("tiny", overrides=tiny_overrides(**QUICK), progress=False)
    assert tree_digest(quick_run.run_dir) == before


def test_overwrite_moves_the_old_run_aside(quick_run, tiny_overrides):
    before = tree_digest(quick_run.run_dir)
    with pytest.warns(UserWarning, match="moved the run"):
        again = api.fit("tiny", overrides=tiny_overrides(**QUICK), overwrite=True,
                        progress=False)  # fmt: skip
    aside = quick_run.run_dir.with_name(quick_run.run_dir.name + ".old-1")
    assert {k: v for k, v in tree_digest(aside).items() if k != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"
    }
    assert (again.run_dir / "checkpoints" / "latest.gguf").exists()


def test_cli_fit_into_a_run_folder_is_one_line(quick_run, cache_dir):
    done = subprocess.run(
        [sys.executable, "-m", "llamatrain", "fit", "--config", "tiny", "--set",
         f"output.dir={quick_run.run_dir}", "--set", f"data.cache_dir={cache_dir}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert "already holds a run" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_checkpoints_are_pruned_by_their_step_number(tmp_path):
    """Names sort wrongly past the 7-digit padding; the step read from the name decides, and
    checkpoints a resume from an earlier step abandoned go first."""
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (9_999_998, 9_999_999, 10_000_000, 10_000_001):
        manager.path_for(step).write_bytes(b"GGUF")
    manager._prune(10_000_001)
    assert sorted(manager.numbered()) == [10_000_000, 10_000_001]
    for step in (20, 30, 40):
        manager.path_for(step).write_bytes(b"GGUF")
    manager._prune(30)  # resumed from 20, now at 30: 40 and the 10M ones are abandoned
    assert sorted(manager.numbered()) == [20, 30]


def test_a_context_no_gguf_key_can_hold_is_one_line_at_export(quick_run, tmp_path):
    """A file claiming a 2^62-token context (stored as UINT64, without our config record):
    refused in one line when read, before an export would fail to write it back."""
    model = tmp_path / "model.gguf"
    assert export_cli(str(quick_run.run_dir), "-o", str(model)).returncode == 0
    contents = read_gguf(model)
    metadata = {k: typed_value(contents, k) for k in contents.metadata}
    arch = metadata.pop("general.architecture")
    metadata.pop("llamatrain.model_config")
    metadata["llama.context_length"] = np.uint64(2**62)
    tensors = {name: (t, "f32") for name, t in contents.tensors.items()}
    model.unlink()
    write_gguf(model, arch, metadata, tensors)
    done = export_cli(str(model), "-o", str(tmp_path / "out.gguf"))
    assert done.returncode == 1 and "max_seq_len must be <= 4294967295" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.gguf").exists()


# ---- 4. a count a file claims is bounded by what it holds ----------------------------------

CLAIMS = {
    "general.base_model.count": np.uint64(10**12),
    "general.base_model.0.name": "Grandparent",
    "general.base_model.0.repo_url": "https://huggingface.co/someone/grandparent",
    "general.base_model.7.name": "Seventh",  # present, and below the count
    "general.base_model.01.name": "not an index as the writer spells one",
    "general.dataset.count": np.uint64(10**12),
    "general.dataset.0.repo_url": "https://huggingface.co/datasets/someone/data",
}


@pytest.fixture(scope="module")
def claiming(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A tiny random model (byte-level BPE, so an HF export can hold its tokenizer) whose
    GGUF carries :data:`CLAIMS` among its keys."""
    model, tokenizer = tiny_llama(cache_dir, overrides=BYTE_BPE, max_seq_len=64)
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    path = tmp_path_factory.mktemp("counts") / "claiming.gguf"
    return write_model(path, model.cfg, tensors, tokenizer, inherited=CLAIMS)


@pytest.mark.slow
def test_a_gguf_export_finishes_and_keeps_the_files_own_keys(claiming, tmp_path):
    """A conversion copies its file's lineage keys as they are (the claim included); reading
    them costs the keys present. Before: a loop of 10^12 entries past 2.8 GB."""
    out = tmp_path / "out.gguf"
    done = export_cli(str(claiming), "-o", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    keys = read_gguf_metadata(out)
    assert {k: keys[k] for k in CLAIMS} == CLAIMS


@pytest.mark.slow
def test_an_hf_export_cards_the_entries_present_not_the_count_claimed(claiming, tmp_path):
    done = export_cli(str(claiming), "-o", str(tmp_path / "hf"), "--format", "hf")
    assert done.returncode == 0, done.stderr[-2000:]
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "someone/grandparent" in card and "someone/data" in card
    card_head = card.split("---")[1]
    assert card_head.count("base_model") == 1, card_head


# ---- 5. logs are data ------------------------------------------------------------------------


def test_a_damaged_metrics_log_costs_its_lines_not_the_export_plot_or_resume(
    quick_run, tiny_overrides, tmp_path
):
    """A line with more digits than Python reads is skipped with a warning; a loss of 10^400
    is no value (before: tracebacks in export's model card, in plot, and on resume)."""
    metrics = quick_run.run_dir / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"step": 1, "loss": ' + "9" * 5000 + "}\n")
        f.write('{"step": 2, "loss": ' + str(10**400) + ', "lr": 0.001}\n')
    done = export_cli(str(quick_run.run_dir), "-o", str(tmp_path / "model.gguf"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "skipped 1 damaged line(s), the first line" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "llamatrain", "plot", str(quick_run.run_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    with pytest.warns(LlamatrainWarning, match="skipped 1 damaged line"):
        api.fit("tiny", overrides=tiny_overrides(**{**QUICK, "train.steps": 3}),
                resume="latest", progress=False)  # fmt: skip
    assert "9" * 5000 not in metrics.read_text()  # the resume kept the whole lines only
