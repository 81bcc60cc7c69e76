"""LoRA (Hu et al., arXiv 2106.09685): a frozen base weight W plus a trainable low-rank update, y = x·Wᵀ + b +
s·(x·Aᵀ)·Bᵀ with A (r, in), B (out, r) and s = alpha / r, as PEFT's `LoraLayer` defines it (A Kaiming-uniform,
B zero, so training starts from the base model).

The decoder layer's explicit forward and backward call `low_rank_add` / `low_rank_backward` for every linear
that is a `LoraLinear`, tile by tile like the rest: the product never exists at full width, only the (tokens, r)
intermediate. A frozen W gets no gradient at all: the backward skips its dW product, it does not compute and
discard it. `apply_lora` freezes every base parameter (embeddings, norms, head included) and swaps the target
projections for `LoraLinear`s that share the base weight tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .config import ModelConfig
from .matmul import add_mm

# `--lora-targets` name -> the decoder layer's module, and the name PEFT gives it in Llama/Qwen/Mistral
TARGETS = {
    "q": ("wq", "q_proj"),
    "k": ("wk", "k_proj"),
    "v": ("wv", "v_proj"),
    "o": ("wo", "o_proj"),
    "gate": ("w_gate", "gate_proj"),
    "up": ("w_up", "up_proj"),
    "down": ("w_down", "down_proj"),
}
ALL_TARGETS = tuple(TARGETS)


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the projections `targets` of every layer: rank r and scale alpha / r."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = ALL_TARGETS

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"`--lora-rank` must be a positive integer, got {self.rank!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"`--lora-alpha` must be a finite number > 0, got {self.alpha!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(
                f"`--lora-targets` must name distinct projections among {','.join(TARGETS)}, got {','.join(self.targets)!r}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def modules(self, config: ModelConfig) -> list[str]:
        """Returns the layer modules that get adapters (a GPT layer has no gate)."""
        names = [TARGETS[t][0] for t in self.targets]
        return [n for n in names if not (n == "w_gate" and config.arch == "gpt")]


def targets_value(text: str) -> tuple[str, ...]:
    """Returns `--lora-targets` as written: names separated by commas (checked by LoraConfig)."""
    return tuple(part.strip() for part in text.split(","))


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Returns (in, out) features of each projection of a decoder layer."""
    h, d, f = config.hidden_size, config.head_dim, config.ffn_hidden_size
    qd, kvd = config.n_heads * d, config.n_kv_heads * d
    return {"wq": (h, qd), "wk": (h, kvd), "wv": (h, kvd), "wo": (qd, h), "w_gate": (h, f), "w_up": (h, f), "w_down": (f, h)}


def adapter_parameters(config: ModelConfig, lora: LoraConfig) -> int:
    """Returns the number of trainable adapter parameters of the whole model: r·(in + out) per target and layer."""
    shapes = module_shapes(config)
    return config.n_layers * sum(lora.rank * sum(shapes[m]) for m in lora.modules(config))


class LoraLinear(nn.Linear):
    """An nn.Linear (weight and bias as before, frozen) with adapters `lora_A` (r, in) and `lora_B` (out, r)."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float):
        nn.Module.__init__(self)  # not nn.Linear's: the base's own weight and bias are taken, not made
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.scaling = scaling
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **like))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's default init of A

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


def apply_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """Freezes every parameter of `model` (a memo.Transformer) and gives the `lora` targets adapters; returns it.
    Call it before FSDP wraps the model and before the optimizer is built."""
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.layers:
        for name in lora.modules(model.config):
            setattr(layer, name, LoraLinear(getattr(layer, name), lora.rank, lora.scaling))
    return model


def low_rank_add(out: torch.Tensor, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """Adds s·(x·Aᵀ)·Bᵀ to `out` (rows of x, (b, r, out)) in place when `lin` has adapters; returns `out`."""
    if not isinstance(lin, LoraLinear):
        return out
    xa = x @ lin.lora_A.t()  # (b, r, rank)
    if out.is_contiguous():
        flat = out.view(-1, out.shape[-1])
        torch.addmm(flat, xa.reshape(-1, xa.shape[-1]), lin.lora_B.t(), alpha=lin.scaling, out=flat)
    else:  # token rows of several sequences: each sequence's rows are contiguous
        for xa_b, out_b in zip(xa, out):
            torch.addmm(out_b, xa_b, lin.lora_B.t(), alpha=lin.scaling, out=out_b)
    return out


def low_rank_backward(dy: torch.Tensor, x: torch.Tensor, lin: nn.Linear, name: str, grads: dict, dx: torch.Tensor):
    """Adds the adapters' gradients of y += s·(x·Aᵀ)·Bᵀ for flat rows dy (n, out), x (n, in) to `grads`, and
    their part of the input gradient, s·(dy·B)·A, to the flat rows `dx` (n, in) in place; nothing without
    adapters."""
    if not isinstance(lin, LoraLinear):
        return
    s = lin.scaling
    dyb = dy @ lin.lora_B  # (n, rank)
    xa = x @ lin.lora_A.t()  # (n, rank): recomputed, as cheap as keeping it
    add_mm(grads, name + ".lora_A", dyb.t() * s, x)  # (rank, in)
    add_mm(grads, name + ".lora_B", dy.t(), xa * s)  # (out, rank)
    torch.addmm(dx, dyb, lin.lora_A, alpha=s, out=dx)


def adapter_names(weights: dict[str, torch.Tensor]) -> list[str]:
    """Returns the projections (`layers.i.wq`) that carry adapters in a state dict, in order."""
    return [name[: -len(".lora_A")] for name in weights if name.endswith(".lora_A")]


def merge_adapters(weights: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Returns `weights` with every adapter folded into its base weight, W + s·B·A (in float32, then W's dtype),
    and the adapter tensors gone: the plain weights of the fine-tuned model."""
    merged = {name: t for name, t in weights.items() if not name.endswith((".lora_A", ".lora_B"))}
    for module in adapter_names(weights):
        base = weights[module + ".weight"]
        update = weights[module + ".lora_B"].float() @ weights[module + ".lora_A"].float()
        merged[module + ".weight"] = (base.float() + scaling * update).to(base.dtype)
    return merged
