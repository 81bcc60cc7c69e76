"""Greedy DSA placement: buffers in some order, each into the best-fitting gap among the placed buffers
that are live at the same time; several orders are tried and the lowest peak kept.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .problem import Problem

ORDERS = ("size", "area", "lifetime", "start")


def order_by(p: Problem, key: str) -> np.ndarray:
    """Returns buffer indices in placement order: largest size / area / lifetime first, or earliest start."""
    duration = p.upper - p.lower
    keys = {
        "size": (-duration, -p.size),
        "area": (-p.size, -(p.size * duration)),
        "lifetime": (-p.size, -duration),
        "start": (-p.size, p.lower),
    }
    if key not in keys:
        raise ValueError(f"unknown greedy order {key!r}; choose one of {', '.join(ORDERS)}")
    return np.lexsort(keys[key])  # lexsort sorts by the last key first


def place_greedy(p: Problem, order: np.ndarray, best_fit: bool = True) -> np.ndarray:
    """Returns offsets placing buffers in `order`, each in the smallest gap that holds it (lowest if not best_fit)
    among the placed buffers live at the same time (the lowest-addressed first where two start at one address)."""
    if not len(p):
        return np.full(0, -1, dtype=np.int64)
    return _place(p.lower, p.upper, p.size, np.ascontiguousarray(order, dtype=np.int64), best_fit)


@njit(cache=True)
def _place(lower, upper, size, order, best_fit):
    """The placement loop. The placed buffers live with a buffer are found in a tree over the buffers sorted by
    their start that keeps the latest end placed under each node: a step costs the buffers it finds, not all n."""
    n = len(lower)
    by_start = np.argsort(lower, kind="mergesort")
    starts = lower[by_start]
    leaf = np.empty(n, dtype=np.int64)
    leaf[by_start] = np.arange(n)
    width = 1
    while width < n:
        width *= 2
    latest = np.full(2 * width, -1, dtype=np.int64)  # per node: the latest end of a placed buffer under it
    offsets = np.full(n, -1, dtype=np.int64)
    found = np.empty(n, dtype=np.int64)
    stack = np.empty(64, dtype=np.int64)
    for i in order:
        before = np.searchsorted(starts, upper[i])  # the buffers starting before i ends
        count, top = 0, 1
        stack[0] = 1
        while top:
            top -= 1
            node = stack[top]
            first = node
            while first < width:  # the first leaf under the node
                first *= 2
            if first - width >= before or latest[node] <= lower[i]:
                continue
            if node >= width:
                found[count] = by_start[node - width]
                count += 1
            else:
                stack[top] = 2 * node + 1
                stack[top + 1] = 2 * node
                top += 2
        offsets[i] = _gap(offsets, size, np.sort(found[:count]), size[i], best_fit)
        node = width + leaf[i]
        while node and latest[node] < upper[i]:
            latest[node] = upper[i]
            node //= 2
    return offsets


@njit(cache=True)
def _gap(offsets, size, live, need, best_fit):
    """Returns the offset of the gap for `need` bytes among the `live` buffers (by index), by address."""
    if not len(live):
        return 0
    order = np.argsort(offsets[live], kind="mergesort")
    reach, best, pick = 0, -1, -1
    for k in order:
        j = live[k]
        gap = offsets[j] - reach
        if gap >= need and (best < 0 or gap < best):
            best, pick = gap, reach
            if not best_fit:
                return pick
        reach = max(reach, offsets[j] + size[j])
    return pick if pick >= 0 else reach


LARGE = 10_000  # buffers: above this only best fit is tried (a pass took seconds before the tree; plans keep theirs)


def greedy(p: Problem) -> tuple[np.ndarray, str]:
    """Returns the best placement over all orders and fit rules, and its name (e.g. 'greedy:size')."""
    best, name, best_peak = None, "", None
    for key in ORDERS:
        order = order_by(p, key)
        for best_fit in (True,) if len(p) > LARGE else (True, False):
            offsets = place_greedy(p, order, best_fit)
            peak = int((offsets + p.size).max()) if len(p) else 0
            if best_peak is None or peak < best_peak:
                best, best_peak, name = offsets, peak, f"greedy:{key}" + ("" if best_fit else "-first-fit")
    return best, name
