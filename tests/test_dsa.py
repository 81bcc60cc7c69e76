"""DSA solvers against brute force and against each other; the search's techniques each cut work."""

import itertools
import json
import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from memo.plan.dsa import solve
from memo.plan.greedy import ORDERS, greedy, order_by, place_greedy
from memo.plan.mip import solve_mip
from memo.plan.problem import Problem, check_placement, max_load, peak, read_csv
from memo.plan.search import SearchStats, Techniques, search

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bad_inputs import busy as busy_cpus  # noqa: E402  (the benchmark's loaded machine, one place)

INSTANCES = Path(__file__).resolve().parents[1] / "benchmarks" / "dsa-instances"
# Budgets are kernel work, not seconds, so no answer depends on the machine's speed or load; this one is about
# 60x what the largest small case below takes (0.2 s on this project's machine).
WORK = 100_000_000

# docs/method.md §5: one layer's allocation sequence in MB; 15 and 16 live from forward into backward
PAPER_LAYER = (
    "malloc 13 128, malloc 14 128, free 14, malloc 15 256, free 13, malloc 16 512, malloc 17 128, malloc 18 128, "
    "malloc 19 256, free 17, free 19, free 18, malloc 20 512, free 20, malloc 21 1024, malloc 22 256, free 15, "
    "malloc 23 128, malloc 24 512, free 21, free 22, free 23, free 24, free 16"
)


def paper_problem() -> Problem:
    start, rows = {}, []
    for t, step in enumerate(PAPER_LAYER.split(", ")):
        words = step.split()
        if words[0] == "malloc":
            start[words[1]] = (t, int(words[2]))
        else:
            lo, size = start.pop(words[1])
            rows.append((words[1], lo, t, size))
    return Problem.from_rows(rows)


def brute_force_peak(p: Problem) -> int:
    """Returns the least peak by trying every offset vector (tiny instances only)."""
    capacity = max_load(p)
    while True:
        ranges = [range(capacity - int(s) + 1) for s in p.size]
        for offsets in itertools.product(*ranges):
            if not check_placement(p, np.array(offsets)):
                return capacity
        capacity += 1


