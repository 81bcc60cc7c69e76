from pathlib import Path

import numpy as np
import pytest

from memo.plan.problem import Problem, check_placement, max_load, read_csv, write_csv

INSTANCES = Path(__file__).resolve().parents[1] / "benchmarks" / "dsa-instances"


def _brute_force_load(p: Problem) -> int:
    return max(int(p.size[(p.lower <= t) & (t < p.upper)].sum()) for t in range(int(p.upper.max())))


def test_load_matches_brute_force_on_random_instances():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 12))
        lo = rng.integers(0, 20, n)
        p = Problem(tuple(range(n)), lo, lo + rng.integers(1, 10, n), rng.integers(1, 50, n))
        assert max_load(p) == _brute_force_load(p)


def test_half_open_lifetimes_let_a_buffer_reuse_a_freed_address():
    p = Problem.from_rows([("a", 0, 5, 10), ("b", 5, 9, 10)])
    assert max_load(p) == 10
    assert check_placement(p, [0, 0]) == []


def test_checker_catches_a_planted_overlap_and_says_why():
    p = Problem.from_rows([("a", 0, 5, 10), ("b", 4, 9, 10), ("c", 9, 12, 5)])
    assert check_placement(p, [0, 10, 0]) == []
    reasons = check_placement(p, [0, 5, 0])
    assert len(reasons) == 1 and "'a' [0, 10) and 'b' [5, 15) overlap" in reasons[0]
    assert "exceeds capacity 12" in check_placement(p, [0, 10, 0], capacity=12)[0]
    assert "negative offset" in check_placement(p, [-1, 10, 0])[0]


def test_csv_round_trip(tmp_path):
    p = Problem.from_rows([("x", 0, 3, 7), ("y", 1, 4, 9)])
    write_csv(p, tmp_path / "p.csv")
    q = read_csv(tmp_path / "p.csv")
    assert q.ids == ("x", "y") and (q.size == p.size).all() and (q.upper == p.upper).all()


@pytest.mark.parametrize(
    "text, message",
    [
        ("id,lower,size\n0,1,2\n", "header must have"),
        ("id,lower,upper,size\n0,5,5,2\n", r"line 2: upper \(5\) must be above lower \(5\)"),
        ("id,lower,upper,size\n0,1,4,2\n1,1,x,2\n", "line 3: upper 'x' is not an integer"),
        ("id,lower,upper,size\n0,1,4,0\n", "line 2: size must be positive, got 0"),
        ("id,lower,upper,size\n0,1,4,-3\n", "line 2: size must be positive, got -3"),
        ("id,lower,upper,size\n0,1,4,2.5\n", "line 2: size '2.5' is not an integer"),
        ("id,lower,upper,size\n0,0,2,18446744073709551616\n", "line 2: size 18446744073709551616 is too large"),
        ("id,lower,upper,size\n0,-9223372036854775809,2,1\n", "line 2: lower -9223372036854775809 is too large"),
        ("id,lower,upper,size\n0,1,4\n", "line 2: the row has no size"),
        ("id,lower,upper,size\n0,0,2,4611686018427387903\n1,0,2,1\n", "the sizes add up to 4611686018427387904"),
    ],
)
def test_bad_csv_is_one_line_naming_the_file_and_row(tmp_path, text, message):
    (tmp_path / "bad.csv").write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        read_csv(tmp_path / "bad.csv")
    assert str(err.value).startswith(str(tmp_path / "bad.csv")) and "\n" not in str(err.value)


def test_shipped_instances_have_the_size_and_load_their_table_lists():
    rows = [line.split("|")[1:4] for line in (INSTANCES / "README.md").read_text().splitlines() if ".csv |" in line]
    assert {name.strip() for name, _, _ in rows} == {str(p.relative_to(INSTANCES)) for p in INSTANCES.rglob("*.csv")}
    for name, n, load in rows:
        p = read_csv(INSTANCES / name.strip())
        assert (len(p), max_load(p)) == (int(n), int(load)), name
    # LOADs published with the instances (MiniMalloc's and idealloc's own tools)
    for name, load in [("minimalloc/challenging/D.1048576.csv", 986112), ("idealloc/G_1.csv", 3030937746)]:
        assert max_load(read_csv(INSTANCES / name)) == load
