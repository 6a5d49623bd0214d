"""GRPO teaches a model to use a tool, and only a tool that answers teaches it (issue 47's
learning proof with controls).

The task: "What is 764 * 303?" — products of two 3-digit numbers, 5-6 digits, which a tiny llama
(2 layers, width 64) cannot work out in its head; the reward is 1 when the conversation's last
reply is the product, else 0. A calculator, ``multiply(a, b)``, is offered through
``train.tools`` with Qwen 2.5's chat template (its ``<tools>`` block, ``<tool_call>`` JSON
calls and ``<tool_response>`` turns; its long tool preamble cut short to keep the prompts ~140
tokens).

The base is a random tiny llama over a small sentencepiece vocabulary trained here (the
template's markers its own tokens), warmed up with plain next-token loss on what the assistant
writes (~1.5 min): first only conversations that call ``multiply`` with the question's numbers,
read the tool's answer and repeat it (the call format and the copying), then, at a lower rate,
a mix in which 70% reply directly with the product — a guess it cannot get right — and 30%
call (the habit). That warm-up is the fair stand-in for an instruct model, which knows its
template's call format before any RL; it teaches the format, not *when* to call: the base's
greedy reply is the direct guess, right on none of the held-out questions, while its sampled
replies call 40% of the time and are right 38% of the time. Only the reward can make calling
the rule.

The control, on the same base, prompts, seeds and settings: *offline* names a ``multiply`` with
the same name, signature and docstring (so the same prompts and schema) that raises "the
calculator is offline"; the model may still call it and reads its error. So what the run learns
from the reward is using a tool that answers, not the format, nor GRPO by itself. Held out: the
last 40 of 400 prompt rows, new number pairs, answered greedily with each run's own tool.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from llamatrain import Llama, ModelConfig, api
from llamatrain.chat_template import ChatTemplate, prompt_ids
from llamatrain.objectives.grpo.answers import answer_tokens
from llamatrain.objectives.grpo.rollout import sample_completions, stop_ids
from llamatrain.objectives.grpo.tool_turns import ToolSettings, ToolTurns
from llamatrain.plot import read_records
from llamatrain.sampling import SamplingParams
from llamatrain.tokenizer import Tokenizer
from llamatrain.tokenizer.sentencepiece_train import train_spm
from llamatrain.tools.loading import load as load_tools
from llamatrain.tools.schema import json_schema

QWEN = Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen2.5.jinja"
SHORTER = {  # Qwen 2.5's tool preamble, in the template's source, and what stands for it here
    (
        r"\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        r"You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    ): r"\n<tools>",
    (
        r"\n</tools>\n\nFor each function call, return a json object with function name and "
        r"arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        r"<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    ): r"\n</tools><|im_end|>\n",
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.": "Be helpful.",
}


def short_qwen_template() -> str:
    """Qwen 2.5's chat template, its tool preamble cut to the <tools> block (the same calls,
    tool responses and turns; a third of the prompt's tokens, so a third of the compute)."""
    source = QWEN.read_text()
    for long, short in SHORTER.items():
        assert long in source, long
        source = source.replace(long, short)
    return source


TEMPLATE = short_qwen_template()
DOC = '''"""Multiply two whole numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """'''
TOOLS = f"""
def multiply(a: int, b: int) -> int:
    {DOC}
    return a * b
"""
OFFLINE_TOOLS = f"""
def multiply(a: int, b: int) -> int:
    {DOC}
    raise RuntimeError("the calculator is offline")
"""
REWARDS = """
def right(prompts, completions, completion_ids, answer, **_):
    return [float(c[-1]["content"].strip() == a) for c, a in zip(completions, answer)]
"""
MARKERS = (
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
)
"""The template's markers, each one token of the vocabulary (as in Qwen's)."""

N_PROMPTS, N_HELD_OUT = 400, 40
CALL_STEPS, HABIT_STEPS, CALL_SHARE = 900, 100, 0.3
"""The warm-up's steps of calls only, then of mostly direct replies, and their share of calls."""


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


SCHEMAS = [json_schema(multiply)]


