"""ActivationPolicy (which skeletal tensors stay, go to host, or are recomputed) and the α solver."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from .units import format_bytes

Strategy = Literal["none", "full", "memo"]
STRATEGIES = ("none", "full", "memo")


@dataclass(frozen=True)
class ActivationPolicy:
    """How a model keeps the tensors its backward needs.

    - `none`: every skeletal tensor stays on the device.
    - `full`: only each layer's input stays; the layer is recomputed before its backward.
    - `memo`: memo-method.md §3-4; `alpha` is a float, one value per layer, or None (solved from measured
      layer time, copy bandwidth and `host_budget_bytes`). The last two layers stay on the device unless
      `offload_last_layers`.
    """

    strategy: Strategy = "none"
    alpha: float | tuple[float, ...] | None = None
    host_budget_bytes: int | None = None
    offload_last_layers: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"`--strategy` must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if isinstance(self.alpha, (list, tuple)):
            object.__setattr__(self, "alpha", tuple(float(a) for a in self.alpha))
            values = self.alpha
        else:
            values = () if self.alpha is None else (self.alpha,)
        for a in values:
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"`--alpha` must be in [0, 1], got {a}")
        if self.alpha is not None and self.strategy != "memo":
            raise ValueError(f"`--alpha` applies only to strategy 'memo', not {self.strategy!r}")
        if self.host_budget_bytes is not None and self.host_budget_bytes <= 0:
            raise ValueError(f"`--host-budget` must be positive, got {self.host_budget_bytes} bytes")

    def layer_alphas(self, n_layers: int) -> list[float] | None:
        """Returns α for each layer, or None when α is to be solved."""
        if self.alpha is None:
            return None
        if isinstance(self.alpha, tuple):
            if len(self.alpha) != n_layers:
                raise ValueError(f"`--alpha` lists {len(self.alpha)} values for a model of {n_layers} layers")
            return list(self.alpha)
        return [float(self.alpha)] * n_layers

    def offloaded_layers(self, n_layers: int) -> list[int]:
        """Returns the indices of the layers whose skeletal tensors go to host (§3: not the last two)."""
        if self.strategy != "memo":
            return []
        return list(range(n_layers if self.offload_last_layers else max(n_layers - 2, 0)))

    def reloaded_layers(self, n_layers: int) -> list[int]:
        """Returns the offloaded layers whose backward needs their tensors back (prefetch + recompute): the
        last two keep theirs in the rounding buffers, which no later layer overwrites (§4)."""
        return [i for i in self.offloaded_layers(n_layers) if i + 2 < n_layers]


def split_row(alpha: float, seq_len: int) -> int:
    """Returns how many leading tokens are offloaded for `alpha` (floor: the copy must stay hidden)."""
    return min(seq_len, math.floor(alpha * seq_len + 1e-9))


@dataclass(frozen=True)
class AlphaProblem:
    """The per-GPU quantities of memo-method.md §3, bytes and seconds."""

    input_bytes: int
    attention_bytes: int
    other_bytes: int
    bandwidth: float
    layer_seconds: float
    host_budget: int
    offloaded_layers: int


def solve_alpha(p: AlphaProblem) -> float:
    """Returns the largest α in [0, 1] meeting the copy-time and host-memory constraints of §3.

    Raises ValueError when even α = 0 does not fit the host budget: that must be reported before training.
    """
    fixed = p.input_bytes + p.attention_bytes
    if p.offloaded_layers * fixed > p.host_budget:
        raise ValueError(
            f"host memory cannot hold the offload: {p.offloaded_layers} layers x {format_bytes(fixed)} of input and "
            f"attention output need {format_bytes(p.offloaded_layers * fixed)} at alpha=0, "
            f"budget is {format_bytes(p.host_budget)}"
        )
    if p.other_bytes == 0 or p.offloaded_layers == 0:
        return 1.0
    by_time = (p.bandwidth * p.layer_seconds - fixed) / p.other_bytes
    by_host = (p.host_budget / p.offloaded_layers - fixed) / p.other_bytes
    return max(0.0, min(1.0, by_time, by_host))
