"""Memory that kernels allocate inside one op call, which a dispatch-level trace cannot see: the op's meta kernel
returns its outputs only, while the CUDA kernel also takes scratch from the allocator for the length of the
call. Each entry gives that scratch in bytes from the op's arguments, with the source of the sizes, so an
offline plan predicts the LOAD the device's allocator will see (reported beside the dispatch-level LOAD).

FlashAttention-2 backward, as PyTorch ships it (`aten/src/ATen/native/transformers/cuda/flash_attn/
flash_api.cpp`, `mha_bwd`): `softmax_d` fp32 (b, h, s_q rounded up to 128); `dq_accum` fp32 (b, s_q rounded to
128, h, d rounded to 32, or to 64 above 128) on its default, non-deterministic path; and with grouped-query
attention `dk_expanded` and `dv_expanded` in the inputs' dtype (b, s_k, h, d), summed into dk and dv after the
kernel.

Memory-efficient attention backward (`aten/src/ATen/native/transformers/cuda/attention_backward.cu`,
`_efficient_attention_backward`, with `mem_eff_attention/kernel_backward.h` and the sm80 kernel list of
`kernels/cutlassB.h`, which sm90 uses too; memo takes this kernel for fp32): `delta` fp32 (b, h, s_q) — for
fp32 computed outside the kernel as (dout · out) summed over the head, a (b, s_q, h, dv + 2) fp32 moment —
and the `workspace` of `Params::workspace_size()`, whose gradQ part is ceil(s_q / BI) · ceil(d / BJ) tiles of
BI · BJ floats and a 16-byte header per (b, h), rounded to 4 floats; the tile is 128 × 128 for 16-bit inputs
and 128 × 64 for fp32 above head dim 64, 64 × 64 at most 64. Neither configuration accumulates dk, dv in the
workspace. cuBLAS's workspace is allocated once per handle, not per call: the cost model counts it apart.

cuDNN's fused attention backward (`aten/src/ATen/native/cudnn/MHA.cpp`, `run_cudnn_SDP_bprop`, which takes
the graph's `get_workspace_size()` from the caching allocator): the part the cuDNN frontend sizes itself
(NVIDIA/cudnn-frontend, `include/cudnn_frontend/node/scaled_dot_product_flash_attention.h`,
`CompositeSDPABackwardNode::get_fe_workspace_size_node`), on cuDNN >= 9 without the deterministic or dBias
options: `dQ_accum` fp32 (b, h_q, s_q, d_qk) and `softmax_sum` fp32 (b, h_q, s_q); grouped-query heads of dense
(not ragged) tensors expand dK and dV in virtual tensors, which take no workspace. The backend engine's own
workspace, which cuDNN picks per kernel at run time, is not published and is left out.

FlashAttention-4 backward (Dao-AILab/flash-attention `flash_attn/cute/interface.py`, `_flash_attn_bwd`, as of
commit 004b1a2e; memo calls it on dense (b, s, h, d) views): `dq_accum` fp32 (b, h, s_q rounded to the query
tile, d rounded to 32), `dpsum` and `lse_log2` fp32 (b, h, s_q rounded), and with grouped-query attention
`dk_accum` and `dv_accum` fp32 (b, h_kv, s_k rounded to the key tile, d rounded to 32). The tiles are the
architecture's (64 query and 128 key rows on sm90; 128 and 128 on sm100, whose two-CTA clusters at head dim 128
round the keys to 256): a meta trace does not know the GPU, so it rounds to the larger, a tile at most over.
Its sizes have changed between versions; the rounding is all a newer one may change without the model knowing.
"""

from __future__ import annotations

import torch

from .. import attention  # noqa: F401  (registers memo::fa4_attention_backward)

aten = torch.ops.aten
FP32 = 4


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


def flash_backward_bytes(b: int, s_q: int, s_k: int, heads: int, kv_heads: int, d: int, itemsize: int) -> int:
    """Returns the scratch FlashAttention-2's backward allocates for one call (see the module's docstring)."""
    d = _round(d, 8)
    d_rounded = _round(d, 32 if d <= 128 else 64)
    s_rounded = _round(s_q, 128)
    scratch = b * heads * s_rounded * FP32 + b * s_rounded * heads * d_rounded * FP32
    if kv_heads != heads:
        scratch += 2 * b * s_k * heads * d * itemsize
    return scratch


