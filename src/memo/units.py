"""Human units for sizes and lengths: parse `512K`, `1M`, `80GB`, `2GiB`; print bytes the same way."""

from __future__ import annotations

import re

_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str | int) -> int:
    """Returns an integer from '1M' (2**20), '512K', '80GB', '2GiB' or a plain number (binary multiples)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read size {text!r}; use a number with an optional K/M/G/T suffix, e.g. 512K")
    value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


def format_bytes(n: float) -> str:
    """Returns `n` bytes in binary units, e.g. '1.50GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024:
            return f"{int(n)}B" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return f"{n:.2f}PiB"


def format_count(n: int) -> str:
    """Returns a token count the way `parse_size` reads it: 1048576 -> '1M', 524288 -> '512K'."""
    for suffix in ("T", "G", "M", "K"):
        if n >= _SUFFIX[suffix] and n % _SUFFIX[suffix] == 0:
            return f"{n // _SUFFIX[suffix]}{suffix}"
    return str(n)


def parse_length(text: str | int) -> int:
    """Returns a positive token count read by `parse_size` (a length of 0 or less is an error)."""
    n = parse_size(text)
    if n <= 0:
        raise ValueError(f"must be a positive number of tokens, e.g. 512K, got {text!r}")
    return n


def format_seconds(s: float) -> str:
    """Returns a duration people read at a glance: '42 s', '8.5 min', '1.2 h'."""
    if s < 60:
        return f"{s:.0f} s"
    return f"{s / 60:.1f} min" if s < 3600 else f"{s / 3600:.1f} h"
