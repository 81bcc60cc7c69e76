"""The Dynamic Storage Allocation problem: buffers with half-open lifetimes, MiniMalloc CSV I/O, LOAD, validation.

A placement gives every buffer an offset; it is valid when buffers that are live at the same time
(`lower_i < upper_j and lower_j < upper_i`) do not overlap in address, and its peak is max(offset + size).
"""

from __future__ import annotations

import bisect
import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..files import atomic_output

# The most a size, a time or the sum of the sizes may be: offsets and peaks then stay below 2^62 in int64 (the
# search kernel's "infinity"), and a larger arena than 4 EiB is no machine's.
MAX_BYTES = (1 << 62) - 1


@dataclass(frozen=True)
class Problem:
    """Buffers as parallel arrays; `ids` are the caller's names (CSV ids, tensor ids)."""

    ids: tuple
    lower: np.ndarray
    upper: np.ndarray
    size: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.ids)
        for name in ("lower", "upper", "size"):
            # contiguous: the search kernel is compiled for one array layout; another would compile it again
            arr = np.ascontiguousarray(getattr(self, name), dtype=np.int64)
            if arr.shape != (n,):
                raise ValueError(f"`{name}` has {arr.shape[0] if arr.ndim else 0} entries for {n} buffers")
            object.__setattr__(self, name, arr)
        if n and (self.size <= 0).any():
            raise ValueError(f"buffer {self.ids[int(np.argmax(self.size <= 0))]!r} has a non-positive size")
        if n and (self.upper <= self.lower).any():
            raise ValueError(f"buffer {self.ids[int(np.argmax(self.upper <= self.lower))]!r} has an empty lifetime")

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def from_rows(cls, rows) -> "Problem":
        """Returns the problem of (id, lower, upper, size) rows."""
        rows = list(rows)
        ids = tuple(r[0] for r in rows)
        cols = np.array([r[1:4] for r in rows], dtype=np.int64).reshape(-1, 3)
        return cls(ids, cols[:, 0], cols[:, 1], cols[:, 2])

    def overlaps(self) -> tuple[np.ndarray, np.ndarray]:
        """Returns index pairs (i < j) of buffers whose lifetimes overlap, by a sweep over start times."""
        order = np.argsort(self.lower, kind="stable")
        lo, hi = self.lower[order], self.upper[order]
        # for each buffer (sorted by start), the later-starting buffers that start before it ends
        ends = np.searchsorted(lo, hi, side="left")
        counts = np.maximum(ends - np.arange(len(lo)) - 1, 0)
        first = np.repeat(np.arange(len(lo)), counts)
        rank = np.arange(len(first)) - np.repeat(np.cumsum(counts) - counts, counts)  # 0, 1, ... per group
        second = first + 1 + rank
        a, b = order[first], order[second]
        return np.minimum(a, b), np.maximum(a, b)


def read_csv(path: str | Path) -> Problem:
    """Returns the problem in a MiniMalloc CSV (`id,lower,upper,size`, half-open lifetimes)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no such DSA instance: {path}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        fields = set(reader.fieldnames or ())
        if not {"id", "lower", "upper", "size"} <= fields:
            raise ValueError(f"{path}: header must have id,lower,upper,size; got {sorted(fields)}")
        rows = [_row(r, f"{path}: line {reader.line_num}") for r in reader]
    total = sum(r[3] for r in rows)
    if total > MAX_BYTES:
        raise ValueError(f"{path}: the sizes add up to {total}, too large for the planner (at most 2^62 - 1)")
    return Problem.from_rows(rows)


def _row(r: dict, where: str) -> tuple:
    """Returns one CSV row as (id, lower, upper, size); a ValueError naming `where` and the field when it is not
    an integer the solvers can hold (int64), or not a positive size or a non-empty lifetime."""
    values = []
    for name in ("lower", "upper", "size"):
        if r[name] is None:
            raise ValueError(f"{where}: the row has no {name}")
        try:
            value = int(r[name])
        except ValueError:
            raise ValueError(f"{where}: {name} {r[name]!r} is not an integer") from None
        if abs(value) > MAX_BYTES:
            raise ValueError(f"{where}: {name} {value} is too large for the planner (at most 2^62 - 1)")
        values.append(value)
    lower, upper, size = values
    if size <= 0:
        raise ValueError(f"{where}: size must be positive, got {size}")
    if upper <= lower:
        raise ValueError(f"{where}: upper ({upper}) must be above lower ({lower}): lifetimes are [lower, upper)")
    return (r["id"], lower, upper, size)


def write_csv(problem: Problem, path: str | Path, offsets: np.ndarray | None = None) -> None:
    """Writes the problem (with an `offset` column when a placement is given) in MiniMalloc's CSV format."""
    with atomic_output(path) as tmp, tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "lower", "upper", "size"] + (["offset"] if offsets is not None else []))
        for i, name in enumerate(problem.ids):
            row = [name, int(problem.lower[i]), int(problem.upper[i]), int(problem.size[i])]
            w.writerow(row + ([int(offsets[i])] if offsets is not None else []))


