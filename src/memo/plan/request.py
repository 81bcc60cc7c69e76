"""What `memo plan` and `memo dsa` are asked: their flags as typed records, checked once before any work, and the
plan's report as data and as the lines the CLI prints."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..parallel.ulysses import Ulysses
from ..policy import ActivationPolicy
from ..units import format_count
from .budget import describe


def check_time_limit(seconds: float) -> None:
    if not seconds > 0:
        raise ValueError(f"`--time-limit` must be positive, got {seconds}")


@dataclass(frozen=True, kw_only=True)
class DsaRequest:
    """`memo dsa`'s flags: the instance, the search's work budget and its safety clock."""

    file: str
    work: int
    time_limit: float
    out: str | None = None

    def __post_init__(self) -> None:
        check_time_limit(self.time_limit)


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """`memo plan`'s flags: the model, one GPU's share of a step (`--seq` over `--tp` GPUs, `--batch`
    sequences), the activation strategy, the DSA search's budget and clock."""

    model: str
    seq: int
    work: int
    time_limit: float
    batch: int = 1
    tp: int = 1
    policy: str = "memo"
    alpha: float | None = None
    plot: str | None = None

    def __post_init__(self) -> None:
        if self.tp <= 0 or self.seq % self.tp:
            raise ValueError(f"`--tp` ({self.tp}) must be positive and divide `--seq` ({self.seq})")
        if self.batch <= 0:
            raise ValueError(f"`--batch` must be positive, got {self.batch}")
        check_time_limit(self.time_limit)
        self.activation_policy()

    @property
    def tokens(self) -> int:
        """Returns the tokens of one sequence each GPU holds."""
        return self.seq // self.tp

    def activation_policy(self) -> ActivationPolicy:
        """Returns `--policy` with `--alpha` (memo's default 0.5); refuses an `--alpha` given with another."""
        alpha = 0.5 if self.alpha is None and self.policy == "memo" else self.alpha
        return ActivationPolicy(self.policy, alpha=alpha)

    def check_model(self, c: ModelConfig) -> None:
        """Raises unless `c`'s heads split over `--tp` GPUs, as train's `--sp` ranks split them."""
        try:
            Ulysses.traced(self.tp, c.n_heads, c.n_kv_heads)
        except ValueError as err:
            raise ValueError(str(err).replace("`--sp`", "`--tp`")) from None


def plan_report(result, work_limit: int) -> dict:
    """Returns a `bilevel.plan` result as `memo plan --json` prints it."""
    return {
        "load": result.load,
        "dispatch_load": result.dispatch_load,
        "flat_peak": result.flat.peak,
        "flat_gap": result.flat.peak / result.load - 1,
        "flat_seconds": result.flat.seconds,
        "arena_peak": result.iteration.peak,
        "gap": result.iteration.peak / result.load - 1,
        "caching_peak_allocated": result.caching.peak_allocated,
        "caching_peak_reserved": result.caching.peak_reserved,
        "saved_vs_caching": result.caching.peak_reserved - result.iteration.peak,
        "layer_forward_peak": result.forward.peak,
        "layer_backward_peak": result.backward.peak,
        "store_bytes": result.store_bytes,
        "solve_seconds": result.forward.seconds + result.backward.seconds + result.iteration.seconds,
        "trace_seconds": result.trace_seconds,
        "work": result.work,
        "work_limit": work_limit,
        "clock_cut": result.clock_cut,
    }


def plan_lines(report: dict, title: str) -> str:
    """Returns the lines `memo plan` prints of its `report` (`plan_report`) under `title`."""
    gib = 2**30
    return "\n".join(
        [
            title,
            f"LOAD (bytes live at once)      {report['load'] / gib:8.2f} GiB  (kernel scratch included)",
            f"LOAD of the tensors ops return {report['dispatch_load'] / gib:8.2f} GiB  (what a dispatch trace sees)",
            f"flat plan (--arena)            {report['flat_peak'] / gib:8.2f} GiB  ({100 * report['flat_gap']:+.2f}% "
            f"vs LOAD, solved in {report['flat_seconds']:.1f}s)",
            f"bi-level plan (the paper's)    {report['arena_peak'] / gib:8.2f} GiB  ({100 * report['gap']:+.2f}% vs "
            "LOAD)",
            f"caching allocator: allocated   {report['caching_peak_allocated'] / gib:8.2f} GiB",
            f"caching allocator: reserved    {report['caching_peak_reserved'] / gib:8.2f} GiB",
            f"saved by planning              {report['saved_vs_caching'] / gib:8.2f} GiB",
            f"per layer: forward {report['layer_forward_peak'] / gib:.2f} GiB, backward "
            f"{report['layer_backward_peak'] / gib:.2f} GiB; store buffers {report['store_bytes'] / gib:.2f} GiB "
            f"(allocated once); bi-level solved in {report['solve_seconds']:.1f}s; traced in "
            f"{report['trace_seconds']:.1f}s",
            f"DSA search: {describe(report['work'], report['work_limit'], report['clock_cut'])}",
        ]
    )


def plan_title(name: str, request: PlanRequest) -> str:
    return f"{name}, {format_count(request.seq)} tokens over {request.tp} GPU(s), strategy {request.policy}"
