"""Chat templates: a conversation rendered the way a model was tuned to read it.

A chat template is Jinja2 source from a model file, so it is untrusted code; it is rendered
here byte for byte as transformers' ``apply_chat_template`` renders it, inside a sandbox that
meters every render. Its own package, below the data readers and generation, which both
render conversations with it (generating text does not import the training data):

- :mod:`~llamatrain.chat_template.render`: :class:`ChatTemplate` (rendering, the trained
  :class:`Segment` s of a conversation, the end-of-turn marker), the built-in templates, and
  which failure is the template's fault (:class:`TemplateFault`) and which the conversation's.
- :mod:`~llamatrain.chat_template.choice`: the template ``data.chat_template`` (or
  ``--chat-template``) chooses for a model; :mod:`~llamatrain.chat_template.prompt_tokens`: a
  rendered chat's token ids as llama.cpp's prompt path makes them.
- :mod:`~llamatrain.chat_template.sandbox`: the Jinja environment every template compiles in,
  metered per render, with transformers' helpers (:mod:`~llamatrain.chat_template.helpers`);
  :mod:`~llamatrain.chat_template.budget` (the budget and its meter),
  :mod:`~llamatrain.chat_template.costs` (what one operation may make, checked before it is
  made) and :mod:`~llamatrain.chat_template.codegen` (the code a template compiles to) serve it.
"""

from llamatrain.chat_template.choice import chat_template_for, resolve_chat_template
from llamatrain.chat_template.prompt_tokens import needs_bos, prompt_ids
from llamatrain.chat_template.render import (
    BUILTIN_TEMPLATES,
    ROLES,
    ChatTemplate,
    Segment,
    TemplateFault,
)

__all__ = [
    "BUILTIN_TEMPLATES",
    "ROLES",
    "ChatTemplate",
    "Segment",
    "TemplateFault",
    "chat_template_for",
    "needs_bos",
    "prompt_ids",
    "resolve_chat_template",
]