def is_placement(path: str | Path) -> bool:
    """Returns whether `path` is a placement `write_csv` wrote (its header has the offset column): memo's own."""
    try:
        with open(path, newline="") as f:
            return f.readline().strip() == "id,lower,upper,size,offset"
    except (OSError, UnicodeDecodeError):
        return False


def max_load(problem: Problem) -> int:
    """Returns LOAD: the most bytes live at any one time, a lower bound on any placement's peak."""
    if not len(problem):
        return 0
    times = np.concatenate((problem.lower, problem.upper))
    deltas = np.concatenate((problem.size, -problem.size))
    order = np.lexsort((deltas, times))  # at equal times frees (negative) come first: half-open lifetimes
    return int(np.cumsum(deltas[order]).max())


def peak(problem: Problem, offsets: np.ndarray) -> int:
    return int((np.asarray(offsets) + problem.size).max()) if len(problem) else 0


def check_placement(problem: Problem, offsets, capacity: int | None = None) -> list[str]:
    """Returns why a placement is invalid (overlapping live buffers, negative offsets, over capacity); [] if valid.

    Independent of every solver: a sweep over time keeps the live buffers sorted by offset, and each new
    buffer is compared with its neighbours in that order (the live set never overlaps, so they suffice).
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets.shape != (len(problem),):
        return [f"{offsets.shape[0] if offsets.ndim else 0} offsets for {len(problem)} buffers"]
    problems = [f"buffer {problem.ids[i]!r} at negative offset {offsets[i]}" for i in np.flatnonzero(offsets < 0)[:5]]
    if capacity is not None and len(problem) and peak(problem, offsets) > capacity:
        problems.append(f"peak {peak(problem, offsets)} exceeds capacity {capacity}")
    n = len(problem)
    times = np.concatenate((problem.lower, problem.upper))
    kinds = np.concatenate((np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64)))  # frees (0) first
    which = np.concatenate((np.arange(n), np.arange(n)))
    live: list[tuple[int, int]] = []  # (offset, buffer), sorted
    for k in np.lexsort((kinds, times)):
        b = int(which[k])
        key = (int(offsets[b]), b)
        if not kinds[k]:
            del live[bisect.bisect_left(live, key)]
            continue
        at = bisect.bisect_left(live, key)
        for j in (at - 1, at):
            if 0 <= j < len(live) and len(problems) < 10:
                _, other = live[j]
                lo, hi = (
                    max(offsets[b], offsets[other]),
                    min(offsets[b] + problem.size[b], offsets[other] + problem.size[other]),
                )
                if lo < hi:
                    problems.append(
                        f"buffers {problem.ids[other]!r} [{offsets[other]}, {offsets[other] + problem.size[other]}) "
                        f"and {problem.ids[b]!r} [{offsets[b]}, {offsets[b] + problem.size[b]}) overlap while both live"
                    )
        live.insert(at, key)
    return problems
