"""Model cards: what an export says about how it was made, read back by the readers that matter.

A two-step LoRA run of the tiny config over a base GGUF whose keys name it as a Hub model
(license, tags, repository, and a base model of its own), on data inside the Hub's dataset
cache. Its HF folder's and PEFT folder's README.md are parsed with the Hub's own library
(``huggingface_hub.ModelCard``), its GGUF exports' ``general.*`` keys read with gguf-py's
``GGUFReader`` and by real llama.cpp, and every fact is checked against the file it comes from
(the checkpoint's counters, metrics.jsonl, the base's bytes).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader
from gguf.constants import Keys
from huggingface_hub import ModelCard
from random_models import BYTE_BPE, tiny_llama

from llamatrain import api
from llamatrain.cli import main
from llamatrain.data import SONNETS_PATH
from llamatrain.gguf.file import read_gguf_metadata
from llamatrain.gguf.llama import write_model
from llamatrain.model_card.facts import BaseModel, Training
from llamatrain.model_card.facts import ModelCard as Card
from llamatrain.model_card.readme import readme

BASE_ID = "HuggingFaceTB/SmolLM2-135M"
BASE_KEYS = {
    "general.name": "SmolLM2 135M",
    "general.organization": "HuggingFaceTB",
    "general.license": "apache-2.0",
    "general.tags": ["text-generation"],
    "general.repo_url": f"https://huggingface.co/{BASE_ID}",
    "general.base_model.count": np.uint32(1),  # the base's own base: not the finetune's
    "general.base_model.0.name": "Grandparent",
    "general.base_model.0.repo_url": "https://huggingface.co/someone/grandparent",
}  # fmt: skip
DATASET_ID = "someorg/sonnets"
TAGS = ["text-generation", "llamatrain", "sft", "lora"]


def _defined_general_keys() -> list[re.Pattern[str]]:
    """Every ``general.*`` key gguf-py defines, ``{id}`` standing for an index."""
    names = [v for k, v in vars(Keys.General).items() if not k.startswith("_")]
    return [re.compile(re.escape(n).replace(r"\{id\}", r"\d+")) for n in names]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Any:
    """The LoRA run (byte-level BPE, so an HF export can hold its tokenizer) and its base."""
    root = tmp_path_factory.mktemp("card")
    sets = [f'data.cache_dir="{cache_dir}"', 'tokenizer.model_type="byte_bpe"']
    model, tokenizer = tiny_llama(cache_dir, overrides=BYTE_BPE, max_seq_len=64)
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    base = write_model(root / "base.gguf", model.cfg, tensors, tokenizer, inherited=BASE_KEYS)
    data = root / "hub" / "datasets--someorg--sonnets" / "snapshots" / "0123abc" / "sonnets.txt"
    data.parent.mkdir(parents=True)
    shutil.copy(SONNETS_PATH, data)
    overrides = [*sets, f'output.dir="{root / "run"}"', f'model.init_from="{base}"',
                 f'data.path="{data}"', "tokenizer.vocab_size=320", "lora.rank=4",
                 "lora.targets=['attn_q', 'attn_v']", "train.steps=2", "train.eval_every=0",
                 "train.eval_batches=1", "train.sample_tokens=0", "train.save_every=0"]  # fmt: skip
    return api.fit("tiny", overrides=overrides, progress=False), base


def _hub_metadata(folder: Path) -> dict[str, Any]:
    return ModelCard.load(folder / "README.md").data.to_dict()


def _expected_metadata() -> dict[str, Any]:
    return {
        "base_model": BASE_ID,
        "library_name": "llamatrain",
        "license": "apache-2.0",
        "tags": TAGS,
        "datasets": [DATASET_ID],
        "pipeline_tag": "text-generation",
    }


def _last(records: list[dict], key: str) -> float:
    return [r[key] for r in records if key in r][-1]


def test_hf_export_card_is_what_the_hub_reads_and_states_the_run(run, tmp_path):
    result, base = run
    folder = tmp_path / "hf"
    assert main(["export", str(result.run_dir), "--format", "hf", "-o", str(folder)]) == 0
    assert _hub_metadata(folder) == _expected_metadata()
    text = (folder / "README.md").read_text()
    state = read_gguf_metadata(result.run_dir / "checkpoints" / "latest.gguf")
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    sha256 = hashlib.sha256(base.read_bytes()).hexdigest()
    for row in (
        "| Objective | `sft` |",
        f"| Optimizer steps | {state['training.iteration_count']} |",
        f"| Tokens trained on (scored by the loss) | {state['training.token_count']:,} |",
        f"| Final train loss | {_last(records, 'loss'):.4f} (step 2) |",
        f"| Final validation loss | {_last(records, 'val_loss'):.4f} (step 2) |",
        "| LoRA | rank 4, alpha 16, targets attn_q, attn_v |",
        f"| Base file | `base.gguf` (sha256 `{sha256}`) |",
        "| llamatrain version | 0.1.0 |",
    ):
        assert row in text, row
    assert state["training.token_count"] > 0
    # transformers still loads the folder, the card beside its files
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(folder)


def test_peft_adapter_card_is_what_the_hub_reads(run, tmp_path):
    result, _ = run
    folder = tmp_path / "peft"
    args = ["export", str(result.run_dir), "--adapter", "--format", "hf", "-o", str(folder)]
    assert main(args) == 0
    assert _hub_metadata(folder) == _expected_metadata()
    text = (folder / "README.md").read_text()
    assert "llama-cli -m base.gguf --lora adapter.gguf" in text
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4


def _general(path: Path) -> dict[str, Any]:
    reader = GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("general.")}


def test_gguf_exports_carry_the_same_facts_in_llama_cpps_keys(run, tmp_path):
    """The fit's merged model and adapter and ``export``'s: the base is general.base_model.0
    (its own base gone), the data general.dataset.0, the tags extend the base's; every
    general.* key is one gguf-py defines; llama.cpp loads each and reads them."""
    import llama_cpp

    result, base = run
    exported = tmp_path / "again.gguf"
    assert main(["export", str(result.run_dir), "-o", str(exported), "--type", "q8_0"]) == 0
    adapter = tmp_path / "adapter.gguf"
    assert main(["export", str(result.run_dir), "--adapter", "-o", str(adapter)]) == 0
    latest = result.run_dir / "checkpoints" / "latest.gguf"
    tokens = read_gguf_metadata(latest)["training.token_count"]
    expected = {
        "general.name": "SmolLM2 135M",
        "general.license": "apache-2.0",
        "general.tags": TAGS,
        "general.base_model.count": 1,
        "general.base_model.0.name": "SmolLM2 135M",
        "general.base_model.0.organization": "HuggingFaceTB",
        "general.base_model.0.repo_url": f"https://huggingface.co/{BASE_ID}",
        "general.dataset.count": 1,
        "general.dataset.0.name": "sonnets",
        "general.dataset.0.organization": "someorg",
        "general.dataset.0.repo_url": f"https://huggingface.co/datasets/{DATASET_ID}",
        "general.description": "sft LoRA of SmolLM2 135M by llamatrain 0.1.0: 2 steps, "
        f"{tokens} tokens",
    }
    defined = _defined_general_keys()
    for path in (result.export_path, result.adapter_path, exported, adapter):
        general = _general(path)
        assert {k: general.get(k) for k in expected} == expected, path
        assert "general.repo_url" not in general, path  # the base's address, not this model's
        assert all(any(p.fullmatch(k) for p in defined) for k in general), sorted(general)
    for path in (result.export_path, exported):
        llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        try:
            assert llm.metadata["general.license"] == "apache-2.0"
            assert llm.metadata["general.base_model.0.repo_url"].endswith(BASE_ID)
            assert llm.metadata["general.dataset.0.name"] == "sonnets"
        finally:
            llm.close()
    llm = llama_cpp.Llama(str(base), lora_path=str(adapter), n_ctx=32, verbose=False)
    try:  # the adapter with its new keys still applies over the base
        assert llm.metadata["general.license"] == "apache-2.0"
    finally:
        llm.close()


def test_a_conversion_repeats_its_files_lineage(run, tmp_path):
    """Exporting the base itself (no run behind it): its own base model is the card's, no
    training section, and a GGUF export keeps its keys as they were."""
    _, base = run
    folder = tmp_path / "hf"
    assert main(["export", str(base), "--format", "hf", "-o", str(folder)]) == 0
    metadata = _hub_metadata(folder)
    assert metadata["base_model"] == "someone/grandparent"
    assert metadata["license"] == "apache-2.0"
    assert metadata["tags"] == ["text-generation", "llamatrain"]
    assert "datasets" not in metadata
    assert "## Training" not in (folder / "README.md").read_text()
    assert main(["export", str(base), "-o", str(tmp_path / "same.gguf")]) == 0
    general = _general(tmp_path / "same.gguf")
    assert {k: general[k] for k in BASE_KEYS} == {
        k: (list(v) if isinstance(v, list) else v.item() if isinstance(v, np.generic) else v)
        for k, v in BASE_KEYS.items()
    }


def test_a_card_leaves_out_what_no_file_states_and_quotes_what_files_say(tmp_path):
    """A run from scratch names no base model or license; a GRPO run shows its rewards; a
    base's name that tries to add a field or break the page stays one quoted value."""
    run = Training("grpo", 5, 640, {"reward": (5, 0.25), "val_reward": (5, 0.5)}, None, None, None)
    scratch = Card(None, (), None, None, None, ("llamatrain", "grpo"), (), run)
    (tmp_path / "README.md").write_text(readme(scratch, "model"))
    metadata = _hub_metadata(tmp_path)
    assert "base_model" not in metadata and "license" not in metadata
    text = (tmp_path / "README.md").read_text()
    assert "| Final GRPO reward (train) | 0.2500 (step 5) |" in text
    assert "| Final GRPO reward (held-out prompts) | 0.5000 (step 5) |" in text
    hostile = 'x"\nlicense: evil\n---\n# y'
    base = BaseModel(name=hostile, repo_url="https://huggingface.co/a/b")
    card = Card(hostile, (base,), "mit", None, None, (hostile,), (), run)
    (tmp_path / "README.md").write_text(readme(card, "adapter"))
    metadata = _hub_metadata(tmp_path)
    assert (metadata["license"], metadata["base_model"]) == ("mit", "a/b")
    assert metadata["tags"] == [hostile]
