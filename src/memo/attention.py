"""Causal attention through PyTorch's fused flash kernels, keeping output and log-sum-exp for the backward.

q, k, v are (batch, heads, seq, head_dim) views; k and v may have fewer heads (grouped-query attention).
`aux` carries what a kernel's backward needs besides (q, k, v, out, lse); it is small and stays on device
(without dropout it is the same for every call over the same lengths).

Heads are independent, so a layer may call the kernels on a few heads at a time (`head_chunks`): each call's
outputs and scratch (the backward's fp32 dq accumulator, its expanded dk and dv under grouped-query attention)
then take about as much memory as one tile of the token-local work, not all heads' worth.
"""

from __future__ import annotations

import torch

from .device import kernel_device_type

aten = torch.ops.aten


def _kernel(q: torch.Tensor) -> str:
    if kernel_device_type(q.device) != "cuda":
        return "cpu_flash"
    return "cuda_flash" if q.dtype in (torch.float16, torch.bfloat16) else "cuda_efficient"


def lse_seq_len(seq_len: int, device: torch.device, dtype: torch.dtype) -> int:
    """Returns the length of the LSE's token dimension for the kernel that runs on `device` (on meta: the
    one `device.meta_kernels` names); the CUDA efficient kernel pads it to a multiple of 32."""
    if kernel_device_type(device) == "cuda" and dtype not in (torch.float16, torch.bfloat16):
        return -(-seq_len // 32) * 32
    return seq_len


MIN_CALL_ROWS = 1 << 16  # query rows x heads per call that keep a GPU's SMs busy (512 blocks of 128 rows)


def heads_per_call(heads: int, seq: int, tile: int, device: torch.device) -> int:
    """Returns how many of `heads` query heads attending over `seq` tokens each kernel call takes by default: on a
    GPU about `tile` rows of every head (heads·tile/seq heads, at least one), never fewer rows than fill it; the
    CPU kernels spread their work over heads (one head runs on one thread): all of them."""
    if kernel_device_type(device) != "cuda":
        return heads
    return min(heads, max(1, heads * tile // seq, -(-MIN_CALL_ROWS // seq)))


def head_chunks(heads: int, kv_heads: int, per_call: int) -> list[tuple[slice, list[slice]]]:
    """Returns the kernel calls over `heads` query heads, at most `per_call` each, as (key/value heads, the
    query-head slices that use them): whole key/value groups per call, or parts of one group."""
    group = heads // kv_heads
    if per_call >= group:
        kv = _divisor_at_most(kv_heads, per_call // group)
        return [(slice(j, j + kv), [slice(j * group, (j + kv) * group)]) for j in range(0, kv_heads, kv)]
    size = _divisor_at_most(group, per_call)
    return [
        (slice(j, j + 1), [slice(j * group + i, j * group + i + size) for i in range(0, group, size)])
        for j in range(kv_heads)
    ]


def _divisor_at_most(n: int, most: int) -> int:
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def _repeat_kv(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Returns k or v with heads repeated to `n_heads` (the CUDA efficient kernel wants equal head counts)."""
    rep = n_heads // t.shape[1]
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _sum_kv(grad: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Returns the gradient of repeated k/v folded back onto its `n_kv` heads."""
    b, heads, s, d = grad.shape
    return grad if heads == n_kv else grad.view(b, n_kv, heads // n_kv, s, d).sum(2)


def attention_forward(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Returns (out, lse, aux) of causal attention; out is (b, heads, s, d), lse is float32 (b, heads, s')."""
    kind = _kernel(q)
    if kind == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()
    if kind == "cuda_flash":  # takes grouped-query k, v as they are (FlashAttention-2's num_heads_k)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True, scale=scale)
    return out, lse, (seed, offset)


def attention_backward(dout, q, k, v, out, lse, aux: tuple, scale: float):
    """Returns (dq, dk, dv) for `attention_forward`, with dk, dv on k's and v's own head count."""
    kind = _kernel(q)
    if kind == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True, scale=scale
        )
    if kind == "cuda_flash":
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
        )[:3]
    n_kv = k.shape[1]
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    seed, offset = aux
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True, scale=scale
    )
    return dq, _sum_kv(dk, n_kv), _sum_kv(dv, n_kv)
