"""Figures are drawn off-screen (Agg), and matplotlib is imported only when one is drawn: importing it costs
a fifth of a second of every command's start. Each figure carries memo's name (PNG's Software field, the
Creator of SVG, PDF and PostScript), so that a later command may replace it without `--overwrite`
(`memo.files.claim_file`)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .files import atomic_output
from .units import format_count

# how each format names the program that drew it (matplotlib's metadata keys), and the bytes that then say memo
MARKS = {
    ".png": ({"Software": "memo"}, b"Software\x00memo"),
    ".svg": ({"Creator": "memo"}, b"<dc:title>memo</dc:title>"),
    ".pdf": ({"Creator": "memo"}, b"/Creator (memo)"),
    ".ps": ({"Creator": "memo"}, b"%%Creator: memo"),
    ".eps": ({"Creator": "memo"}, b"%%Creator: memo"),
}
READ_BYTES = 1 << 16  # the marks lie in a file's first (PNG, SVG, PS) or last (PDF) bytes


def pyplot():
    """Returns matplotlib.pyplot on the Agg backend (no display needed: runs on servers and in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path, dpi: int = 110) -> None:
    """Writes `fig` to `path` atomically (a failed save leaves no half picture), marked as memo's, and frees it."""
    metadata, _ = MARKS.get(Path(path).suffix.lower(), (None, b""))
    try:
        with atomic_output(path) as tmp:
            fig.savefig(tmp, dpi=dpi, metadata=metadata)
    finally:
        pyplot().close(fig)


def drawn_by_memo(path: str | Path) -> bool:
    """Returns whether `path` is a figure that `save` wrote (one memo may replace without `--overwrite`)."""
    _, mark = MARKS.get(Path(path).suffix.lower(), (None, None))
    if mark is None:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(READ_BYTES)
            f.seek(max(f.seek(0, 2) - READ_BYTES, 0))
            return mark in head or mark in f.read()
    except OSError:
        return False


def plot_heatmap(values: dict[tuple[int, float], float | None], path: str | Path, title: str, label: str) -> None:
    """Writes a needle heatmap as PNG: context length across, needle depth down, `values` as colour (with a colour
    bar), each cell's value written in it; cells not given (an interrupted run) or without a value blank."""
    plt = pyplot()
    lengths = sorted({n for n, _ in values})
    depths = sorted({d for _, d in values})
    grid = np.array([[math.nan if values.get((n, d)) is None else values[n, d] for n in lengths] for d in depths])
    fig, ax = plt.subplots(figsize=(2.5 + 1.1 * len(lengths), 1.8 + 0.45 * len(depths)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
        ax.text(j, i, "-" if math.isnan(value) else f"{value:.0%}", ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(lengths)), [format_count(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label=label)
    fig.tight_layout()
    save(fig, path, dpi=120)
