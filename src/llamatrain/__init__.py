"""llamatrain: train llama models in PyTorch, run them in llama.cpp."""

from llamatrain.model import Llama, ModelConfig

_API = (
    "chat",
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
)
"""Entry points of ``llamatrain.api`` offered here; they load on first use. The one list of
them: ``__all__`` and ``__getattr__`` derive from it, and tests/unit/test_public_api.py checks
it against ``llamatrain.api.__all__`` and the calls README.md documents."""

__all__ = ["Llama", "ModelConfig", *_API]
__version__ = "0.1.0"


def __getattr__(name: str):
    """Training and GGUF entry points load on first use, keeping ``import llamatrain`` light."""
    if name in _API:
        from llamatrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'llamatrain' has no attribute {name!r}")
