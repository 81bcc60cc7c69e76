"""MEMO: fine-grained activation memory management for ultra-long-context LLM training."""

from .config import ModelConfig
from .hf import from_hf, to_hf
from .hf_patch import patch, patch_stats, unpatch
from .job import Job
from .model import Transformer
from .policy import ActivationPolicy

__all__ = [
    "ActivationPolicy",
    "Job",
    "ModelConfig",
    "Transformer",
    "from_hf",
    "patch",
    "patch_stats",
    "to_hf",
    "unpatch",
]
__version__ = "0.1.0"
