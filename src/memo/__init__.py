"""MEMO: fine-grained activation memory management for ultra-long-context LLM training."""

from .config import ModelConfig
from .model import Transformer
from .policy import ActivationPolicy

__all__ = ["ActivationPolicy", "ModelConfig", "Transformer"]
__version__ = "0.1.0"
