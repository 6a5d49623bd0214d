"""GGUF files: the container format, the llama mapping on top of it, and ``llamatrain info``.

Eight modules; ``file`` (on top of ``header`` and ``export_types``) is the base the others
build on:

- ``llamatrain.gguf.file``: the container (read any GGUF, write one atomically, verify a
  checkpoint's sha256s); the only module in llamatrain that uses the ``gguf`` package's
  writer and codecs.
- ``llamatrain.gguf.header``: the header parser ``file`` reads through (metadata and tensor
  table, every length checked against the file size).
- ``llamatrain.gguf.export_types``: which GGUF types a model is exported as, tensor by tensor
  or through llama.cpp's quantizer (``EXPORT_TYPES``, ``QUANTIZER_TYPES``).
- ``llamatrain.gguf.llama``: the keys and tensors of a llama model, checkpoint or vocabulary
  (``write_model``, ``read_model``, ``read_tokenizer``, ``write_vocab``).
- ``llamatrain.gguf.vocab``: the ``tokenizer.ggml.*`` keys of a vocabulary
  (``tokenizer_metadata``, ``tokenizer_from_metadata``).
- ``llamatrain.gguf.describe``: ``describe_gguf``, the text ``llamatrain info`` prints.
- ``llamatrain.gguf.quantize``: exports in the types llama.cpp's own quantizer writes
  (K-quants, IQ4, Q4_1, Q5_x), through llama-cpp-python when it is installed.
- ``llamatrain.gguf.adapter``: LoRA adapters as llama.cpp's ``--lora`` reads them.

Nothing is re-exported here: importing the package loads neither the model nor the tokenizer
modules, so those can use ``llamatrain.gguf.file`` without an import cycle.
"""
