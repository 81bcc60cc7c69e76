"""Matrix products summed over token chunks (loss chunks, layer tiles) without rounding each partial sum."""

from __future__ import annotations

import torch

from .device import kernel_device_type


def accumulating_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Returns a @ b in float32 from 16-bit inputs at 16-bit matmul speed: CUDA's mm with out_dtype
    accumulates and writes in float32; elsewhere the 16-bit product (fp32-accumulated) is widened."""
    if a.dtype == torch.float32:
        return a @ b
    if kernel_device_type(a.device) == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def add_mm(sums: dict[str, torch.Tensor], name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Adds a @ b to `sums[name]` (a float32 sum for 16-bit inputs, so that many chunks lose nothing)."""
    total = sums.get(name)
    if total is None:
        sums[name] = accumulating_mm(a, b)
    elif total.dtype == a.dtype:
        torch.addmm(total, a, b, out=total)  # addmm, not addmm_: FLOP counters know the one op
    else:
        total += accumulating_mm(a, b)


def add_to(sums: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    """Adds `value` to `sums[name]`, widened to float32 when it is 16-bit."""
    value = value.to(torch.promote_types(value.dtype, torch.float32))
    if name in sums:
        sums[name] += value
    else:
        sums[name] = value
