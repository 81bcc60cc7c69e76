"""Token tiles on the CPU: each configuration's measured device-side memory beside the cost model's prediction,
and its step time against the same run untiled (memo, α = 0.5, one sequence per step).

Measured device-side peak = the activation store's buffers (allocated once, when the step's shape is first
seen) + the most bytes alive at once during a steady forward and backward, as the planned allocator records
every request at PyTorch's CPU allocator (kernel-internal buffers included; the host pool is allocated with
the buffers, so it is not in the step). Predicted = the store layout the cost model computes for the plan
(`swap.store_layout`) + the transient peak of the cost model's traced step (`cost.memory.transient_peak`: a
4-layer step on `meta` with CPU kernels, float32, extended from two short traces). Each
configuration's memory is measured in a process of its own. Step times are measured in one more process that
alternates a step of each tile length (same weights, same batch), so that a shared machine's drift in speed,
which is larger than the differences measured, falls on every configuration alike; each time is the median.

    PYTHONPATH=src .venv/bin/python benchmarks/tiling.py                     # tiny, tiny-gpt at 8K-32K
    PYTHONPATH=src .venv/bin/python benchmarks/tiling.py --seqs 8192 --tiles 1024,4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
WARMUP = 2  # the first step sizes the store and makes the gradients; the second warms the caches


def _model(preset: str, seq: int, tile: int | None):
    import torch

    from memo import ActivationPolicy, ModelConfig, Transformer

    torch.manual_seed(0)
    config = ModelConfig.preset(preset)
    policy = ActivationPolicy("memo", alpha=0.5, tile_tokens=tile or seq, host_budget_bytes=1 << 40)
    return config, Transformer(config, policy), torch.randint(0, config.vocab_size, (1, seq))


def step_times(preset: str, seq: int, tiles: list, steps: int) -> list[float]:
    """Median step seconds of each tile length (None: untiled), their steps alternated in this process."""
    models = [_model(preset, seq, tile) for tile in tiles]
    times = [[] for _ in tiles]
    for _ in range(steps):
        for (_, model, ids), spent in zip(models, times):
            start = time.perf_counter()
            model(ids, labels=ids).backward()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent[WARMUP:]) for spent in times]


def run(preset: str, seq: int, tile: int | None) -> dict:
    """One configuration in this process: its measured device-side peak and the predicted one."""
    import numpy as np
    import torch

    from memo.cost.memory import Traced, store_bytes, transient_peak
    from memo.plan.allocator import PlannedAllocator
    from memo.plan.problem import Problem, max_load

    config, model, ids = _model(preset, seq, tile)
    for _ in range(WARMUP):
        model(ids, labels=ids).backward()
    with PlannedAllocator() as arena, arena.step():  # one recorded step: every request, with its lifetime
        model(ids, labels=ids).backward()
    log = np.asarray(arena.recorded(), dtype=np.int64).reshape(-1, 3)
    end = int(log[:, 1:].max()) + 1
    freed = np.where(log[:, 2] >= 0, log[:, 2], end)  # the gradients and the loss outlive the step's clock
    load = max_load(Problem(tuple(range(len(log))), log[:, 1], freed, log[:, 0]))
    stats = model.swap_stats()
    layout = store_bytes(config, seq, stats.modes, stats.alphas, stats.tile_tokens, dtype=torch.float32)
    cut = tile if tile and tile < seq else None
    traced = Traced.of(config, seq, "memo", tile=cut, kernels="cpu", dtype=torch.float32)
    transient = transient_peak(config, seq, traced, model.loss_chunk_tokens)
    return {
        "measured": stats.device_skeletal_bytes + load,
        "predicted": layout.device_bytes + transient,
        "buffers": stats.device_skeletal_bytes,
        "predicted_buffers": layout.device_bytes,
    }


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def measure(call: str):
    """Returns what `tiling.<call>` returns, run in a fresh process (its memory and allocator its own)."""
    code = f"import json, sys; sys.path.insert(0, 'benchmarks'); import tiling; print(json.dumps(tiling.{call}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tiling.{call} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="tiny,tiny-gpt", help="model presets (default: %(default)s)")
    p.add_argument("--seqs", default="8192,16384,32768", help="tokens per sequence (default: %(default)s)")
    p.add_argument("--tiles", default="1024,4096", help="tile lengths besides untiled (default: %(default)s)")
    p.add_argument("--steps", type=int, default=7, help="steps of each tile length, the first two not counted")
    args = p.parse_args(argv)
    print("| model | tokens | tile | device peak measured MiB | predicted MiB | measured / predicted | "
          "buffers MiB | step s | step / untiled |", flush=True)  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for preset in args.presets.split(","):
        for seq in map(int, args.seqs.split(",")):
            tiles = [None, *map(int, args.tiles.split(","))]
            times = measure(f"step_times({preset!r}, {seq}, {tiles}, {args.steps})")
            for tile, step in zip(tiles, times):
                m = measure(f"run({preset!r}, {seq}, {tile})")
                print(
                    f"| {preset} | {_tokens(seq)} | {_tokens(tile) if tile else 'untiled'} | "
                    f"{m['measured'] / MIB:.1f} | {m['predicted'] / MIB:.1f} | {m['measured'] / m['predicted']:.3f} | "
                    f"{m['buffers'] / MIB:.1f} | {step:.3f} | {step / times[0]:.3f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
