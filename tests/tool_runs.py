"""A tool-using GRPO run's files and draws, for any test module: ``from tool_runs import …``.

The base is a tiny random llama over llama.cpp's Qwen2 vocabulary with Qwen 2.5's chat template
in its metadata (the template renders ``tools``), exported f32; the prompts are message rows
asking for a product, of pairwise different token lengths (every decode batch ragged); the
tool is a file's ``multiply``, the reward whether the conversation got a tool result back.

A random model never writes a call, so the first turn of each completion is scripted
(:func:`scripted_then_sampled`): a row "draws" ``REPLIES[seed % 2]`` (a good call, a call to a
tool that does not exist; ``seed`` its sampler's, which the rollout makes of its index in the
step), then samples for real from its own generator, which has drawn at every step all along —
so a row's draws stay its own in any batch, on any number of ranks, and a resumed step draws
what the uninterrupted one did, as a real rollout's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from llamatrain import Llama, ModelConfig, api
from llamatrain.decoding import RowDecoder
from llamatrain.tokenizer import Tokenizer

TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2.5.jinja"
TOOLS = '''
def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b
'''
REWARDS = """
def got_a_result(prompts, completions, completion_ids, **_):
    return [
        float(any(m["role"] == "tool" and "error" not in m["content"] for m in c))
        for c in completions
    ]
"""
REPLIES = [
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "divide", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>',
]
N_CTX = 352
"""The prompt with the tool's schema (215-235 tokens) and a completion of 96."""


def tool_run_files(
    folder: Path, tokenizer: Tokenizer, prompts: int, base: Path | None = None
) -> dict[str, Path]:
    """The base GGUF (``base``, or the random Qwen one), ``prompts`` prompt rows, the tool
    file and the reward file in ``folder``."""
    if base is None:
        shape = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=N_CTX)
        torch.manual_seed(0)
        model = Llama(ModelConfig(vocab_size=tokenizer.vocab_size, **shape))
        template = {"tokenizer.chat_template": TEMPLATE.read_text()}
        base = api.export_gguf(model, tokenizer, folder / "base.gguf", inherited=template)
    rows = [
        {"prompt": [{"role": "user", "content": "What is 6 times 7?" + " Now." * k}]}
        for k in range(prompts)
    ]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tools.py").write_text(TOOLS)
    (folder / "rewards.py").write_text(REWARDS)
    return {name: folder / name for name in ("prompts.jsonl", "tools.py", "rewards.py")} | {
        "base": base
    }


def tool_overrides(files: dict[str, Path], run_dir: Path, cache: Path) -> list[str]:
    """A LoRA GRPO run with the tool, G = 2, 96 completion tokens, saved every step."""
    return [
        f'model.init_from="{files["base"]}"',
        f'data.path="{files["prompts.jsonl"]}"',
        'data.format="jsonl"',
        f"data.n_ctx={N_CTX}",
        f'data.cache_dir="{cache}"',
        f'output.dir="{run_dir}"',
        'train.objective="grpo"',
        f'train.rewards=["{files["rewards.py"]}:got_a_result"]',
        f'train.tools=["{files["tools.py"]}:multiply"]',
        "train.num_generations=2",
        "train.max_completion_length=96",
        "train.save_every=1",
        "train.keep_checkpoints=0",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.log_every=1",
        'train.device="cpu"',
        "data.val_fraction=0.0",
        "lora.rank=4",
        "lora.alpha=8",
        "optim.lr=2e-2",
        "optim.warmup_steps=0",
    ]


def scripted_then_sampled(replies: Sequence[Sequence[int]]) -> Callable:
    """A ``RowDecoder.sample`` whose row draws ``replies[seed % len(replies)]`` token by token
    (``seed`` its generator's), then what the decoder samples (drawn for every row at every
    step, scripted or not)."""
    sample = RowDecoder.sample

    def scripted(self: RowDecoder, rows: Sequence[int]) -> list[int]:
        drawn = self.__dict__.setdefault("scripted", {})
        tokens = []
        for row, token in zip(rows, sample(self, rows), strict=True):
            k = drawn[row] = drawn.get(row, -1) + 1
            script = replies[self.generator[row].initial_seed() % len(replies)]
            tokens.append(script[k] if k < len(script) else token)
        return tokens

    return scripted


def reply_tokens(tokenizer: Tokenizer) -> list[list[int]]:
    """:data:`REPLIES` as tokens."""
    return [tokenizer.encode(reply, special=True) for reply in REPLIES]


def install(replies: Sequence[Sequence[int]]) -> None:
    """Script every rollout of this process (a DDP rank's: ``test_distributed.main``'s
    ``setup`` file calls this)."""
    RowDecoder.sample = scripted_then_sampled(replies)
