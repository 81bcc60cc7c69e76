"""Regenerates the default-run figures of the README and docs/training.md: runs `memo train` exactly as the
README's first command does (no arguments but `--out`), then prints the summary it printed, the wall time, the machine, and the held-out
accuracy by step from the run's metrics.jsonl, as markdown to paste.

    python benchmarks/default_run.py                 # about 5 minutes on the project's 2-core machine
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from memo.cli import main as memo  # noqa: E402
from memo.train.metrics import read_metrics  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    p.add_argument("--steps", type=int, default=None, help="fewer steps for a smoke run (default: the README's)")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="memo-default-"))
    extra = ["--steps", str(args.steps)] if args.steps else []
    printed = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        status = memo(["train", "--out", str(out), *extra])
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"memo train exited {status}")
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval_accuracy" in r]
    minutes, rest = divmod(round(seconds), 60)
    print("```")
    print(printed.getvalue().rstrip().replace(str(out), "runs/<date-time>"))
    print("```")
    print(
        f"\nMeasured {datetime.date.today()} on {platform.machine()} with {os.cpu_count()} cores, torch "
        f"{torch.__version__}: {minutes} min {rest:02d} s. Held-out accuracy by step: "
        + ", ".join(f"{r['eval_accuracy']:.1%} at {r['step']}" for r in evals)
        + "."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
