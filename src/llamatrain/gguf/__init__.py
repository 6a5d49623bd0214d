"""GGUF files: the container format, the llama mapping on top of it, and ``llamatrain info``.

Five modules; ``file`` is the base the others build on:

- ``llamatrain.gguf.file``: the container (read any GGUF, write one atomically, the export
  types); the only module in llamatrain that imports the ``gguf`` package.
- ``llamatrain.gguf.llama``: the keys and tensors of a llama model, checkpoint or vocabulary
  (``write_model``, ``read_model``, ``read_tokenizer``, ``write_vocab``).
- ``llamatrain.gguf.describe``: ``describe_gguf``, the text ``llamatrain info`` prints.
- ``llamatrain.gguf.quantize``: exports in the types llama.cpp's own quantizer writes
  (K-quants, IQ4, Q4_1, Q5_x), through llama-cpp-python when it is installed.
- ``llamatrain.gguf.adapter``: LoRA adapters as llama.cpp's ``--lora`` reads them.

Nothing is re-exported here: importing the package loads neither the model nor the tokenizer
modules, so those can use ``llamatrain.gguf.file`` without an import cycle.
"""
