"""LoRA (Hu et al., arXiv 2106.09685): a frozen base weight W plus a trainable low-rank update, y = x·Wᵀ + b +
s·(x·Aᵀ)·Bᵀ with A (r, in), B (out, r) and s = alpha / r, as PEFT's `LoraLayer` defines it (A Kaiming-uniform,
B zero, so training starts from the base model).

The decoder layer's explicit forward and backward call `low_rank_add` / `low_rank_backward` for every linear
that is a `LoraLinear`, tile by tile like the rest: the product never exists at full width, only the (tokens, r)
intermediate. A frozen W gets no gradient at all: the backward skips its dW product, it does not compute and
discard it. `apply_lora` freezes every base parameter (embeddings, norms, head included) and swaps the target
projections for `LoraLinear`s that share the base weight tensors.

Dropout (PEFT's `lora_dropout`, on the adapter's input) cannot draw from a generator's stream: the token-wise
recompute rebuilds some rows in other tiles than the forward made them, so the mask is a counter-based hash of
(step key, layer, projection, sequence, global token position, feature), `keep_mask`.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
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
    """Low-rank adapters on the projections `targets` of every layer: rank r, scale alpha / r, and the dropout
    probability of their input."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = ALL_TARGETS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.dropout < 1:
            raise ValueError(f"`--lora-dropout` must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"`--lora-rank` must be a positive integer, got {self.rank!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"`--lora-alpha` must be a finite number > 0, got {self.alpha!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(
                f"`--lora-targets` must name distinct projections among {','.join(TARGETS)}, "
                f"got {','.join(self.targets)!r}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def modules(self, config: ModelConfig) -> list[str]:
        """Returns the layer modules that get adapters (those the layer has: a GPT layer has no gate)."""
        shapes = module_shapes(config)
        return [TARGETS[t][0] for t in self.targets if TARGETS[t][0] in shapes]


def lora_of_flags(
    rank: int, alpha: float | None = None, targets: tuple[str, ...] | None = None, dropout: float | None = None
) -> LoraConfig | None:
    """Returns the adapters the `--lora-*` flags ask for (None: full fine-tuning; None for the others: not given,
    their defaults): the one check of them that `memo train` and `memo estimate` share. A flag of the adapters
    given without a rank would be dropped while every weight trains, the opposite of what was asked: refused."""
    if rank < 0:
        raise ValueError(f"`--lora-rank` must not be negative, got {rank}")
    given = {"alpha": alpha, "targets": targets, "dropout": dropout}
    if rank:
        return LoraConfig(rank, **{name: value for name, value in given.items() if value is not None})
    named = [name for name, value in given.items() if value is not None]
    if named:
        raise ValueError(f"`--lora-{named[0]}` applies to LoRA's adapters: give `--lora-rank` too")
    return None


def check_targets(lora: LoraConfig, config: ModelConfig) -> None:
    """Raises ValueError when `--lora-targets` names a projection `config`'s layers lack (a GPT layer has no gate):
    those adapters would silently not exist, and with none left nothing would train."""
    if lora.targets == ALL_TARGETS:  # the default: every projection the layer has
        return
    shapes = module_shapes(config)
    absent = [t for t in lora.targets if TARGETS[t][0] not in shapes]
    if absent and config.moe:
        raise ValueError(
            f"`--lora-targets` names {','.join(absent)}: adapters on {config.name}'s experts are not built (they "
            "would need PEFT's `target_parameters` arithmetic); adapt its attention projections q,k,v,o"
        )
    if absent:
        has = ",".join(t for t in TARGETS if TARGETS[t][0] in shapes)
        raise ValueError(
            f"`--lora-targets` names {','.join(absent)}, which {config.name}'s layers lack (they have {has})"
        )


def targets_value(text: str) -> tuple[str, ...]:
    """Returns `--lora-targets` as written: names separated by commas (checked by LoraConfig)."""
    return tuple(part.strip() for part in text.split(","))


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Returns (in, out) features of each projection a decoder layer has (SwiGLU's gate: Llama only; a mixture of
    experts' layer has attention's alone: its experts are stacked tensors, not projections)."""
    h, d, f = config.hidden_size, config.head_dim, config.ffn_hidden_size
    qd, kvd = config.n_heads * d, config.n_kv_heads * d
    shapes = {"wq": (h, qd), "wk": (h, kvd), "wv": (h, kvd), "wo": (qd, h)}
    if config.moe:
        return shapes
    if config.arch == "llama":
        shapes["w_gate"] = (h, f)
    return {**shapes, "w_up": (h, f), "w_down": (f, h)}


def adapter_parameters(config: ModelConfig, lora: LoraConfig) -> int:
    """Returns the number of trainable adapter parameters of the whole model: r·(in + out) per target and layer."""
    shapes = module_shapes(config)
    return config.n_layers * sum(lora.rank * sum(shapes[m]) for m in lora.modules(config))


class LoraLinear(nn.Linear):
    """An nn.Linear (weight and bias as before, frozen) with adapters `lora_A` (r, in) and `lora_B` (out, r)."""

    def __init__(self, base: nn.Linear, rank: int, scaling: float, dropout: float = 0.0):
        nn.Module.__init__(self)  # not nn.Linear's: the base's own weight and bias are taken, not made
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.scaling, self.dropout = scaling, dropout
        self.dropout_key: int | None = None  # set for each training forward (`set_dropout_keys`); None: no dropout
        like = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **like))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # PEFT's default init of A

    @classmethod
    def view(cls, tensors: dict[str, torch.Tensor | None], scaling: float, dropout: float, key: int | None):
        """Returns a LoraLinear over tensors it does not own (weight, bias, lora_A, lora_B: a patched transformers
        layer's, `memo.patch`), registered as they are so that the layer's backward names their gradients."""
        view = cls.__new__(cls)
        nn.Module.__init__(view)
        view.out_features, view.in_features = tensors["weight"].shape
        view._parameters.update(tensors)  # not nn.Parameter's check: a cast or summed tensor is a weight here
        view.scaling, view.dropout, view.dropout_key = scaling, dropout, key
        return view

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.shape[0]}, scaling={self.scaling:g}"


def apply_lora(model: nn.Module, lora: LoraConfig) -> nn.Module:
    """Freezes every parameter of `model` (a memo.Transformer) and gives the `lora` targets adapters; returns it.
    Call it before FSDP wraps the model and before the optimizer is built."""
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.layers:
        for name in lora.modules(model.config):
            setattr(layer, name, LoraLinear(getattr(layer, name), lora.rank, lora.scaling, lora.dropout))
    return model


def set_dropout_keys(model: nn.Module, key: int | None) -> None:
    """Gives every adapter of `model` (a memo.Transformer) its dropout key for the coming forward and backward,
    derived from `key` (one per step and micro-batch), its layer and its projection; None turns dropout off."""
    for layer in model.layers:
        for name, _ in TARGETS.values():
            lin = getattr(layer, name, None)
            if isinstance(lin, LoraLinear):
                lin.dropout_key = adapter_key(key, layer.index, name)


@contextmanager
def keys_of(layer: nn.Module, keys: dict[str, int | None]):
    """Gives the adapters of `layer` the dropout `keys` a forward ran with (`dropout_keys`), for its backward: a
    forward in between (under no_grad: dropout off) must not change the mask the backward applies."""
    before = dropout_keys(layer)
    for name, key in keys.items():
        getattr(layer, name).dropout_key = key
    try:
        yield
    finally:
        for name, key in before.items():
            getattr(layer, name).dropout_key = key


def dropout_keys(layer: nn.Module) -> dict[str, int | None]:
    """Returns the dropout key of each adapter of `layer` by module name."""
    return {name: m.dropout_key for name, m in layer.named_children() if isinstance(m, LoraLinear)}


def adapter_key(key: int | None, layer: int, module: str) -> int | None:
    """Returns the dropout key of the adapter on `module` (`wq`) of `layer` for a forward keyed `key` (None: off)."""
    ordinal = [name for name, _ in TARGETS.values()].index(module)
    return None if key is None else (key * 1_000_003 + layer) * 16 + ordinal


def low_rank_add(out: torch.Tensor, x: torch.Tensor, lin: nn.Linear, pos: torch.Tensor | None = None):
    """Adds s·(dropout(x)·Aᵀ)·Bᵀ to `out` (rows of x, (b, r, out)) in place when `lin` has adapters; returns
    `out`. `pos` (1, r) are the rows' global token positions, which key the dropout mask."""
    if not isinstance(lin, LoraLinear):
        return out
    xa = dropped(x, lin, pos) @ lin.lora_A.t()  # (b, r, rank)
    if out.is_contiguous():
        flat = out.view(-1, out.shape[-1])
        torch.addmm(flat, xa.reshape(-1, xa.shape[-1]), lin.lora_B.t(), alpha=lin.scaling, out=flat)
    else:  # token rows of several sequences: each sequence's rows are contiguous
        for xa_b, out_b in zip(xa, out):
            torch.addmm(out_b, xa_b, lin.lora_B.t(), alpha=lin.scaling, out=out_b)
    return out


def low_rank_backward(dy, x, lin: nn.Linear, name: str, grads: dict, dx: torch.Tensor, pos=None) -> None:
    """Adds the adapters' gradients of y += s·(dropout(x)·Aᵀ)·Bᵀ for rows dy (b, r, out), x (b, r, in) to
    `grads`, and their part of the input gradient, dropout's backward of s·(dy·B)·A, to `dx` (b, r, in) in
    place; nothing without adapters."""
    if not isinstance(lin, LoraLinear):
        return
    s, flat = lin.scaling, lambda t: t.reshape(-1, t.shape[-1])
    xd = flat(dropped(x, lin, pos))
    dyb = flat(dy) @ lin.lora_B  # (n, rank)
    xa = xd @ lin.lora_A.t()  # (n, rank): recomputed, as cheap as keeping it
    add_mm(grads, name + ".lora_A", dyb.t() * s, xd)  # (rank, in)
    add_mm(grads, name + ".lora_B", flat(dy).t(), xa * s)  # (out, rank)
    if _dropout_on(lin, pos):  # the mask and its scale again: dropout's backward
        dx.add_(dropped((dyb @ lin.lora_A).view(dx.shape), lin, pos), alpha=s)
    else:
        torch.addmm(flat(dx), dyb, lin.lora_A, alpha=s, out=flat(dx))


def drops_out(module: nn.Module) -> bool:
    """Returns whether `module` is an adapter whose dropout is on for the coming forward and backward."""
    return isinstance(module, LoraLinear) and module.dropout > 0 and module.dropout_key is not None


def _dropout_on(lin: LoraLinear, pos) -> bool:
    return drops_out(lin) and pos is not None


def dropped(x: torch.Tensor, lin: LoraLinear, pos: torch.Tensor | None) -> torch.Tensor:
    """Returns LoRA dropout of x (b, r, in): x·keep/(1 - p), the mask a pure function of the adapter's key, the
    sequence, the token's global position and the feature, so that the forward, the token-wise recompute and the
    backward drop the same entries whatever the tiles; x itself when dropout is off."""
    if not _dropout_on(lin, pos):
        return x
    keep = keep_mask(lin.dropout_key, pos, x.shape[0], x.shape[-1], lin.dropout)
    return x * keep.to(x.dtype) / (1 - lin.dropout)


# murmur3's 32-bit finaliser constants (0x85ebca6b, 0xc2b2ae35) and the golden ratio (0x9e3779b9), as int32
_MIX1, _MIX2, _GOLDEN = -2048144789, -1028477387, -1640531527


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on int32 (products wrap; right shifts masked to be logical)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _MIX1
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _MIX2
    return h ^ ((h >> 16) & 0xFFFF)


def keep_mask(key: int, pos: torch.Tensor, batch: int, features: int, p: float) -> torch.Tensor:
    """Returns the (batch, r, features) keep mask of tokens at global positions `pos` (1, r): True with
    probability 1 - p, from a counter-based hash (no generator state, any subset of rows alike)."""
    key32 = ((key & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000
    rows = pos.to(torch.int32) ^ key32  # (1, r)
    sequences = torch.arange(batch, dtype=torch.int32, device=pos.device)[:, None] * _GOLDEN
    row = _fmix(_fmix(rows) + sequences)  # (b, r)
    feature = torch.arange(features, dtype=torch.int32, device=pos.device) * _GOLDEN
    bits = (_fmix(row[..., None] + feature) >> 8) & 0xFFFFFF  # (b, r, features), 24 uniform bits
    return bits >= round(p * (1 << 24))


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
