"""Where the cost model's in-training attention speed comes from, and the published runs that check it.

Calibration (the one run `cost.efficiency.IN_TRAINING` is set from): TRL's Qwen3-8B at 1,048,576 tokens on one
8x H100 node, 380 s per step (huggingface/trl v1.13.0 release notes), context parallel 8 over SDPA with the
whole layer recomputed, timed by the cost model at each Hopper kernel's published speed (the fast end of the
band): the run's kernel is not named, so each reading gives the fraction of its benchmark the run reached.

Validation (never used to set a number): ALST's published Llama-3.1-8B runs on H100s (arXiv 2506.13996v1,
section 5: Tables 1-3, batch 1, unpacked, FlashAttention-2 2.7.4 unless said) at the lengths of the recipes that
made them (snowflakedb/ArcticTraining b28638e, projects/sequence-parallelism, `max_length`), estimated as
`memo estimate --system alst`: whether each fits, the longest it fits, and the published step beside the
predicted one and its band. The 15M run on 32 GPUs is left out: Ulysses over 32 ranks needs the 8 key/value
heads repeated, which memo does not model.

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
# ALST's published runs: GPUs, GPU, the recipe's max_length, the paper's label, its step (h:mm:ss), what differs
ALST = [
    (1, "h100", 500_000, "500K", "0:16:50", "Table 2; weights in host memory too"),
    (8, "h100", 1_100_000, "1.1M", "0:09:24", "Table 1; no TiledMLP, layer inputs kept on the GPU"),
    (8, "h100", 1_200_000, "1.2M", "0:11:43", "Table 1; TiledMLP, inputs on the GPU, PyTorch SDPA"),
    (8, "h100", 2_400_000, "2.4M", "0:43:30", "Table 1; no TiledMLP"),
    (8, "h100", 3_800_000, "3.7M", "1:47:35", "Tables 1 and 3; the whole recipe"),
]


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


def _seconds(hms: str) -> int:
    h, m, sec = (int(x) for x in hms.split(":"))
    return 3600 * h + 60 * m + sec


def validation() -> list[dict]:
    """Returns ALST's published runs beside `--system alst`'s answer at their lengths and its longest length."""
    rows = []
    for gpus, name, length, label, step, note in ALST:
        job = Job(model=named_model("llama3.1-8b"), seq=length, gpus=gpus)
        e = estimate(job, gpu(name), "alst")
        longest = max_seq(job, gpu(name), "alst", Pricing(memory="high", headroom=HEADROOM))
        low, high = e.ranges["step_seconds"] if e.fits else (None, None)
        rows.append(
            {
                "gpus": gpus,
                "gpu": name,
                "published": length,
                "label": label,
                "note": note,
                "fits": e.fits,
                "why": e.why,
                "device_gib": e.device_bytes["total"] / 2**30,
                "longest": longest.tokens,
                "why_not": longest.why_not,
                "published_s": _seconds(step),
                "predicted_s": e.step_seconds if e.fits else None,
                "band_s": [low, high],
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
        "validation: ALST's published runs, memo estimate --system alst (the longest: memory at its upper end, "
        "3 GiB kept free); published step / predicted middle"
    )
    for r in checked:
        answer = f"fits, {r['device_gib']:.1f} GiB" if r["fits"] else f"does not fit: {r['why']}"
        print(
            f"  {r['gpus']}x {r['gpu']}, {r['label']} ({format_count(r['published'])}): {answer}; "
            f"longest {format_count(r['longest'])} ({r['why_not']})"
        )
        if r["fits"]:
            low, high = r["band_s"]
            inside = "inside" if low <= r["published_s"] <= high else "OUTSIDE"
            print(
                f"    step {r['published_s']} s published, {r['predicted_s']:.0f} s predicted "
                f"({low:.0f}-{high:.0f}, {inside} the band): {r['published_s'] / r['predicted_s']:.3f}; {r['note']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
