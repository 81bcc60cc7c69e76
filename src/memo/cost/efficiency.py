"""What kernels achieve of a GPU's peaks: per phase (GEMMs, causal attention forward and backward, memory-bound
ops, host copies, collectives), published for each GPU generation with its source and read at the shape of a
run, or measured by `memo calibrate`; every prediction is made at a band of them (low, mid, high)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from .hardware import GPUSpec, is_gpu


@dataclass(frozen=True)
class Efficiency:
    """Achieved fraction of each peak, per phase, at one shape."""

    matmul: float
    attention_forward: float  # of the causal (half-matrix) forward FLOPs
    attention_backward: float  # of the causal backward FLOPs (2.5 × forward)
    hbm: float = 0.80  # of the HBM bandwidth, for memory-bound ops
    host_link: float = 0.80
    nvlink: float = 0.70
    network: float = 0.70

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not 0 < getattr(self, f.name) <= 1:
                raise ValueError(f"efficiency `{f.name}` must be in (0, 1], got {getattr(self, f.name)}")

    def scaled(self, factor: float) -> Efficiency:
        """Returns every efficiency times `factor`, at most 1."""
        return Efficiency(*(min(1.0, getattr(self, f.name) * factor) for f in dataclasses.fields(self)))


POINTS = ("low", "mid", "high")


@dataclass(frozen=True)
class Band:
    """The efficiencies a prediction is made at (mid) and the slow and fast ends of its range."""

    low: Efficiency
    mid: Efficiency
    high: Efficiency
    source: str

    @classmethod
    def around(cls, mid: Efficiency, spread: float, source: str) -> Band:
        return cls(mid.scaled(1 - spread), mid, mid.scaled(1 + spread), source)


@dataclass(frozen=True)
class KernelSpeeds:
    """Published achieved speeds of one GPU generation (TFLOP/s), each table with its source. Attention
    counts the causal half of the s × s matrix; backward FLOPs are 2.5 × forward's."""

    # kernel -> head dim -> (forward, backward), each ((sequence length, TFLOP/s), ...); "flash2" is PyTorch's
    attention: dict[str, dict[int, tuple[tuple, tuple]]]
    matmul: tuple[tuple[int, float], ...]  # (hidden size of a layer's GEMMs, TFLOP/s)
    sms: int  # streaming multiprocessors: one attention block per 128 query rows and head must fill them
    hbm: float  # achieved fraction of the HBM bandwidth by memory-bound ops
    host_link: float  # achieved fraction of the PCIe peak, pinned copies
    nvlink: float
    network: float
    spread: float  # half-width of the band, relative: how far published figures for the same shape disagree
    source: str


LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)  # the published attention benchmarks' sequence lengths
# FlashAttention-2 (the kernel PyTorch's SDPA flash backend has shipped since 2.2), causal, forward + backward,
# TFLOP/s at LENGTHS, counted as the paper counts (causal half, backward 2.5 × forward): Dao 2023,
# arXiv 2307.08691, Fig. 4 (A100 80GB SXM4) and the H100 SXM5 figure of the same release
# (Dao-AILab/flash-attention assets/flash2_{a100,h100}_fwd_bwd_benchmark.png)
_FA2_A100 = {64: (88, 119, 140, 156, 165, 171), 128: (99, 133, 155, 173, 182, 189)}
# the other kernels of the same A100 figure (what published runs before FlashAttention-2 used): FlashAttention
# (v1), its Triton version, and standard attention in PyTorch (out of memory at 16K: its 8K speed stands there)
_OTHERS_A100 = {
    "flash1": {64: (58, 70, 77, 87, 92, 97), 128: (55, 62, 69, 76, 80, 83)},
    "triton": {64: (59, 75, 79, 76, 79, 80), 128: (50, 61, 68, 74, 78, 80)},
    "standard": {64: (15, 16, 17, 18, 18, 18), 128: (23, 28, 32, 32, 34, 34)},
}
_FA2_H100 = {64: (141, 192, 232, 257, 273, 284), 128: (163, 221, 265, 294, 308, 328)}
# FlashAttention-2 forward alone on H100 SXM5, causal: Shah et al. 2024 (FlashAttention-3), arXiv 2407.08608, Fig. 5
_FA2_H100_FORWARD = {64: (180, 229, 262, 284, 295, 299), 128: (191, 260, 298, 319, 333, 335)}
# A100's forward and backward apart are only given at their best: "up to 73% ... forward, up to 63% ...
# backward" (FlashAttention-2, §1); the combined figures are split in that ratio
_A100_FORWARD_OVER_BACKWARD = 0.73 / 0.63


