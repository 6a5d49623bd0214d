"""Messages that say what is true (issue 48, item 5): a run folder without a checkpoint yet is
named as one (not as an HF folder without config.json), an empty message list is called
empty, and text outside the BMP reaches a model card's front matter as itself."""

from __future__ import annotations

import numpy as np
import pytest
from huggingface_hub import ModelCard as HubCard
from user_errors import error_of

from llamatrain import api
from llamatrain.data.preferences import parse_pair
from llamatrain.data.prompts import parse_prompt_row
from llamatrain.model_card.facts import conversion_card
from llamatrain.model_card.readme import readme
from llamatrain.model_path import is_hf_folder


def test_a_run_folder_without_a_checkpoint_is_named_as_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("")
    (run / "metrics.jsonl").write_text("")  # what every fit writes before its first step
    assert not is_hf_folder(run)
    message = error_of(api.export, run, tmp_path / "out.gguf")
    assert message.startswith(f"{run} is a run folder with no checkpoint yet (a run saves one")
    assert "config.json" not in message


@pytest.mark.parametrize(
    "parse, line, told",
    [
        (parse_prompt_row, '{"prompt": []}',
         '"prompt" must be a non-empty list, not an empty list'),
        (parse_prompt_row, '{"prompt": {}}', 'a prompt row needs a "prompt", text or a list of '
                                            "messages, got an object"),
        (parse_pair, '{"prompt": [], "chosen": "a", "rejected": "b"}',
         '"prompt" must be a non-empty list, not an empty list'),
        (parse_pair, '{"prompt": [{"role": "user", "content": "p"}], "chosen": [], '
          '"rejected": "b"}',
         '"chosen" must be text or a non-empty list of messages, not an empty list'),
    ],
)  # fmt: skip
def test_an_empty_message_list_is_called_empty_under_its_own_key(parse, line, told):
    """Before: '"messages" (a key the line lacks) must be a non-empty list, not a list'."""
    assert error_of(parse, line) == told


def test_text_outside_the_bmp_is_itself_in_the_front_matter(tmp_path):
    """An emoji in a base's license or tags was written as JSON's surrogate pair, which the
    Hub's YAML reads back as two broken characters."""
    keys = {"general.license": "llama-🦙-license", "general.tags": ["🦙 llama", "a\u2028b"]}
    keys["general.base_model.count"] = np.uint32(0)
    (tmp_path / "README.md").write_text(readme(conversion_card(keys), "model"), encoding="utf-8")
    text = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert 'license: "llama-🦙-license"' in text and "\\ud83e" not in text
    metadata = HubCard.load(tmp_path / "README.md").data.to_dict()
    assert metadata["license"] == "llama-🦙-license"
    assert metadata["tags"][:2] == ["🦙 llama", "a\u2028b"]
