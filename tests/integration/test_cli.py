"""End to end through the command line: fit, generate, eval, export, info, and bad inputs.

Most tests read one real ``llamatrain fit --config tiny`` run (the session fixture
``tiny_run`` in tests/conftest.py), made in a fresh process from a working directory outside
the repository.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from user_errors import error_of

from llamatrain import api
from llamatrain.checkpoint import load_checkpoint
from llamatrain.cli import _one_line_warning, main, run
from llamatrain.config import load_config
from llamatrain.data import SONNETS_PATH
from llamatrain.errors import DataError
from llamatrain.generate import generate
from llamatrain.optim import lr_at
from llamatrain.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]

# Unigram entropy of the sonnets under the tiny 384-piece tokenizer is 4.41 nats (uniform:
# ln 384 = 5.95). A validation loss below 4.1 can only come from using context, not from
# learning token frequencies; the 60-step run reaches ~3.8 deterministically.
LEARNED_CONTEXT_LOSS = 4.1
SAMPLE_END = "-" * 32  # the line that closes a sample printed during fit


def read_metrics(run: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r], [r for r in lines if "val_loss" in r]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``llamatrain ARGS`` in a new process, as a shell would run it."""
    return subprocess.run(
        [sys.executable, "-m", "llamatrain", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


@pytest.fixture(scope="module")
def export(tiny_run) -> Path:
    return tiny_run.run_dir / "model-f32.gguf"


# ---- fit -----------------------------------------------------------------------------------


def test_fit_runs_from_any_folder_and_keeps_everything_in_the_run(tiny_run, cache_dir):
    """Only output.dir (relative) and data.cache_dir were set: the built-in config and corpus
    came from the package, and nothing but the run folder appeared in the working directory."""
    assert [p.name for p in tiny_run.cwd.iterdir()] == ["run"]
    assert (cache_dir / "tokenizers").is_dir()  # the tokenizer was cached where we said
    assert sorted(p.name for p in tiny_run.run_dir.iterdir()) == [
        ".lock",  # the run lock's file, left in place (llamatrain.runlock says why)
        "checkpoints",
        "config.toml",
        "curves.png",
        "metrics.jsonl",
        "model-f32.gguf",
    ]
    saved = load_config(tiny_run.run_dir / "config.toml")  # the exact config, loadable again
    assert (saved.data.path, saved.output.dir, saved.model.dim, saved.train.steps) == (
        "sonnets",
        str(tiny_run.run_dir),  # "run", resolved where it started (config.paths)
        64,
        60,
    )
    assert (tiny_run.run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fit_learns_and_logs_every_step_it_should(tiny_run):
    train, evals = read_metrics(tiny_run.run_dir)
    optim = load_config("tiny").optim
    assert [r["step"] for r in train] == [10, 20, 30, 40, 50, 60]  # train.log_every = 10
    for record in train:
        assert record["lr"] == pytest.approx(lr_at(record["step"] - 1, optim))
        assert math.isfinite(record["loss"]) and record["tokens_per_s"] > 0
    assert [r["step"] for r in evals] == [30, 60]  # train.eval_every = 30
    final = evals[-1]
    assert final["val_loss"] < LEARNED_CONTEXT_LOSS < train[0]["loss"]
    assert final["val_loss"] < evals[0]["val_loss"]
    assert final["val_ppl"] == pytest.approx(math.exp(final["val_loss"]))
    assert 0.1 < final["val_acc"] < 1


def test_fit_checkpoints_and_export_hold_the_trained_model(tiny_run, export):
    directory = tiny_run.run_dir / "checkpoints"
    assert sorted(p.name for p in directory.glob("step-*.gguf")) == [
        "step-0000030.gguf",
        "step-0000060.gguf",
    ]
    assert (directory / "latest.gguf").resolve().name == "step-0000060.gguf"
    ckpt = load_checkpoint(directory / "latest.gguf")
    assert ckpt.state.step == 60
    model, tokenizer = api.load_gguf(export)
    assert (model.cfg.dim, model.cfg.n_layers, model.cfg.kv_heads, model.cfg.hidden_dim) == (
        64,
        2,
        2,
        192,
    )
    assert (model.cfg.vocab_size, model.cfg.max_seq_len) == (384, 64)
    assert tokenizer.fingerprint() == ckpt.tokenizer.fingerprint()
    for name, weight in model.state_dict().items():  # an f32 export is the checkpoint's model
        assert torch.equal(weight, torch.as_tensor(ckpt.weights[name])), name


def test_fit_says_what_it_is_about_to_do_before_the_first_step(tiny_run):
    """The first screen: model size and device, the data, the work per step and in all, the
    memory it will need and where the run goes, before anything else is printed."""
    first = tiny_run.stdout.splitlines()[:5]
    assert first[0].startswith("model: llama, 2 layers x 64, ") and "parameters; cpu" in first[0]
    assert first[1].startswith("data: ") and "training windows of 64" in first[1]
    assert first[2].startswith("steps: 60, each ") and "epochs" in first[2]
    assert first[3].startswith("memory: about ") and "activations" in first[3]
    assert first[4] == f"run folder: {tiny_run.run_dir.resolve()}"


def test_fit_prints_samples_as_text(tiny_run):
    """Each evaluation's sample is printed verbatim (newlines as newlines, not a repr) between
    a header naming the step and a dashed line, and is the text metrics.jsonl records."""
    lines = tiny_run.stdout.splitlines()
    _, evals = read_metrics(tiny_run.run_dir)
    for record in evals:
        start = lines.index(f"---- sample at step {record['step']} ----") + 1
        end = lines.index(SAMPLE_END, start)
        text = "\n".join(lines[start:end])
        assert text == record["sample"].rstrip("\n")
        assert text.startswith("From fairest")
    # the samples span several lines, so a repr (one quoted line with \n escapes) would differ
    assert all(record["sample"].count("\n") >= 2 for record in evals)


def test_fit_ends_with_the_llama_cli_command_for_the_export(tiny_run, export):
    last = tiny_run.stdout.rstrip("\n").splitlines()[-1]
    prefix = "run it in llama.cpp: "
    assert last.startswith(prefix)
    argv = shlex.split(last.removeprefix(prefix))
    assert argv[0] == "llama-cli" and argv[argv.index("-p") + 1] == "From fairest"
    path = Path(argv[argv.index("-m") + 1])
    assert (tiny_run.cwd / path).resolve() == export.resolve()  # valid where fit was run
    assert "-n" in argv


@pytest.fixture(scope="module")
def diverged(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path):
    """``llamatrain fit`` with optim.lr = 1e30 and no clipping: AdamW's first updates (~lr
    each) overflow float32 within a few steps."""
    return run_cli(
        "fit", "--config", "tiny", "--set", "optim.lr=1e30", "--set", "optim.grad_clip=0",
        "--set", "output.dir=run", "--set", f"data.cache_dir={cache_dir}",
        cwd=tmp_path_factory.mktemp("diverged"),
    )  # fmt: skip


def test_diverging_fit_exits_1_with_a_message(diverged):
    """The run stops with a readable error naming the step, not a traceback or NaN training."""
    assert diverged.returncode == 1
    assert "Traceback" not in diverged.stderr
    assert re.search(r"llamatrain: error: loss became (nan|inf) at step \d+;", diverged.stderr)


def test_diverging_fit_message_is_a_line_of_its_own(diverged):
    lines = diverged.stderr.strip().splitlines()
    assert lines[-1].startswith("llamatrain: error: loss became")


# ---- generate ------------------------------------------------------------------------------


def test_generate_greedy_produces_every_token_past_the_context(export, capsys):
    """A 10-token prompt (11 with BOS) plus 64 new tokens runs past the 64-token context the
    model was trained with; like llama.cpp, generation goes on (with one warning) and greedy
    output is the model's argmax continuation, all 64 tokens of it."""
    model, tokenizer = api.load_gguf(export)
    prompt = "But thy eternal"
    ids = tokenizer.encode(prompt, bos=True)
    assert len(ids) == 1 + 10
    with pytest.warns(UserWarning, match="past the 64"):
        out = generate(model, torch.tensor(ids), 64, SamplingParams(temperature=0)).tolist()
    new = out[len(ids) :]
    assert len(new) == 64 and tokenizer.eos_id not in new
    expected = tokenizer.decode(out)[len(tokenizer.decode(ids)) :]
    args = ["generate", str(export), "--prompt", prompt, "--max-tokens", "64", "--temperature", "0"]
    with pytest.warns(UserWarning, match="past the 64"):
        assert main(args) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_a_prompt_longer_than_the_context_is_refused_up_front(export, capsys):
    """A 130 KB prompt on the 64-token model: one line naming its tokens and the context, as
    llama.cpp refuses it ("prompt is too long"), not a minute of silent prefill; a prompt that
    fits may still generate past the context, with a warning (the test above)."""
    assert main(["generate", str(export), "--prompt", "From fairest creatures " * 5700]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "longer than the model's context of 64" in err, err
    assert re.search(r"the prompt is [\d,]+ tokens", err) and "shorten the prompt" in err


@pytest.mark.parametrize(
    "args",
    [["generate", "m.gguf", "--prompt", "caf\udce9"], ["generate", "m.gguf", "--chat", "\udcff"],
     ["chat", "m.gguf", "--system", "x\udc80y"]],
)  # fmt: skip
def test_a_text_flag_that_is_not_utf8_is_one_line_before_any_model_is_read(args, capsys):
    """Issue 37, item 1: a --prompt holding a byte that is not UTF-8 (a lone surrogate to
    Python) ended in a UnicodeEncodeError traceback from the tokenizer."""
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bytes that are not UTF-8" in err and args[2] in err, err
    assert "does not exist" not in err  # checked before the model is looked for


def test_a_chat_turn_that_is_not_utf8_ends_the_chat_in_one_line(monkeypatch):
    from llamatrain.cli import _user_turn

    for raw in (b"\xff\xfe hello\n", "x\udcff\n".encode("utf-8", "surrogateescape")):
        errors = "strict" if raw.startswith(b"\xff") else "surrogateescape"
        stdin = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors=errors)
        monkeypatch.setattr(sys, "stdin", stdin)
        assert "not UTF-8" in error_of(_user_turn, False)


HOSTILE = "\x1b[2J\x1b]0;owned\x07 and \udcff"


@pytest.mark.parametrize(
    "raised",
    [DataError(f"row 3 holds {HOSTILE}"), FileNotFoundError(2, "No such file", f"d/{HOSTILE}")],
)
def test_every_message_the_cli_prints_escapes_control_characters(raised, capsys):
    """Issue 37, item 6: a message quotes files and data; whatever raised it, a control
    character is printed escaped (shown), on one line, and a lone surrogate does not crash
    the print; warnings too."""

    def command(args):
        raise raised

    assert run(command, argparse.Namespace(debug=False)) == 1
    warning = _one_line_warning(UserWarning(f"quoted {HOSTILE}"), UserWarning, "x.py", 1)
    for line in [capsys.readouterr().err, warning]:
        assert line.endswith("\n") and line[:-1].isprintable() and "\\x1b[2J" in line, line


@pytest.mark.parametrize(
    ("argv", "fails", "words"),
    [
        (["generate", "m.gguf", "--prompt", "x"], "load", "lower --max-tokens"),
        (["generate", "m.gguf", "--chat", "hi"], "load_chat", "lower --max-tokens"),
        (["chat", "m.gguf"], "load_chat", "lower --max-tokens"),
        (["eval", "m.gguf", "--data", "x.txt"], "load", "lower --n-ctx"),
        (["export", "m.gguf", "-o", "x.gguf"], "export", "or a LoRA run's adapter alone"),
        (["export", "r", "-o", "a.gguf", "--adapter"], "export_adapter", "more free memory"),
    ],
)
@pytest.mark.parametrize("error", [MemoryError(), torch.OutOfMemoryError("CUDA out of memory.")])
def test_out_of_memory_in_a_standalone_command_is_one_line(
    monkeypatch, capsys, argv, fails, words, error
):
    """Issue 37, item 7: fit named the phase and the setting when memory ran out, but export,
    generate, chat and eval ended in a traceback."""

    def out_of_memory(*args, **kwargs):
        raise error

    monkeypatch.setattr(api, fails, out_of_memory)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    said = "MemoryError" if isinstance(error, MemoryError) else "CUDA out of memory."
    assert err.startswith("llamatrain: error: out of memory while ") and f"({said})" in err
    assert " was held; " in err and words in err


def test_generate_samples_reproducibly_with_llama_cpp_defaults(tiny_run, capsys):
    args = ["generate", str(tiny_run.run_dir), "--prompt", "Shall I", "--max-tokens", "20"]
    assert main([*args, "--seed", "1"]) == 0
    first = capsys.readouterr().out
    assert main([*args, "--seed", "1"]) == 0
    assert capsys.readouterr().out == first and len(first.strip()) > 5
    # the defaults are SamplingParams' (llama.cpp's), as the API's
    model, tokenizer = api.load(tiny_run.run_dir)
    pieces = api.generate_text(model, tokenizer, "Shall I", max_tokens=20, seed=1)
    assert "".join(pieces) + "\n" == first
    assert main([*args, "--seed", "2"]) == 0
    assert capsys.readouterr().out != first


# ---- eval, export, info --------------------------------------------------------------------


def test_eval_prints_llama_perplexity_and_mean_loss(export, capsys):
    assert main(["eval", str(export), "--data", str(SONNETS_PATH)]) == 0
    lines = {
        line.split(":")[0]: line.split(":", 1)[1].split()
        for line in capsys.readouterr().out.splitlines()
    }
    model, tokenizer = api.load_gguf(export)
    expected = api.perplexity(model, tokenizer, SONNETS_PATH)
    assert int(lines["tokens"][0]) == expected.n_tokens
    assert float(lines["mean loss"][0]) == pytest.approx(expected.mean_loss, abs=1e-4)
    assert float(lines["perplexity"][0]) == pytest.approx(expected.perplexity, abs=1e-4)
    assert expected.n_chunks == expected.n_tokens // 64 and expected.n_ctx == 64
    # the training text itself: better than the held-out bound, worse than memorised
    assert 1.0 < expected.mean_loss < LEARNED_CONTEXT_LOSS
    assert math.log(expected.perplexity) < expected.mean_loss  # second halves have context


def test_export_q8_0_and_info(tiny_run, export, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["export", str(tiny_run.run_dir), "-o", str(out), "--type", "q8_0"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}")
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "blk.0.attn_q.weight" in text and "Q8_0" in text and "llama.block_count: 2" in text
    # the quantized model is the trained one, to within 8-bit rounding of its weights:
    # logits of this model span ~±4.5; measured max difference 0.013
    quantized, _ = api.load_gguf(out)
    reference, tokenizer = api.load_gguf(export)
    ids = torch.tensor([tokenizer.encode("From fairest creatures we desire increase", bos=True)])
    with torch.no_grad():
        diff = (quantized(ids) - reference(ids)).abs().max().item()
    assert 0 < diff < 0.1
    assert out.stat().st_size < 0.4 * export.stat().st_size


def test_export_script_wraps_the_api(tiny_run, tmp_path):
    out = tmp_path / "script.gguf"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "export_gguf.py"), str(tiny_run.run_dir),
         "-o", str(out), "--type", "f16"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "f16" in done.stdout
    model, _ = api.load_gguf(out)
    reference, _ = api.load_gguf(tiny_run.run_dir / "model-f32.gguf")
    weight = reference.token_embd.weight
    # f16 keeps 11 significant bits: relative rounding error at most 2^-11
    torch.testing.assert_close(model.token_embd.weight, weight, rtol=2**-11, atol=1e-7)


# ---- user errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, named",
    [
        (["fit", "--config", "missing.toml"], "missing.toml"),
        (["eval", "{run}", "--data", "missing.txt"], "missing.txt"),
        (["export", "{ckpt}", "-o", "/proc/x/y.gguf"], "/proc/x"),
    ],
    ids=["fit-missing-config", "eval-missing-data", "export-unwritable"],
)
def test_user_errors_exit_1_with_one_line(tiny_run, tmp_path, args, named):
    """Mistakes in what the user typed end in one line naming the culprit, never a traceback."""
    ckpt = tiny_run.run_dir / "checkpoints" / "latest.gguf"
    args = [a.format(run=tiny_run.run_dir, ckpt=ckpt) for a in args]
    done = run_cli(*args, cwd=tmp_path)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("llamatrain: error:") and named in lines[0]
    assert done.stdout == ""
    assert list(tmp_path.iterdir()) == []  # and nothing was left behind


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "unknown key"),
        ("optim.lr=-1", "optim.lr"),
        ("model.dim=30", "n_heads"),
        ('data.path="does/not/exist.txt"', "does/not/exist.txt"),
    ],
)
def test_bad_config_values_are_reported(override, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # were the check to fail, no run folder lands in the repository
    assert main(["fit", "--config", "tiny", "--set", override]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llamatrain: error:") and message in err
    assert list(tmp_path.iterdir()) == []


def test_bad_input_files_are_reported(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    short = tmp_path / "short.txt"
    short.write_text("Too short for a window.\n" * 3)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"text\x00\x01\x02 more")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for path, word in [(binary, "binary"), (empty, "empty")]:
        assert main(["fit", "--config", "tiny", "--set", f"data.path={path}"]) == 1
        err = capsys.readouterr().err
        assert word in err.lower() and str(path) in err
    tokenizer = ["--set", f"tokenizer.path={tmp_path / 'nope.model'}"]
    assert main(["fit", "--config", "tiny", "--set", f"data.path={short}", *tokenizer]) == 1
    assert "nope.model" in capsys.readouterr().err


def test_corpus_shorter_than_a_window_is_reported(export, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Too short for a window.\n" * 3)
    args = ["fit", "--config", "tiny", "--set", f"data.path={short}",
            "--set", "data.val_fraction=0", "--set", f"output.dir={tmp_path / 'r'}",
            "--set", f"data.cache_dir={tmp_path / 'cache'}",
            "--set", f"model.init_from={export}"]  # fmt: skip
    assert main(args) == 1
    assert "n_ctx" in capsys.readouterr().err


def test_corrupt_gguf_is_reported(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    assert main(["generate", str(bad), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("llamatrain: error:") and "bad.gguf" in err


# ---- finetuning ----------------------------------------------------------------------------


def test_finetune_from_a_gguf_model_runs_in_llama_cpp(export, tiny_overrides):
    """model.init_from: start from an exported model (its tokenizer too), train on, export,
    and the result loads and runs in real llama.cpp with the same logits."""
    import llama_cpp

    result = api.fit(
        "tiny",
        overrides=tiny_overrides(
            **{"model.init_from": f'"{export}"', "train.steps": 5, "train.eval_every": 0,
               "optim.warmup_steps": 1}
        ),
        progress=False,
    )  # fmt: skip
    base_model, base_tok = api.load(export)
    assert result.tokenizer.fingerprint() == base_tok.fingerprint()
    assert result.model.cfg.architecture() == base_model.cfg.architecture()
    assert not torch.equal(result.model.token_embd.weight, base_model.token_embd.weight)
    llm = llama_cpp.Llama(str(result.export_path), n_ctx=64, logits_all=True, verbose=False,
                          type_k=0, type_v=0, flash_attn=False, n_threads=1)  # fmt: skip
    try:
        ids = result.tokenizer.encode("Shall I compare thee", bos=True)
        llm.eval(ids)
        theirs = torch.tensor(llm.scores[: len(ids)])
        with torch.no_grad():
            ours = result.model.eval()(torch.tensor([ids]))[0]
        # float32 on both sides with an F32 KV cache: measured 1.9e-6 (tests/integration/
        # test_llama_cpp.py holds a longer comparison to 1e-5)
        assert (theirs - ours).abs().max() < 1e-4
    finally:
        llm.close()
