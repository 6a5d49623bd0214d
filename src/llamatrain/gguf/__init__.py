"""GGUF files: the container format, the llama mapping on top of it, and ``llamatrain info``.

Three modules; ``file`` is the base the other two build on:

- ``llamatrain.gguf.file``: the container (read any GGUF, write one atomically, the export
  types); the only module in llamatrain that imports the ``gguf`` package.
- ``llamatrain.gguf.llama``: the keys and tensors of a llama model, checkpoint or vocabulary
  (``write_model``, ``read_model``, ``read_tokenizer``, ``write_vocab``).
- ``llamatrain.gguf.describe``: ``describe_gguf``, the text ``llamatrain info`` prints.

Nothing is re-exported here: importing the package loads neither the model nor the tokenizer
modules, so those can use ``llamatrain.gguf.file`` without an import cycle.
"""
