"""Sliding-window attention on the CPU against full causal attention over the same tokens: one layer's attention,
forward and backward, through `memo.attention` (the windowed call runs its query blocks against their band,
`memo/window.py`), at the `tiny` preset's widths (4 heads of 16, grouped as the preset groups them), fp32.

Each row is the median of `--repeats` forward + backward calls after one warm-up, the two kinds alternated so a
shared machine's drift falls on both; memory is the resident-set high-water mark of one windowed call above the
resident set before it, after a warm-up, in a fresh process whose malloc returns freed memory from its start,
against the bytes of one s x s fp32 score matrix of one head (what a dense windowed mask would cost, let alone the
scores). The issue's goals: the windowed call at most 0.2x the full call's time at
s = 64K, w = 4096, and no s² buffer anywhere. One CPU thread by default (`--threads`), as in `packing.py`.

    PYTHONPATH=src .venv/bin/python benchmarks/window.py                        # s = 64K, w = 4096: ~2 min
    PYTHONPATH=src .venv/bin/python benchmarks/window.py --seq 8192 --window 1024
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:  # absent when run through runpy
    sys.path.insert(0, str(BENCHMARKS))
from strategies import RssPeak, _return_freed_memory_to_os  # noqa: E402

from memo import ModelConfig  # noqa: E402
from memo.attention import attention_backward, attention_forward  # noqa: E402
from memo.units import parse_size  # noqa: E402

TIME_GOAL = 0.2  # windowed over full causal, issue 38


def inputs(seq: int) -> tuple[torch.Tensor, ...]:
    """Returns q (1, heads, s, d), k, v (1, kv heads, s, d) and an output gradient at the tiny preset's widths."""
    c = ModelConfig.preset("tiny")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, c.n_heads, seq, c.head_dim, generator=g)
    k, v = (torch.randn(1, c.n_kv_heads, seq, c.head_dim, generator=g) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=g), c.head_dim**-0.5


def call(q, k, v, dout, scale, window: int | None) -> None:
    """Runs one attention forward and its backward."""
    out, lse, aux = attention_forward(q, k, v, scale, "flash", window=window)
    attention_backward(dout, q, k, v, out, lse, aux, scale)


def measure(seq: int, window: int, repeats: int, threads: int) -> dict:
    """Returns the median seconds of each kind of call and the windowed call's memory above its start."""
    args = inputs(seq)
    seconds: dict[str, list[float]] = {"full": [], "windowed": []}
    for i in range(repeats + 1):
        for kind, w in (("full", None), ("windowed", window)):
            start = time.perf_counter()
            call(*args, w)
            if i:  # the first round warms up
                seconds[kind].append(time.perf_counter() - start)
    full, windowed = (statistics.median(seconds[k]) for k in ("full", "windowed"))
    peak = _peak_in_subprocess(seq, window, threads)
    return {"full_s": full, "windowed_s": windowed, "ratio": windowed / full, "peak_bytes": peak}


def windowed_peak(seq: int, window: int) -> int:
    """Returns the resident-set peak of one windowed call above its start, after one warm-up, in a process whose
    malloc returns freed memory from its start (a heap grown by earlier calls would serve the call from its pages)."""
    _return_freed_memory_to_os()
    args = inputs(seq)
    call(*args, window)
    with RssPeak() as rss:
        call(*args, window)
    return rss.peak


def _peak_in_subprocess(seq: int, window: int, threads: int) -> int:
    argv = ["--seq", str(seq), "--window", str(window), "--threads", str(threads), "--peak-only"]
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", default="64K", help="tokens of the sequence (64K)")
    p.add_argument("--window", type=int, default=4096, help="the sliding window (tokens)")
    p.add_argument("--repeats", type=int, default=1, help="timed calls of each kind after one warm-up")
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--peak-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    seq = parse_size(args.seq)
    if not 0 < args.window < seq:
        p.error(f"`--window` must lie between 0 and `--seq` ({seq}), got {args.window}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    if args.peak_only:
        print(windowed_peak(seq, args.window))
        return 0
    try:
        r = measure(seq, args.window, args.repeats, args.threads)
    finally:
        torch.set_num_threads(threads)
    square = seq * seq * 4
    print("| s | w | full causal s | windowed s | x full | windowed call's peak MiB | one s x s fp32 MiB |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {seq} | {args.window} | {r['full_s']:.2f} | {r['windowed_s']:.2f} | {r['ratio']:.3f} | "
        f"{r['peak_bytes'] / 2**20:.1f} | {square / 2**20:.0f} |"
    )
    met = r["ratio"] <= TIME_GOAL
    small = r["peak_bytes"] < square
    print(
        f"windowed attention {r['ratio']:.3f}x full causal (goal <= {TIME_GOAL}x): {'met' if met else 'NOT met'}; "
        f"its peak {r['peak_bytes'] / square:.3f}x one s x s fp32 matrix: {'no' if small else 'an'} s² buffer"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
