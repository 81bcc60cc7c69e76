"""Figures are drawn off-screen (Agg), and matplotlib is imported only when one is drawn: importing it costs
a fifth of a second of every command's start."""

from __future__ import annotations

from pathlib import Path

from .files import atomic_output


def pyplot():
    """Returns matplotlib.pyplot on the Agg backend (no display needed: runs on servers and in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path, dpi: int = 110) -> None:
    """Writes `fig` to `path` atomically (a failed save leaves no half picture) and frees it."""
    try:
        with atomic_output(path) as tmp:
            fig.savefig(tmp, dpi=dpi)
    finally:
        pyplot().close(fig)
