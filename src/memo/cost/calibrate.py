"""`memo calibrate`: measure the current device's speeds for the cost model's phases, at one GPU's shape of a
run: the layer's GEMMs, causal attention forward and backward apart, memory bandwidth, host copy bandwidth."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .. import device as dev
from ..attention import attention_backward, attention_forward
from ..config import ModelConfig, check_int
from ..files import read_json
from ..swap import measure_copy_bandwidth

GEMM_ROWS = {"cuda": 16384, "cpu": 1024}  # token rows of the GEMMs timed: speed no longer grows past these
ATTENTION_TOKENS = {"cuda": 1 << 17, "cpu": 4096}  # longest attention timed (published speeds are flat past 16K)


@dataclass(frozen=True)
class Shape:
    """One GPU's share of a run under Ulysses: `tokens` token rows through the layer's GEMMs (`hidden`, `ffn`),
    and attention over the whole sequence (`attention_tokens`) for `heads` query heads (`kv_heads` key/value)
    of `head_dim`."""

    tokens: int
    attention_tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int

    @classmethod
    def of(cls, c: ModelConfig, seq: int, sp: int = 1) -> Shape:
        if check_int("--seq", seq) % check_int("--sp", sp) or c.n_heads % sp:
            raise ValueError(f"`--seq` ({seq}) and the {c.n_heads} heads of {c.name} must split over `--sp` {sp}")
        kv = max(c.n_kv_heads // sp, 1)
        return cls(
            tokens=seq // sp,
            attention_tokens=seq,
            heads=c.n_heads // sp,
            kv_heads=kv,
            head_dim=c.head_dim,
            hidden=c.hidden_size,
            ffn=c.ffn_hidden_size,
        )


GENERIC_SHAPE = {
    "cuda": Shape(tokens=16384, attention_tokens=16384, heads=16, kv_heads=16, head_dim=128, hidden=4096, ffn=11008),
    "cpu": Shape(tokens=2048, attention_tokens=2048, heads=16, kv_heads=16, head_dim=128, hidden=1024, ffn=2816),
}


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, shape: Shape) -> float:
    """Returns FLOP/s of the layer's GEMMs (projection in, out, and the MLP's) at `shape`'s sizes."""
    rows = min(shape.tokens, GEMM_ROWS[device.type])
    x = torch.randn(rows, shape.hidden, device=device, dtype=dtype)
    weights = [torch.randn(shape.hidden, n, device=device, dtype=dtype) for n in (shape.hidden, shape.ffn)]
    work = sum(2 * rows * w.shape[0] * w.shape[1] for w in weights)
    return work / dev.timed(lambda: [x @ w for w in weights], device, repeats=5)


def measure_attention_flops(device: torch.device, dtype: torch.dtype, shape: Shape) -> tuple[float, float, str]:
    """Returns FLOP/s of causal attention forward and of its backward, counting the causal (half-matrix) work
    and backward as 2.5 × forward, at `shape` (its length capped at `ATTENTION_TOKENS`), and the kernel timed
    (what `--attention auto` takes here)."""
    seq = min(shape.attention_tokens, ATTENTION_TOKENS[device.type])

    def heads(n: int) -> torch.Tensor:
        return torch.randn(1, seq, n, shape.head_dim, device=device, dtype=dtype).transpose(1, 2)

    q, k, v = heads(shape.heads), heads(shape.kv_heads), heads(shape.kv_heads)
    scale = shape.head_dim**-0.5
    out, lse, aux = attention_forward(q, k, v, scale)
    forward = 4 * seq * seq * shape.heads * shape.head_dim / 2
    forward_s = dev.timed(lambda: attention_forward(q, k, v, scale), device, repeats=3)
    backward_s = dev.timed(lambda: attention_backward(out, q, k, v, out, lse, aux, scale), device, repeats=3)
    return forward / forward_s, 2.5 * forward / backward_s, aux[0]


def measure_hbm_bandwidth(device: torch.device, nbytes: int) -> float:
    """Returns bytes/s a device-to-device copy moves (read and written): what memory-bound ops run at."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / dev.timed(lambda: dst.copy_(src), device, repeats=5)


def is_calibration(path: str | Path) -> bool:
    """Returns whether `path` holds measurements `memo calibrate --out` wrote (memo's own, to replace)."""
    try:
        measured = read_json(path)
    except ValueError:  # unreadable, or not JSON
        return False
    return isinstance(measured, dict) and {"matmul_flops_per_s", "host_copy_bytes_per_s"} <= measured.keys()


def calibrate(device: torch.device, shape: Shape | None = None) -> dict:
    """Returns measured throughputs of `device` (bf16 on CUDA, float32 on CPU) at `shape` (default: generic)."""
    cuda = dev.is_cuda(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = shape or GENERIC_SHAPE["cuda" if cuda else "cpu"]
    copy_src = torch.empty((256 if cuda else 64) << 20, dtype=torch.uint8, device=device)
    attention_fwd, attention_bwd, kernel = measure_attention_flops(device, dtype, shape)
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "shape": shape.__dict__,
        "matmul_flops_per_s": measure_matmul_flops(device, dtype, shape),
        "attention_forward_flops_per_s": attention_fwd,
        "attention_backward_flops_per_s": attention_bwd,
        "attention_kernel": kernel,
        "hbm_bytes_per_s": measure_hbm_bandwidth(device, (1 << 30) if cuda else (256 << 20)),
        "host_copy_bytes_per_s": measure_copy_bandwidth(copy_src),
    }


@dataclass(frozen=True, kw_only=True)
class CalibrateRequest:
    """`memo calibrate`'s flags: the device, and the shape to time (`--model` and `--seq`, split over `--sp`
    GPUs; none of them: a generic shape)."""

    device: str
    model: str | None = None
    seq: int | None = None
    sp: int | None = None
    out: str | None = None

    def __post_init__(self) -> None:
        if (self.model is None) != (self.seq is None):
            raise ValueError("give `--model` and `--seq` together (or neither, for a generic shape)")
        if self.sp is not None and self.model is None:
            raise ValueError("`--sp` splits the shape of `--model` and `--seq`: give them too")


def calibration_lines(result: dict) -> str:
    """Returns the lines `memo calibrate` prints of its measurements (`calibrate`)."""
    shape = result["shape"]
    return "\n".join(
        [
            f"device {result['device']} ({result['dtype']}): GEMMs of {shape['tokens']} tokens, attention over "
            f"{shape['attention_tokens']} tokens x {shape['heads']} heads",
            f"matmul              {result['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s",
            f"attention forward   {result['attention_forward_flops_per_s'] / 1e12:.2f} TFLOP/s (causal work)",
            f"attention backward  {result['attention_backward_flops_per_s'] / 1e12:.2f} TFLOP/s (causal work)",
            f"attention kernel    {result['attention_kernel']}",
            f"memory              {result['hbm_bytes_per_s'] / 1e9:.2f} GB/s (device copy, read + write)",
            f"host copy           {result['host_copy_bytes_per_s'] / 1e9:.2f} GB/s",
        ]
    )
