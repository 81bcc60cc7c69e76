"""Exact DSA search: lowest-offset depth-first placement with load-based pruning (memo-method.md §5).

The technique is the one MiniMalloc (Moffitt, ASPLOS 2023) made fast, written here from its description:

- Time is cut into *sections*: the sets of buffers live just before each distinct end time. Each is a
  clique, each buffer covers a contiguous run of them, and the largest section total is LOAD.
- *Canonical placements*: a buffer is only ever put at its `min_off`, the top of the highest placed buffer
  that overlaps it in time (or 0), and buffers are placed in non-decreasing (offset, preorder rank).
  Every placement can be pushed down into this form, so nothing is lost.
- *Section inference*: the unplaced buffers of a section stack above its floor, so a node is cut when
  floor + unplaced total > capacity in any section. The floor rises to the offset of the latest
  placement (*monotonic floor*) and to the lowest `min_off` among the section's unplaced buffers
  (*unallocated floor*).
- *Dominance*: a candidate at or above min(min_off + size) over the unplaced buffers would leave a hole
  that buffer fits in; skipped. *Hatless*: when a buffer that overlaps no unplaced buffer fails, its
  siblings fail the same way.
- *Decomposition*: when no unplaced buffer crosses a section boundary any more, both sides are solved
  independently.
- Node budgets that double, round-robin over three static orders, act as restarts.

The kernel is compiled with numba (it visits millions of nodes). Each technique has a flag (`Techniques`)
and `SearchStats.nodes` counts the work, so tests check that every combination finds the same answers
and that each technique cuts work.
"""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass

import numpy as np
from numba import njit

from .problem import Problem

HEURISTICS = ("WAT", "TAW", "TWA", "AWT", "WTA", "ATW")  # static orders: W lifetime, A area, T section total
_KEY = {"W": 0, "A": 1, "T": 2}
FOUND, NOT_FOUND = 1, 0  # kernel results; -1: stopped by the node budget
ASSUMED_NODES_PER_S = 50_000  # until the first run measures the rate


@dataclass(frozen=True)
class Techniques:
    section_inference: bool = True
    monotonic_floor: bool = True
    unallocated_floor: bool = True
    dominance: bool = True
    hatless: bool = True
    decomposition: bool = True
    restarts: bool = True


@dataclass
class SearchStats:
    nodes: int = 0  # nodes entered plus placements tried
    exhausted: bool = False  # the search space was covered: a None result proves that nothing fits


@dataclass(frozen=True)
class Sections:
    """Cliques of buffers live just before each distinct end time; buffer b spans [first[b], last[b])."""

    first: np.ndarray
    last: np.ndarray
    count: int

    @classmethod
    def of(cls, p: Problem) -> "Sections":
        ends = np.unique(p.upper)  # section k: buffers with lower < ends[k] <= upper
        first = np.searchsorted(ends, p.lower, side="right")
        last = np.searchsorted(ends, p.upper, side="left") + 1
        return cls(first.astype(np.int64), last.astype(np.int64), len(ends))


def _csr(groups: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(groups) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(g) for g in groups])
    return ptr, (np.concatenate(groups).astype(np.int64) if groups else np.zeros(0, dtype=np.int64))


def _instance(p: Problem, sec: Sections):
    """Returns the arrays the kernel works on: overlap lists and section member lists (CSR)."""
    n = len(p)
    order = np.argsort(p.lower, kind="stable")
    neighbours: list[list[int]] = [[] for _ in range(n)]
    lo, hi = p.lower[order], p.upper[order]
    ends = np.searchsorted(lo, hi, side="left")
    for k in range(n):  # sweep: later-starting buffers that start before this one ends
        for j in order[k + 1 : ends[k]]:
            neighbours[order[k]].append(int(j))
            neighbours[int(j)].append(int(order[k]))
    nb_ptr, nb_idx = _csr([np.array(g, dtype=np.int64) for g in neighbours])
    members = [[] for _ in range(sec.count)]
    for b in range(n):
        for s in range(sec.first[b], sec.last[b]):
            members[s].append(b)
    sec_ptr, sec_idx = _csr([np.array(m, dtype=np.int64) for m in members])
    return nb_ptr, nb_idx, sec_ptr, sec_idx


