"""One entry point for DSA: always a valid placement within the time limit, with LOAD, gap and proof status.

Greedy (several orders) gives the first answer; the exact search then asks "does a placement fit in C?"
starting at C = LOAD and moving up, each answer either improving the placement or raising the proven lower
bound; HiGHS's MIP gets what time is left on small instances. Every returned placement passes the
independent overlap check of `problem.check_placement`.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .greedy import greedy
from .mip import solve_mip
from .problem import Problem, check_placement, max_load, peak
from .search import HEURISTICS, SearchStats, Techniques, compile_kernel, search

log = logging.getLogger(__name__)
MIP_MAX_BUFFERS = 80  # the big-M MIP stalls beyond ~100 tensors (docs/method.md §5)
# The search's overlap lists take 16 bytes and its per-node work grows with the overlapping pairs: beyond this
# many (S_1 has 43M, Y_1 180M) building them alone costs more than the time limit leaves.
SEARCH_MAX_OVERLAPS = 20_000_000
# Above this many buffers the search at LOAD has no chance in seconds (a single dive visits every buffer, and
# each node scans the range), so the driver first dives below greedy's peak: area-first orders (on pangu_2.6B
# their canonical dive ends 0.76% above LOAD, greedy 3.34%), without the unallocated floor (its per-placement
# cost is the sections of every raised buffer times their members: it made a dive five times slower).
LARGE = 2000
LARGE_ORDERS = ("AWT", "ATW") + tuple(h for h in HEURISTICS if h not in ("AWT", "ATW"))


@dataclass
class Solution:
    offsets: np.ndarray
    peak: int
    lower_bound: int
    optimal: bool
    seconds: float
    method: str
    steps: list[str] = field(default_factory=list)

    @property
    def gap(self) -> float:
        """Returns peak / lower bound − 1 (0 when the peak meets the bound)."""
        return self.peak / self.lower_bound - 1 if self.lower_bound else 0.0

    def summary(self) -> dict:
        return {
            "peak": self.peak,
            "lower_bound": self.lower_bound,
            "gap": self.gap,
            "optimal": self.optimal,
            "seconds": self.seconds,
            "method": self.method,
        }


def solve(
    p: Problem,
    time_limit: float | None = 10.0,
    use_search: bool = True,
    use_mip: bool = True,
    work_limit: int | None = None,
) -> Solution:
    """Returns the best placement found for `p` within `time_limit` seconds (never worse than greedy).

    `work_limit` bounds the exact search's work instead of (or as well as) the clock, so the answer does not depend
    on the machine's speed; HiGHS has no such counter, so a solve without a clock skips the MIP. The first call in a
    process also loads the search kernel from numba's cache (about 1 s; 15 s to compile it the first time), before
    the clock starts.
    """
    if time_limit is None and work_limit is None:
        raise ValueError("a DSA solve needs a time limit or a work limit")
    use_search = use_search and _overlapping_pairs(p) <= SEARCH_MAX_OVERLAPS
    if use_search:
        compile_kernel()
    start = time.perf_counter()
    budget = Budget(None if time_limit is None else start + time_limit, work_limit)
    load = max_load(p)
    offsets, method = greedy(p)
    best = peak(p, offsets)
    steps = [f"{method}: peak {best}"]
    lower = load
    unit = math.gcd(*(int(s) for s in p.size)) if len(p) else 1
    if use_search:
        lower, offsets, best, method = _drive_search(p, lower, offsets, best, method, unit, budget, steps)
    mip_time = budget.seconds_left()
    if use_mip and best > lower and len(p) <= MIP_MAX_BUFFERS and mip_time and mip_time > 0 and _has_highs():
        found, proven, bound = solve_mip(p, offsets, mip_time)
        steps.append(f"mip: peak {peak(p, found)}{' (optimal)' if proven else ''}, bound {bound}")
        lower = max(lower, bound)
        if peak(p, found) < best:
            offsets, best, method = found, peak(p, found), "mip"
    problems = check_placement(p, offsets)
    if problems:  # every accepted placement was checked, so this is a bug: fall back to greedy and say so
        log.error("placement from %s failed verification (%s); falling back to greedy", method, problems[0])
        offsets, method = greedy(p)
        best, steps = peak(p, offsets), steps + [f"verification failed: {problems[0]}"]
    return Solution(offsets, best, lower, best <= lower, time.perf_counter() - start, method, steps)


@dataclass
class Budget:
    """What a solve has left: a deadline on the clock and kernel work, each None when not limited."""

    deadline: float | None
    work: int | None

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.perf_counter()

    def spent(self) -> bool:
        seconds = self.seconds_left()
        return (seconds is not None and seconds <= 0.05) or (self.work is not None and self.work <= 0)

    def share(self, fraction: float) -> tuple[float | None, int | None]:
        """Returns (seconds, work) for a step that may take `fraction` of what is left."""
        seconds = self.seconds_left()
        return (
            None if seconds is None else seconds * fraction,
            None if self.work is None else max(int(self.work * fraction), 1),
        )


@functools.cache
def _has_highs() -> bool:
    """Returns whether HiGHS can be imported; without it the MIP step is skipped, once with a warning."""
    try:
        import highspy  # noqa: F401
    except ImportError:
        log.warning("highspy is not installed: DSA plans skip the MIP step (search and greedy only)")
        return False
    return True


def _overlapping_pairs(p: Problem) -> int:
    """Returns how many pairs of buffers overlap in time (without listing them)."""
    order = np.argsort(p.lower, kind="stable")
    later = np.searchsorted(p.lower[order], p.upper[order], side="left") - np.arange(1, len(p) + 1)
    return int(later.clip(0).sum())


def _drive_search(p, lower, offsets, best, method, unit, budget, steps):
    """Asks the exact search for placements at capacity LOAD (large instances: just below the best peak), then
    bisects between the highest capacity that failed (proven or out of budget) and the best peak found; returns
    (lower, offsets, peak, method)."""
    lower = -(-lower // unit) * unit
    failed = lower - unit  # highest capacity known not to yield a placement (within the budget it had)
    large = len(p) > LARGE
    capacity = (best - 1) // unit * unit if large else lower
    techniques = Techniques(unallocated_floor=False) if large else Techniques()
    orders = LARGE_ORDERS if large else HEURISTICS
    while lower < best and not budget.spent():
        stats = SearchStats()
        seconds, work = budget.share(1 / 2 if capacity == lower or capacity >= best - unit else 1 / 3)
        found = search(p, capacity, seconds, techniques, stats, orders, work)
        if budget.work is not None:
            budget.work -= stats.work
        if found is not None and check_placement(p, found):
            log.error("search returned an invalid placement at capacity %d; ignoring it", capacity)
            found = None
        if found is not None:
            offsets, best, method = found, peak(p, found), "search"
            steps.append(f"search at {capacity}: peak {best} ({stats.nodes} nodes)")
        else:
            failed = max(failed, capacity)
            if stats.exhausted:
                lower = capacity + unit
            steps.append(
                f"search at {capacity}: {'none fits' if stats.exhausted else 'out of budget'} ({stats.nodes} nodes)"
            )
        capacity = max(lower, (failed + best) // 2 // unit * unit)
        if capacity <= failed or capacity >= best:
            break
    return lower, offsets, best, method
