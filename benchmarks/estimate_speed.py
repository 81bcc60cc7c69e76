"""How long `memo estimate` and `memo plan` take at production shapes, each command a cold process (interpreter
start-up and imports included) against the times they are held to: an estimate with numba's on-disk cache in a
fresh folder (it compiles nothing unless `--arena`); the plan once numba's cache holds its kernels (compiling the
DSA search and the greedy placement takes some 15 s more, once).

The cost model prices memory from traced steps on `meta`, and a trace costs its op calls: a step of 3.7M tokens on 8
GPUs makes hundreds of tile passes a layer. The estimate traces two short steps per layout and extends them to the
true length (`plan.extend`), with a memo of meta kernels' outputs (`plan.meta_ops`) and the second trace in a forked
child (`plan.worker`). `--exact` also checks, at 3.7M on 8 GPUs, that the extended steps are the direct traces event
by event (the slow test of tests/test_trace_speed.py).

    PYTHONPATH=src .venv/bin/python benchmarks/estimate_speed.py            # about 90 s on the 2-core machine
    PYTHONPATH=src .venv/bin/python benchmarks/estimate_speed.py --exact    # and 10 s more
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ESTIMATE = "estimate --model llama3.1-8b --gpu h100"
COMMANDS = (  # the command, the seconds it is held to, the exit codes that answer it, whether numba's cache is warm
    (f"{ESTIMATE} --gpus 8 --seq 3700K --system memo", 5.0, (0,), False),
    (f"{ESTIMATE} --gpus 8 --max-seq --system memo", 20.0, (0,), False),
    (f"{ESTIMATE} --gpus 1 --seq 500K --offload-states --system memo", 5.0, (0,), False),
    (f"{ESTIMATE} --gpus 8 --seq 1048576T", 5.0, (0, 2), False),  # every system; priced, or refused in one line
    ("plan --model tiny --seq 4M", 21.0, (0,), True),
)


def timed(command: str, warm: bool) -> tuple[float, int]:
    """Returns (wall seconds, exit code) of `python -m memo COMMAND` in a fresh process, with numba's cache in a
    fresh folder (`warm`: filled by a first run, not timed)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "NUMBA_CACHE_DIR": cache}
        argv = [sys.executable, "-m", "memo", *command.split()]
        if warm:
            subprocess.run(argv, env=env, capture_output=True)
        start = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True)
        return time.perf_counter() - start, done.returncode


def exact() -> list[str]:
    """Returns a line per tile of memo's layout at 3.7M on 8 GPUs: whether the extended step is the direct trace."""
    sys.path.insert(0, str(ROOT / "src"))
    from memo.cost import memory
    from memo.job import named_model
    from memo.plan.extend import events
    from memo.plan.trace import TILE, TILES_DONE

    c, tokens, lines = named_model("llama3.1-8b"), 3700 * 1024 // 8, []
    for tile in (16384, 4096, None):
        traced = memory.Traced.of(c, tokens, "memo", True, tile, 8, attention="cudnn")  # what H100's estimate runs
        start = time.perf_counter()
        extended = events(memory._program(c, tokens, traced, 4096)[0]).events
        middle = time.perf_counter()
        direct = memory._traced_step(c, tokens, traced, 4096).trace.events
        direct = [e for e in direct if e.op not in (TILE, TILES_DONE)]
        same = [(e.kind, e.tensor, e.nbytes, str(e.op)) for e in extended] == [
            (e.kind, e.tensor, e.nbytes, str(e.op)) for e in direct
        ]
        lines.append(
            f"tile {tile}: {len(direct)} events, extended {'==' if same else '!='} direct "
            f"(extended in {middle - start:.1f} s, traced whole in {time.perf_counter() - middle:.1f} s)"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--exact", action="store_true", help="also compare extended and direct steps at 3.7M")
    args = parser.parse_args()
    failed = False
    for command, limit, answers, warm in COMMANDS:
        seconds, code = timed(command, warm)
        ok = code in answers and seconds <= limit
        failed |= not ok
        verdict = "ok" if ok else "NOT OK"
        print(f"{seconds:6.1f} s (at most {limit:4.1f} s) {verdict:6}  exit {code}  memo {command}")
    if args.exact:
        lines = exact()
        print("\n".join(lines))
        failed |= any("!=" in line for line in lines)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
