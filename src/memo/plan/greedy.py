"""Greedy DSA placement: buffers in some order, each into the best-fitting gap among the placed buffers
that are live at the same time; several orders are tried and the lowest peak kept.
"""

from __future__ import annotations

import numpy as np

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
    """Returns offsets placing buffers in `order`, each in the smallest gap that holds it (lowest if not best_fit)."""
    n = len(p)
    offsets = np.full(n, -1, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    for i in order:
        live = np.flatnonzero(placed & (p.lower < p.upper[i]) & (p.lower[i] < p.upper))
        offsets[i] = _best_gap(offsets[live], offsets[live] + p.size[live], int(p.size[i]), best_fit)
        placed[i] = True
    return offsets


def _best_gap(starts: np.ndarray, ends: np.ndarray, size: int, best_fit: bool) -> int:
    """Returns the offset of the gap for `size` among occupied [starts, ends) intervals."""
    if not len(starts):
        return 0
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)  # top of everything at or below each interval
    gap_lo = np.concatenate(([0], reach[:-1]))
    gap_len = starts - gap_lo
    ok = np.flatnonzero(gap_len >= size)
    if not len(ok):
        return int(reach[-1])
    pick = ok[np.argmin(gap_len[ok])] if best_fit else ok[0]
    return int(gap_lo[pick])


LARGE = 10_000  # buffers: above this, one pass costs seconds, so only best fit is tried


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
