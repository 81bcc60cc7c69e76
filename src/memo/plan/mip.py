"""The paper's DSA mixed-integer program (docs/method.md §5), solved with HiGHS.

    minimise M  s.t.  A_i + S_i <= M;   A_i + S_i <= A_j + z_ij·C;   A_j + S_j <= A_i + (1 − z_ij)·C
                      for every pair (i, j) live at the same time;  A_i >= 0, z_ij ∈ {0, 1},  LOAD <= M <= C

C (the big-M) is the best known peak, M is bounded below by LOAD, and the solver starts from the best known
placement; sizes are divided by their greatest common divisor first. Worth it for small instances only.
"""

from __future__ import annotations

import math

import numpy as np

from .problem import Problem, check_placement, max_load, peak


def solve_mip(
    p: Problem, start: np.ndarray, time_limit: float | None, nodes: int | None = None
) -> tuple[np.ndarray, bool, int]:
    """Returns (offsets, proven optimal, proven lower bound) starting from `start`; never worse than `start`.

    `nodes` bounds HiGHS's branch and bound by a count, which (single-threaded) gives the same answer on any
    machine; `time_limit` seconds is a safety net. Both None run to optimality (small instances: the tests'
    reference). The offsets are checked before they are returned (rounding a near-integral solution could overlap).
    """
    import highspy  # here, not at `import memo`: the planner works without the MIP where highspy is missing

    n = len(p)
    unit = math.gcd(*(int(s) for s in p.size)) if n else 1
    size = p.size // unit
    best = int((start + p.size).max()) // unit if n else 0
    a, b = p.overlaps()
    pairs = len(a)
    h = highspy.Highs()
    h.silent()
    if time_limit is not None:
        h.setOptionValue("time_limit", float(max(time_limit, 0.1)))
    if nodes is not None:
        h.setOptionValue("mip_max_nodes", nodes)
    h.setOptionValue("threads", 1)
    h.setOptionValue("mip_rel_gap", 0.0)  # the default 1e-4 would call a peak optimal while units remain
    h.setOptionValue("mip_abs_gap", 0.999)  # peaks are whole units
    inf = highspy.kHighsInf
    # columns: A_0..A_{n-1}, M, z_0..z_{pairs-1}
    lower = np.concatenate((np.zeros(n), [max_load(p) // unit], np.zeros(pairs)))
    upper = np.concatenate((best - size, [best], np.ones(pairs))).astype(float)
    cost = np.zeros(n + 1 + pairs)
    cost[n] = 1.0
    h.addCols(n + 1 + pairs, cost, lower, upper, 0, np.zeros(n + 1 + pairs, dtype=np.int32), [], [])
    h.changeColsIntegrality(
        pairs, np.arange(n + 1, n + 1 + pairs, dtype=np.int32), np.full(pairs, highspy.HighsVarType.kInteger)
    )
    z = n + 1 + np.arange(pairs)
    # A_i − M <= −S_i
    _add_rows(h, np.stack((np.arange(n), np.full(n, n)), 1), [1.0, -1.0], -inf, -size.astype(float))
    # A_i − A_j − C·z <= −S_i ;  A_j − A_i + C·z <= C − S_j
    _add_rows(h, np.stack((a, b, z), 1), [1.0, -1.0, -float(best)], -inf, -size[a].astype(float))
    _add_rows(h, np.stack((b, a, z), 1), [1.0, -1.0, float(best)], -inf, (best - size[b]).astype(float))
    warm = highspy.HighsSolution()
    start_units = start // unit
    warm.col_value = list(np.concatenate((start_units, [best], (start_units[a] > start_units[b]).astype(float))))
    h.setSolution(warm)
    h.run()
    load = max_load(p)
    status = h.getModelStatus()
    stopped = (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kSolutionLimit)  # nodes: "solution"
    if status != highspy.HighsModelStatus.kOptimal and status not in stopped:
        return start, False, load
    bound = max(load, math.ceil(h.getInfo().mip_dual_bound - 1e-6) * unit)
    values = np.asarray(h.getSolution().col_value)
    if not len(values):
        return start, False, bound
    offsets = np.rint(values[:n]).astype(np.int64) * unit
    if check_placement(p, offsets) or peak(p, offsets) > peak(p, start):
        return start, False, bound
    optimal = status == highspy.HighsModelStatus.kOptimal
    return offsets, optimal, peak(p, offsets) if optimal else bound


def _add_rows(h, cols: np.ndarray, coefficients: list[float], lower, upper) -> None:
    """Adds one row per line of `cols` (rows × width column indices), all with the same coefficients."""
    rows, width = cols.shape
    starts = np.arange(rows, dtype=np.int32) * width
    values = np.tile(np.asarray(coefficients, dtype=float), rows)
    h.addRows(
        rows,
        np.full(rows, lower),
        np.asarray(upper, dtype=float),
        rows * width,
        starts,
        cols.reshape(-1).astype(np.int32),
        values,
    )