def search(
    p: Problem,
    capacity: int,
    time_limit: float,
    techniques: Techniques = Techniques(),
    stats: SearchStats | None = None,
):
    """Returns offsets with peak <= capacity, or None: proven impossible if `stats.exhausted`, else out of time."""
    stats = stats if stats is not None else SearchStats()
    n = len(p)
    if not n:
        stats.exhausted = True
        return np.zeros(0, dtype=np.int64)
    compile_kernel()
    deadline = time.perf_counter() + time_limit
    sec = Sections.of(p)
    nb_ptr, nb_idx, sec_ptr, sec_idx = _instance(p, sec)
    size = p.size.astype(np.int64)
    width = (p.upper - p.lower).astype(np.int64)
    total0 = np.zeros(sec.count, dtype=np.int64)
    for s in range(sec.count):
        total0[s] = size[sec_idx[sec_ptr[s] : sec_ptr[s + 1]]].sum()
    if size.max() > capacity or (techniques.section_inference and total0.max() > capacity):
        stats.exhausted = True
        return None
    cuts0 = np.zeros(max(sec.count - 1, 0), dtype=np.int64)
    for b in range(n):
        cuts0[sec.first[b] : sec.last[b] - 1] += 1
    flags = np.array(astuple(techniques), dtype=np.bool_)
    heuristics = HEURISTICS if techniques.restarts else HEURISTICS[:1]
    budget, rate = 2 * n, None
    while True:
        for name in heuristics:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return None
            # never start a run that cannot end before the deadline (the kernel cannot read the clock)
            by_time = max(int((rate or ASSUMED_NODES_PER_S) * remaining), 1000)
            limit = min(budget, by_time) if techniques.restarts else by_time
            counters = np.array([0, limit], dtype=np.int64)
            solution = np.full(n, -1, dtype=np.int64)
            started = time.perf_counter()
            result = _run(
                size,
                width,
                sec.first,
                sec.last,
                nb_ptr,
                nb_idx,
                sec_ptr,
                sec_idx,
                total0.copy(),
                cuts0.copy(),
                capacity,
                np.array([_KEY[c] for c in name], dtype=np.int64),
                flags,
                counters,
                solution,
            )
            stats.nodes += int(counters[0])
            rate = counters[0] / max(time.perf_counter() - started, 1e-6)
            if result == FOUND:
                return solution
            if result == NOT_FOUND:
                stats.exhausted = True
                return None
            if not techniques.restarts:
                return None  # the single run used up the time it had
        budget *= 2


def compile_kernel() -> None:
    """Compiles the kernel once per process (about 10 s), outside any search's time limit."""
    global _compiled
    if not _compiled:
        _compiled = True
        search(Problem.from_rows([(0, 0, 2, 1), (1, 1, 3, 1)]), 2, 60.0, Techniques(restarts=False))


_compiled = False


@njit(cache=False)  # cached recursive kernels crash when reloaded (numba)
def _run(
    size, width, first, last, nb_ptr, nb_idx, sec_ptr, sec_idx, total, cuts, capacity, keys, flags, counters, solution
):
    n = size.shape[0]
    state = (
        size,
        width,
        first,
        last,
        nb_ptr,
        nb_idx,
        sec_ptr,
        sec_idx,
        total,
        cuts,
        capacity,
        keys,
        flags,
        counters,
        solution,
        np.zeros(n, dtype=np.int64),
        np.zeros(n, dtype=np.bool_),
        np.zeros(total.shape[0], dtype=np.int64),
        np.zeros(total.shape[0], dtype=np.int64),
        np.zeros(1, np.int64),
    )
    return _solve_range(state, 0, total.shape[0])


@njit(cache=False)  # cached recursive kernels crash when reloaded (numba)
def _preorder(state, buffers):
    size, width, first, last, total, keys = state[0], state[1], state[2], state[3], state[8], state[11]
    m = buffers.shape[0]
    values = np.zeros((3, m), dtype=np.float64)
    for i in range(m):
        b = buffers[i]
        values[0, i] = width[b]
        values[1, i] = width[b] * size[b]
        best = 0
        for s in range(first[b], last[b]):
            best = max(best, total[s])
        values[2, i] = best
    order = np.arange(m)  # stable sorts from the least to the most significant key, each descending
    for k in range(keys.shape[0] - 1, -1, -1):
        order = order[np.argsort(-values[keys[k]][order], kind="mergesort")]
    return buffers[order]


@njit(cache=False)  # cached recursive kernels crash when reloaded (numba)
def _solve_range(state, lo, hi):
    first, last, placed = state[2], state[3], state[16]
    n = first.shape[0]
    count = 0
    for b in range(n):
        if not placed[b] and first[b] < hi and last[b] > lo:
            count += 1
    if count == 0:
        return 1
    inside = np.empty(count, dtype=np.int64)
    k = 0
    for b in range(n):
        if not placed[b] and first[b] < hi and last[b] > lo:
            inside[k] = b
            k += 1
    order = _preorder(state, inside)
    rank = np.zeros(n, dtype=np.int64)
    for i in range(order.shape[0]):
        rank[order[i]] = i
    return _dfs(state, order, rank, lo, hi, 0, -1)


