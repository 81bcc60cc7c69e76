"""MFU against sequence length for several systems, as data and as a PNG plot."""

from __future__ import annotations

from pathlib import Path

from ..figures import pyplot, save
from ..job import Job
from ..units import format_count
from .efficiency import Band
from .estimate import SYSTEMS, Estimate, Pricing, estimate
from .hardware import GPUSpec


def default_lengths(start: int = 32 * 1024, stop: int = 4 << 20) -> list[int]:
    """Returns powers of two from 32K to 4M tokens."""
    lengths = [start]
    while lengths[-1] * 2 <= stop:
        lengths.append(lengths[-1] * 2)
    return lengths


def sweep(
    job: Job, lengths: list[int], gpu: GPUSpec, systems=SYSTEMS, band: Band | None = None
) -> dict[str, list[Estimate]]:
    """Returns each system's estimate of `job` at each length (`estimate.estimate`)."""
    pricing = Pricing(band=band)
    return {s: [estimate(job.at(n), gpu, s, pricing) for n in lengths] for s in systems}


def plot_sweep(results: dict[str, list[Estimate]], path: str | Path, title: str) -> None:
    """Writes MFU against sequence length (log scale), one line per system with its efficiency band shaded;
    lengths that do not fit are not drawn."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for system, estimates in results.items():
        fitting = [e for e in estimates if e.fits]
        x = [e.seq for e in fitting]
        (line,) = ax.plot(x, [100 * e.mfu for e in fitting], marker="o", label=system)
        low, high = ([100 * e.ranges["mfu"][i] for e in fitting] for i in (0, 1))
        ax.fill_between(x, low, high, color=line.get_color(), alpha=0.15, linewidth=0)  # the efficiency band
    ax.set_xscale("log", base=2)
    lengths = [e.seq for e in next(iter(results.values()))]
    ax.set_xticks(lengths, [format_count(n) for n in lengths])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("MFU (%), causal attention counted as half")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save(fig, path, dpi=120)
