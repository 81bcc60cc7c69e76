"""The CPU optimizer step of `--offload-states`: torch.optim.AdamW over fp32 host tensors (parameters, gradients,
two moments: what FSDP2's CPU offload leaves on the host), timed on this machine for each implementation
torch offers on CPU, and printed as seconds per billion parameters and core-seconds per billion (one core's
share: seconds x threads).

The update reads and writes every state once per step, so its time is linear in the parameter count: a few
hundred million parameters measure it as well as eight billion would, in a fraction of the host memory. The
tensors are shaped like a decoder's weight matrices; the first steps are warm-up (state allocation, first touch
of the pages) and left out; each time is the median of the rest.

    PYTHONPATH=src .venv/bin/python benchmarks/cpu_adam.py                     # 256M parameters, all kinds
    PYTHONPATH=src .venv/bin/python benchmarks/cpu_adam.py --params 64M --steps 3 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from memo.units import format_count, parse_size  # noqa: E402

WARMUP = 1  # the first step allocates the moments and touches their pages
SHAPE = (4096, 4096)  # one attention projection of an 8B Llama: the tensors the optimizer walks
KINDS = {  # torch.optim.AdamW's implementations on CPU and the flags that pick them
    "for-loop (default on CPU)": dict(foreach=False, fused=False),
    "foreach": dict(foreach=True, fused=False),
    "fused": dict(foreach=False, fused=True),
}


def _tensors(params: int) -> list[torch.nn.Parameter]:
    """Returns fp32 parameters of about `params` elements in `SHAPE` matrices, each with a gradient."""
    rows, cols = SHAPE
    count = max(1, round(params / (rows * cols)))
    tensors = []
    for _ in range(count):
        p = torch.nn.Parameter(torch.randn(rows, cols))
        p.grad = torch.randn(rows, cols)
        tensors.append(p)
    return tensors


def time_step(params: list[torch.nn.Parameter], steps: int, **flags) -> float:
    """Returns the median seconds of one AdamW step over `params` (after `WARMUP` steps)."""
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **flags)
    spent = []
    for _ in range(WARMUP + steps):
        start = time.perf_counter()
        optimizer.step()
        spent.append(time.perf_counter() - start)
    del optimizer  # its moments: the next kind starts from the same free memory
    return statistics.median(spent[WARMUP:])


def measure(params: int, steps: int) -> dict:
    """Returns each implementation's seconds and core-seconds per billion parameters on this machine (None for
    one this torch does not offer on CPU)."""
    tensors = _tensors(params)
    count = sum(p.numel() for p in tensors)
    threads = torch.get_num_threads()
    rows = {}
    for name, flags in KINDS.items():
        try:
            seconds = time_step(tensors, steps, **flags)
        except (RuntimeError, ValueError) as err:  # fused AdamW on CPU needs torch >= 2.4
            rows[name] = {"error": str(err).splitlines()[0]}
            continue
        per_billion = seconds * 1e9 / count
        rows[name] = {"seconds_per_step": seconds, "seconds_per_billion": per_billion,
                      "core_seconds_per_billion": per_billion * threads}
    return {"parameters": count, "threads": threads, "torch": torch.__version__, "kinds": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=parse_size, default=256 * 2**20, help="fp32 parameters (default: 256M)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per implementation (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    result = measure(args.params, args.steps)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"AdamW over {format_count(result['parameters'])} fp32 host parameters, {result['threads']} threads, "
          f"torch {result['torch']}")
    print("| implementation | s / step | s / billion params | core-s / billion params |")
    print("|---|---:|---:|---:|")
    for name, row in result["kinds"].items():
        if "error" in row:
            print(f"| {name} | - | - | - ({row['error']}) |")
            continue
        print(f"| {name} | {row['seconds_per_step']:.3f} | {row['seconds_per_billion']:.2f} | "
              f"{row['core_seconds_per_billion']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