def random_problem(rng, n, horizon=12, max_size=3) -> Problem:
    lo = rng.integers(0, horizon, n)
    return Problem(tuple(range(n)), lo, lo + rng.integers(1, horizon // 2, n), rng.integers(1, max_size + 1, n))


def test_paper_layer_is_packed_at_its_load():
    p = paper_problem()
    solution = solve(p, time_limit=None, work_limit=WORK)
    assert max_load(p) == 512 + 1024 + 256 + 128 + 512  # 16, 21, 22, 23 and 24 live together
    assert solution.peak == max_load(p) and solution.optimal and solution.gap == 0
    assert check_placement(p, solution.offsets) == []


def test_search_finds_the_brute_force_optimum_and_proves_nothing_lower():
    rng = np.random.default_rng(0)
    for _ in range(25):
        p = random_problem(rng, int(rng.integers(2, 6)))
        best = brute_force_peak(p)
        found = search(p, best, None, work_limit=WORK)
        assert found is not None and check_placement(p, found, best) == []
        if best > max_load(p):
            stats = SearchStats()
            assert search(p, best - 1, None, stats=stats, work_limit=WORK) is None and stats.exhausted


def test_mip_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(10):
        p = random_problem(rng, int(rng.integers(2, 6)))
        offsets, optimal, bound = solve_mip(p, greedy(p)[0], None)
        assert optimal and peak(p, offsets) == bound == brute_force_peak(p) and check_placement(p, offsets) == []


def test_mip_proves_optimality_to_the_unit_on_large_coprime_sizes():
    rng = np.random.default_rng(6)
    for _ in range(15):  # sizes with gcd 1 and ~1e6 magnitude: a relative MIP gap would hide whole units
        small = random_problem(rng, int(rng.integers(3, 7)))
        p = Problem(small.ids, small.lower, small.upper, small.size * 10**6 + rng.integers(0, 3, len(small)))
        offsets, optimal, bound = solve_mip(p, greedy(p)[0], None)
        assert optimal and check_placement(p, offsets) == []
        assert search(p, peak(p, offsets), None, work_limit=WORK) is not None
        stats = SearchStats()
        assert search(p, peak(p, offsets) - 1, None, stats=stats, work_limit=WORK) is None and stats.exhausted


ALL_OFF = Techniques(False, False, False, False, False, False, False)
FLAGS = [f for f in Techniques.__dataclass_fields__]


@pytest.mark.parametrize(
    "techniques",
    [Techniques(), ALL_OFF] + [replace(Techniques(), **{f: False}) for f in FLAGS],
    ids=["all", "none"] + [f"no-{f}" for f in FLAGS],
)
def test_every_technique_combination_gives_the_same_answers(techniques):
    rng = np.random.default_rng(2)
    for _ in range(15):
        p = random_problem(rng, int(rng.integers(6, 11)), horizon=16, max_size=4)
        offsets, optimal, _ = solve_mip(p, greedy(p)[0], None)
        best = peak(p, offsets)
        assert optimal and search(p, best, None, techniques, work_limit=WORK) is not None
        stats = SearchStats()
        assert search(p, best - 1, None, techniques, stats, work_limit=WORK) is None and stats.exhausted


def hard_instances() -> list[tuple[Problem, int]]:
    """Returns small instances whose optimum exceeds LOAD, so proving it takes a real search (shipped data:
    such instances are rare among random ones and slow to find)."""
    data = json.loads((Path(__file__).parent / "data" / "hard_dsa.json").read_text())
    return [(Problem.from_rows([(i, *row) for i, row in enumerate(d["rows"])]), d["optimum"]) for d in data]


def test_hard_instances_are_what_they_claim():
    for p, best in hard_instances():
        assert best > max_load(p)
        offsets, optimal, _ = solve_mip(p, greedy(p)[0], None)
        assert optimal and peak(p, offsets) == best


@pytest.mark.parametrize("flag", ["section_inference", "monotonic_floor", "unallocated_floor", "dominance", "hatless"])
def test_each_technique_cuts_the_work_of_proofs(flag):
    # decomposition solves the two sides of a buffer that overlaps nothing unplaced on their own, which
    # subsumes hatless pruning on these instances; decomposition has its own tests
    base = Techniques(restarts=False, decomposition=False)
    nodes = {True: 0, False: 0}
    for p, best in hard_instances():
        for on in (True, False):
            stats = SearchStats()
            techniques = base if on else replace(base, **{flag: False})
            assert search(p, best - 1, None, techniques, stats, work_limit=WORK) is None and stats.exhausted
            nodes[on] += stats.nodes
    assert nodes[True] < nodes[False]


def test_decomposition_cuts_the_work_on_a_real_instance():
    p = read_csv(INSTANCES / "minimalloc" / "challenging" / "G.1048576.csv")
    with_it = SearchStats()
    assert search(p, max_load(p), None, stats=with_it, work_limit=20 * WORK) is not None
    # without decomposition the same work finds nothing
    without = replace(Techniques(), decomposition=False)
    assert search(p, max_load(p), None, without, work_limit=with_it.work) is None


def test_a_work_budget_stops_the_search_without_claiming_a_proof():
    p, best = max(hard_instances(), key=lambda h: len(h[0]))
    full, cut = SearchStats(), SearchStats()
    assert search(p, best - 1, None, stats=full, work_limit=WORK) is None and full.exhausted
    assert search(p, best - 1, None, stats=cut, work_limit=full.work // 2) is None and not cut.exhausted
    assert not cut.clock_cut
    assert solve(p, time_limit=None, work_limit=full.work // 2).peak >= best
    with pytest.raises(ValueError, match="positive work limit"):
        solve(p, time_limit=None, work_limit=0)


def test_a_solve_gives_the_same_placement_on_a_busy_machine_and_reports_its_work():
    p = read_csv(INSTANCES / "minimalloc" / "challenging" / "D.1048576.csv")  # never proven: the budget ends it
    budget = 100_000_000  # about 0.15 s idle
    idle = solve(p, time_limit=None, work_limit=budget)  # no clock at all
    with busy_cpus():  # a clock that does not bind must change nothing, even with the cores taken
        busy = solve(p, time_limit=60, work_limit=budget)
    assert busy.offsets.tobytes() == idle.offsets.tobytes() and busy.steps == idle.steps
    assert 0 < idle.work <= budget + 1_000_000 and idle.work_limit == budget  # a run stops just past its limit
    assert not idle.clock_cut and not busy.clock_cut
    assert idle.summary()["work"] == idle.work and idle.summary()["clock_cut"] is False


def test_the_mip_stops_at_its_node_limit_with_the_same_answer_on_a_busy_machine():
    rng = np.random.default_rng(2)  # 40 buffers, 221 overlapping pairs: 20 nodes improve on greedy, prove nothing
    lo = rng.integers(0, 50, 40)
    p = Problem(
        tuple(range(40)), lo, lo + rng.integers(1, 15, 40), rng.integers(1, 30, 40) * 1000 + rng.integers(0, 3, 40)
    )
    start = greedy(p)[0]
    idle = solve_mip(p, start, None, nodes=20)
    with busy_cpus():
        busy = solve_mip(p, start, None, nodes=20)
    assert not idle[1] and peak(p, idle[0]) < peak(p, start) and check_placement(p, idle[0]) == []
    assert idle[0].tobytes() == busy[0].tobytes() and idle[2] == busy[2]


def test_a_solve_the_safety_time_limit_cuts_says_so(caplog):
    p = read_csv(INSTANCES / "minimalloc" / "challenging" / "D.1048576.csv")
    with caplog.at_level(logging.WARNING, logger="memo.plan.dsa"):
        cut = solve(p, time_limit=0.01, work_limit=WORK)
    assert cut.clock_cut and cut.summary()["clock_cut"] is True and cut.work < WORK
    assert check_placement(p, cut.offsets) == []
    assert "depends on the machine's speed and load" in caplog.text


def test_decomposition_splits_at_boundaries_no_buffer_crosses_from_the_start():
    (easy, _), (hard, best) = min(hard_instances(), key=lambda h: h[1]), max(hard_instances(), key=lambda h: h[1])
    shift = int(easy.upper.max())  # the hard instance starts when the easy one has ended
    rows = [(f"e{i}", lo, hi, sz) for i, (lo, hi, sz) in enumerate(zip(easy.lower, easy.upper, easy.size))]
    rows += [
        (f"h{i}", lo + shift, hi + shift, sz) for i, (lo, hi, sz) in enumerate(zip(hard.lower, hard.upper, hard.size))
    ]
    p = Problem.from_rows(rows)
    nodes = {}
    for on in (True, False):
        stats = SearchStats()
        techniques = Techniques(decomposition=on, restarts=False)
        assert search(p, best - 1, None, techniques, stats, work_limit=WORK) is None and stats.exhausted
        nodes[on] = stats.nodes
    assert nodes[True] < nodes[False]


def test_search_places_thousands_of_buffers_without_recursion():
    rng = np.random.default_rng(8)
    lo = rng.integers(0, 10_000, 5000)
    p = Problem(tuple(range(5000)), lo, lo + rng.integers(1, 40, 5000), rng.integers(1, 50, 5000))
    capacity = peak(p, place_greedy(p, order_by(p, "area")))
    # without decomposition the search is one dive 5000 placements deep (the recursive kernel overflowed ~3000)
    found = search(p, capacity, None, Techniques(decomposition=False), orders=("AWT",), work_limit=10 * WORK)
    assert found is not None and check_placement(p, found, capacity) == []


@pytest.mark.parametrize("key", ORDERS)
def test_greedy_orders_are_valid(key):
    rng = np.random.default_rng(4)
    for _ in range(10):
        p = random_problem(rng, 30, horizon=40, max_size=9)
        for best_fit in (True, False):
            assert check_placement(p, place_greedy(p, order_by(p, key), best_fit)) == []


def test_solve_is_never_worse_than_greedy_and_reports_gap():
    rng = np.random.default_rng(5)
    p = random_problem(rng, 60, horizon=50, max_size=20)
    g, _ = greedy(p)
    s = solve(p, time_limit=None, work_limit=WORK)
    assert s.peak <= peak(p, g) and check_placement(p, s.offsets) == []
    assert s.lower_bound >= max_load(p) and s.gap == pytest.approx(s.peak / s.lower_bound - 1)


def test_memo_imports_and_plans_without_highspy():
    """The GPU image has no highspy: `import memo` must not need it, and a plan skips the MIP and says so."""
    # greedy places this one 1 above LOAD, so the solver would reach for the MIP
    code = (
        "import sys, logging; sys.modules['highspy'] = None; logging.basicConfig()\n"
        "import memo\n"
        "from memo.plan.dsa import solve\n"
        "from memo.plan.problem import Problem\n"
        "p = Problem.from_rows([(0, 1, 3, 3), (1, 1, 4, 3), (2, 3, 6, 4), (3, 0, 1, 4), (4, 2, 3, 2), (5, 2, 4, 2)])\n"
        "s = solve(p, 1.0, use_search=False)\n"
        "print('peak', s.peak, s.method)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "peak" in done.stdout
    assert "highspy is not installed" in done.stderr
