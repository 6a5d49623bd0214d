"""Tool calling for GRPO rollouts: Python functions the model may call, as TRL's ``tools=``.

- :mod:`~llamatrain.tools.schema`: a function's type hints and docstring → the JSON schema a
  chat template renders for it (transformers' ``get_json_schema``, key for key).
- :mod:`~llamatrain.tools.loading`: ``train.tools`` specs → the functions and their schemas;
  :mod:`~llamatrain.tools.specs` is the import of ``'file.py:name'`` / ``'module:name'`` specs
  that rewards share.
- :mod:`~llamatrain.tools.calls`: the calls in a model's reply, per format as llama.cpp's
  server parses them (Qwen/Hermes ``<tool_call>``, Llama 3.x JSON and ``<|python_tag|>``,
  the generic JSON form), failed calls as data. :mod:`~llamatrain.tools.formats` finds them
  in the text, :mod:`~llamatrain.tools.call_json` reads their JSON strictly and within
  bounds, :mod:`~llamatrain.tools.arguments` checks their arguments against the schema.
- :mod:`~llamatrain.tools.template_tools`: the variables that show a chat template the
  tools (``tools``, and SmolLM3's ``xml_tools``).
- :mod:`~llamatrain.tools.running`: one call run for a rollout, in a worker thread cut at
  ``train.tool_timeout``, its output cut at ``train.tool_output_chars``, a fault returned as
  its error (TRL's), never raised.

The standard library, :mod:`llamatrain.errors` and :mod:`llamatrain.user_code` are all this
package needs (no torch): the rollout's turns, masks and metrics are GRPO's
(``objectives.grpo.turns``, ``objectives.grpo.tool_turns``).
"""