def _apart(combined: tuple, forward: tuple) -> tuple[tuple, tuple]:
    """Returns (forward, backward) speed tables at LENGTHS from forward + backward speeds and forward ones:
    3.5 units of work take 1 / forward + 2.5 / backward."""
    backward = tuple(2.5 / (3.5 / c - 1 / f) for c, f in zip(combined, forward))
    return tuple(zip(LENGTHS, forward)), tuple(zip(LENGTHS, backward))


def _split(combined: tuple, ratio: float) -> tuple[tuple, tuple]:
    """Returns (forward, backward) speed tables from forward + backward speeds and forward / backward = ratio."""
    return _apart(combined, tuple(c * (1 + 2.5 * ratio) / 3.5 for c in combined))


_A100_ATTENTION = {
    kernel: {d: _split(v, _A100_FORWARD_OVER_BACKWARD) for d, v in table.items()}
    for kernel, table in {"flash2": _FA2_A100, **_OTHERS_A100}.items()
}
_H100_ATTENTION = {"flash2": {d: _apart(v, _FA2_H100_FORWARD[d]) for d, v in _FA2_H100.items()}}
SPEEDS: dict[str, KernelSpeeds] = {
    "A100": KernelSpeeds(
        attention=_A100_ATTENTION,
        # bf16 GEMMs: 271 TFLOP/s (0.87) at the best shape searched (S. Bekman, ml-engineering, "Maximum
        # Achievable Matmul FLOPS"), "80-90% of the theoretical maximum" (FlashAttention-2, §1); no published
        # fall-off with size for A100: 0.80 at every size, the band covers the rest
        matmul=((1024, 250.0), (8192, 250.0)),
        sms=108,
        hbm=0.80,  # assumed: elementwise kernels read and write at about 80% of the datasheet bandwidth
        host_link=0.78,  # 24.8 GB/s pinned on PCIe 4 x16 (NVIDIA developer forum, A100-SXM4-80GB)
        nvlink=0.70,  # nccl-tests all-to-all bus bandwidth 210 GB/s of 300 on DGX A100 (NVIDIA GTC25 S72583)
        network=0.70,  # no published figure used: the generic assumption
        spread=0.10,
        source="FlashAttention-2 paper (A100 attention), ml-engineering matmul table, nccl-tests",
    ),
    "H100": KernelSpeeds(
        attention=_H100_ATTENTION,
        # sm_90 bf16 GEMMs measured by OpenXLA (xla/service/gpu/model/matmul_interpolator_data.h): 632 TFLOP/s
        # at 2048^3, 783 at 4096^3 (0.79); 794.5 at the best shape searched (ml-engineering)
        matmul=((1024, 524.0), (2048, 632.0), (4096, 783.0)),
        sms=132,
        hbm=0.80,
        host_link=0.86,  # 55.1 GB/s device-to-host of 64 on PCIe 5 x16 (nvbandwidth on H200, ml-engineering)
        nvlink=0.71,  # all-to-all bus bandwidth 320 GB/s of 450 on DGX H100 (NVIDIA GTC25 S72583)
        network=0.70,
        spread=0.10,
        source="FlashAttention-2/-3 papers (H100 attention, PyTorch's flash backend), OpenXLA sm_90 GEMM table",
    ),
}
SPEEDS["A800"] = SPEEDS["A100"]  # the A100 die, NVLink cut to 400 GB/s (the spec's bandwidth, not its fraction)
SPEEDS["H200"] = SPEEDS["H100"]  # the H100 die with more and faster HBM: the kernels are compute-bound
GENERIC = Efficiency(matmul=0.6, attention_forward=0.4, attention_backward=0.4)
CALIBRATION_SPREAD = 0.05


