"""Memory of a training step served by the planned allocator (`memo train --arena`) against PyTorch's own CPU
allocator on the same steps, each run in a process of its own, plus what PyTorch's CUDA caching allocator would
reserve for the recorded step (`plan.caching_sim` replaying the planned allocator's log).

Columns: the step's LOAD (most bytes alive at once, recorded), the arena, the process's peak resident memory
over the steady steps (from the fourth on) above what it held before the first step, with each allocator (what
the machine really gave: optimizer state, the step's tensors, and the arena or the allocator's fragmentation),
the caching allocator's predicted reservation, and the median step time. Ratios are against LOAD and against
the default allocator measured in the same run. Linux only (peak resident memory is reset through /proc).

    PYTHONPATH=src .venv/bin/python benchmarks/arena.py                  # tiny and tiny-gpt, 1K-8K tokens
    PYTHONPATH=src .venv/bin/python benchmarks/arena.py --seqs 16384 --batch 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
STEADY = 3  # steps 1-3 are recorded (the first makes the optimizer state) and 3 planned: 4 on are served


def run(preset: str, seq: int, batch: int, steps: int, planned: bool) -> dict:
    """One configuration in this process: trains `steps` steps and returns its measurements."""
    import torch

    from memo import ActivationPolicy, ModelConfig, Transformer
    from memo.plan.allocator import PlannedAllocator, extension
    from memo.plan.caching_sim import replay
    from memo.plan.search import compile_kernel

    extension(), compile_kernel()  # code both runs hold (the solver's kernel, the allocator): not step memory
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset(preset), ActivationPolicy("memo", alpha=0.5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    arena = PlannedAllocator() if planned else None
    times, rss_before, served_before = [], _resident("VmRSS"), 0
    with arena if arena else contextlib.nullcontext():
        for step in range(steps):
            if step == STEADY:  # state and plan are made: the peak from here on is the steady state's
                Path("/proc/self/clear_refs").write_text("5")
                served_before = arena.counters()["served"] if arena else 0
            start = time.perf_counter()
            with arena.step() if arena else contextlib.nullcontext():
                model(ids, targets=ids).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        out = {"rss_growth": _resident("VmHWM") - rss_before, "step_s": statistics.median(times[STEADY:])}
        if arena:
            log = arena.recorded()
            counters = arena.counters()
            out.update(arena=arena.plan.arena_bytes, load=arena.plan.load_bytes, **counters)
            out["served_steady"] = (counters["served"] - served_before) / (arena.plan.planned * (steps - STEADY))
            out["caching_reserved"] = replay(_events(log)).peak_reserved
    return out


def _resident(field: str) -> int:
    """Returns VmRSS (resident now) or VmHWM (peak since the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _events(log: list[list[int]]) -> list[tuple[str, int, int]]:
    """Returns the planned allocator's log (size, born, freed) as caching_sim events in clock order."""
    timed = [(born, "alloc", k, size) for k, (size, born, _) in enumerate(log)]
    timed += [(freed, "free", k, size) for k, (size, _, freed) in enumerate(log) if freed >= 0]
    return [(kind, k, size) for _, kind, k, size in sorted(timed)]


def measure(preset: str, seq: int, batch: int, steps: int, planned: bool) -> dict:
    """Runs one configuration in a fresh process (so peak resident memory is its own)."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import arena; "
        f"print(json.dumps(arena.run({preset!r}, {seq}, {batch}, {steps}, {planned})))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{preset} {seq} planned={planned} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="tiny,tiny-gpt", help="model presets (default: %(default)s)")
    p.add_argument("--seqs", default="1024,4096,8192", help="tokens per sequence (default: %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="steps per run; the first three are not measured")
    args = p.parse_args(argv)
    print("| model | tokens | LOAD MiB | arena / LOAD | served (steady) | peak RSS growth, default MiB | planned MiB | "
          "planned / default | caching_sim reserved / LOAD | step s default | planned |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for preset in args.presets.split(","):
        for seq in map(int, args.seqs.split(",")):
            default = measure(preset, seq, args.batch, args.steps, planned=False)
            planned = measure(preset, seq, args.batch, args.steps, planned=True)
            load = planned["load"]
            served = planned["served_steady"]
            print(
                f"| {preset} | {args.batch}x{seq} | {load / MIB:.1f} | {planned['arena'] / load:.3f} | {served:.0%} | "
                f"{default['rss_growth'] / MIB:.1f} | {planned['rss_growth'] / MIB:.1f} | "
                f"{planned['rss_growth'] / max(default['rss_growth'], 1):.2f} | "
                f"{planned['caching_reserved'] / load:.3f} | {default['step_s']:.3f} | {planned['step_s']:.3f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
