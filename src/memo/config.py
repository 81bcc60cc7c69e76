"""Model configurations: one frozen dataclass and a table of named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

Arch = Literal["gpt", "llama"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer.

    `gpt`: LayerNorm, GeLU, FFN with biases (the paper's models, memo-method.md §8).
    `llama`: RMSNorm, SwiGLU, no biases, grouped-query attention.
    Both use rotary position embeddings: a learned table of 1M positions would cost more than the model.
    """

    arch: Arch
    n_layers: int
    hidden_size: int
    n_heads: int
    ffn_hidden_size: int
    vocab_size: int
    n_kv_heads: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"`arch` must be 'gpt' or 'llama', got {self.arch!r}")
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        for field in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "ffn_hidden_size", "vocab_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"`{field}` must be a positive integer, got {value!r}")
        if self.hidden_size % self.n_heads:
            raise ValueError(f"`n_heads` ({self.n_heads}) must divide `hidden_size` ({self.hidden_size})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"`n_kv_heads` ({self.n_kv_heads}) must divide `n_heads` ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"`hidden_size`/`n_heads` must be even for rotary embeddings, got {self.head_dim}")
        if not self.norm_eps > 0:
            raise ValueError(f"`norm_eps` must be > 0, got {self.norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"`rope_theta` must be > 0, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> "ModelConfig":
        """Returns the named preset, with any fields replaced by `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)

    def num_parameters(self) -> int:
        """Returns the parameter count (embedding and head untied)."""
        return sum(_param_shapes_numel(self))


def _param_shapes_numel(c: ModelConfig) -> list[int]:
    h, f, kv = c.hidden_size, c.ffn_hidden_size, c.n_kv_heads * c.head_dim
    if c.arch == "gpt":
        layer = 2 * 2 * h + (h * h + h) * 2 + (h * kv + kv) * 2 + (h * f + f) + (f * h + h)
        final_norm = 2 * h
    else:
        layer = 2 * h + 2 * h * h + 2 * h * kv + 3 * h * f
        final_norm = h
    return [c.vocab_size * h, c.n_layers * layer, final_norm, c.vocab_size * h]


def _gpt(name: str, n_layers: int, hidden: int, heads: int) -> ModelConfig:
    return ModelConfig("gpt", n_layers, hidden, heads, 4 * hidden, 50257, name=name)


PRESETS: dict[str, ModelConfig] = {
    # memo-method.md §8 (the paper's table)
    "gpt-7b": _gpt("gpt-7b", 32, 4096, 32),
    "gpt-13b": _gpt("gpt-13b", 40, 5120, 40),
    "gpt-30b": _gpt("gpt-30b", 48, 7168, 56),
    "gpt-65b": _gpt("gpt-65b", 80, 8192, 64),
    # published Llama configs
    "llama2-7b": ModelConfig("llama", 32, 4096, 32, 11008, 32000, n_kv_heads=32, name="llama2-7b"),
    "llama3-8b": ModelConfig("llama", 32, 4096, 32, 14336, 128256, n_kv_heads=8, rope_theta=500000.0, name="llama3-8b"),
    # CPU-sized debug presets used by tests and the default training job
    "tiny": ModelConfig("llama", 4, 64, 4, 176, 256, n_kv_heads=2, name="tiny"),
    "tiny-gpt": ModelConfig("gpt", 4, 64, 4, 256, 256, name="tiny-gpt"),
}
