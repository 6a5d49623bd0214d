"""llamatrain: train llama models in PyTorch, run them in llama.cpp."""

from llamatrain.model import Llama, ModelConfig

__all__ = [
    "Llama",
    "ModelConfig",
    "export_gguf",
    "fit",
    "generate_text",
    "load",
    "load_gguf",
    "load_tokenizer",
    "perplexity",
]
__version__ = "0.1.0"

_API = {"fit", "load", "export_gguf", "load_gguf", "load_tokenizer", "generate_text", "perplexity"}


def __getattr__(name: str):
    """Training and GGUF entry points load on first use, keeping ``import llamatrain`` light."""
    if name in _API:
        from llamatrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'llamatrain' has no attribute {name!r}")
