"""Figures are drawn off-screen (Agg), and matplotlib is imported only when one is drawn: importing it costs
a fifth of a second of every command's start."""

from __future__ import annotations


def pyplot():
    """Returns matplotlib.pyplot on the Agg backend (no display needed: runs on servers and in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
