"""A DPO LoRA adapter, run in real llama.cpp, prefers the chosen style on pairs it never saw.

After a short DPO LoRA run on the synthetic set of ``test_preference_fit`` (chosen replies
terse, " <word> is fair.", rejected ones long), llama.cpp scores held-out pairs built on other
words: each reply's summed log-probability given its prompt, with the exported base alone and
with ``--lora`` (``lora_path``) the run's adapter file. The adapter must raise the chosen
reply's log-prob relative to the rejected one's on every pair: DPO's implicit reward margin,
β·((c_lora − c_base) − (r_lora − r_base)), is positive on all of them (reward accuracy 1) and
clearly so on average. llama.cpp's log-probs are also checked to be our model's (with the
adapter and without), so the preference is the trained model's, not an artefact of the export.

Measured (2-core x86, llama-cpp-python 0.3.36, β = 0.1, 8 steps): held-out margins 0.93-1.18,
mean 1.04 (the last training step's: 1.20); chosen − rejected log-prob 60.1 without the
adapter, 70.5 with it; |llama.cpp − ours| at most 2.3e-7 (base) and 7.1e-7 (with the adapter)
on sums of -62 to -145.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llama_cpp_runs import logits_of, open_exact
from test_preference_fit import files as files  # the random tiny base and the pairs
from test_preference_fit import overrides

from llamatrain import api
from llamatrain.data.examples import Example, LineEncoder
from llamatrain.data.preferences import PairEncoder, parse_pair
from llamatrain.lora import adapters_disabled

HELD_OUT = ["night", "grace", "moon", "spring", "song", "face", "mind", "light"]
"""Words not in the training pairs (``test_preference_fit.WORDS``)."""

LOGP_TOL = 1e-4
"""|llama.cpp − ours| of a reply's summed log-prob (f32 both; measured at most 7.1e-7)."""


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    return pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path]) -> api.FitResult:
    run_dir = tmp_path_factory.mktemp("dpo-cpp") / "run"
    return api.fit("tiny", overrides=overrides(files, run_dir), progress=False)


def held_out_pairs(result: api.FitResult) -> list[tuple[Example, Example]]:
    """The held-out pairs encoded as the run's data encodes a pair (reply + EOS scored)."""
    encoder = PairEncoder(LineEncoder(result.tokenizer, None, train_on="completion"))
    lines = [
        {"prompt": f"What is {w}?", "chosen": f" {w} is fair.",
         "rejected": f" {w} doth fade and die in winter."}
        for w in HELD_OUT
    ]  # fmt: skip
    encoded = [encoder.encode(parse_pair(json.dumps(line))) for line in lines]
    return [(pair.chosen, pair.rejected) for pair in encoded]


def reply_logp(logits: np.ndarray, example: Example) -> float:
    """Σ log p(token | before) over ``example``'s scored tokens, from its (len, vocab) logits."""
    logits = logits[:-1]
    log_softmax = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    picked = log_softmax[np.arange(len(logits)), example.ids[1:]]
    return float(picked[example.scored[1:]].sum())


def cpp_reply_logps(llama_cpp: Any, result: api.FitResult, base: Path, lora: Path | None):
    """(pairs, 2) llama.cpp's summed reply log-probs, chosen and rejected."""
    llm = open_exact(llama_cpp, base, lora=lora, n_ctx=64)  # the run's n_ctx
    try:
        return np.array([
            [reply_logp(logits_of(llm, ex.ids.tolist()), ex) for ex in pair]
            for pair in held_out_pairs(result)
        ])  # fmt: skip
    finally:
        llm.close()


def our_reply_logps(result: api.FitResult, adapters: bool) -> np.ndarray:
    """The same from the run's model (its adapters on or off)."""
    model = result.model.eval()
    rows = []
    with torch.no_grad():
        for pair in held_out_pairs(result):
            row = []
            for ex in pair:
                if adapters:
                    logits = model(torch.from_numpy(ex.ids)[None])[0]
                else:
                    with adapters_disabled(model):
                        logits = model(torch.from_numpy(ex.ids)[None])[0]
                row.append(reply_logp(logits.double().numpy(), ex))
            rows.append(row)
    return np.array(rows)


def test_the_adapter_in_llama_cpp_prefers_the_chosen_style_on_held_out_pairs(
    llama_cpp, dpo_run, files
):
    base = cpp_reply_logps(llama_cpp, dpo_run, files["base"], None)
    tuned = cpp_reply_logps(llama_cpp, dpo_run, files["base"], dpo_run.adapter_path)
    assert np.abs(base - our_reply_logps(dpo_run, adapters=False)).max() <= LOGP_TOL
    assert np.abs(tuned - our_reply_logps(dpo_run, adapters=True)).max() <= LOGP_TOL

    beta = dpo_run.config.train.beta
    margins = beta * ((tuned[:, 0] - base[:, 0]) - (tuned[:, 1] - base[:, 1]))
    assert (margins > 0).all(), margins  # reward accuracy 1 on the held-out pairs
    assert margins.mean() > 0.3, margins
    before, after = base[:, 0] - base[:, 1], tuned[:, 0] - tuned[:, 1]
    assert after.mean() > before.mean(), (before, after)
