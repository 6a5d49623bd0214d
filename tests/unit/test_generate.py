"""Decoding (``llamatrain.generate``): stop tokens act per row of a batch."""

from __future__ import annotations

import pytest
import torch

from llamatrain import Llama, ModelConfig
from llamatrain.chat_template import chat_template_for
from llamatrain.errors import ConfigError
from llamatrain.generate import Conversation, chat, generate, generate_text, reply_stops
from llamatrain.sampling import SamplingParams

SMALL = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)
GREEDY = SamplingParams(temperature=0)
BUDGET = 12


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(ModelConfig(**SMALL)).double()


def early_stop(model: Llama, early: torch.Tensor, late: torch.Tensor) -> int:
    """A token ``early`` generates (greedy, alone) within its first few steps and ``late``
    never generates within the budget: stopping on it ends one row early, not the other."""
    first = generate(model, early, BUDGET, GREEDY)[len(early) :].tolist()
    other = set(generate(model, late, BUDGET, GREEDY)[len(late) :].tolist())
    token = next(t for t in first[1:4] if t not in other)  # in mid-stream, not at its start
    assert first.index(token) < BUDGET - 1
    return token


@pytest.mark.parametrize("early_row", [0, 1])
def test_a_row_that_stops_does_not_stop_the_batch(model: Llama, early_row: int) -> None:
    """Each row of a batch is what its prompt gives alone (greedy, same seed): a row stops at
    its own stop token and is padded with it, the other row runs to the token budget."""
    prompts = [torch.tensor([3, 14, 15, 9]), torch.tensor([50, 8, 21, 37])]
    early, late = prompts[early_row], prompts[1 - early_row]
    stop = frozenset({early_stop(model, early, late)})
    batch = generate(model, torch.stack(prompts), BUDGET, GREEDY, seed=5, stop_tokens=stop)
    assert batch.shape == (2, 4 + BUDGET)  # the late row used its whole budget
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt, BUDGET, GREEDY, seed=5, stop_tokens=stop)
        assert torch.equal(batch[row, : len(alone)], alone)
        assert (batch[row, len(alone) :] == alone[-1]).all()  # padding: the stop token
    alone_early = generate(model, early, BUDGET, GREEDY, seed=5, stop_tokens=stop)
    assert len(alone_early) < 4 + BUDGET and alone_early[-1].item() in stop


def test_the_batch_ends_when_every_row_has_stopped(model: Llama) -> None:
    prompts = torch.tensor([[3, 14, 15, 9], [3, 14, 15, 9]])
    first = generate(model, prompts[0], BUDGET, GREEDY)[4:].tolist()
    stop = frozenset({first[2]})
    out = generate(model, prompts, BUDGET, GREEDY, stop_tokens=stop)
    assert out.shape == (2, 4 + first.index(first[2]) + 1)


class Bytes:
    """A tokenizer of one id per byte (3 + byte), BOS 1 and EOS 2, control tokens unparsed:
    enough for the prompt paths of generate_text and chat."""

    bos_id, eos_id, add_eos, vocab_size = 1, 2, False, 259

    def __init__(self, add_bos: bool = True) -> None:
        self.add_bos = add_bos

    def encode(self, text: str, bos: bool = False, eos: bool = False, special: bool = False):
        return [self.bos_id] * bos + [3 + b for b in text.encode()] + [self.eos_id] * eos

    def encode_prompt(self, text: str, special: bool = True):
        return self.encode(text, self.add_bos, self.add_eos, special)

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode(errors="replace")


class MarkerToken(Bytes):
    """Bytes, with chatml's end-of-turn marker as one control token (id 300) when parsed."""

    def encode(self, text: str, bos: bool = False, eos: bool = False, special: bool = False):
        if special and text == "<|im_end|>":
            return [300]
        return super().encode(text, bos, eos, special)


def test_a_reply_stops_at_eos_and_at_a_one_token_end_of_turn_marker() -> None:
    """chat's stop tokens (public for the notebooks' llama.cpp comparisons): EOS always; the
    end-of-turn marker only where the vocabulary spells it as one token (else chat cuts the
    text at it instead)."""
    template = chat_template_for("chatml", None, bos_token="", eos_token="")
    assert reply_stops(MarkerToken(), template) == {Bytes.eos_id, 300}
    assert reply_stops(Bytes(), template) == {Bytes.eos_id}  # "<|im_end|>" spelled in bytes


