"""llamatrain: train llama models in PyTorch, run them in llama.cpp."""

from llamatrain.model import Llama, ModelConfig

__all__ = ["Llama", "ModelConfig"]
__version__ = "0.1.0"
