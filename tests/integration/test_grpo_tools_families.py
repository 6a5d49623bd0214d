"""QLoRA GRPO with a tool over every family whose real template has tools (Qwen 2.5, Qwen3,
Llama 3.1, Llama 3.2, SmolLM3), out to llama.cpp: issue 47's "LoRA/QLoRA over every family that
has a tool template".

For each family: a random tiny base of its architecture (``test_families``' shapes, matrices
unit-scaled so every block moves the logits), over a real vocabulary in which its template's
markers are control tokens (``tool_vocabs``: Qwen2's for the ChatML families, Llama 3.1's),
with the family's own template (the fixtures, byte-identical to the models') in its metadata,
written Q8_0. ``fit`` trains a QLoRA adapter over that file (``lora.base_dtype = "quantized"``)
with ``train.tools``: each completion's first turn is a call in the family's format
(``tool_runs``' scripted draws: a good call or one to an unknown tool; Llama 3.1's good call is
its ``<|python_tag|>`` JSON form ended by ``<|eom_id|>``, Llama 3.2's the plain JSON form its
template writes), answered with the tool's result
rendered by the family's template, then sampled. The GGUF adapter it exports must run in
llama.cpp (llama-cpp-python) over the quantized file with the run's own logits on a tool
conversation.

Bounds: llama.cpp rounds the activations to 8 bits for its Q8_0 matmuls, we multiply by the
dequantized weights in float32, so over the Q8_0 file the logits agree to a few percent of the
largest (5% allowed); the adapter must move llama.cpp's logits by 5 times that bound. The same
adapter over an f32 file of the dequantized base (what our run multiplies by) must give our
logits to 2e-5: the adapter is exact, the rest is llama.cpp's activation rounding. Measured
(2-core x86, 2 steps at lr 3e-2; qwen2.5, qwen3, llama3.1, llama3.2, smollm3): the adapter
moves the logits by 0.79, 4.3, 4.7, 6.7, 0.59; |Δ| over Q8_0 0.028, 0.088, 0.11, 0.10, 0.020
(largest logit 0.83, 5.3, 5.5, 5.1, 0.82: 3.4%, 1.6%, 2.0%, 1.9%, 2.5%); over the f32 file
1.0e-6, 4.0e-6, 5.2e-6, 4.4e-6, 1.2e-6. ~35 s a family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llama_cpp_files import vocab_dir as vocab_dir
from llama_cpp_runs import cpp_logits
from random_models import unit_scaled
from test_families import BASE, VARIANTS, logits
from tool_runs import scripted_then_sampled, tool_overrides, tool_run_files
from tool_vocabs import family_vocab

from llamatrain import Llama, ModelConfig, api
from llamatrain.chat_template import ChatTemplate
from llamatrain.decoding import RowDecoder

pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
HERMES = '<tool_call>\n{{"name": "{}", "arguments": {{"a": 6, "b": 7}}}}\n</tool_call><|im_end|>'
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2.5": dict(vocab="qwen", shape=VARIANTS["qwen2"], eos="<|im_end|>", call=HERMES),
    "qwen3": dict(vocab="qwen", shape=VARIANTS["qwen3"], eos="<|im_end|>", call=HERMES),
    "llama3.1": dict(
        vocab="llama3.1",
        shape={},
        eos="<|eot_id|>",
        call='<|python_tag|>{{"name": "{}", "parameters": {{"a": 6, "b": 7}}}}<|eom_id|>',
    ),
    "llama3.2": dict(
        vocab="llama3.1",  # Llama 3.2 kept 3.1's vocabulary
        shape={},
        eos="<|eot_id|>",
        call='{{"name": "{}", "parameters": {{"a": 6, "b": 7}}}}<|eot_id|>',
    ),
    "smollm3": dict(vocab="qwen", shape=VARIANTS["smollm3"], eos="<|im_end|>", call=HERMES),
}
N_CTX = 768
"""SmolLM3's prompt (its long system prompt and the tool, ~560 tokens) and 96 completion
tokens."""
QUANTIZED_BOUND = 0.05
"""max |llama.cpp's logit - ours| over the Q8_0 file, as a fraction of our largest logit (see
the module doc)."""
EXACT_BOUND = 2e-5
"""max |llama.cpp's logit - ours| over the f32 file of the dequantized base."""


