"""GRPO with tools end to end: ``llamatrain.fit`` from a GGUF base whose chat template renders
tools (a tiny random llama over llama.cpp's Qwen2 vocabulary, the Qwen 2.5 template in its
metadata), message prompts and ``train.tools`` naming a file's function.

The model's draws are scripted (as in ``test_grpo_tool_turns``): each completion calls the tool
(a good call in one row of a group, a call to an unknown tool in the other) and then answers,
so the run goes through everything a tool-using run does — the prompts rendered with the
tools, the tool rounds, their tokens masked, the rewards of the conversations, the tool
metrics in metrics.jsonl, the completions table, the tool panels of the plot and the adapter
exported as every LoRA run's.

Also (slow): a tool run cut after one step and resumed is the uninterrupted run, bit for bit —
its first turns scripted, the rest sampled for real from each row's own generator
(``tool_runs``), so the resumed step redraws the same tokens, runs the same calls and trains
on the same masks.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from llama_cpp_files import vocab_dir as vocab_dir
from tool_functions import multiply
from tool_runs import (
    N_CTX,
    TEMPLATE,
    TOOLS,
    reply_tokens,
    scripted_then_sampled,
    tool_overrides,
    tool_run_files,
)

from llamatrain import Llama, ModelConfig, api
from llamatrain.decoding import RowDecoder
from llamatrain.gguf.adapter import read_lora_adapter
from llamatrain.gguf.llama import read_tokenizer
from llamatrain.plot import metrics_figure, read_metrics, read_records

REWARDS = """
def right(prompts, completions, completion_ids, answer, **_):
    return [float(c[-1]["content"] == a) for c, a in zip(completions, answer)]
