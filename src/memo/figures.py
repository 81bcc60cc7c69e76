"""Figures are drawn off-screen (Agg), and matplotlib is imported only when one is drawn: importing it costs
a fifth of a second of every command's start. Each PNG carries memo's name (its Software text field), so that a
later command may replace it without `--overwrite` (`memo.files.claim_file`)."""

from __future__ import annotations

from pathlib import Path

from .files import atomic_output

SOFTWARE = "memo"


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
            png = Path(path).suffix.lower() in ("", ".png")  # matplotlib's default format; others lack the field
            fig.savefig(tmp, dpi=dpi, metadata={"Software": SOFTWARE} if png else None)
    finally:
        pyplot().close(fig)


def drawn_by_memo(path: str | Path) -> bool:
    """Returns whether `path` is a PNG that `save` wrote (one memo may replace)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.format == "PNG" and image.info.get("Software") == SOFTWARE
    except (OSError, UnidentifiedImageError, ValueError):
        return False
