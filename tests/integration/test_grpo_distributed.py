"""GRPO on two DDP ranks (torchrun, gloo, one thread each) is the same optimisation as one process.

Each rank samples its half of a step's prompts (whole groups of G completions), scores them, and
the ranks' rewards are gathered so every advantage is over its whole group (and, with
``scale_rewards = "batch"``, over the whole step). The one-process run of the same config must
give the same step: its metrics (rewards, lengths, loss, clip ratios, KL), its completions table
(written by rank 0 alone, every rank's rows), its held-out reward and its weights after each step.

The same completions: each row's sampler is seeded by its index in the step and draws what it
would in any batch, and every prompt here has a token length of its own, so the one process
decodes a step's 16 rows as one ragged batch (left-padded to its longest prompt) and each rank
its 8 (padded to its own longest) — the same rows, the same seeds, the same tokens: padding
moves a row's logits by float32 rounding alone (``test_generate_ragged``), never a draw here.
The micro-batches are one group each (``n_ubatch``), so the ranks' micro-batches are the
one process's: rank r's two are its four in the same order.

Tolerance: 1e-5 relative (1e-6 absolute beside metrics near 0), as ``test_distributed``'s, and
3e-5 on the weights. The per-row arithmetic is the same; the gradients are summed in another
order (each rank's two micro-batches, then DDP's all-reduce of the halves, against four in a
row), and the metrics are nanmeans of the same values: float32 rounding, ~1e-7 (measured on 2
x86 cores: 1.0e-6 on the KL, 3.3e-7 on the loss). AdamW's first update of an element is about
lr x sign(g), so the elements whose gradient is near 0 carry g's rounding into the weights:
measured 4.5e-6 (step 1, one LoRA B) and 1.2e-5 (step 2, the first update of a LoRA A, whose
gradient is 0 while B is), like ``test_preference_distributed``'s LoRA DPO. The same property
makes the weights blind to a gradient's scale, which the logged loss and grad_norm are not: a
wrong normaliser (dapo's token count per rank instead of over all ranks, tried: grad_norm
0.073 against 0.145; grpo's accumulation steps not per rank) moves them by a factor, and a
group split across ranks moves the advantages by far more.

The runs: LoRA with dapo (TRL's default loss), beta = 0.04 (the KL to the adapters-off base),
num_iterations = 2 (the second step trains on the first's rollout again, so it is compared too)
and clip-higher; and (slow) a full finetune with bnpo and scale_rewards = "batch", whose loss
divides by each micro-batch's own tokens as TRL's does. The random base rarely ends a
completion, so the rewards that vary are the length's, in characters (8 tokens make 8 to ~30).
Also (slow): a two-rank run cut after its first step and resumed on two ranks is the
uninterrupted one, bit for bit; and a LoRA run with a tool (``tool_runs``: its first turns
scripted in every process, the rest sampled) is the one-process run under the same tolerance —
its tool rounds, the tool metrics over every rank's calls, the masks that leave the tool's
tokens out, the advantages and the weights.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from llama_cpp_files import vocab_dir as vocab_dir
from random_models import tiny_llama
from test_distributed import torchrun, weights
from tool_runs import N_CTX, reply_tokens, scripted_then_sampled, tool_overrides, tool_run_files

from llamatrain import api
from llamatrain.decoding import RowDecoder
from llamatrain.gguf.llama import read_tokenizer
from llamatrain.plot import read_records

RTOL, ATOL, WEIGHTS_RTOL = 1e-5, 1e-6, 3e-5  # see the module docstring

REWARD_FILE = """
def mentions_answer(prompts, completions, completion_ids, answer, **columns):
    return [float(a in c) for c, a in zip(completions, answer)]
