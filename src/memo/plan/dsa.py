"""One entry point for DSA: always a valid placement within a work budget, with LOAD, gap and proof status.

Greedy (several orders) gives the first answer; the exact search then asks "does a placement fit in C?"
starting at C = LOAD and moving up, each answer either improving the placement or raising the proven lower
bound; HiGHS's MIP then searches a bounded number of nodes on small instances. Every returned placement passes
the independent overlap check of `problem.check_placement`.

The budget is counted in work (the search kernel's loop iterations, HiGHS's branch-and-bound nodes), never in
seconds, so equal inputs give byte-identical plans on an idle and on a loaded machine. A time limit stays as a
safety net only; a solve it cuts says so (`Solution.clock_cut`), since its plan then depends on the machine.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .budget import DEFAULT_WORK, SAFETY_SECONDS, Budget
from .greedy import greedy
from .mip import solve_mip
from .problem import Problem, check_placement, max_load, peak
from .search import HEURISTICS, SearchStats, Techniques, compile_kernel, search

log = logging.getLogger(__name__)
MIP_MAX_BUFFERS = 80  # the big-M MIP stalls beyond ~100 tensors (docs/method.md §5)
# HiGHS's budget is its branch-and-bound nodes, a limit any machine reaches alike (single-threaded), unlike its
# time limit. A node's cost is not bounded (the root alone took 25 s on 80 of D's buffers, 3024 overlapping
# pairs), so the MIP runs only on instances this small: at most 400 pairs took 13 s for 10k nodes, most far less.
MIP_MAX_PAIRS = 400
MIP_NODES = 5_000
# The search's overlap lists take 16 bytes and its per-node work grows with the overlapping pairs: beyond this
# many (S_1 has 43M, Y_1 180M) building them alone takes longer than the default budget lets the search run.
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
    work: int = 0  # search work spent (`SearchStats.work`)
    work_limit: int = 0
    clock_cut: bool = False  # the time limit ended the solve before its work budget: not reproducible

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
            "work": self.work,
            "work_limit": self.work_limit,
            "clock_cut": self.clock_cut,
        }


def solve(
    p: Problem,
    time_limit: float | None = SAFETY_SECONDS,
    use_search: bool = True,
    use_mip: bool = True,
    work_limit: int = DEFAULT_WORK,
) -> Solution:
    """Returns the best placement found for `p` within `work_limit` units of search work (never worse than greedy).

    The work budget makes the answer independent of the machine's speed and load; `time_limit` seconds is only a
    safety net (`Solution.clock_cut` says when it ended the solve). The first call in a process also loads the
    search kernel from numba's cache (about 1 s; 15 s to compile it the first time), before the clock starts.
    """
    if not work_limit > 0:
        raise ValueError(f"a DSA solve needs a positive work limit, got {work_limit}")
    pairs = _overlapping_pairs(p)
    use_search = use_search and pairs <= SEARCH_MAX_OVERLAPS
    use_mip = use_mip and len(p) <= MIP_MAX_BUFFERS and pairs <= MIP_MAX_PAIRS
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
    if use_mip and best > lower and not budget.clock_spent() and _has_highs():
        lower, offsets, best, method = _run_mip(p, lower, offsets, best, method, budget, steps)
    problems = check_placement(p, offsets)
    if problems:  # every accepted placement was checked, so this is a bug: fall back to greedy and say so
        log.error("placement from %s failed verification (%s); falling back to greedy", method, problems[0])
        offsets, method = greedy(p)
        best, steps = peak(p, offsets), steps + [f"verification failed: {problems[0]}"]
    seconds = time.perf_counter() - start
    spent = work_limit - budget.work
    if budget.clock_cut:
        log.warning(
            "the DSA solve's safety time limit (%s s) ended it before its work budget: this plan of %d buffers "
            "depends on the machine's speed and load",
            time_limit,
            len(p),
        )
    return Solution(offsets, best, lower, best <= lower, seconds, method, steps, spent, work_limit, budget.clock_cut)


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


def _run_mip(p, lower, offsets, best, method, budget, steps):
    """Runs HiGHS's MIP from the best placement for `MIP_NODES` nodes; returns (lower, offsets, peak, method)."""
    found, proven, bound = solve_mip(p, offsets, budget.seconds_left(), MIP_NODES)
    budget.clock_spent()  # a MIP the clock stopped leaves no time: the answer then depends on the machine
    steps.append(f"mip: peak {peak(p, found)}{' (optimal)' if proven else ''}, bound {bound}")
    if peak(p, found) < best:
        offsets, best, method = found, peak(p, found), "mip"
    return max(lower, bound), offsets, best, method


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
        share = 1 / 2 if capacity == lower or capacity >= best - unit else 1 / 3
        found = search(p, capacity, budget.seconds_left(), techniques, stats, orders, max(int(budget.work * share), 1))
        budget.work -= stats.work
        budget.clock_cut |= stats.clock_cut
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
            steps.append(f"search at {capacity}: {_why_none(stats)} ({stats.nodes} nodes)")
        capacity = max(lower, (failed + best) // 2 // unit * unit)
        if capacity <= failed or capacity >= best:
            break
    return lower, offsets, best, method


def _why_none(stats: SearchStats) -> str:
    """Returns why a search returned no placement, for the solve's steps."""
    return "none fits" if stats.exhausted else "out of time" if stats.clock_cut else "out of work"
