"""Exact DSA search: lowest-offset depth-first placement with load-based pruning (docs/method.md §5).

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
- *Decomposition*: when no unplaced buffer crosses a section boundary (at the start, or once the buffers
  crossing it are placed), both sides are solved independently.
- Node budgets that double, round-robin over six static orders, act as restarts.

The kernel is compiled with numba (it visits millions of nodes) and is iterative: an explicit stack of
frames and a trail of undo entries instead of recursion, so depth is bounded by memory, not the C stack, and
numba can cache it on disk (its cache of recursive functions crashes when reloaded). Each technique has a
flag (`Techniques`) and `SearchStats.nodes` counts the work, so tests check that every combination finds the
same answers and that each technique cuts work.
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
ASSUMED_WORK_PER_S = 400_000_000  # kernel loop iterations per second (0.47-0.8G measured), until a run measures it
UNLIMITED = 1 << 62


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
    work: int = 0  # the kernel's loop iterations: what `work_limit` counts
    exhausted: bool = False  # the search space was covered: a None result proves that nothing fits
    clock_cut: bool = False  # the time limit, not the work limit, stopped it: the answer depends on the machine


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


def _csr(owner: np.ndarray, item: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Returns (ptr, idx): the items of each owner 0..count-1, grouped by owner in item order."""
    order = np.lexsort((item, owner))
    ptr = np.zeros(count + 1, dtype=np.int64)
    ptr[1:] = np.cumsum(np.bincount(owner, minlength=count))
    return ptr, item[order].astype(np.int64)


def _instance(p: Problem, sec: Sections):
    """Returns the arrays the kernel works on: overlap lists and section member lists (CSR)."""
    a, b = p.overlaps()
    nb_ptr, nb_idx = _csr(np.concatenate((a, b)), np.concatenate((b, a)), len(p))
    spans = sec.last - sec.first
    buffers = np.repeat(np.arange(len(p)), spans)
    sections = np.arange(len(buffers)) - np.repeat(np.cumsum(spans) - spans, spans) + np.repeat(sec.first, spans)
    sec_ptr, sec_idx = _csr(sections, buffers, sec.count)
    return nb_ptr, nb_idx, sec_ptr, sec_idx


_last_prepared: tuple = (None, None)


def _prepared(p: Problem):
    """Returns the kernel's static arrays for `p`, reusing them when asked about the same problem again (the
    driver asks at several capacities; on 20k buffers the overlap lists take seconds)."""
    global _last_prepared
    if _last_prepared[0] is not p:
        sec = Sections.of(p)
        nb_ptr, nb_idx, sec_ptr, sec_idx = _instance(p, sec)
        total0 = np.add.reduceat(p.size[sec_idx], sec_ptr[:-1])  # every section holds the buffer ending there
        diff = np.zeros(sec.count + 1, dtype=np.int64)  # buffers crossing each boundary between sections
        np.add.at(diff, sec.first, 1)
        np.add.at(diff, sec.last - 1, -1)
        cuts0 = np.cumsum(diff)[: max(sec.count - 1, 0)]
        _last_prepared = (p, (sec, nb_ptr, nb_idx, sec_ptr, sec_idx, total0, cuts0))
    return _last_prepared[1]