def published_band(
    spec: GPUSpec, c: ModelConfig, tokens: int, heads: int, kernel: str = "flash2", rows: int | None = None
) -> Band:
    """Returns the efficiency band of `spec`'s kernels at one GPU's shape: attention over `tokens` tokens for
    `heads` query heads (all sequences of a micro-batch), `c`'s head dimension, and GEMMs of its hidden size
    over `rows` token rows at a time (a tile; default as many as the hidden size). A GPU without published
    speeds gets `GENERIC`, wide. `kernel` names the attention kernel (default PyTorch's flash)."""
    speeds = next((v for k, v in SPEEDS.items() if k.lower() in spec.name.lower()), None)
    if speeds is None:
        return Band.around(GENERIC, 0.25, f"no published speeds for {spec.name}: generic efficiencies ±25%")
    if kernel not in speeds.attention:
        raise ValueError(f"no published {kernel!r} attention speeds for {spec.name}: {', '.join(speeds.attention)}")
    head_dim = min(speeds.attention[kernel], key=lambda d: (abs(d - c.head_dim), d))
    forward, backward = speeds.attention[kernel][head_dim]
    # fewer attention blocks than SMs leave SMs idle: the published runs always filled them
    fill = min(1.0, -(-tokens // 128) * heads / speeds.sms)
    peak = spec.peak_flops / 1e12
    mid = Efficiency(
        # the GEMM tables are of square shapes: a tile of fewer rows than the hidden size runs as the smaller one
        matmul=_interpolate(speeds.matmul, min(c.hidden_size, rows or c.hidden_size)) / peak,
        attention_forward=fill * _interpolate(forward, tokens) / peak,
        attention_backward=fill * _interpolate(backward, tokens) / peak,
        hbm=speeds.hbm,
        host_link=speeds.host_link,
        nvlink=speeds.nvlink,
        network=speeds.network,
    )
    return Band.around(mid, speeds.spread, speeds.source)


def _interpolate(points: tuple[tuple[int, float], ...], x: float) -> float:
    """Returns the value at `x` on the line through `points` in log2(x), flat past either end."""
    xs = [math.log2(p) for p, _ in points]
    return float(np.interp(math.log2(max(x, 1)), xs, [v for _, v in points]))


def check_calibration_device(calibration: dict, spec: GPUSpec) -> None:
    """Raises ValueError unless `calibration` was measured on a `spec` GPU: a CPU's (or another GPU's) speeds
    divided by this GPU's peaks would predict a utilisation that means nothing."""
    device = str(calibration.get("device", "an unnamed device"))
    if not is_gpu(device, spec):
        raise ValueError(
            f"the calibration was measured on {device}, not on a {spec.name}: run `memo calibrate` on a {spec.name} "
            "(or leave out `--calibration`)"
        )


def efficiency_from_calibration(calibration: dict, spec: GPUSpec) -> Band:
    """Returns the efficiency band that `memo calibrate`'s measurements on a `spec` GPU imply: the measured
    speeds, ± `CALIBRATION_SPREAD` (run-to-run variation of timed kernels)."""

    def ratio(key: str, peak: float) -> float:
        if key not in calibration:
            raise ValueError(f"calibration lacks {key!r}; rerun `memo calibrate`")
        return min(1.0, float(calibration[key]) / peak)

    mid = Efficiency(
        matmul=ratio("matmul_flops_per_s", spec.peak_flops),
        attention_forward=ratio("attention_forward_flops_per_s", spec.peak_flops),
        attention_backward=ratio("attention_backward_flops_per_s", spec.peak_flops),
        hbm=ratio("hbm_bytes_per_s", spec.hbm_bytes_per_s),
        host_link=ratio("host_copy_bytes_per_s", spec.host_link_bytes_per_s),
    )
    shape = calibration.get("shape", {})
    where = f" at {shape.get('attention_tokens')} tokens x {shape.get('heads')} heads per GPU" if shape else ""
    return Band.around(mid, CALIBRATION_SPREAD, f"memo calibrate on {calibration.get('device')}{where}")
