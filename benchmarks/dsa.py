"""Every DSA instance in benchmarks/dsa-instances (or --root): our solver against best-of-orders greedy, in one table.

python benchmarks/dsa.py                      # 30 s each (60 s for pangu); greedy only above 20M overlapping pairs
python benchmarks/dsa.py --only A B           # a subset, matched on the file name
python benchmarks/dsa.py --root DIR           # any folder of MiniMalloc CSVs (idealloc's larger ones, say)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from memo.plan.dsa import solve  # noqa: E402
from memo.plan.greedy import greedy  # noqa: E402
from memo.plan.problem import max_load, peak, read_csv  # noqa: E402
from memo.plan.search import compile_kernel  # noqa: E402

INSTANCES = Path(__file__).resolve().parent / "dsa-instances"
LONGER = {"pangu_2.6B": 60.0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(INSTANCES), help="folder searched for *.csv (default: %(default)s)")
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--only", nargs="*", default=None, help="substrings of the file names to run")
    args = parser.parse_args(argv)
    files = sorted(Path(args.root).rglob("*.csv"))
    if args.only:
        files = [f for f in files if any(s in f.name for s in args.only)]
    compile_kernel()
    print("| instance | n | LOAD | greedy gap | greedy s | peak | gap | proven | s | method |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for f in files:
        p = read_csv(f)
        load = max_load(p)
        start = time.perf_counter()
        g = peak(p, greedy(p)[0])
        greedy_s = time.perf_counter() - start
        s = solve(p, LONGER.get(f.stem, args.time_limit))
        print(
            f"| {f.stem} | {len(p)} | {load} | {100 * (g / load - 1):.2f}% | {greedy_s:.1f} | {s.peak} | "
            f"{100 * s.gap:.2f}% | {'yes' if s.optimal else 'no'} | {s.seconds:.1f} | {s.method} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
