"""ActivationPolicy (where each layer's skeletal tensors live between its forward and its backward), the tile
length, and the plan solver: α and a mode per layer (docs/method.md §3, generalised).

Modes of a layer:
- `keep`: every skeletal tensor stays on the device (whole-length), nothing copied or recomputed;
- `memo`: the layer input and attention output (+LSE) go to host, and α of the token rows of every other
  tensor; the rest are recomputed token-wise before the backward (attention never is);
- `checkpoint`: only the input goes to host; the whole layer, attention included, runs again before its
  backward (the regime of systems that checkpoint layer inputs to host memory);
- `recompute` (strategy `full` only): the input stays on the device, the whole layer runs again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from .attention import check_choice
from .units import format_bytes

Strategy = Literal["none", "full", "memo"]
STRATEGIES = ("none", "full", "memo")
Mode = Literal["keep", "memo", "checkpoint", "recompute"]
MODES = ("keep", "memo", "checkpoint")  # what a `memo` plan may say per layer
BUFFERED = ("memo", "checkpoint")  # the modes whose whole-length tensors live in the two rounding buffers
# A plan may be this fraction of its layers' compute slower than the fastest to pin less host memory: ten times
# inside the ±10% the published kernel speeds leave a prediction (cost.efficiency), so no prediction tells such
# plans apart, while every TB pinned takes the OS's memory and minutes of start-up (docs/estimate.md, host memory)
HOST_SLACK = 0.01
DEFAULT_TILE_TOKENS = 8192  # rows per tile: full-speed matmuls on a GPU, tile tensors small beside the rest


@dataclass(frozen=True)
class ActivationPolicy:
    """How a model keeps the tensors its backward needs.

    - `none`: every layer `keep`.
    - `full`: every layer `recompute`.
    - `memo`: `plan` (a mode per layer; default every layer `memo`) with `alpha` a float, one value per
      layer, or None (solved with the plan from measured layer time, copy bandwidth, `host_budget_bytes` and
      `device_budget_bytes`: the plan then mixes modes). The last buffered layer of each parity keeps its
      whole-length tensors in its rounding buffer through its backward unless `offload_last_layers`.

    `tile_tokens` is the length of the token tiles of the token-local work (default `DEFAULT_TILE_TOKENS`,
    or the whole sequence when shorter; None: untiled, as the cost model's `Layout.tile` and `Traced.tile`
    say); `attention_heads` how many query heads each attention kernel call
    takes at most (default `attention.heads_per_call`: on a GPU about a tile's rows of every head);
    `attention` the attention kernel (`attention.CHOICES`, default the fastest that runs);
    `gradient_over_input`: a layer backward whose input went to host writes attention's output gradient over the
    input's device bytes and takes the input back from host for its q, k, v tiles (`layer.backward_phase`): one
    whole-length tensor less, for one copy of the input that nothing hides on a GPU;
    `shared_layers` (with `empty_buffers`): how many of the lowest buffered layers hold one rounding buffer at their
    backward, where the parameter gradients pile up: 1 frees the buffer of the layer above the lowest, and each
    more makes one more layer reload after the backward above it, a copy nothing hides on a GPU.
    """

    strategy: Strategy = "none"
    alpha: float | tuple[float, ...] | None = None
    host_budget_bytes: int | None = None
    offload_last_layers: bool = False
    empty_buffers: bool = False
    plan: tuple[str, ...] | None = None
    tile_tokens: int | None = DEFAULT_TILE_TOKENS  # None: untiled, the whole sequence (shard) at once
    device_budget_bytes: int | None = None
    attention_heads: int | None = None
    attention: str = "auto"
    gradient_over_input: bool = False
    shared_layers: int = 1

    def __post_init__(self) -> None:
        check_choice(self.attention)
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
        if self.plan is not None:
            object.__setattr__(self, "plan", tuple(self.plan))
            if self.strategy != "memo":
                raise ValueError(f"`--plan` applies only to strategy 'memo', not {self.strategy!r}")
            for mode in self.plan:
                if mode not in MODES:
                    raise ValueError(f"`--plan` modes must be {', '.join(MODES)}, got {mode!r}")
        if self.host_budget_bytes is not None and self.host_budget_bytes <= 0:
            raise ValueError(f"`--host-budget` must be positive, got {self.host_budget_bytes} bytes")
        if self.tile_tokens is not None and self.tile_tokens <= 0:
            raise ValueError(f"`--tile-tokens` must be positive, got {self.tile_tokens}")
        if self.attention_heads is not None and self.attention_heads <= 0:
            raise ValueError(f"`--attention-heads` must be positive, got {self.attention_heads}")
        if self.shared_layers < 1 or (self.shared_layers > 1 and not self.empty_buffers):
            raise ValueError(f"`shared_layers` must be 1, or more with `empty_buffers`, got {self.shared_layers}")
        if self.device_budget_bytes is not None and self.device_budget_bytes < 0:
            raise ValueError(f"`--device-budget` must not be negative, got {self.device_budget_bytes} bytes")

    def layer_alphas(self, n_layers: int) -> list[float] | None:
        """Returns α for each layer, or None when α is to be solved."""
        if self.alpha is None:
            return None
        if isinstance(self.alpha, tuple):
            if len(self.alpha) != n_layers:
                raise ValueError(f"`--alpha` lists {len(self.alpha)} values for a model of {n_layers} layers")
            return list(self.alpha)
        return [float(self.alpha)] * n_layers

    def layer_modes(self, n_layers: int) -> list[str] | None:
        """Returns each layer's mode, or None when the plan is to be solved (memo, no plan, α solved)."""
        if self.strategy == "none":
            return ["keep"] * n_layers
        if self.strategy == "full":
            return ["recompute"] * n_layers
        if self.plan is None:
            return None if self.alpha is None else ["memo"] * n_layers
        if len(self.plan) != n_layers:
            raise ValueError(f"`--plan` lists {len(self.plan)} modes for a model of {n_layers} layers")
        return list(self.plan)

    def least_host_plan(self, n_layers: int) -> tuple[list[str], list[float]]:
        """Returns the plan (mode and α per layer) of the least host memory this policy can end up with: its
        own, with what is still to be solved at its least (α = 0; every layer checkpointed)."""
        modes = self.layer_modes(n_layers) or ["checkpoint"] * n_layers
        return modes, mode_alphas(modes, self.layer_alphas(n_layers) or [0.0] * n_layers)

    def tile_for(self, seq: int) -> int:
        """Returns the tile length for a sequence (shard) of `seq` tokens."""
        return min(seq, self.tile_tokens or seq)


def plan_runs(modes: list[str] | None, alphas: list[float] | None) -> str:
    """Returns each layer's mode (and α) as runs, e.g. 'checkpoint x3, memo (0.40) x27, keep x2' ('-' when
    nothing is offloaded)."""
    if not modes:
        return "-"
    runs: list[list] = []
    for mode, a in zip(modes, alphas):
        label = f"memo ({a:.2f})" if mode == "memo" else mode
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    return ", ".join(f"{label} x{k}" for label, k in runs)


def reloaded(modes: list[str], empty: bool = False) -> list[bool]:
    """Returns, per layer, whether its rounding buffer is overwritten before its backward (by a later buffered
    layer of the same parity, or emptied across the loss when `empty`), so its whole-length tensors must come
    back from host (§4)."""
    if empty:
        return [m in BUFFERED for m in modes]
    later = [False, False]
    out = [False] * len(modes)
    for i in reversed(range(len(modes))):
        if modes[i] in BUFFERED:
            out[i] = later[i % 2]
            later[i % 2] = True
    return out


def offloaded(modes: list[str], offload_last_layers: bool = False, empty: bool = False) -> list[bool]:
    """Returns, per layer, whether its input (and for `memo` its attention output) goes to host: every
    buffered layer that is reloaded, and the last ones too when asked."""
    back = reloaded(modes, empty)
    return [m in BUFFERED and (back[i] or offload_last_layers) for i, m in enumerate(modes)]


def mode_alphas(modes: list[str], alphas: list[float]) -> list[float]:
    """Returns the α each layer really has: its own for memo, 1 for keep (all rows kept), 0 otherwise."""
    return [a if m == "memo" else 1.0 if m == "keep" else 0.0 for m, a in zip(modes, alphas)]


def slot_survives(modes: list[str], tiled: bool, empty: bool = False) -> list[bool]:
    """Returns, per layer, whether its token-local tensors are still in its tile slot at its backward: one tile
    covers the sequence (nothing reuses the slot within the layer) and no later layer overwrites its buffer."""
    back = reloaded(modes, empty)
    return [m in BUFFERED and not back[i] and not tiled for i, m in enumerate(modes)]


def split_row(alpha: float, seq_len: int) -> int:
    """Returns how many leading tokens are offloaded for `alpha` (floor: the copy must stay hidden)."""
    return min(seq_len, math.floor(alpha * seq_len + 1e-9))


@dataclass(frozen=True)
class PlanProblem:
    """One GPU's quantities for the plan (§3 generalised): one layer's bytes and seconds, the budgets.

    `other_bytes` are the token-split tensors of a layer (q, k, v and the token-local ones, whole-length);
    `local_bytes` their token-local part alone (what a layer whose rounding buffer survives sends by α).
    Seconds: `layer_seconds` the forward, `backward_seconds` the backward, `attention_seconds` the forward's
    attention, `qkv_seconds` and `mlp_seconds` the token-local work before and after attention that a
    recompute runs again (what α spares).
    """

    n_layers: int
    input_bytes: int
    attention_bytes: int
    other_bytes: int
    local_bytes: int
    keep_bytes: int
    bandwidth: float
    layer_seconds: float
    backward_seconds: float
    attention_seconds: float
    qkv_seconds: float
    mlp_seconds: float
    host_budget: int
    device_budget: int = 0
    offload_last_layers: bool = False
    empty_buffers: bool = False  # the rounding buffers are freed across the loss: every buffered layer reloaded
    tiled: bool = True  # more than one tile: no layer's token-local tensors survive in its tile slot
    slack: float | None = None  # of the layers' compute a plan may add over the fastest to pin less host (HOST_SLACK)

    @property
    def slack_seconds(self) -> float:
        slack = HOST_SLACK if self.slack is None else self.slack
        return slack * self.n_layers * (self.layer_seconds + self.backward_seconds)


@lru_cache(maxsize=4096)
def _flags(modes: tuple[str, ...], offload_last_layers: bool, tiled: bool, empty: bool) -> tuple[list[bool], ...]:
    """Returns (`offloaded`, `reloaded`, `slot_survives`) of a plan: the solver asks them of the same plans
    again and again (a `--max-seq` search a million times)."""
    m = list(modes)
    return offloaded(m, offload_last_layers, empty), reloaded(m, empty), slot_survives(m, tiled, empty)


def _parts(p: PlanProblem, modes: list[str]) -> list[tuple[float, float, float, float]]:
    """Returns per layer (host bytes, host bytes per unit of α, seconds recomputed, of which α spares) as §3
    and its generalisation say for the layer's mode: memo sends the input and attention output when its
    rounding buffer is overwritten before its backward, and α of the rows of q, k, v then and of its token-local
    tensors unless they survive in the layer's own tile slot (a single tile, the buffer not overwritten);
    checkpoint sends the input and runs the layer again; recompute keeps the input and runs it again."""
    sent, back, survive = _flags(tuple(modes), p.offload_last_layers, p.tiled, p.empty_buffers)
    qkv_rows = p.other_bytes - p.local_bytes
    parts = []
    for i, mode in enumerate(modes):
        local, mlp = (0.0, 0.0) if survive[i] else (p.local_bytes, p.mlp_seconds)
        qkv = p.qkv_seconds if back[i] else 0.0
        if mode == "memo":
            whole = p.input_bytes + p.attention_bytes if sent[i] else 0.0
            parts.append((whole, (qkv_rows if sent[i] else 0.0) + local, 0.0, mlp + qkv))
        elif mode == "checkpoint":
            again = mlp + (p.attention_seconds + qkv if back[i] else 0.0)
            parts.append((p.input_bytes if sent[i] else 0.0, 0.0, again, 0.0))
        elif mode == "recompute":
            parts.append((0.0, 0.0, p.mlp_seconds + p.attention_seconds + p.qkv_seconds, 0.0))
        else:
            parts.append((0.0, 0.0, 0.0, 0.0))
    return parts


def host_bytes(p: PlanProblem, modes: list[str], alphas: list[float]) -> float:
    """Returns the host bytes a plan keeps: §3's per-layer offload, by mode."""
    return sum(fixed + a * per_alpha for (fixed, per_alpha, _, _), a in zip(_parts(p, modes), alphas))


def plan_costs(p: PlanProblem, modes: list[str], alphas: list[float]) -> dict[str, float]:
    """Returns what a plan adds to a step over keeping everything, in seconds: "recompute" (the token-local
    work of the rows not kept, and a checkpointed layer's forward) and "exposed_copy" (the part of each
    offload that does not hide behind the layer's forward, and of each prefetch behind the backward above).

    With FLOPs for the seconds and an infinite bandwidth it counts the recomputed FLOPs (cost/flops.py)."""
    back = _flags(tuple(modes), p.offload_last_layers, p.tiled, p.empty_buffers)[1]
    recompute = copy = 0.0
    for i, ((fixed, per_alpha, again, spared), a) in enumerate(zip(_parts(p, modes), alphas)):
        recompute += again + (1 - a) * spared
        host = fixed + a * per_alpha
        copy += max(0.0, host / p.bandwidth - p.layer_seconds) if host else 0.0
        copy += max(0.0, host / p.bandwidth - p.backward_seconds) if host and back[i] else 0.0
    return {"recompute": recompute, "exposed_copy": copy}


def plan_seconds(p: PlanProblem, modes: list[str], alphas: list[float]) -> float:
    """Returns the seconds a plan adds to a step (`plan_costs`, summed)."""
    return sum(plan_costs(p, modes, alphas).values())


def _alphas(p: PlanProblem, modes: list[str]) -> list[float] | None:
    """Returns α per layer: for the memo layers that send their whole-length tensors the largest α whose copy
    hides behind the forward and whose host bytes fit the budget, then with what host is left the same for
    the other memo layers (a row kept for them spares less recomputation per byte: their q, k, v rows stay on
    the device anyway); 1 where nothing is left to send; None when the plan does not fit even at α = 0."""
    sent = offloaded(modes, p.offload_last_layers, p.empty_buffers)
    parts = _parts(p, modes)
    alphas = [0.0] * p.n_layers
    left = p.host_budget - host_bytes(p, modes, alphas)
    if left < 0:
        return None
    for sends in (True, False):
        layers = [i for i, m in enumerate(modes) if m == "memo" and sent[i] == sends]
        row_bytes = sum(parts[i][1] for i in layers)
        if not row_bytes:
            for i in layers:
                alphas[i] = 1.0
            continue
        copy_room = p.bandwidth * p.layer_seconds - (p.input_bytes + p.attention_bytes if sends else 0.0)
        a = max(0.0, min(1.0, copy_room * len(layers) / row_bytes, left / row_bytes))
        for i in layers:
            alphas[i] = a
        left -= a * row_bytes
    return mode_alphas(modes, alphas)


def solve_plan(p: PlanProblem, modes: list[str] | None = None) -> tuple[list[str], list[float]]:
    """Returns (mode per layer, α per layer) of the least host memory whose `plan_seconds` is within
    `p.slack_seconds` of the fastest plan's, within the host and device budgets; `modes` fixes the plan and
    leaves α alone to solve. Pinned host is not free: it is taken from the OS, the page cache and checkpoint
    staging, and pinning it costs start-up time (`HOST_SLACK`).

    Keep layers (the last ones, as many as `device_budget` holds) cost nothing; then every memo layer, then
    one checkpointed layer more at a time (the first layers) while the host runs short: α first spends the
    host on the token-local tensors, a checkpointed layer gives back its attention output. Raises ValueError
    when even checkpointing every buffered layer does not fit the host budget: that must be reported before
    training starts.
    """
    candidates = [modes] if modes is not None else _candidate_plans(p)
    fastest = _fastest(p, candidates)
    if fastest is None:
        least = min(candidates, key=lambda m: host_bytes(p, m, [0.0] * p.n_layers))
        need = host_bytes(p, least, [0.0] * p.n_layers)
        what = "the layer inputs alone" if modes is None else "this plan at alpha=0"
        raise ValueError(
            f"host memory cannot hold the offload: {what} need {format_bytes(int(need))}, "
            f"the host budget is {format_bytes(p.host_budget)}"
        )
    allowed = fastest[0] + p.slack_seconds
    lo, hi = least_host(p, candidates), host_bytes(p, fastest[1], fastest[2])
    best = fastest
    for _ in range(40):  # the least budget whose fastest plan is within the slack: seconds fall as it grows
        if hi - lo <= max(1.0, 1e-4 * hi):
            break
        budget = (lo + hi) / 2
        found = _fastest(dataclasses.replace(p, host_budget=int(budget)), candidates)
        if found is not None and found[0] <= allowed:
            best, hi = found, budget
        else:
            lo = budget
    return best[1], best[2]


def _fastest(p: PlanProblem, candidates: list[list[str]]) -> tuple[float, list[str], list[float]] | None:
    """Returns (seconds, modes, α) of the fastest of `candidates` within the budgets, None if none fits."""
    best = None
    for plan in candidates:
        alphas = _alphas(p, plan)
        if alphas is None:
            continue
        seconds = plan_seconds(p, plan, alphas)
        if best is None or seconds < best[0] - 1e-12:
            best = (seconds, plan, alphas)
    return best


def least_host(p: PlanProblem, candidates: list[list[str]] | None = None) -> float:
    """Returns the host bytes of the plan that pins least (the most checkpointed layers, α = 0): what any plan
    at this length needs at least."""
    plans = _candidate_plans(p) if candidates is None else candidates
    return min(host_bytes(p, m, [0.0] * p.n_layers) for m in plans)


def _candidate_plans(p: PlanProblem) -> list[list[str]]:
    """Returns the plans `solve_plan` weighs: k keep layers at the end (as many as the device budget holds),
    then c checkpointed layers first and memo in between, for every c."""
    n = p.n_layers
    keep = min(n, p.device_budget // p.keep_bytes) if p.keep_bytes else n
    buffered = n - keep
    return [["checkpoint"] * c + ["memo"] * (buffered - c) + ["keep"] * keep for c in range(buffered + 1)]