def search(
    p: Problem,
    capacity: int,
    time_limit: float | None,
    techniques: Techniques = Techniques(),
    stats: SearchStats | None = None,
    orders: tuple[str, ...] = HEURISTICS,
    work_limit: int | None = None,
):
    """Returns offsets with peak <= capacity, or None: proven impossible if `stats.exhausted`, else out of budget.

    The budget is `work_limit` units of kernel work (`SearchStats.work`): the same answer on any machine at any
    load. `time_limit` seconds is a safety net; when it ends the search first, `stats.clock_cut` says so. None is no
    limit. `orders` are the static orders the restarts take turns with (only the first without restarts).
    """
    stats = stats if stats is not None else SearchStats()
    n = len(p)
    if not n:
        stats.exhausted = True
        return np.zeros(0, dtype=np.int64)
    compile_kernel()
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    work_left = UNLIMITED if work_limit is None else work_limit
    sec, nb_ptr, nb_idx, sec_ptr, sec_idx, total0, cuts0 = _prepared(p)
    size = p.size
    width = p.upper - p.lower
    if size.max() > capacity or (techniques.section_inference and total0.max() > capacity):
        stats.exhausted = True
        return None
    flags = np.array(astuple(techniques), dtype=np.bool_)
    heuristics = orders if techniques.restarts else orders[:1]
    budget, rate = 2 * n, None
    while True:
        for name in heuristics:
            if work_left <= 0:
                return None
            by_time = UNLIMITED
            if deadline is not None:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    stats.clock_cut = True
                    return None
                # the kernel cannot read the clock: the safety net turns the seconds left into work at the rate
                # measured so far (loop iterations track time far better than nodes on large instances)
                by_time = max(int((rate or ASSUMED_WORK_PER_S) * remaining), 10_000)
            limit = budget if techniques.restarts else UNLIMITED
            clock_binds = by_time < work_left
            counters = np.array([0, limit, 0, min(by_time, work_left)], dtype=np.int64)
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
            stats.work += int(counters[2])
            work_left -= int(counters[2])
            if counters[2] > 100_000:  # short runs measure mostly overhead
                rate = counters[2] / max(time.perf_counter() - started, 1e-6)
            if result == FOUND:
                return solution
            if result == NOT_FOUND:
                stats.exhausted = True
                return None
            if clock_binds and counters[2] > counters[3]:
                stats.clock_cut = True
                return None
            if not techniques.restarts:
                return None  # the single run used up its budget
        budget *= 2


def compile_kernel() -> None:
    """Compiles (or loads from numba's on-disk cache) the kernel once per process, outside any time limit."""
    global _compiled
    if not _compiled:
        _compiled = True
        search(Problem.from_rows([(0, 0, 2, 1), (1, 1, 3, 1)]), 2, None, Techniques(restarts=False))


_compiled = False


# ---- kernel (iterative: an explicit stack of frames and an undo trail, so numba can cache it) ----

DFS, SPLIT = 0, 1  # frame kinds
ENTER, NEXT, CHILD = 0, 1, 2  # frame states: just pushed, try the next candidate, a child has answered in `ret`
# frame fields
KIND, STATE, LO, HI, ORD, M, KEY, MINH, MARK, HAT, ROOT, POS, END, START, FINAL = range(15)
N_FIELDS = 15
# trail codes: which array an undo entry restores
T_MIN_OFF, T_FLOOR, T_TOTAL, T_PLACED, T_CUTS, T_RANK = range(6)


@njit(cache=True)
def _grow(a, need):
    """Returns `a` with at least `need` rows (doubling), its contents kept."""
    if need <= a.shape[0]:
        return a
    rows = a.shape[0]
    while rows < need:
        rows *= 2
    b = np.empty((rows,) + a.shape[1:], dtype=a.dtype)
    b[: a.shape[0]] = a
    return b


@njit(cache=True)
def _log(trail, tp, code, index, old):
    trail[tp, 0] = code
    trail[tp, 1] = index
    trail[tp, 2] = old
    return tp + 1


@njit(cache=True)
def _undo(trail, tp, mark, min_off, floor, total, placed, cuts, rank):
    """Restores every entry logged after `mark`, latest first; returns the new trail top."""
    while tp > mark:
        tp -= 1
        code, i, old = trail[tp, 0], trail[tp, 1], trail[tp, 2]
        if code == T_MIN_OFF:
            min_off[i] = old
        elif code == T_FLOOR:
            floor[i] = old
        elif code == T_TOTAL:
            total[i] = old
        elif code == T_PLACED:
            placed[i] = old != 0
        elif code == T_CUTS:
            cuts[i] = old
        else:
            rank[i] = old
    return tp


@njit(cache=True)
def _range_order(lo, hi, placed, size, width, first, last, total, keys):
    """Returns the unplaced buffers that live in sections [lo, hi), in the static order `keys` (each descending)."""
    n = size.shape[0]
    count = 0
    for b in range(n):
        if not placed[b] and first[b] < hi and last[b] > lo:
            count += 1
    buffers = np.empty(count, dtype=np.int64)
    k = 0
    for b in range(n):
        if not placed[b] and first[b] < hi and last[b] > lo:
            buffers[k] = b
            k += 1
    values = np.zeros((3, count), dtype=np.float64)
    for i in range(count):
        b = buffers[i]
        values[0, i] = width[b]
        values[1, i] = width[b] * size[b]
        best = 0
        for s in range(first[b], last[b]):
            best = max(best, total[s])
        values[2, i] = best
    order = np.arange(count)  # stable sorts from the least to the most significant key
    for k in range(keys.shape[0] - 1, -1, -1):
        order = order[np.argsort(-values[keys[k]][order], kind="mergesort")]
    return buffers[order]


