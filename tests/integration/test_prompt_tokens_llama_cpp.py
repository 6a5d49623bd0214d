"""A prompt is tokenized as the model file says, as llama.cpp tokenizes it.

llama.cpp puts BOS before a prompt only where the vocabulary says so
(``tokenizer.ggml.add_bos_token``; without the key: yes for a llama/SPM vocabulary, for byte-level
BPE as the pre-tokenizer decides, Llama 3's yes and Qwen2's no) and EOS after it where
``tokenizer.ggml.add_eos_token`` says so. Qwen2.5 Instruct's file says no BOS, and a prompt given
one continues differently. For a tiny random model of each family, its vocabulary's keys set
both ways, the file we export runs in llama.cpp (llama-cpp-python) and:

* the file reads back with the keys it was written with, and our ``encode_prompt`` gives
  llama.cpp's ``tokenize(add_bos=True)`` (``add_special``: llama.cpp's own BOS/EOS decision);
* our greedy ids from those prompt ids are llama.cpp's, and ``generate_text``, a chat's reply
  (the rendered template tokenized with its control tokens) and the trainer's greedy sample
  show the text of llama.cpp's greedy continuation of the prompt llama.cpp frames;
* ``perplexity`` is llama-perplexity's number from llama.cpp's logits, its chunks starting with
  BOS only where the file adds one.

The first check also shows that the framing matters: the other BOS decision moves the next-token
logits by far more than the families' 1e-5 agreement with llama.cpp (``test_families``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llama_cpp_runs import logits_of, open_exact
from random_models import move_off_neutral

from llamatrain import api
from llamatrain.chat_template import chat_template_for, prompt_ids
from llamatrain.config import load_config
from llamatrain.generate import generate
from llamatrain.gguf.file import read_gguf
from llamatrain.gguf.vocab import tokenizer_from_metadata, tokenizer_metadata
from llamatrain.model import Llama, ModelConfig
from llamatrain.sampling import SamplingParams
from llamatrain.tokenizer import Tokenizer, train_byte_bpe, train_spm
from llamatrain.trainer import Trainer

TEXT = "\n".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times."
    for i in range(400)
)
PROMPT = "Line 7: the quick brown"
N_NEW = 12
BASE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=128)
FAMILIES: dict[str, tuple[str, str | None, dict[str, Any]]] = {
    # family: (vocabulary, BPE pre-tokenizer, model switches)
    "llama": ("spm", None, dict(arch="llama")),
    "llama3": ("bpe", "llama-bpe", dict(arch="llama")),
    "qwen2": ("bpe", "qwen2", dict(arch="qwen2")),
    "qwen3": ("bpe", "qwen2", dict(arch="qwen3", key_length=32)),
    "smollm3": ("bpe", "smollm", dict(arch="smollm3", rope_theta=2e6)),
}
FRAMINGS = ((True, False), (False, False), (False, True))
"""(add_bos_token, add_eos_token) each file is written with: both ways for BOS, and EOS once."""
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    import llama_cpp

    return llama_cpp


@pytest.fixture(scope="module")
def vocabularies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    corpus = tmp_path_factory.mktemp("prompt-tokens") / "corpus.txt"
    corpus.write_text(TEXT)
    return {"spm": train_spm([corpus], vocab_size=320), "bpe": train_byte_bpe([corpus], 400)}


def family_file(
    vocabularies: dict[str, Tokenizer], family: str, framing: tuple[bool, bool], folder: Path
) -> Path:
    """A random model of ``family`` exported with its vocabulary's add_bos/add_eos keys set
    to ``framing`` (the pre-tokenizer swapped in for a BPE family)."""
    vocab, pre, switches = FAMILIES[family]
    keys = tokenizer_metadata(vocabularies[vocab])
    if pre is not None:
        keys["tokenizer.ggml.pre"] = pre
    keys["tokenizer.ggml.add_bos_token"], keys["tokenizer.ggml.add_eos_token"] = framing
    tokenizer = tokenizer_from_metadata(keys)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, **{**BASE, **switches})
    model = move_off_neutral(Llama(cfg)).eval()
    with torch.no_grad():  # sharper attention: the first token shows in every continuation
        for p in model.parameters():
            p.mul_(3.0 if p.dim() == 2 else 1.0)
    return api.export_gguf(model, tokenizer, folder / f"{family}-{framing[0]}-{framing[1]}.gguf")


def greedy_ids(llm: Any, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's argmax continuation of ``prompt``, one token at a time from its logits."""
    llm.reset()
    llm.eval(prompt)
    new: list[int] = []
    for _ in range(n):
        new.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(new[-1:])
    return new


@pytest.mark.parametrize("framing", FRAMINGS, ids=lambda f: f"bos={f[0]}-eos={f[1]}")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_runs_as_llama_cpp_runs_it(
    llama_cpp: Any,
    vocabularies: dict[str, Tokenizer],
    tmp_path: Path,
    family: str,
    framing: tuple[bool, bool],
) -> None:
    path = family_file(vocabularies, family, framing, tmp_path)
    meta = read_gguf(path).metadata
    assert (meta["tokenizer.ggml.add_bos_token"], meta["tokenizer.ggml.add_eos_token"]) == framing
    model, tok = api.load_gguf(path)
    model.eval()
    assert (tok.add_bos, tok.add_eos) == framing
    llm = open_exact(llama_cpp, path)
    try:
        assert (llm._model.add_bos_token(), llm._model.add_eos_token()) == framing
        ids = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
        assert tok.encode_prompt(PROMPT) == ids
        assert (ids[0] == tok.bos_id, ids[-1] == tok.eos_id) == framing
        theirs = greedy_ids(llm, ids, N_NEW)
        # the other BOS decision: llama.cpp's next-token logits move far past 1e-5
        other = tok.encode(PROMPT, bos=not framing[0], eos=framing[1])
        moved = np.abs(logits_of(llm, ids)[-1] - logits_of(llm, other)[-1]).max()
    finally:
        llm.close()
    ours = generate(model, torch.tensor(ids), N_NEW, GREEDY)[len(ids) :].tolist()
    assert ours == theirs
    text = "".join(api.generate_text(model, tok, PROMPT, max_tokens=N_NEW, params=GREEDY))
    assert text == streamed(tok, ids, theirs)
    assert moved > 1e-2, moved


