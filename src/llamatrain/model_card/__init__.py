"""What an export says about how it was made: one home for the facts that an HF folder's and a
PEFT adapter's ``README.md`` model card and a GGUF's ``general.*`` keys carry, so the three
never tell different stories.

- ``llamatrain.model_card.facts``: the facts (:class:`~llamatrain.model_card.facts.ModelCard`),
  read from what a run leaves behind: its checkpoint's keys, ``metrics.jsonl``, the base's keys.
- ``llamatrain.model_card.readme``: the ``README.md`` the Hugging Face Hub reads (YAML front
  matter, then what the run did and how to run the result in llama.cpp).
- ``llamatrain.model_card.general_keys``: the same facts as the ``general.*`` keys llama.cpp's
  gguf-py defines (base models, license, tags, datasets, description).

Nothing is re-exported here: importing the package loads nothing.
"""
