"""Every DSA instance in benchmarks/dsa-instances (or --root): our solver against best-of-orders greedy, in one table.

python benchmarks/dsa.py                      # the default work budget each (about 30 s on D and J, 50 s on pangu)
python benchmarks/dsa.py --only A B           # a subset, matched on the file name
python benchmarks/dsa.py --root DIR           # any folder of MiniMalloc CSVs (idealloc's larger ones, say)
python benchmarks/dsa.py --out DIR            # also write each placement: runs on an idle and a loaded machine
                                              # must write byte-identical files (`cmp`), the work budget's promise
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from memo.plan.budget import DEFAULT_WORK, SAFETY_SECONDS, work_value  # noqa: E402
from memo.plan.dsa import solve  # noqa: E402
from memo.plan.greedy import greedy  # noqa: E402
from memo.plan.problem import max_load, peak, read_csv, write_csv  # noqa: E402
from memo.plan.search import compile_kernel  # noqa: E402

INSTANCES = Path(__file__).resolve().parent / "dsa-instances"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=str(INSTANCES), help="folder searched for *.csv (default: %(default)s)")
    parser.add_argument("--work", type=work_value, default=DEFAULT_WORK, help="search work per instance")
    parser.add_argument("--time-limit", type=float, default=SAFETY_SECONDS, help="safety cap in seconds")
    parser.add_argument("--only", nargs="*", default=None, help="substrings of the file names to run")
    parser.add_argument("--out", type=Path, default=None, help="folder to write each placement to (<name>.csv)")
    args = parser.parse_args(argv)
    files = sorted(Path(args.root).rglob("*.csv"))
    if args.only:
        files = [f for f in files if any(s in f.name for s in args.only)]
    compile_kernel()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    print("| instance | n | LOAD | greedy gap | greedy s | peak | gap | proven | s | work G | method |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|")
    for f in files:
        p = read_csv(f)
        load = max_load(p)
        start = time.perf_counter()
        g = peak(p, greedy(p)[0])
        greedy_s = time.perf_counter() - start
        s = solve(p, args.time_limit, work_limit=args.work)
        if args.out:
            write_csv(p, args.out / f"{f.stem}.csv", s.offsets)
        cut = " (cut by the clock)" if s.clock_cut else ""
        print(
            f"| {f.stem} | {len(p)} | {load} | {100 * (g / load - 1):.2f}% | {greedy_s:.1f} | {s.peak} | "
            f"{100 * s.gap:.2f}% | {'yes' if s.optimal else 'no'} | {s.seconds:.1f} | {s.work / 2**30:.1f}{cut} | "
            f"{s.method} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