def streamed(tok: Tokenizer, prompt: list[int], new: list[int]) -> str:
    """The text a stream shows for ``new`` after ``prompt``, up to EOS: a random model's stray
    byte tokens are U+FFFD, those at its end too (held back while a character might still be
    arriving, given when the stream ends)."""
    new = new[: new.index(tok.eos_id)] if tok.eos_id in new else new
    return tok.decode(prompt + new)[len(tok.decode(prompt)) :]


@pytest.mark.parametrize("add_bos", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_chat_prompt_runs_as_llama_cpp_runs_it(
    llama_cpp: Any, vocabularies: dict[str, Tokenizer], tmp_path: Path, family: str, add_bos: bool
) -> None:
    """A chat's rendered prompt, its control tokens parsed, framed as the file says: llama.cpp's
    ``tokenize(add_bos=True, special=True)`` of the same text, and its greedy reply."""
    path = family_file(vocabularies, family, (add_bos, False), tmp_path)
    model, tok = api.load_gguf(path)
    template = chat_template_for("chatml", None, bos_token="", eos_token="")
    rendered = template.render([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    llm = open_exact(llama_cpp, path)
    try:
        ids = llm.tokenize(rendered.encode(), add_bos=True, special=True)
        theirs = greedy_ids(llm, ids, N_NEW)
    finally:
        llm.close()
    assert prompt_ids(tok, rendered) == ids and (ids[0] == tok.bos_id) == add_bos
    reply = "".join(api.chat(model, tok, template, PROMPT, max_tokens=N_NEW, params=GREEDY))
    assert reply == streamed(tok, ids, theirs)


@pytest.mark.parametrize(
    ("family", "add_bos"), [("llama", True), ("llama", False), ("qwen3", False)]
)
def test_the_trainers_sample_is_llama_cpps_greedy_continuation(
    llama_cpp: Any, vocabularies: dict[str, Tokenizer], tmp_path: Path, family: str, add_bos: bool
) -> None:
    """``Trainer.sample`` prompts as the file says: BOS first only where the file adds one."""
    path = family_file(vocabularies, family, (add_bos, False), tmp_path)
    model, tok = api.load_gguf(path)
    llm = open_exact(llama_cpp, path)
    try:
        ids = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
        theirs = greedy_ids(llm, ids, N_NEW)
    finally:
        llm.close()
    overrides = [f'output.dir="{tmp_path / "run"}"', "train.device=cpu", "train.compile=false"]
    overrides += [f'train.sample_prompt="{PROMPT}"', f"train.sample_tokens={N_NEW}"]
    overrides += ["train.sample_temperature=0", "train.sample_seen_tokens_only=false"]
    cfg = load_config("tiny", overrides)
    sample = Trainer(model, cfg, tokenizer=tok, progress=False).sample()
    assert sample == tok.decode(ids + theirs)


@pytest.mark.parametrize("add_bos", [True, False])
def test_perplexity_frames_its_chunks_as_llama_perplexity(
    llama_cpp: Any, vocabularies: dict[str, Tokenizer], tmp_path: Path, add_bos: bool
) -> None:
    """llama-perplexity tokenizes the text with ``add_special`` and puts BOS first in each
    chunk only where the file adds BOS; its number from llama.cpp's logits is ours."""
    path = family_file(vocabularies, "qwen2", (add_bos, False), tmp_path)
    model, tok = api.load_gguf(path)
    text, n_ctx = TEXT[:1200], 32
    llm = open_exact(llama_cpp, path)
    try:
        tokens = llm.tokenize(text.encode(), add_bos=True, special=False)
        chunks = [tokens[i : i + n_ctx] for i in range(0, len(tokens) - n_ctx + 1, n_ctx)]
        if add_bos:
            chunks = [[tok.bos_id, *chunk[1:]] for chunk in chunks]
        nll = [_second_half_nll(logits_of(llm, chunk), chunk) for chunk in chunks]
    finally:
        llm.close()
    assert (tokens[0] == tok.bos_id) == add_bos and len(chunks) >= 3
    theirs = math.exp(sum(nll) / (len(chunks) * (n_ctx - 1 - n_ctx // 2)))
    file = tmp_path / "text.txt"
    file.write_text(text, encoding="utf-8")
    ours = api.perplexity(model, tok, file, n_ctx=n_ctx)
    assert ours.n_tokens == len(tokens) and ours.n_chunks == len(chunks)
    assert ours.perplexity == pytest.approx(theirs, rel=1e-5)


def _second_half_nll(logits: np.ndarray, chunk: list[int]) -> float:
    """llama-perplexity's summed negative log-likelihood of a chunk's second half."""
    rows = logits[len(chunk) // 2 : len(chunk) - 1]
    targets = chunk[len(chunk) // 2 + 1 :]
    top = rows.max(axis=1)
    log_z = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
    return float((log_z - rows[np.arange(len(targets)), targets]).sum())
