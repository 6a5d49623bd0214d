"""HF (transformers) checkpoint folders in and out: a llama's ``config.json``, safetensors
weights and tokenizer files ⇄ the ``LlamaFile`` a GGUF import gives.

- ``llamatrain.hf.folder``: the folder as a whole (``read_hf_folder``, ``write_hf_folder``);
  the entry point the API uses.
- ``llamatrain.hf.config``: ``config.json`` ⇄ ``ModelConfig``.
- ``llamatrain.hf.rope``: rope base and scaling (linear, llama3 → ``rope_freqs.weight``).
- ``llamatrain.hf.weights``: tensor names, the q/k row permutation, reading shards.
- ``llamatrain.hf.tokenizer_files``: vocabulary sizing, chat template, tokenizer_config.json.
- ``llamatrain.hf.peft``: LoRA adapters as a PEFT adapter folder (``write_peft_adapter``).

Nothing is re-exported here, as in ``llamatrain.gguf``: importing the package loads nothing.
transformers is never imported; the format is read and written with ``json`` and
``safetensors``.
"""