"""

RUNS = {
    "lora_dapo": (
        "lora.rank=4",
        "lora.alpha=8",
        "train.beta=0.04",
        "train.num_iterations=2",
        "train.epsilon_high=0.28",
        "train.steps=2",
    ),
    "full_bnpo": (
        "lora.rank=0",
        'train.loss_type="bnpo"',
        'train.scale_rewards="batch"',
        "optim.lr=1e-3",
        "train.steps=1",
    ),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Path]:
    """The random tiny base, prompts of pairwise different token lengths ("Count: 0 1 2":
    every decode batch ragged), the reward file."""
    folder = tmp_path_factory.mktemp("grpo-ddp")
    model, tokenizer = tiny_llama(cache_dir)
    base = api.export_gguf(model, tokenizer, folder / "base.gguf")
    rows, lengths = [], set()
    for k in range(1, 40):
        prompt = "Count: " + " ".join(str(i) for i in range(k))
        length = len(tokenizer.encode(prompt))
        if length not in lengths:
            lengths.add(length)
            rows.append({"prompt": prompt, "answer": str(k)})
    rows = rows[:16]
    assert len(rows) == 16, "fewer prompts of different lengths than the test needs"
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "my_rewards.py").write_text(REWARD_FILE)
    return {"base": base, "prompts": prompts, "folder": folder, "cache": cache_dir}


def overrides(files: dict[str, Path], run_dir: Path, name: str, *extra: str) -> list[str]:
    """Run ``name`` of RUNS into ``run_dir``: 4 prompts a step, G = 4, one group a
    micro-batch (4 micro-batches; 2 a rank on 2 ranks); 2 of 16 prompts held out."""
    rewards = f'["{files["folder"] / "my_rewards.py"}:mentions_answer", "builtin:length"]'
    return [
        f'data.cache_dir="{files["cache"]}"',
        f'output.dir="{run_dir}"',
        f'model.init_from="{files["base"]}"',
        f'data.path="{files["prompts"]}"',
        'data.format="jsonl"',
        "data.val_fraction=0.125",
        'train.objective="grpo"',
        f"train.rewards={rewards}",
        "train.reward_args={length={target=16, unit='characters'}}",
        "train.num_generations=4",
        "train.max_completion_length=8",
        "train.n_batch=1024",
        "train.n_ubatch=256",
        "train.save_every=1",
        "train.keep_checkpoints=0",
        "train.eval_every=0",
        "train.sample_tokens=0",
        "train.log_every=1",
        'train.device="cpu"',
        "output.export=false",
        "optim.lr=2e-2",
        "optim.warmup_steps=0",
        *RUNS[name],
        *extra,
    ]


def one_and_two_ranks(files: dict[str, Path], root: Path, names: list[str]) -> Path:
    """Each run of ``names`` in one process into ``root/name``, then all of them on two DDP
    ranks in one launch into ``root/name-ddp``."""
    for name in names:
        api.fit("tiny", overrides=overrides(files, root / name, name), progress=False)
    launched = [
        {"overrides": overrides(files, root / f"{name}-ddp", name, 'train.parallel="ddp"')}
        for name in names
    ]
    with torchrun(launched, root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as ranks:
        output, _ = ranks.communicate(timeout=600)
    assert ranks.returncode == 0, output[-4000:]
    return root


def assert_same_run(ours: Path, reference: Path, steps: int, rows: int = 16) -> None:
    """Every step's and the held-out evaluation's numbers (not the speed), the completions
    table (``rows`` a step) and each step's weights within the tolerance."""
    mine, theirs = read_records(ours / "metrics.jsonl"), read_records(reference / "metrics.jsonl")
    for kind in ("reward", "val_reward"):
        a, b = [r for r in mine if kind in r], [r for r in theirs if kind in r]
        assert b and [r["step"] for r in a] == [r["step"] for r in b], kind
        for x, y in zip(a, b, strict=True):
            numbers = {
                k for k, v in y.items() if isinstance(v, float) and not k.endswith(("per_s", "_s"))
            }
            assert kind in numbers and numbers <= set(x), (x, y)
            for key in sorted(numbers):
                assert x[key] == pytest.approx(y[key], rel=RTOL, abs=ATOL), (y["step"], key)
    table, expected = (read_records(run / "completions.jsonl") for run in (ours, reference))
    assert len(table) == len(expected) == steps * rows
    for x, y in zip(table, expected, strict=True):
        assert (x["step"], x["prompt"], x["completion"]) == (
            y["step"],
            y["prompt"],
            y["completion"],
        )
        assert x["rewards"] == y["rewards"]
        assert x["advantage"] == pytest.approx(y["advantage"], rel=RTOL, abs=ATOL)
    for step in range(1, steps + 1):
        ours_w, reference_w = weights(ours, step), weights(reference, step)
        assert ours_w.keys() == reference_w.keys()
        for name, weight in reference_w.items():
            difference = (ours_w[name] - weight).norm() / weight.norm().clamp(min=1e-30)
            assert difference <= WEIGHTS_RTOL, (
                f"step {step}, {name}: relative difference {difference:.2e}"
            )


