"""Token tiles on the CPU: each configuration's measured device-side memory beside the cost model's prediction,
and its step time against the same run untiled (memo, α = 0.5, one sequence per step).

Measured device-side peak = the activation store's buffers (allocated once, when the step's shape is first
seen) + the most bytes alive at once during a steady forward and backward, as the planned allocator records
every request at PyTorch's CPU allocator (kernel-internal buffers included; the host pool is allocated with
the buffers, so it is not in the step). Predicted = the store layout the cost model computes for the plan
(`swap.store_layout`) + the transient peak of the cost model's traced step (`cost.memory.transient_peak`: a
4-layer step on `meta` with CPU kernels, float32, read on its lines between traced lengths). Each
configuration runs in a process of its own.

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


def run(preset: str, seq: int, tile: int | None, steps: int) -> dict:
    """One configuration in this process: its step time, measured device-side peak and predicted one."""
    import numpy as np
    import torch

    from memo import ActivationPolicy, ModelConfig, Transformer
    from memo.cost.memory import Traced, store_bytes, transient_peak
    from memo.plan.allocator import PlannedAllocator
    from memo.plan.problem import Problem, max_load

    torch.manual_seed(0)
    config = ModelConfig.preset(preset)
    policy = ActivationPolicy("memo", alpha=0.5, tile_tokens=tile or seq, host_budget_bytes=1 << 40)
    model = Transformer(config, policy)
    ids = torch.randint(0, config.vocab_size, (1, seq))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(ids, labels=ids).backward()
        times.append(time.perf_counter() - start)
    with PlannedAllocator() as arena, arena.step():  # one recorded step: every request, with its lifetime
        model(ids, labels=ids).backward()
    log = np.asarray(arena.recorded(), dtype=np.int64).reshape(-1, 3)
    end = int(log[:, 1:].max()) + 1
    freed = np.where(log[:, 2] >= 0, log[:, 2], end)  # the gradients and the loss outlive the step's clock
    load = max_load(Problem(tuple(range(len(log))), log[:, 1], freed, log[:, 0]))
    stats = model.swap_stats()
    layout = store_bytes(config, seq, stats.modes, stats.alphas, stats.tile_tokens, dtype=torch.float32)
    traced = Traced.of(config, seq, "memo", tile=tile if tile and tile < seq else None, kernels="cpu")
    transient = transient_peak(config, seq, traced, model.loss_chunk_tokens, dtype=torch.float32, kernels="cpu")
    return {
        "step_s": statistics.median(times[WARMUP:]),
        "measured": stats.device_skeletal_bytes + load,
        "predicted": layout.device_bytes + transient,
        "buffers": stats.device_skeletal_bytes,
        "predicted_buffers": layout.device_bytes,
    }


def measure(preset: str, seq: int, tile: int | None, steps: int) -> dict:
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import tiling; "
        f"print(json.dumps(tiling.run({preset!r}, {seq}, {tile}, {steps})))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{preset} {seq} tile={tile} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="tiny,tiny-gpt", help="model presets (default: %(default)s)")
    p.add_argument("--seqs", default="8192,16384,32768", help="tokens per sequence (default: %(default)s)")
    p.add_argument("--tiles", default="1024,4096", help="tile lengths besides untiled (default: %(default)s)")
    p.add_argument("--steps", type=int, default=7, help="timed steps per run, the first two not counted")
    args = p.parse_args(argv)
    print("| model | tokens | tile | device peak measured MiB | predicted MiB | measured / predicted | "
          "buffers MiB | step s | step / untiled |", flush=True)  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for preset in args.presets.split(","):
        for seq in map(int, args.seqs.split(",")):
            untiled = None
            for tile in [None, *map(int, args.tiles.split(","))]:
                m = measure(preset, seq, tile, args.steps)
                untiled = untiled or m
                print(
                    f"| {preset} | {seq // 1024}K | {f'{tile // 1024}K' if tile else 'untiled'} | "
                    f"{m['measured'] / MIB:.1f} | {m['predicted'] / MIB:.1f} | {m['measured'] / m['predicted']:.3f} | "
                    f"{m['buffers'] / MIB:.1f} | {m['step_s']:.3f} | {m['step_s'] / untiled['step_s']:.3f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
