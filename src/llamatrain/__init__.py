"""llamatrain: train llama models in PyTorch, run them in llama.cpp."""

from llamatrain.entry_points import API
from llamatrain.model import Llama
from llamatrain.model_config import ModelConfig

__all__ = ["Llama", "ModelConfig", *API]
__version__ = "0.1.0"


def __getattr__(name: str):
    """Training and GGUF entry points load on first use, keeping ``import llamatrain`` light."""
    if name in API:
        from llamatrain import api

        return getattr(api, name)
    raise AttributeError(f"module 'llamatrain' has no attribute {name!r}")