@pytest.fixture(scope="module")
def llama_cpp() -> Any:
    import llama_cpp

    return llama_cpp


def quantized_base(family: str, folder: Path, vocab_dir: Path) -> tuple[Path, Any]:
    """The family's random base, Q8_0, its template in the metadata; and its tokenizer."""
    spec = FAMILIES[family]
    tokenizer = family_vocab(vocab_dir, spec["vocab"])
    torch.manual_seed(0)
    shape = {**BASE, **spec["shape"], "max_seq_len": N_CTX}
    model = unit_scaled(Llama(ModelConfig(vocab_size=tokenizer.vocab_size, **shape)))
    template = {"tokenizer.chat_template": (TEMPLATES / f"{family}.jinja").read_text()}
    path = folder / "base-q8_0.gguf"
    return api.export_gguf(model, tokenizer, path, type="q8_0", inherited=template), tokenizer


def conversation_ids(family: str, tokenizer: Any) -> list[int]:
    """The last 64 tokens of a tool conversation in the family's template."""
    spec = FAMILIES[family]
    source = (TEMPLATES / f"{family}.jinja").read_text()
    template = ChatTemplate(source, eos_token=spec["eos"], name=family)
    call = {"name": "multiply", "arguments": {"a": 6, "b": 7}}
    messages = [
        {"role": "user", "content": "What is 6 times 7?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "name": "multiply", "content": "42.0"},
        {"role": "assistant", "content": "It is 42."},
    ]
    return tokenizer.encode(template.render(messages), special=True)[-64:]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_qlora_grpo_with_a_tool_exports_an_adapter_llama_cpp_runs(
    llama_cpp, vocab_dir, cache_dir, tmp_path, monkeypatch, family
):
    base, tokenizer = quantized_base(family, tmp_path, vocab_dir)
    calls = [FAMILIES[family]["call"].format(name) for name in ("multiply", "divide")]
    replies = [tokenizer.encode(call, special=True) for call in calls]
    monkeypatch.setattr(RowDecoder, "sample", scripted_then_sampled(replies))
    files = tool_run_files(tmp_path, tokenizer, prompts=2, base=base)
    run_dir = tmp_path / "run"
    items = [
        *tool_overrides(files, run_dir, cache_dir),
        f"data.n_ctx={N_CTX}",
        f"train.n_batch={4 * N_CTX}",  # 2 prompts a step
        "train.steps=2",
        'lora.base_dtype="quantized"',
        'train.dtype="float32"',
        "optim.lr=3e-2",
    ]
    result = api.fit("tiny", overrides=items, progress=False)
    assert result.model.cfg.arch == FAMILIES[family]["shape"].get("arch", "llama")
    train = result.history.train
    assert all(r["tools/call_frequency"] == 1.0 for r in train)
    assert any(r["grad_norm"] > 0 for r in train)

    ids = conversation_ids(family, tokenizer)
    ours = logits(result.model.eval(), ids)
    adapter = api.export_adapter(run_dir, tmp_path / "adapter.gguf")
    theirs = cpp_logits(llama_cpp, base, ids, lora=adapter, n_ctx=128)
    without = cpp_logits(llama_cpp, base, ids, n_ctx=128)
    moved, diff = np.abs(theirs - without).max(), np.abs(ours - theirs).max()
    bound = QUANTIZED_BOUND * np.abs(ours).max()
    assert moved > 5 * bound, f"{family}: the adapter moves llama.cpp's logits by {moved:.2e}"
    assert diff < bound, f"{family}: max |Δlogit| = {diff:.2e} over the Q8_0 file (> {bound:.2e})"
    dequantized = api.export_gguf(*api.load_gguf(base), tmp_path / "dequantized-f32.gguf")
    exact = np.abs(ours - cpp_logits(llama_cpp, dequantized, ids, lora=adapter, n_ctx=128)).max()
    assert exact < EXACT_BOUND, f"{family}: max |Δlogit| = {exact:.2e} over the f32 file"
