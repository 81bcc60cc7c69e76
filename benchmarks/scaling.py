"""Tokens/s of `memo train` on one rank against two ranks (dp=2, or sp=2 with Ulysses), the same global batch and
sequence length, each launched by torchrun (gloo on the CPU; the GPUs hidden), plus one GPU under torchrun when
CUDA is available. Ratios are against the one-rank CPU run; the first step (warm-up) is left out.

    python benchmarks/scaling.py                                  # tiny, 2048 tokens, batch 4, 6 steps
    python benchmarks/scaling.py --model tiny-gpt --seq 4096 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch


def tokens_per_s(nproc: int, flags: list[str], cuda: bool = False) -> float:
    """Returns the mean tokens/s (over all ranks) of the steps after the first of one torchrun launch."""
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    with tempfile.TemporaryDirectory() as out:
        command = [*launch, "-m", "memo", "train", *flags, "--out", f"{out}/run", "--json"]
        result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    records = [json.loads(line) for line in result.stdout.splitlines()]
    timed = [r["tokens_per_s"] for r in records if "loss" in r][1:]
    return statistics.mean(timed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="model preset (default: %(default)s)")
    p.add_argument("--seq", default="2048", help="tokens per sequence (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="global batch (default: %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default: %(default)s)")
    p.add_argument("--strategy", default="memo", help="activation strategy (default: %(default)s)")
    args = p.parse_args(argv)
    flags = ["--model", args.model, "--seq-len", args.seq, "--batch-size", str(args.batch), "--steps", str(args.steps)]
    flags += ["--strategy", args.strategy, "--eval-every", str(10 * args.steps), "--warmup-steps", "1"]
    rows = [
        ("CPU, 1 rank", 1, ["--sp", "1"], False),
        ("CPU, 2 ranks dp=2 (gloo)", 2, ["--sp", "1"], False),
        ("CPU, 2 ranks sp=2 (gloo, Ulysses)", 2, ["--sp", "2"], False),
    ]
    if torch.cuda.is_available():
        rows.append(("CUDA, 1 GPU (torchrun)", 1, ["--device", "cuda", "--dtype", "bfloat16"], True))
    base = None
    print(f"{args.model}, {args.seq} tokens x {args.batch} sequences per step, strategy {args.strategy}")
    print("| run | tokens/s | vs 1 CPU rank |")
    print("|---|---:|---:|")
    for name, nproc, extra, cuda in rows:
        rate = tokens_per_s(nproc, flags + extra, cuda)
        base = base or rate
        print(f"| {name} | {rate:.0f} | {rate / base:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