def question(a: int, b: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {a} * {b}?"}]


def call_text(a: int, b: int) -> str:
    """A reply calling the tool, as the Qwen 2.5 template writes one."""
    arguments = json.dumps({"a": a, "b": b})
    return f'<tool_call>\n{{"name": "multiply", "arguments": {arguments}}}\n</tool_call><|im_end|>'


def pairs(rng: random.Random, n: int) -> list[tuple[int, int]]:
    return [(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(n)]


def conversation_ids(
    template: ChatTemplate, tokenizer: Tokenizer, a: int, b: int, calls: bool
) -> tuple[list[int], list[int]]:
    """A warm-up conversation as a rollout lays it out: the prompt's ids, then what follows
    (the call, the tool's answer as the rollout appends it, the reply; or the direct reply),
    and the targets: the assistant's tokens only."""
    prompt = question(a, b)
    ids = prompt_ids(tokenizer, template.render(prompt, add_generation_prompt=True, tools=SCHEMAS))
    targets = [-100] * len(ids)

    def wrote(text: str) -> None:
        new = written(tokenizer, text)
        ids.extend(new)
        targets.extend(new)

    if calls:
        wrote(call_text(a, b))
        before = [*prompt, {"role": "assistant", "content": "", "tool_calls": [_call(a, b)]}]
        result = [{"role": "tool", "name": "multiply", "content": str(a * b)}]
        answer = answer_tokens(template, tokenizer, before, result, SCHEMAS)
        ids.extend(answer)
        targets.extend([-100] * len(answer))
    wrote(f"{a * b}<|im_end|>")
    return ids, targets


def written(tokenizer: Tokenizer, text: str) -> list[int]:
    """``text`` as the model is taught to write it: without the space piece sentencepiece
    (llama.cpp's add_space_prefix) puts after a marker where it follows <tool_call>, which
    decodes as a space the call format does not allow there (Qwen's byte-level BPE has no such
    space)."""
    opening, space = tokenizer.encode("<tool_call>\n", special=True)[:2]
    ids = tokenizer.encode(text, special=True)
    return [t for i, t in enumerate(ids) if not (t == space and i and ids[i - 1] == opening)]


def _call(a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}


def vocabulary(folder: Path, template: ChatTemplate) -> Tokenizer:
    """A sentencepiece vocabulary trained on warm-up conversations, the markers its own."""
    rng = random.Random(1)
    lines = []
    for a, b in pairs(rng, 300):
        messages = [
            *question(a, b),
            {"role": "assistant", "content": "", "tool_calls": [_call(a, b)]},
        ]
        messages += [{"role": "tool", "name": "multiply", "content": str(a * b)}]
        messages += [{"role": "assistant", "content": str(a * b)}]
        lines.append(template.render(messages, tools=SCHEMAS))
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(lines))
    return train_spm([corpus], 512, user_defined_symbols=MARKERS, num_threads=1)


def warm_started(model: Llama, tokenizer: Tokenizer, template: ChatTemplate) -> Llama:
    """``model`` trained on warm-up conversations (:func:`conversation_ids`): first only
    calls (the format and the copying: CALL_STEPS steps at a high rate), then mostly direct
    replies (CALL_SHARE of calls: the habit of guessing; HABIT_STEPS steps at a low rate, which
    sets the first token's odds without unlearning the copying)."""
    rng = random.Random(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-3)
    for step in range(CALL_STEPS + HABIT_STEPS):
        share = 1.0 if step < CALL_STEPS else CALL_SHARE
        if step == CALL_STEPS:
            optimizer.param_groups[0]["lr"] = 1e-3
        rows = [
            conversation_ids(template, tokenizer, a, b, rng.random() < share)
            for a, b in pairs(rng, 16)
        ]
        _, loss = model(*padded(rows, tokenizer.eos_id))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


def padded(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of (ids, targets) as next-token inputs and targets, padded at the end."""
    width = max(len(ids) for ids, _ in rows)
    inputs = torch.full((len(rows), width), pad)
    targets = torch.full((len(rows), width), -100)
    for r, (ids, wanted) in enumerate(rows):
        inputs[r, : len(ids)] = torch.tensor(ids)
        targets[r, : len(ids) - 1] = torch.tensor(wanted[1:])
    return inputs, targets


def held_out_rows() -> list[tuple[int, int]]:
    return pairs(random.Random(0), N_PROMPTS)[-N_HELD_OUT:]


def held_out(
    model: Llama, tokenizer: Tokenizer, template: ChatTemplate, temperature: float = 0.0
) -> dict:
    """The held-out questions answered with the working calculator (one round of calls, as the
    runs allow) at ``temperature`` (0: greedy, as a GRPO evaluation decodes them): the share
    answered right and the share whose first reply calls."""
    rows = held_out_rows()
    prompts = [question(a, b) for a, b in rows]
    ids = [
        prompt_ids(tokenizer, template.render(p, add_generation_prompt=True, tools=SCHEMAS))
        for p in prompts
    ]
    turns = ToolTurns(
        load_tools([multiply]), ToolSettings(1, 10.0, 4096), template, tokenizer, prompts
    )
    stops = stop_ids(tokenizer, template)
    completions = sample_completions(
        model, ids, 64, SamplingParams(temperature=temperature), stops, lambda i: i, responder=turns
    )
    finals = [
        turns.final_messages(i, c.tokens[c.last_turn :], stops)[-1]["content"].strip()
        for i, c in enumerate(completions)
    ]
    right = sum(f == str(a * b) for f, (a, b) in zip(finals, rows, strict=True))
    return {"right": right / len(rows), "called": float(turns.counts()[:, 0].gt(0).float().mean())}


def prompt_rows() -> list[dict]:
    return [
        {"prompt": question(a, b), "answer": str(a * b)}
        for a, b in pairs(random.Random(0), N_PROMPTS)
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("grpo_tools_learning")
    template = ChatTemplate(TEMPLATE)
    tokenizer = vocabulary(folder, template)
    torch.manual_seed(2)
    shape = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=N_CTX)
    model = warm_started(
        Llama(ModelConfig(vocab_size=tokenizer.vocab_size, **shape)), tokenizer, template
    )
    paths = {"cache": cache_dir}
    for name, text in (("tools", TOOLS), ("offline", OFFLINE_TOOLS), ("rewards", REWARDS)):
        paths[name] = folder / f"{name}.py"
        paths[name].write_text(text)
    paths["prompts"] = folder / "prompts.jsonl"
    paths["prompts"].write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
    inherited = {"tokenizer.chat_template": TEMPLATE}
    paths["base"] = api.export_gguf(model, tokenizer, folder / "base.gguf", inherited=inherited)
    return paths


def overrides(files: dict[str, Path], run_dir: Path, tools: str) -> list[str]:
    """A full finetune of the base with ``files[tools]``'s multiply: 8 prompts x 8 completions
    a step at temperature 1, one round of calls each, the held-out questions answered greedily
    every STEPS // 4 steps."""
    settings = {
        "model.init_from": files["base"],
        "data.path": files["prompts"],
        "data.format": "jsonl",
        "data.cache_dir": files["cache"],
        "data.n_ctx": N_CTX,
        "data.val_fraction": N_HELD_OUT / N_PROMPTS,
        "train.objective": "grpo",
        "train.rewards": [f"{files['rewards']}:right"],
        "train.tools": [f"{files[tools]}:multiply"],
        "train.max_tool_calls": 1,
        "train.num_generations": 8,
        "train.max_completion_length": 64,
        "train.n_batch": 64 * N_CTX,
        "train.n_ubatch": 16 * N_CTX,
        "train.steps": STEPS,
        "train.eval_every": STEPS // 4,
        "train.eval_batches": 0,  # every held-out prompt
        "train.save_every": 0,
        "train.sample_tokens": 0,
        "train.log_every": 1,
        "optim.lr": 5e-4,  # 3e-3 flips the habit in one step and unlearns the copying
        "optim.lr_min": 5e-4,
        "optim.warmup_steps": 0,
        "output.dir": run_dir,
        "output.export": False,
    }
    return [f"{key}={json.dumps(value, default=str)}" for key, value in settings.items()]


N_CTX, STEPS = 256, 20


@pytest.fixture(scope="module")
def curves(files, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The base's held-out replies, greedy and sampled (with the working calculator), and each
    run's held-out greedy accuracy (before training, then every STEPS // 4 steps), its
    rollouts' sampled accuracy and calls per completion at every step."""
    base, tokenizer = api.load_gguf(files["base"])
    template = ChatTemplate(TEMPLATE)
    out: dict[str, Any] = {
        "greedy": held_out(base, tokenizer, template),
        "sampled": held_out(base, tokenizer, template, temperature=1.0),
    }
    for name in ("tools", "offline"):
        run_dir = tmp_path_factory.mktemp(name) / "run"
        api.fit("tiny", overrides=overrides(files, run_dir, name), progress=False)
        records = read_records(run_dir / "metrics.jsonl")
        evaluated = [r["val_rewards/right/mean"] for r in records if "val_reward" in r]
        out[name] = {
            "greedy": [out["greedy"]["right"], *evaluated],
            "sampled": [r["rewards/right/mean"] for r in records if "loss" in r],
            "calls": [r["tools/call_frequency"] for r in records if "loss" in r],
        }
    return out


@pytest.mark.slow
def test_grpo_learns_to_call_the_calculator_and_not_one_that_is_offline(curves):
    """Seeds fixed; 2.4-3.2 min on 2 shared cores (most of it the warm-up).

    The base: greedy, right on 0.0 of the held-out questions and calling on 0.0 of them;
    sampled, calling on 0.40 and right on 0.38 (a call's copying is mostly right). Held-out
    greedy accuracy before training and after steps 5, 10, 15, 20:

    tools    0.0 .80 .80 .80 .80
    offline  0.0 0.0 0.0 0.0 0.0

    the rollouts' sampled accuracy, steps 1-5 and 16-20: tools .30 .38 .53 .63 .66 -> .39 .48
    .59 .69 .92 (calls per completion .39 -> 1.0); offline 0.0 throughout (calls .39 -> .45).
    Greedy accuracy holds at 0.8 (32 of 40) from step 5 on while every reply calls: what is
    left is the warm-up's copying of numbers into the call and out of the result. 0.8 is issue
    47's bar."""
    tools, offline = curves["tools"], curves["offline"]
    assert curves["greedy"]["right"] <= 0.05 and curves["greedy"]["called"] <= 0.1
    assert curves["sampled"]["called"] >= 0.2  # the reward has calls to reinforce
    assert tools["greedy"][-1] >= 0.8
    assert sum(tools["sampled"][-5:]) > sum(tools["sampled"][:5])
    assert min(tools["calls"][-5:]) >= 0.9  # calling became the rule
    assert max(offline["greedy"]) <= 0.1
    assert max(offline["sampled"]) <= 0.05