def test_lora_grpo_under_ddp_trains_as_one_process(files, tmp_path):
    root = one_and_two_ranks(files, tmp_path, ["lora_dapo"])
    assert_same_run(root / "lora_dapo-ddp", root / "lora_dapo", steps=2)


@pytest.mark.slow
def test_full_grpo_with_batch_scaled_rewards_under_ddp_trains_as_one_process(files, tmp_path):
    root = one_and_two_ranks(files, tmp_path, ["full_bnpo"])
    assert_same_run(root / "full_bnpo-ddp", root / "full_bnpo", steps=1)


@pytest.mark.slow
def test_a_grpo_run_under_ddp_resumes_as_it_would_have_gone_on(files, tmp_path):
    """Two steps on two ranks, and the same cut after the first and resumed on two ranks:
    the second step's rollout (its prompts, sampler seeds) and update are the uninterrupted
    run's, bit for bit (the same ranks doing the same arithmetic)."""
    ddp = ('train.parallel="ddp"', "train.steps=2")
    runs = [
        {"overrides": overrides(files, tmp_path / "whole", "full_bnpo", *ddp)},
        {"overrides": overrides(files, tmp_path / "cut", "full_bnpo", *ddp, "train.steps=1")},
        {"overrides": overrides(files, tmp_path / "cut", "full_bnpo", *ddp), "resume": "latest"},
    ]
    with torchrun(runs, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as ranks:
        output, _ = ranks.communicate(timeout=600)
    assert ranks.returncode == 0, output[-4000:]
    tables = [read_records(tmp_path / run / "completions.jsonl") for run in ("whole", "cut")]
    assert tables[0] == tables[1] and len(tables[0]) == 2 * 16
    whole, resumed = weights(tmp_path / "whole", 2), weights(tmp_path / "cut", 2)
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)


@pytest.mark.slow
def test_a_tool_using_grpo_run_under_ddp_trains_as_one_process(
    vocab_dir, cache_dir, tmp_path, monkeypatch
):
    """``tool_runs``' LoRA run with a tool (8 prompts of different lengths a step, G = 2, one
    group a micro-batch), its first turns scripted in every process (each rank runs a setup
    file that installs the draws), on one process and on two DDP ranks: the same tool rounds,
    tool metrics (every rank's calls gathered), masks, advantages and weights."""
    tokenizer = read_tokenizer(vocab_dir / "ggml-vocab-qwen2.gguf")
    files = tool_run_files(tmp_path, tokenizer, prompts=10)
    replies = reply_tokens(tokenizer)
    setup = tmp_path / "draws.py"
    tests = Path(__file__).parents[1]
    setup.write_text(
        f"import sys\nsys.path.insert(0, {str(tests)!r})\n"
        f"import tool_runs\ntool_runs.install({replies!r})\n"
    )

    def items(run: str, *extra: str) -> list[str]:
        sizes = [f"train.n_batch={8 * N_CTX}", f"train.n_ubatch={2 * N_CTX}"]
        held_out = ["data.val_fraction=0.2", "train.steps=2"]  # 2 of 10 prompts
        return [*tool_overrides(files, tmp_path / run, cache_dir), *sizes, *held_out, *extra]

    monkeypatch.setattr(RowDecoder, "sample", scripted_then_sampled(replies))
    api.fit("tiny", overrides=items("single"), progress=False)
    launched = [{"overrides": items("ddp", 'train.parallel="ddp"'), "setup": str(setup)}]
    with torchrun(launched, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as ranks:
        output, _ = ranks.communicate(timeout=600)
    assert ranks.returncode == 0, output[-4000:]
    assert_same_run(tmp_path / "ddp", tmp_path / "single", steps=2, rows=8)
    train = [r for r in read_records(tmp_path / "ddp" / "metrics.jsonl") if "reward" in r]
    assert [r["tools/call_frequency"] for r in train] == [1.0, 1.0]
    assert all(0 < r["tools/failures/unknown_tool"] < 1 for r in train)  # both kinds of call
    assert all(r["rewards/got_a_result/std"] > 0 for r in train)
