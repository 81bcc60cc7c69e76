"""MEMO: fine-grained activation memory management for ultra-long-context LLM training."""

from .config import ModelConfig
from .hf import from_hf, to_hf
from .model import Transformer
from .policy import ActivationPolicy

__all__ = ["ActivationPolicy", "ModelConfig", "Transformer", "from_hf", "to_hf"]
__version__ = "0.1.0"