@pytest.fixture(scope="module")
def byte_model() -> Llama:
    torch.manual_seed(0)
    return Llama(ModelConfig(**{**SMALL, "vocab_size": Bytes.vocab_size}))


def test_a_prompt_longer_than_the_context_is_refused_before_anything_runs(byte_model) -> None:
    """llama-cli refuses a prompt past its context ("prompt is too long"): so do
    generate_text and chat, when called (not at the stream's first step), in one line."""
    template = chat_template_for("chatml", None, bos_token="", eos_token="")
    long = "x" * 130_000
    calls = [
        lambda: generate_text(byte_model, Bytes(), long),
        lambda: chat(byte_model, Bytes(), template, long),
        lambda: chat(byte_model, Bytes(), template, [{"role": "user", "content": long}]),
    ]
    for call in calls:
        with pytest.raises(ConfigError, match=r"the prompt is 130,0\d\d tokens, longer than "
                           r"the model's context of 64 \(llama.context_length\)"):  # fmt: skip
            call()
    conversation = Conversation(byte_model, Bytes(), template, max_tokens=4)
    with pytest.raises(ConfigError, match="/reset starts the conversation over"):
        list(conversation.say(long))
    assert conversation.turns == []  # the refused turn is not kept


def test_a_prompt_that_fits_may_generate_past_the_context_with_a_warning(byte_model) -> None:
    prompt = "y" * 60  # 61 tokens with BOS: within 64, and 8 more run past it
    params = SamplingParams(temperature=0)
    with pytest.warns(UserWarning, match="generating 69 tokens, past the 64 the model was"):
        "".join(generate_text(byte_model, Bytes(), prompt, max_tokens=8, params=params))


def test_an_empty_prompt_is_refused_where_the_file_puts_no_bos_first(byte_model) -> None:
    """llama.cpp runs an empty prompt from BOS where the file adds BOS and refuses it ("input
    is empty") where it does not: so does generate_text, in one line, and generate (the
    trainer's samples) for a prompt of no tokens."""
    greedy = SamplingParams(temperature=0)
    assert len(list(generate_text(byte_model, Bytes(), "", max_tokens=2, params=greedy))) <= 2
    calls = [
        lambda: generate_text(byte_model, Bytes(add_bos=False), ""),
        lambda: generate(byte_model, torch.tensor([], dtype=torch.long), 2),
    ]
    refusal = r"^the prompt is empty and the model puts no BOS before one \(tokenizer.ggml."
    for call in calls:
        with pytest.raises(ConfigError, match=refusal + r"add_bos_token = false\)[^\n]*$"):
            call()


def test_decoding_under_bf16_autocast_reads_the_cache_in_the_steps_dtype() -> None:
    """Under bf16 autocast (a QLoRA run's default on AMX CPUs, and its GRPO rollouts) the
    queries are bf16 while the KV cache keeps the model's float32: the cache hands its keys
    back in the step's dtype (float32 holds bf16 values exactly), so decoding runs, and the
    cached decode's greedy tokens are those of whole forwards under the same autocast."""
    torch.manual_seed(0)
    model = Llama(ModelConfig(**SMALL)).eval()
    prompt = torch.randint(0, SMALL["vocab_size"], (2, 5))
    greedy = SamplingParams(temperature=0.0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, prompt, 4, greedy, seed=0)
        whole = prompt
        for _ in range(4):
            logits = model(whole)[:, -1].float()
            whole = torch.cat([whole, logits.argmax(-1, keepdim=True)], dim=1)
    assert out.shape == (2, 9)
    assert torch.equal(out[:, :6], whole[:, :6])  # the prompt pass: the same bf16 products


def test_bytes_of_a_character_that_never_completes_are_shown_not_dropped(byte_model) -> None:
    """A reply of stray bytes (a small model's: byte tokens that form no UTF-8 character) ends
    as the replacement characters the tokenizer decodes them to, not as an empty reply."""
    lead = torch.zeros(Bytes.vocab_size, dtype=torch.bool)
    lead[3 + 0xED] = True  # the first byte of a three-byte character, again and again
    pieces = generate_text(byte_model, Bytes(), "hi", max_tokens=3, params=GREEDY, allowed=lead)
    assert "".join(pieces) == Bytes().decode([3 + 0xED] * 3) == "\ufffd" * 3
