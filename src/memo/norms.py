"""LayerNorm and RMSNorm forward and backward through the device's fused kernels, as one op on every device.

The forward returns the per-token statistics its backward needs, (b, s, k) in float32 or wider: LayerNorm
keeps (mean, rstd), k = 2; RMSNorm keeps rstd, k = 1. The layer keeps them as skeletal tensors, so the
backward neither reruns the forward nor recomputes them.

The phase planner (plan/phases.py) replays a phase's op sequence traced on `meta`, so a norm must be the
same ops on meta as on the device. `aten._fused_rms_norm` is one kernel on CUDA but a decomposition on
CPU and meta; `memo::rms_norm` wraps it as one custom op whose fake kernel stands in for it on meta.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .device import has_fused_kernel, kernel_device_type

aten = torch.ops.aten


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Returns the dtype of the kept statistics: the kernels' accumulation type (float32 for 16-bit inputs)."""
    return torch.promote_types(dtype, torch.float32)


def stats_width(norm: nn.Module) -> int:
    """Returns how many numbers per token the backward of `norm` needs."""
    return 2 if isinstance(norm, nn.LayerNorm) else 1


def norm_module(c: ModelConfig, size: int) -> nn.Module:
    """Returns a norm over `size` features as `c` has them: LayerNorm (gpt), RMSNorm, or Gemma's `OffsetRMSNorm`."""
    if c.arch == "gpt":
        return nn.LayerNorm(size, eps=c.norm_eps)
    return rms_norm_module(size, c.norm_eps, c.norm_offset)


def rms_norm_module(size: int, eps: float, offset: float = 0.0, device=None) -> nn.RMSNorm:
    """Returns an RMSNorm over `size` features: `OffsetRMSNorm` when the scale is `offset` + weight."""
    return OffsetRMSNorm(size, eps, offset, device) if offset else nn.RMSNorm(size, eps=eps, device=device)


class OffsetRMSNorm(nn.RMSNorm):
    """Gemma's RMSNorm: x·rstd·(offset + weight), computed in fp32 then cast (Llama's casts x·rstd first), its weight
    starting at 0 (transformers' Gemma3RMSNorm); `norm_forward` and `norm_backward` read `offset`."""

    def __init__(self, size: int, eps: float, offset: float, device=None):
        super().__init__(size, eps=eps, device=device)
        self.offset = offset
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)[0]


@torch.library.custom_op("memo::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (x·rstd·weight, rstd) with rstd = 1/sqrt(mean(x²) + eps) of shape (..., 1); with an `offset`,
    x·rstd·(offset + weight) in the statistics' precision, then cast (Gemma)."""
    if not offset and has_fused_kernel("aten::_fused_rms_norm", x.device.type):
        y, rstd = aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        return y, rstd
    xf = x.to(stats_dtype(x.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * rstd * (offset + weight.to(xf.dtype))).to(x.dtype), rstd
    return (xf * rstd).to(x.dtype) * weight, rstd


@rms_norm.register_fake
def _rms_norm_fake(x, weight, eps, offset=0.0):
    return x.new_empty(x.shape), x.new_empty((*x.shape[:-1], 1), dtype=stats_dtype(x.dtype))


def rms_norm_backward(dy, x, rstd, weight, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight) of `rms_norm` from the forward's rstd (…, 1): the scale offset + weight takes the
    weight's place in dx, and dweight does not depend on it."""
    if not offset and has_fused_kernel("aten::_fused_rms_norm_backward", kernel_device_type(x.device)):
        return aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd, weight, [True, True])
    acc = rstd.dtype
    xf, g = x.to(acc), dy.to(acc) * (weight.to(acc) + offset if offset else weight.to(acc))
    dx = rstd * (g - xf * rstd.pow(2) * (g * xf).mean(-1, keepdim=True))
    dw = (dy.to(acc) * xf * rstd).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def norm_forward(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(x), statistics (…, stats_width(norm))) for `norm` an nn.LayerNorm or nn.RMSNorm."""
    if isinstance(norm, nn.LayerNorm):
        y, mean, rstd = aten.native_layer_norm(x, [x.shape[-1]], norm.weight, norm.bias, norm.eps)
        return y, torch.cat((mean, rstd), dim=-1)
    return rms_norm(x, norm.weight, norm.eps, getattr(norm, "offset", 0.0))


def norm_backward(norm: nn.Module, dy, x, stats) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns (dx, parameter grads by name) of `norm_forward` from its kept statistics."""
    if isinstance(norm, nn.LayerNorm):
        # the CPU kernel keeps its statistics in the input's dtype and wants them back so
        kept = x.dtype if kernel_device_type(x.device) == "cpu" else stats.dtype
        mean, rstd = (part.to(kept).contiguous() for part in stats.split(1, dim=-1))  # kernels index densely
        dx, dw, db = aten.native_layer_norm_backward(
            dy, x, [x.shape[-1]], mean, rstd, norm.weight, norm.bias, [True, True, True]
        )
        return dx, {"weight": dw, "bias": db}
    dx, dw = rms_norm_backward(dy, x, stats, norm.weight, getattr(norm, "offset", 0.0))
    return dx, {"weight": dw}
