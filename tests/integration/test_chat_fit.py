"""Chat finetuning end to end: ``data.format = "jsonl"`` over a base model without a template.

The base is a random tiny llama over llama.cpp's real llama SPM vocabulary (32000 tokens, with
``<s>``/``</s>`` control tokens the llama-2 template writes), exported f32; the data is
generated conversations asking for the colour of things. What a run must show: the loss falls;
the trainer scores exactly the assistant tokens (counted here independently of the masking
code); packed and unpacked rows give the same loss; the chosen built-in template is carried
into the checkpoints and the export; a bad line stops the CLI naming file:line; and a resumed
run draws the same batches, so it reproduces the uninterrupted run's losses bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from llama_cpp_files import vocab_dir as vocab_dir

from llamatrain import api
from llamatrain.chat_template import BUILTIN_TEMPLATES
from llamatrain.checkpoint import load_checkpoint
from llamatrain.cli import main
from llamatrain.config import load_config
from llamatrain.data import build_train_data
from llamatrain.gguf.file import read_gguf
from llamatrain.gguf.llama import read_tokenizer
from llamatrain.model import Llama
from llamatrain.sampling import SamplingParams
from llamatrain.trainer import Trainer

THINGS = {"cat": "red", "dog": "blue", "bird": "green", "fish": "black", "tree": "white"}
STEPS = 6


def conversations() -> list[dict]:
    """40 conversations; every fourth has a second exchange, so some score two turns."""
    chats = []
    for i in range(40):
        thing = list(THINGS)[i % len(THINGS)]
        other = list(THINGS)[(i + 2) % len(THINGS)]
        messages = [
            {"role": "user", "content": f"Name the colour of the {thing}."},
            {"role": "assistant", "content": f"The {thing} is {THINGS[thing]}."},
        ]
        if i % 4 == 3:
            messages += [
                {"role": "user", "content": f"And the {other}?"},
                {"role": "assistant", "content": f"{THINGS[other]} {other}"},
            ]
        chats.append({"messages": messages})
    return chats


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join(x if isinstance(x, str) else json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, vocab_dir: Path) -> dict[str, Path]:
    """The base model and the chats, written once for the module."""
    folder = tmp_path_factory.mktemp("chat")
    tokenizer = read_tokenizer(vocab_dir / "ggml-vocab-llama-spm.gguf")
    cfg = load_config("tiny")
    torch.manual_seed(0)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size, max_seq_len=64)
    base = api.export_gguf(Llama(model_cfg), tokenizer, folder / "base.gguf")
    return {"base": base, "chats": write_jsonl(folder / "chats.jsonl", conversations())}


def overrides(files: dict[str, Path], run_dir: Path, *extra: str) -> list[str]:
    return [
        f'model.init_from="{files["base"]}"',
        f'data.path="{files["chats"]}"',
        'data.format="jsonl"',
        'data.chat_template="llama-2"',
        "data.val_fraction=0.1",
        f'output.dir="{run_dir}"',
        f"train.steps={STEPS}",
        "train.n_batch=256",
        "train.save_every=3",
        "train.keep_checkpoints=3",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "optim.lr=1e-2",
        "optim.warmup_steps=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def chat_run(files, tmp_path_factory: pytest.TempPathFactory) -> api.FitResult:
    run_dir = tmp_path_factory.mktemp("run") / "run"
    return api.fit("tiny", overrides=overrides(files, run_dir), progress=False)


def test_the_loss_falls_and_the_template_is_carried_into_checkpoints_and_export(chat_run):
    losses = [r["loss"] for r in chat_run.history.train]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 1.0, losses
    assert chat_run.history.eval[-1]["val_loss"] < losses[0]
    template = BUILTIN_TEMPLATES["llama-2"]
    assert read_gguf(chat_run.export_path).metadata["tokenizer.chat_template"] == template
    latest = load_checkpoint(chat_run.run_dir / "checkpoints" / "latest.gguf")
    assert latest.state.inherited["tokenizer.chat_template"] == template


def test_exactly_the_assistant_tokens_are_scored(files, tmp_path):
    """Unpacked, 4 training conversations fill the 4 rows of a step, so every step scores each
    assistant turn once. The count expected is the llama-2 template's structure: an assistant
    turn renders as " {content} </s>" after "[/INST]", which llama's SPM tokenizes as the
    content's own tokens (its leading space is the one SPM's dummy prefix stands for), then "▁"
    and "</s>" — 2 more tokens a turn."""
    chats = write_jsonl(tmp_path / "four.jsonl", conversations()[:4])
    tokenizer = read_tokenizer(files["base"])
    turns = [m["content"] for c in conversations()[:4] for m in c["messages"]]
    expected = sum(len(tokenizer.encode(t)) + 2 for t in turns[1::2])  # assistant = odd turns
    run = tmp_path / "run"
    extra = [f'data.path="{chats}"', "data.packing=false", "data.val_fraction=0"]
    extra += ["output.export=false"]
    api.fit("tiny", overrides=overrides(files, run, *extra, "train.steps=2"), progress=False)
    latest = load_checkpoint(run / "checkpoints" / "latest.gguf")
    assert latest.state.tokens == 2 * expected


def test_packed_and_unpacked_rows_give_the_same_loss(files, tmp_path):
    """The same 12 examples, the same weights: rows of several documents (attention and
    positions restarting at each) must score what one example a row scores. Float32 sums in
    another order: 1e-5 relative."""
    chats = write_jsonl(tmp_path / "twelve.jsonl", conversations()[:12])
    losses, rows = [], []
    for packing in ("true", "false"):
        extra = [f'data.path="{chats}"', f"data.packing={packing}", "data.val_fraction=0"]
        cfg = load_config("tiny", overrides(files, tmp_path / "run", *extra))
        model, tokenizer = api.load_gguf(files["base"])
        data = build_train_data(cfg, tokenizer, paths=[chats])
        trainer = Trainer(model, cfg, progress=False)
        losses.append(trainer.train_step(*data.train.batch(np.arange(len(data.train)))))
        rows.append(len(data.train))
    assert rows[1] == 12 and rows[0] < 12  # packed rows do hold several examples
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_a_bad_line_stops_the_cli_naming_file_and_line(files, tmp_path, capsys):
    chats = write_jsonl(tmp_path / "bad.jsonl", conversations()[:3] + ['{"messages": 7}\n'])
    items = [*overrides(files, tmp_path / "run"), f'data.path="{chats}"']
    argv = ["fit", "--config", "tiny", *(arg for item in items for arg in ("--set", item))]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"{chats}:4: " in err and '"messages" must be a non-empty list' in err


def test_resume_reproduces_the_uninterrupted_losses(files, chat_run, tmp_path):
    run = tmp_path / "run"
    api.fit("tiny", overrides=overrides(files, run, "train.steps=3"), progress=False)
    resumed = api.fit("tiny", overrides=overrides(files, run), resume="latest", progress=False)
    straight = [r["loss"] for r in chat_run.history.train]
    assert [r["loss"] for r in resumed.history.train] == straight[3:]


def test_generate_chat_prompts_as_llama_cpp_and_stops_at_the_end_of_turn(chat_run, capsys):
    """`generate RUN --chat`: the user turn rendered with the run's template tokenizes exactly
    as llama.cpp's chat tokenizes that prompt (control tokens parsed, one BOS), and the greedy
    reply is
    llama.cpp's greedy continuation of it on the exported model, cut at the turn's end
    (llama-2 ends a turn with EOS)."""
    import llama_cpp  # the test extra
    from llama_cpp_runs import open_exact

    from llamatrain.chat_template import prompt_ids

    n_tokens, message = 12, "Name the colour of the cat."
    _, tokenizer, template = api.load_chat(chat_run.run_dir)
    prompt = template.render([{"role": "user", "content": message}], add_generation_prompt=True)
    ids = prompt_ids(tokenizer, prompt)
    llm = open_exact(llama_cpp, chat_run.export_path, n_ctx=64)
    try:
        # llama.cpp's chat path (common/chat.cpp) drops a BOS the template wrote and lets the
        # tokenizer add it, so a rendered chat starts with one BOS, as ours does.
        text = prompt.removeprefix(template.bos_token)
        assert text != prompt and llm.tokenize(text.encode(), add_bos=True, special=True) == ids
        reply: list[int] = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if token == llm.token_eos() or len(reply) == n_tokens:
                break
            reply.append(token)
    finally:
        llm.close()
    args = ["generate", str(chat_run.run_dir), "--chat", message, "--temperature", "0"]
    assert main([*args, "--max-tokens", str(n_tokens)]) == 0
    # the reply is the words after the template's "[/INST] ", without that space
    assert capsys.readouterr().out == tokenizer.decode(reply).lstrip() + "\n"


def test_chat_command_keeps_the_conversation_over_turns(chat_run, capsys, monkeypatch):
    """`llamatrain chat RUN --system ...`: each input line is a user turn, each reply is the
    model's greedy reply to the whole conversation so far (system prompt, earlier turns and
    its own earlier replies), and the end of input ends it."""
    import io

    model, tokenizer, template = api.load_chat(chat_run.run_dir)
    system, users = "Answer briefly.", ["Name the colour of the cat.", "And the dog?"]
    params = SamplingParams(temperature=0)
    turns, expected = [{"role": "system", "content": system}], []
    for user in users:
        turns.append({"role": "user", "content": user})
        reply = "".join(api.chat(model, tokenizer, template, turns, max_tokens=8, params=params))
        expected.append(reply)
        turns.append({"role": "assistant", "content": reply})
    alone = [{"role": "system", "content": system}, {"role": "user", "content": users[1]}]
    without_history = "".join(
        api.chat(model, tokenizer, template, alone, max_tokens=8, params=params)
    )
    assert without_history != expected[1]  # so the output below shows the history was kept
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(users) + "\n"))
    args = ["chat", str(chat_run.run_dir), "--system", system, "--temperature", "0"]
    assert main([*args, "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out == "".join(reply + "\n" for reply in expected)


def test_chat_in_a_terminal_resets_and_exits_as_a_person_would(chat_run):
    """Driven through a pseudo-terminal: a prompt for each turn, /reset forgets the
    conversation (the same message then gets the first reply again), /exit ends it."""
    import os
    import pty
    import subprocess
    import sys

    main_fd, sub_fd = pty.openpty()
    command = [sys.executable, "-m", "llamatrain", "chat", str(chat_run.run_dir),
               "--temperature", "0", "--max-tokens", "6"]  # fmt: skip
    process = subprocess.Popen(command, stdin=sub_fd, stdout=sub_fd, stderr=sub_fd)
    os.close(sub_fd)
    os.write(main_fd, b"Name the colour of the cat.\n/reset\nName the colour of the cat.\n/exit\n")
    output = b""
    while True:
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        output += chunk
    assert process.wait(timeout=120) == 0
    os.close(main_fd)
    text = output.decode("utf-8", "replace").replace("\r\n", "\n")
    assert "type a message; /reset" in text  # the terminal also echoes what was typed
    model, tokenizer, template = api.load_chat(chat_run.run_dir)
    reply = "".join(
        api.chat(model, tokenizer, template, "Name the colour of the cat.", max_tokens=6,
                 params=SamplingParams(temperature=0))
    )  # fmt: skip
    assert text.count(f"{reply}\n") >= 2  # the same reply before and after /reset
    assert text.count("> ") >= 4  # a prompt for every line read


def test_chat_reply_is_cut_where_a_multi_token_marker_appears():
    """Where the vocabulary spells the end-of-turn marker in several tokens, the streamed reply
    stops where the marker's text begins, even when it arrives split across pieces; the
    template's space before a reply is not part of it."""
    from llamatrain.generate import _reply

    pieces = iter([" ", " Hel", "lo <|im", "_end|>", " never shown"])
    assert "".join(_reply(pieces, "<|im_end|>")) == "Hello "
    assert "".join(_reply(iter(["a", "b", "c"]), "<|im_end|>")) == "abc"
