"""llamatrain: train llama models in PyTorch, run them in llama.cpp."""

from llamatrain.model import Llama
from llamatrain.model_config import ModelConfig

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
    "seen_tokens",
    "verify_gguf",
)
"""The public entry points of ``llamatrain.api``, offered here too, loaded on first use: the
one list of them. ``llamatrain.api.__all__``, this package's ``__all__`` and ``__getattr__``
derive from it; tests/unit/test_public_api.py checks it against the calls README.md and the
docs pages document."""

__all__ = ["Llama", "ModelConfig", *API]
__version__ = "0.1.0"


def __getattr__(name: str):
    """Training and GGUF entry points load on first use, keeping ``import llamatrain`` light."""
    if name in API:
        from llamatrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'llamatrain' has no attribute {name!r}")
