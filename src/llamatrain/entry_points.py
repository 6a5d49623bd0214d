"""The names of the public API, in the one module both front doors read them from: the package
(``import llamatrain``, which loads ``llamatrain.api`` only on first use) and ``llamatrain.api``
itself, which sits above it in the layers."""

__all__ = ["API"]

API = (
    "Conversation",
    "FitResult",
    "PerplexityResult",
    "chat",
    "describe_gguf",
    "export",
    "export_adapter",
    "export_gguf",
    "export_hf",
    "fit",
    "generate_text",
    "load",
    "load_chat",
    "load_gguf",
    "load_tokenizer",
    "perplexity",
    "reply_stops",
    "seen_tokens",
    "verify_gguf",
)
"""The public entry points of ``llamatrain.api``, offered here too, loaded on first use: the
one list of them. ``llamatrain.api.__all__``, this package's ``__all__`` and ``__getattr__``
derive from it; tests/unit/test_public_api.py checks it against the calls README.md and the
docs pages document."""
