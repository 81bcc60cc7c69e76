"""Sliding-window causal attention on the CPU, exact at any length: each block of queries against its band of keys.

A windowed layer lets a token see itself and the `window - 1` tokens before it (transformers 5's convention:
`kv_idx > q_idx - window`). PyTorch's CPU flash kernel takes no window, so the queries run in blocks of `BLOCK`
rows (256); a block [a, e) attends to the keys [a - window + 1, e) through the same kernel with an additive band mask
of (e - a) x (e - a + window - 1): no s x s buffer, and work s·(BLOCK + window) rather than s²/2. Every key a query
sees lies in its block's band, so each block's output and log-sum-exp are final as the kernel writes them, and
attention's backward runs block by block the same way, summing the key and value gradients of overlapping bands
in fp32. (On CUDA the flash kernel takes the window itself: `attention._flash_forward`.)

q is (b, heads, s, d); k and v (b, kv heads, s, d), grouped-query heads as they are.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
# query rows per kernel call: the band is BLOCK + window - 1 keys wide, so smaller blocks waste less of it on masked
# pairs but make more calls; at s = 64K, w = 4096 on one thread (benchmarks/window.py) a call of 1024, 512, 256 and
# 128 rows took 0.23, 0.19, 0.17 and 0.16x full causal attention's time; 256 leaves a CPU kernel's threads several
# query blocks each
BLOCK = 256


def blocks(s: int, window: int) -> list[tuple[int, int, int]]:
    """Returns (first key, first query, end) of each query block of an s-token sequence."""
    return [(max(0, a - window + 1), a, min(a + BLOCK, s)) for a in range(0, s, BLOCK)]


def band_mask(lo: int, a: int, e: int, window: int, like: torch.Tensor) -> torch.Tensor:
    """Returns the additive mask (e - a, e - lo) of queries [a, e) over keys [lo, e): 0 where key j is within
    (i - window, i], -inf elsewhere."""
    i = torch.arange(a, e, device=like.device)[:, None]
    j = torch.arange(lo, e, device=like.device)[None, :]
    seen = (j <= i) & (j > i - window)
    return torch.zeros(seen.shape, dtype=like.dtype, device=like.device).masked_fill_(~seen, float("-inf"))


def band_forward(q, k, v, scale: float, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out (b, heads, s, d), lse float32 (b, heads, s)) of windowed causal attention."""
    b, heads, s, _ = q.shape
    out = torch.empty_like(q)
    lse = q.new_empty((b, heads, s), dtype=torch.float32)
    for lo, a, e in blocks(s, window):
        mask = band_mask(lo, a, e, window, q)
        o, m = aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, :, a:e], k[:, :, lo:e], v[:, :, lo:e], 0.0, False, attn_mask=mask, scale=scale
        )
        out[:, :, a:e].copy_(o)
        lse[:, :, a:e].copy_(m)
    return out, lse


def band_backward(dout, q, k, v, out, lse, scale: float, window: int) -> tuple[torch.Tensor, ...]:
    """Returns (dq, dk, dv) of `band_forward`, dk and dv on k's own heads."""
    s = q.shape[2]
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)  # overlapping bands add up
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for lo, a, e in blocks(s, window):
        mask = band_mask(lo, a, e, window, q)
        gq, gk, gv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[:, :, a:e].contiguous(),
            q[:, :, a:e],
            k[:, :, lo:e],
            v[:, :, lo:e],
            out[:, :, a:e].contiguous(),
            lse[:, :, a:e].contiguous(),
            0.0,
            False,
            attn_mask=mask,
            scale=scale,
        )
        dq[:, :, a:e].copy_(gq)
        dk[:, :, lo:e] += gk
        dv[:, :, lo:e] += gv
    return dq, dk.to(k.dtype), dv.to(v.dtype)