@njit(cache=False)  # cached recursive kernels crash when reloaded (numba)
def _dfs(state, order, rank, lo, hi, last_off, last_rank):
    size, first, last, nb_ptr, nb_idx = state[0], state[2], state[3], state[4], state[5]
    sec_ptr, sec_idx, total, capacity, flags = state[6], state[7], state[8], state[10], state[12]
    counters, solution, min_off, placed, floor, stamp = state[13], state[14], state[15], state[16], state[17], state[18]
    counters[0] += 1
    if counters[0] > counters[1]:
        return -1
    m = 0
    for b in order:
        if not placed[b]:
            m += 1
    if m == 0:
        return 1
    todo = np.empty(m, dtype=np.int64)
    key = np.empty(m, dtype=np.int64)
    m = 0
    min_height = np.int64(1) << 62
    for b in order:
        if not placed[b]:
            todo[m] = b
            key[m] = min_off[b] * (order.shape[0] + 1) + rank[b]
            min_height = min(min_height, min_off[b] + size[b])
            m += 1
    for k in np.argsort(key):
        b = todo[k]
        o = min_off[b]
        if o < last_off or (o == last_off and rank[b] < last_rank):
            continue  # canonical order
        if flags[3] and o >= min_height:
            break  # dominance
        # ---- place b at o ----
        counters[0] += 1  # work = nodes entered + placements tried
        placed[b] = True
        solution[b] = o
        top = o + size[b]
        hatless = True
        raised = np.empty(nb_ptr[b + 1] - nb_ptr[b], dtype=np.int64)
        old_min = np.empty_like(raised)
        r = 0
        state[19][0] += 1
        mark = state[19][0]
        n_aff = 0
        for j in range(nb_ptr[b], nb_ptr[b + 1]):
            u = nb_idx[j]
            if placed[u]:
                continue
            hatless = False
            if min_off[u] < top:
                raised[r] = u
                old_min[r] = min_off[u]
                min_off[u] = top
                r += 1
                for s in range(first[u], last[u]):
                    if stamp[s] != mark:
                        stamp[s] = mark
                        n_aff += 1
        span_floor = floor[first[b] : last[b]].copy()
        for s in range(first[b], last[b]):
            floor[s] = top
            total[s] -= size[b]
        affected = np.empty(n_aff, dtype=np.int64)
        old_aff = np.empty(n_aff, dtype=np.int64)
        a = 0
        for i in range(r):
            u = raised[i]
            for s in range(first[u], last[u]):
                if stamp[s] == mark:
                    stamp[s] = -1  # listed once
                    affected[a] = s
                    old_aff[a] = floor[s]
                    a += 1
        if flags[2]:  # unallocated floor
            for i in range(a):
                s = affected[i]
                lowest = np.int64(1) << 62
                for j in range(sec_ptr[s], sec_ptr[s + 1]):
                    u = sec_idx[j]
                    if not placed[u] and min_off[u] < lowest:
                        lowest = min_off[u]
                if lowest < (np.int64(1) << 62) and floor[s] < lowest:
                    floor[s] = lowest
        # ---- check (section inference, monotonic floor) ----
        ok = True
        for s in range(lo, hi):
            f = floor[s]
            if flags[1] and f < o:
                f = o
            if flags[0]:
                f += total[s]
            if f > capacity:
                ok = False
                break
        result = 0
        if ok:
            if flags[5]:
                result = _split(state, b, order, rank, lo, hi, o)
            else:
                result = _dfs(state, order, rank, lo, hi, o, rank[b])
        # ---- restore ----
        for i in range(a):
            floor[affected[i]] = old_aff[i]
        for s in range(first[b], last[b]):
            floor[s] = span_floor[s - first[b]]
            total[s] += size[b]
        for i in range(r):
            min_off[raised[i]] = old_min[i]
        placed[b] = False
        if result != 0:
            return result
        if flags[4] and hatless:
            break
    return 0


@njit(cache=False)  # cached recursive kernels crash when reloaded (numba)
def _split(state, b, order, rank, lo, hi, o):
    first, last, cuts = state[2], state[3], state[9]
    f, end = first[b], last[b]
    fresh = 0
    for s in range(f, end - 1):
        cuts[s] -= 1
        if cuts[s] == 0 and lo < s + 1 < hi:
            fresh += 1
    if fresh == 0:
        result = _dfs(state, order, rank, lo, hi, o, rank[b])
    else:
        result = 1
        start = lo
        for s in range(f, end - 1):
            if cuts[s] == 0 and lo < s + 1 < hi:
                result = _solve_range(state, start, s + 1)
                start = s + 1
                if result != 1:
                    break
        if result == 1:
            result = _solve_range(state, start, hi)
    for s in range(f, end - 1):
        cuts[s] += 1
    return result
