"""Where the cost model's in-training attention speed comes from, and the published runs that check it.

Calibration (the one run `cost.efficiency.IN_TRAINING` is set from): TRL's Qwen3-8B at 1,048,576 tokens on one
8x H100 node, 380 s per step (huggingface/trl v1.13.0 release notes), context parallel 8 over SDPA with the
whole layer recomputed, timed by the cost model at each Hopper kernel's published speed (the fast end of the
band): the run's kernel is not named, so each reading gives the fraction of its benchmark the run reached.

Validation (never used to set a number): ALST's published recipes (arXiv 2506.13996; snowflakedb/ArcticTraining
projects/sequence-parallelism) at their published lengths, estimated as `memo estimate --system alst`: whether
each fits, and the longest it fits. ALST's step times are not used: this project could not read them offline.

    PYTHONPATH=src .venv/bin/python benchmarks/in_training.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from memo.cost.efficiency import IN_TRAINING
from memo.cost.estimate import HEADROOM, Layout, Pricing, estimate, max_seq
from memo.cost.hardware import gpu
from memo.job import Job, named_model
from memo.units import format_count

TRL_STEP_SECONDS = 380.0  # huggingface/trl v1.13.0: "Qwen3-8B at 1,048,576 tokens, 380 s/step, 56.2 GB per GPU"
TRL_LAYOUT = Layout(system="megatron", cp=8, recompute="full")  # ring attention over 8 GPUs, whole layer again
# ALST's published Llama-3.1-8B lengths (the paper's abstract; the recipes' max_length): GPUs, GPU, length
ALST = [(1, "h100", 500_000), (8, "h100", 3_700_000)]


def calibration(kernels=("flash", "cudnn", "fa4")) -> list[dict]:
    """Returns, per Hopper kernel, TRL's step predicted at the kernel's published speed and the fraction of it
    the run reached (above 1: the run was faster than that kernel can be, so it did not run it)."""
    job = Job(model=named_model("qwen3-8b"), seq=1 << 20, gpus=8)
    rows = []
    for kernel in kernels:
        e = estimate(
            dataclasses.replace(job, attention=kernel),
            gpu("h100"),
            "megatron",
            Pricing(point="high"),
            layout=TRL_LAYOUT,
        )
        rows.append({"kernel": kernel, "predicted_s": e.step_seconds, "fraction": e.step_seconds / TRL_STEP_SECONDS})
    return rows


def validation() -> list[dict]:
    """Returns ALST's published lengths beside `--system alst`'s answer there and its longest length."""
    rows = []
    for gpus, name, length in ALST:
        job = Job(model=named_model("llama3.1-8b"), seq=length // (1024 * gpus) * 1024 * gpus, gpus=gpus)
        e = estimate(job, gpu(name), "alst")
        longest = max_seq(job, gpu(name), "alst", Pricing(memory="high", headroom=HEADROOM))
        rows.append(
            {
                "gpus": gpus,
                "gpu": name,
                "published": length,
                "fits": e.fits,
                "why": e.why,
                "device_gib": e.device_bytes["total"] / 2**30,
                "longest": longest.tokens,
                "why_not": longest.why_not,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    fitted, checked = calibration(), validation()
    if args.json:
        print(json.dumps({"calibration": fitted, "validation": checked, "in_training": IN_TRAINING}))
        return 0
    print(f"calibration: TRL Qwen3-8B 1M on 8x H100, {TRL_STEP_SECONDS:.0f} s per step")
    for r in fitted:
        print(f"  at {r['kernel']}'s published speed: {r['predicted_s']:.1f} s predicted, run at {r['fraction']:.3f}")
    print("  in-training fraction: " + ", ".join(f"{k} {v:.3f}" for k, v in IN_TRAINING.items()))
    print(
        "validation: ALST's published lengths, memo estimate --system alst (the longest: memory at its upper end, "
        "3 GiB kept free)"
    )
    for r in checked:
        answer = f"fits, {r['device_gib']:.1f} GiB" if r["fits"] else f"does not fit: {r['why']}"
        print(
            f"  {r['gpus']}x {r['gpu']}, published {format_count(r['published'])}: {answer}; "
            f"longest {format_count(r['longest'])} ({r['why_not']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
