"""`memo calibrate`: measure the current device's matmul and attention throughput and host copy bandwidth."""

from __future__ import annotations

import torch

from .. import device as dev
from ..attention import attention_backward, attention_forward
from ..swap import measure_copy_bandwidth


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """Returns FLOP/s of an n×n×n matmul."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / dev.timed(lambda: a @ b, device, repeats=5)


def measure_attention_flops(device: torch.device, dtype: torch.dtype, seq: int, heads: int = 16, head_dim: int = 128):
    """Returns FLOP/s of causal attention forward + backward, counting the causal (half-matrix) work."""
    q, k, v = (torch.randn(1, seq, heads, head_dim, device=device, dtype=dtype).transpose(1, 2) for _ in range(3))
    scale = head_dim**-0.5

    def run():
        out, lse, aux = attention_forward(q, k, v, scale)
        attention_backward(out, q, k, v, out, lse, aux, scale)

    forward = 4 * seq * seq * heads * head_dim / 2
    return forward * (1 + 2.5) / dev.timed(run, device, repeats=3)


def calibrate(device: torch.device) -> dict:
    """Returns measured throughputs of `device` (bf16 on CUDA, float32 on CPU)."""
    cuda = dev.is_cuda(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    copy_src = torch.empty((256 if cuda else 64) << 20, dtype=torch.uint8, device=device)
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "matmul_flops_per_s": measure_matmul_flops(device, dtype, 8192 if cuda else 1024),
        "attention_flops_per_s": measure_attention_flops(device, dtype, 16384 if cuda else 2048),
        "host_copy_bytes_per_s": measure_copy_bandwidth(copy_src),
    }