"""
REPLIES = [
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>'
    "42<|im_end|>",
    '<tool_call>\n{"name": "divide", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>'
    "13<|im_end|>",
]


@pytest.mark.slow
@pytest.mark.parametrize("given", ["config", "python"])
def test_a_tool_using_grpo_run_trains_logs_and_exports(tmp_path, vocab_dir, monkeypatch, given):
    """``given``: the tool named in train.tools (a file's function), or passed to ``fit`` as
    a Python function (``tools=[multiply]``, TRL's ``tools=``): the same run."""
    tokenizer = read_tokenizer(vocab_dir / "ggml-vocab-qwen2.gguf")
    torch.manual_seed(0)
    shape = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=512)
    model = Llama(ModelConfig(vocab_size=tokenizer.vocab_size, **shape))
    template = {"tokenizer.chat_template": TEMPLATE.read_text()}
    base = api.export_gguf(model, tokenizer, tmp_path / "base.gguf", inherited=template)
    (tmp_path / "tools.py").write_text(TOOLS)
    (tmp_path / "rewards.py").write_text(REWARDS)
    prompts = tmp_path / "prompts.jsonl"
    row = {"prompt": [{"role": "user", "content": "What is 6 times 7?"}], "answer": "42"}
    prompts.write_text((json.dumps(row) + "\n") * 4)
    replies = [tokenizer.encode(r, special=True) for r in REPLIES]

    def scripted(self, rows):  # a decoder's row r draws REPLIES[r % 2] token by token
        drawn = self.__dict__.setdefault("drawn", {})
        for r in rows:
            drawn[r] = drawn.get(r, -1) + 1
        return [replies[r % 2][drawn[r]] for r in rows]

    monkeypatch.setattr(RowDecoder, "sample", scripted)
    run = tmp_path / "run"
    api.fit(
        "tiny",
        overrides=[
            f'model.init_from="{base}"',
            f'data.path="{prompts}"',
            'data.format="jsonl"',
            "data.n_ctx=512",
            "data.val_fraction=0.0",
            f'data.cache_dir="{tmp_path / "cache"}"',
            f'output.dir="{run}"',
            'train.objective="grpo"',
            f'train.rewards=["{tmp_path / "rewards.py"}:right"]',
            *([f'train.tools=["{tmp_path / "tools.py"}:multiply"]'] if given == "config" else []),
            "train.num_generations=2",
            "train.max_completion_length=80",
            "train.n_batch=1024",
            "train.steps=2",
            "train.eval_every=0",
            "train.sample_tokens=0",
            "train.log_every=1",
            "lora.rank=4",
            "lora.alpha=8",
        ],
        progress=False,
        tools=[multiply] if given == "python" else None,
    )
    train, _ = read_metrics(run)
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert record["tools/call_frequency"] == 1.0
        assert record["tools/failures/unknown_tool"] == 0.5
        assert record["reward"] == 0.5 and record["rewards/right/mean"] == 0.5
    table = read_records(run / "completions.jsonl")
    assert [r["tools"]["failures"] for r in table[:2]] == [{}, {"unknown_tool": 1}]
    assert "<tool_response>\n42\n</tool_response>" in table[0]["completion"]
    titles = {ax.get_title() for ax in metrics_figure(*read_metrics(run), "run").axes}
    assert {"Tool calls", "Failed calls by kind"} <= titles
    assert (run / "adapter-f32.gguf").exists()


@pytest.mark.slow
def test_a_resumed_tool_run_is_the_uninterrupted_run(tmp_path, vocab_dir, cache_dir, monkeypatch):
    """Two steps, and the same cut after one and resumed: the second step's rollout (its
    prompts, draws on the first step's weights, tool rounds, masks) and update (with the
    first's optimizer state) are the uninterrupted run's, bit for bit — a resume is exact with
    deterministic tools, with nothing of the tools stored."""
    tokenizer = read_tokenizer(vocab_dir / "ggml-vocab-qwen2.gguf")
    files = tool_run_files(tmp_path, tokenizer, prompts=4)
    monkeypatch.setattr(RowDecoder, "sample", scripted_then_sampled(reply_tokens(tokenizer)))

    def fit(run: str, steps: int, **kwargs):
        items = tool_overrides(files, tmp_path / run, cache_dir)
        items += [f"train.steps={steps}", f"train.n_batch={4 * N_CTX}"]  # 2 prompts a step
        return api.fit("tiny", overrides=items, progress=False, **kwargs)

    whole = fit("whole", 2)
    fit("cut", 1)
    resumed = fit("cut", 2, resume="latest")
    records = [read_records(tmp_path / run / "metrics.jsonl") for run in ("whole", "cut")]
    last = [[r for r in rs if r.get("step") == 2 and "reward" in r] for rs in records]
    assert len(last[0]) == len(last[1]) == 1
    numbers = {k for k, v in last[0][0].items() if isinstance(v, float) and not k.endswith("_s")}
    assert {"loss", "reward", "tools/call_frequency", "tools/failures/unknown_tool"} <= numbers
    assert {k: last[1][0][k] for k in numbers} == {k: last[0][0][k] for k in numbers}
    tables = [read_records(tmp_path / run / "completions.jsonl") for run in ("whole", "cut")]
    assert tables[0] == tables[1] and len(tables[0]) == 2 * 4
    assert {r["tools"]["calls"] for r in tables[0]} == {1}
    assert all("<tool_response>" in r["completion"] for r in tables[0])  # answered
    assert {r["reward"] for r in tables[0]} == {0.0, 1.0} and last[0][0]["grad_norm"] > 0
    a, b = (read_lora_adapter(run.adapter_path).tensors for run in (whole, resumed))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(torch.as_tensor(a[name]), torch.as_tensor(b[name])), name


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 4], ids=["full", "lora-merged"])
def test_a_tool_run_logs_to_a_tracker_and_exports_a_model_llama_cpp_runs(
    tmp_path, vocab_dir, cache_dir, monkeypatch, rank
):
    """Tools with what every GRPO run has: full finetuning (``lora.rank=0``) and a LoRA run's
    merged export, the tool metrics in TensorBoard as in metrics.jsonl, and the exported
    model's logits in llama.cpp (llama-cpp-python) the trained model's — the tool rounds
    change what is trained on, not how a run is logged or written."""
    import llama_cpp
    from llama_cpp_runs import cpp_logits
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tokenizer = read_tokenizer(vocab_dir / "ggml-vocab-qwen2.gguf")
    files = tool_run_files(tmp_path, tokenizer, prompts=2)
    monkeypatch.setattr(RowDecoder, "sample", scripted_then_sampled(reply_tokens(tokenizer)))
    overrides = tool_overrides(files, tmp_path / "run", cache_dir) + [
        f"lora.rank={rank}", "train.steps=2", f"train.n_batch={4 * N_CTX}", "train.save_every=0",
        'output.loggers=["tensorboard"]', "output.export=true", 'output.export_type="f32"',
    ]  # fmt: skip
    result = api.fit("tiny", overrides=overrides, progress=False)

    train, _ = read_metrics(result.run_dir)
    events = EventAccumulator(str(result.run_dir / "tensorboard"))
    events.Reload()
    for name in ("tools/call_frequency", "tools/failures/unknown_tool", "reward"):
        logged = {e.step: e.value for e in events.Scalars(f"train/{name}")}
        assert logged == pytest.approx({r["step"]: r[name] for r in train}), name
    assert {r["tools/call_frequency"] for r in train} == {1.0}
    assert train[-1]["grad_norm"] > 0

    ids = tokenizer.encode("What is 6 times 7? <tool_call>", special=True)
    with torch.no_grad():
        ours = result.model.eval()(torch.tensor([ids]))[0].double().numpy()
    theirs = cpp_logits(llama_cpp, result.export_path, ids, n_ctx=64)
    scale = np.abs(ours).max()
    assert np.abs(ours - theirs).max() < 1e-4 * scale  # f32 export: float summation order only
    if rank:  # the merge moved the base: the export is the trained model, not the base
        base = cpp_logits(llama_cpp, files["base"], ids, n_ctx=64)
        assert np.abs(base - theirs).max() > 100 * 1e-4 * scale