@njit(cache=True)
def _run(
    size, width, first, last, nb_ptr, nb_idx, sec_ptr, sec_idx, total, cuts, capacity, keys, flags, counters, solution
):
    """Depth-first search over canonical placements; returns FOUND (offsets in `solution`), NOT_FOUND, or -1.

    `counters` holds [nodes, node limit, work, work limit]: the run stops (-1) when either limit is passed.
    """
    n, n_sec = size.shape[0], total.shape[0]
    big = np.int64(1) << 62
    min_off = np.zeros(n, dtype=np.int64)  # the top of the highest placed buffer overlapping each one in time
    placed = np.zeros(n, dtype=np.bool_)
    floor = np.zeros(n_sec, dtype=np.int64)
    stamp = np.zeros(n_sec, dtype=np.int64)
    rank = np.zeros(n, dtype=np.int64)  # position in the order of the innermost range holding the buffer
    affected = np.empty(n_sec, dtype=np.int64)
    trail = np.empty((4 * n + n_sec + 64, 3), dtype=np.int64)
    pool = np.empty(2 * n + 8, dtype=np.int64)  # the orders of the ranges on the stack
    frames = np.zeros((2 * n + 4, N_FIELDS), dtype=np.int64)  # a placement pushes at most a split and a range
    tp, pp, sp, mark_count = 0, 0, 0, 0
    ret = 0

    # the whole instance, split first at the boundaries that no buffer crosses (with decomposition)
    fr = frames[0]
    fr[KIND], fr[STATE], fr[LO], fr[HI] = SPLIT, NEXT, 0, n_sec
    fr[POS], fr[END], fr[START], fr[FINAL] = 0, n_sec - 1 if flags[5] else 0, 0, 0
    sp = 1

    while sp > 0:
        fr = frames[sp - 1]
        if fr[KIND] == SPLIT:
            if fr[STATE] == CHILD and ret != 1:
                sp -= 1  # a part failed (or ran out of nodes): so does the whole
                continue
            fr[STATE] = CHILD
            lo, hi = fr[LO], fr[HI]
            pushed = False
            while not pushed:
                if fr[POS] < fr[END]:
                    s = fr[POS]
                    fr[POS] += 1
                    if not (cuts[s] == 0 and lo < s + 1 < hi):
                        continue
                    a, z = fr[START], s + 1
                    fr[START] = s + 1
                elif fr[FINAL] == 0:
                    fr[FINAL] = 1
                    a, z = fr[START], hi
                else:
                    break
                order = _range_order(a, z, placed, size, width, first, last, total, keys)
                m = order.shape[0]
                if m == 0:
                    continue
                pool = _grow(pool, pp + m)
                trail = _grow(trail, tp + m)
                for i in range(m):
                    tp = _log(trail, tp, T_RANK, order[i], rank[order[i]])
                    pool[pp + i] = order[i]
                    rank[order[i]] = i
                child = frames[sp]
                child[KIND], child[STATE], child[LO], child[HI] = DFS, ENTER, a, z
                child[ORD], child[M], child[KEY], child[ROOT] = pp, m, -1, 1
                pp += m
                sp += 1
                pushed = True
            if not pushed:
                ret = 1
                sp -= 1
            continue

        # ---- a depth-first node: place the next candidate of its range ----
        lo, hi, base, m_all = fr[LO], fr[HI], fr[ORD], fr[M]
        if fr[STATE] == ENTER:
            counters[0] += 1
            counters[2] += m_all
            if counters[0] > counters[1] or counters[2] > counters[3]:
                ret = -1
                sp -= 1
                continue
            left = 0
            min_height = big
            for i in range(m_all):
                b = pool[base + i]
                if not placed[b]:
                    left += 1
                    min_height = min(min_height, min_off[b] + size[b])
            if left == 0:
                ret = 1
                if fr[ROOT]:
                    pp = base
                sp -= 1
                continue
            fr[MINH] = min_height
            fr[STATE] = NEXT
        elif fr[STATE] == CHILD:
            if ret != 0:
                if fr[ROOT]:
                    pp = base
                sp -= 1
                continue
            tp = _undo(trail, tp, fr[MARK], min_off, floor, total, placed, cuts, rank)
            fr[STATE] = NEXT
            if flags[4] and fr[HAT]:  # hatless: its siblings fail the same way
                ret = 0
                if fr[ROOT]:
                    pp = base
                sp -= 1
                continue
        # next candidate: the unplaced buffer with the least (min_off, rank) key above the last one tried
        pushed = False
        while True:
            b, best = -1, big
            for i in range(m_all):
                u = pool[base + i]
                if not placed[u]:
                    k = min_off[u] * (m_all + 1) + i
                    if fr[KEY] < k < best:
                        b, best = u, k
            counters[2] += m_all
            if b < 0:
                break
            o = min_off[b]
            if flags[3] and o >= fr[MINH]:
                break  # dominance
            fr[KEY] = best
            counters[0] += 1  # work = nodes entered + placements tried
            fr[MARK] = tp
            span = last[b] - first[b]
            trail = _grow(trail, tp + 1 + 3 * span + (nb_ptr[b + 1] - nb_ptr[b]) + n_sec)
            tp = _log(trail, tp, T_PLACED, b, 0)
            placed[b] = True
            solution[b] = o
            top = o + size[b]
            hatless = True
            mark_count += 1
            n_aff = 0
            for j in range(nb_ptr[b], nb_ptr[b + 1]):
                u = nb_idx[j]
                if placed[u]:
                    continue
                hatless = False
                if min_off[u] < top:
                    tp = _log(trail, tp, T_MIN_OFF, u, min_off[u])
                    min_off[u] = top
                    if not flags[2]:
                        continue
                    counters[2] += last[u] - first[u]
                    for s in range(first[u], last[u]):
                        if stamp[s] != mark_count:
                            stamp[s] = mark_count
                            affected[n_aff] = s
                            n_aff += 1
            for s in range(first[b], last[b]):
                tp = _log(trail, tp, T_FLOOR, s, floor[s])
                tp = _log(trail, tp, T_TOTAL, s, total[s])
                floor[s] = top
                total[s] -= size[b]
            if flags[2]:  # unallocated floor: a section's floor is at least its lowest unplaced min_off
                for i in range(n_aff):
                    s = affected[i]
                    lowest = big
                    counters[2] += sec_ptr[s + 1] - sec_ptr[s]
                    for j in range(sec_ptr[s], sec_ptr[s + 1]):
                        u = sec_idx[j]
                        if not placed[u] and min_off[u] < lowest:
                            lowest = min_off[u]
                    if lowest < big and floor[s] < lowest:
                        tp = _log(trail, tp, T_FLOOR, s, floor[s])
                        floor[s] = lowest
            counters[2] += nb_ptr[b + 1] - nb_ptr[b] + hi - lo
            ok = True  # section inference with the monotonic floor
            for s in range(lo, hi):
                f = floor[s]
                if flags[1] and f < o:
                    f = o
                if flags[0]:
                    f += total[s]
                if f > capacity:
                    ok = False
                    break
            fr[HAT] = hatless
            if not ok:
                tp = _undo(trail, tp, fr[MARK], min_off, floor, total, placed, cuts, rank)
                if flags[4] and hatless:
                    break
                continue
            fr[STATE] = CHILD
            fresh = 0
            if flags[5]:  # decomposition: count the boundaries no unplaced buffer crosses any more
                for s in range(first[b], last[b] - 1):
                    tp = _log(trail, tp, T_CUTS, s, cuts[s])
                    cuts[s] -= 1
                    if cuts[s] == 0 and lo < s + 1 < hi:
                        fresh += 1
            child = frames[sp]
            if fresh:
                child[KIND], child[STATE], child[LO], child[HI] = SPLIT, NEXT, lo, hi
                child[POS], child[END], child[START], child[FINAL] = first[b], last[b] - 1, lo, 0
            else:
                child[KIND], child[STATE], child[LO], child[HI] = DFS, ENTER, lo, hi
                child[ORD], child[M], child[KEY], child[ROOT] = base, m_all, best - 1, 0
            sp += 1
            pushed = True
            break
        if not pushed:
            ret = 0
            if fr[ROOT]:
                pp = base
            sp -= 1
    return ret
