"""Pictures of a plan: tensors as rectangles in (time, address), and the caching allocator's curves."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..figures import pyplot, save
from .bilevel import Plan

GiB = 2**30
BELOW = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.14), "ncol": 3, "fontsize": 9}  # legends off the plots


def plot_plan(plan: Plan, path: str | Path, title: str) -> None:
    """Writes a PNG: the level-2 arena (left) and simulated caching-allocator memory over the step (right)."""
    plt = pyplot()
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    p, offsets = plan.problem, plan.iteration.offsets
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.2), layout="constrained")  # makes room for the legends
    blocks = np.array([str(i).startswith(("fwd", "bwd")) for i in p.ids])
    for mask, color, label in ((~blocks, "tab:blue", "tensors"), (blocks, "tab:orange", "layer blocks (level 1)")):
        rects = [
            Rectangle((lo, off / GiB), hi - lo, size / GiB)
            for lo, hi, off, size in zip(p.lower[mask], p.upper[mask], offsets[mask], p.size[mask])
        ]
        left.add_collection(
            PatchCollection(rects, facecolor=color, edgecolor="black", linewidth=0.2, alpha=0.7, label=label)
        )
    left.set_xlim(0, int(p.upper.max()))
    left.set_ylim(0, plan.iteration.peak / GiB * 1.05)
    left.set_xlabel("trace event")
    left.set_ylabel("arena offset (GiB)")
    left.set_title(f"planned arena: peak {plan.iteration.peak / GiB:.2f} GiB")
    left.legend(
        handles=[Rectangle((0, 0), 1, 1, color="tab:blue"), Rectangle((0, 0), 1, 1, color="tab:orange")],
        labels=["tensors", "layer blocks (level 1)"],
        **BELOW,
    )
    allocated, reserved = (np.array(x) / GiB for x in zip(*plan.caching.timeline))
    right.plot(reserved, label="caching allocator: reserved")
    right.plot(allocated, label="caching allocator: allocated")
    right.axhline(plan.iteration.peak / GiB, color="tab:red", linestyle="--", label="planned arena")
    right.set_xlabel("allocation event")
    right.set_ylabel("GiB")
    right.set_title("PyTorch caching allocator (simulated) vs plan")
    right.legend(**BELOW)
    fig.suptitle(title)
    save(fig, path)