def _sdpa_flash_backward(args) -> int:
    """aten._scaled_dot_product_flash_attention_backward: query (b, h, s, d), key (b, h_kv, s_k, d)."""
    q, k = args[1], args[2]
    b, h, s, d = q.shape
    return flash_backward_bytes(b, s, k.shape[2], h, k.shape[1], d, q.element_size())


def _flash_backward(args) -> int:
    """aten._flash_attention_backward: query (b, s, h, d), key (b, s_k, h_kv, d); or, variable-length, query
    (tokens, h, d), whose accumulators span all the tokens as one sequence's would."""
    q, k = args[1], args[2]
    if q.dim() == 3:
        q, k = q[None], k[None]
    b, s, h, d = q.shape
    return flash_backward_bytes(b, s, k.shape[1], h, k.shape[2], d, q.element_size())


def efficient_backward_bytes(b: int, s_q: int, heads: int, d: int, dv: int, itemsize: int) -> int:
    """Returns the scratch the memory-efficient attention backward allocates for one call (see the docstring)."""
    block_i, block_j = (128, 128 if itemsize == 2 else 64) if d > 64 else (64, 64)
    tiles = -(-s_q // block_i) * -(-d // block_j)
    workspace = FP32 * b * heads * _round(tiles * (block_i * block_j + 4), 4)
    delta = FP32 * b * heads * s_q
    if itemsize == 2:  # 16-bit kernels compute delta themselves
        return delta + workspace
    return max(FP32 * b * s_q * heads * (dv + 2), delta + workspace)


def cudnn_backward_bytes(b: int, s_q: int, heads: int, d: int) -> int:
    """Returns the workspace the cuDNN frontend sizes for one fused attention backward (see the docstring)."""
    return FP32 * b * heads * s_q * (d + 1)


def _sdpa_cudnn_backward(args) -> int:
    """aten._scaled_dot_product_cudnn_attention_backward: grad_out, then query (b, h, s, d)."""
    b, h, s, d = args[1].shape
    return cudnn_backward_bytes(b, s, h, d)


def fa4_backward_bytes(b: int, s_q: int, s_k: int, heads: int, kv_heads: int, d: int) -> int:
    """Returns the scratch FlashAttention-4's backward allocates for one call (see the module's docstring)."""
    d_rounded, s_rounded = _round(d, 32), _round(s_q, 128)
    scratch = FP32 * b * heads * s_rounded * (d_rounded + 2)
    if kv_heads != heads:
        scratch += 2 * FP32 * b * kv_heads * _round(s_k, 256) * d_rounded
    return scratch


def _fa4_backward(args) -> int:
    """memo::fa4_attention_backward: dout, then query (b, h, s, d), key (b, h_kv, s_k, d)."""
    q, k = args[1], args[2]
    b, h, s, d = q.shape
    return fa4_backward_bytes(b, s, k.shape[2], h, k.shape[1], d)


def _sdpa_efficient_backward(args) -> int:
    """aten._scaled_dot_product_efficient_attention_backward: query (b, h, s, d), value (b, h, s_k, dv)."""
    q, v = args[1], args[3]
    b, h, s, d = q.shape
    return efficient_backward_bytes(b, s, h, d, v.shape[-1], q.element_size())


REGISTRY = {
    torch.ops.memo.fa4_attention_backward.default: _fa4_backward,
    aten._scaled_dot_product_cudnn_attention_backward.default: _sdpa_cudnn_backward,
    aten._scaled_dot_product_efficient_attention_backward.default: _sdpa_efficient_backward,
    aten._scaled_dot_product_flash_attention_backward.default: _sdpa_flash_backward,
    aten._flash_attention_backward.default: _flash_backward,
}


def kernel_scratch(func, args) -> int:
    """Returns the bytes `func` takes for scratch while it runs on CUDA (0 for ops not in the registry)."""
    size = REGISTRY.get(func)
    return size(args) if size else 0
