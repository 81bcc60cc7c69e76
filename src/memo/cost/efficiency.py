"""What kernels achieve of a GPU's peaks: per phase (GEMMs, causal attention forward and backward, memory-bound
ops, host copies, collectives), published for each GPU generation with its source and read at the shape of a
run, or measured by `memo calibrate`; every prediction is made at a band of them (low, mid, high)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from .flops import linear_params_per_layer, sparse_share
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
    """The efficiencies a prediction is made at (mid) and the slow and fast ends of its range, and the attention
    kernel whose speeds they hold."""

    low: Efficiency
    mid: Efficiency
    high: Efficiency
    source: str
    attention: str = ""
    note: str = ""  # what the speeds do not cover, e.g. a length past the longest published benchmark

    @classmethod
    def around(cls, mid: Efficiency, spread: float, source: str, attention: str = "") -> Band:
        return cls(mid.scaled(1 - spread), mid, mid.scaled(1 + spread), source, attention)

    def blended(self, other: Band, share: float) -> Band:
        """Returns this band with `share` of the attention FLOPs run at `other`'s attention speeds (a model's
        windowed layers on their own kernel and length): at each point the speed that takes the time of both parts,
        1 / ((1 - share) / e + share / e_other); everything else is this band's."""

        def mix(mine: Efficiency, theirs: Efficiency) -> Efficiency:
            speeds = {
                name: 1 / ((1 - share) / getattr(mine, name) + share / getattr(theirs, name))
                for name in ("attention_forward", "attention_backward")
            }
            return dataclasses.replace(mine, **speeds)

        attention = f"{self.attention}, windowed layers {other.attention}"
        note = "; ".join(n for n in (self.note, other.note) if n)
        points = (mix(getattr(self, p), getattr(other, p)) for p in POINTS)
        return Band(*points, source=self.source, attention=attention, note=note)


@dataclass(frozen=True)
class KernelSpeeds:
    """Published achieved speeds of one GPU generation (TFLOP/s), each table with its source. Attention
    counts the causal half of the s × s matrix; backward FLOPs are 2.5 × forward's."""

    # published kernel (the values of TIMED_AS, and older ones) -> head dim -> (forward, backward), each
    # ((sequence length, TFLOP/s), ...)
    attention: dict[str, dict[int, tuple[tuple, tuple]]]
    auto: str  # memo's kernel that `--attention auto` runs here without optional packages (memo.attention)
    matmul: tuple[tuple[int, float], ...]  # (hidden size of a layer's GEMMs, TFLOP/s)
    sms: int  # streaming multiprocessors: one attention block per 128 query rows and head must fill them
    hbm: float  # achieved fraction of the HBM bandwidth by memory-bound ops
    host_link: float  # achieved fraction of the PCIe peak, pinned copies
    nvlink: float
    network: float
    spread: float  # the slow end's distance below the published speeds, relative: how far published figures for
    # the same shape disagree (attention's slow end is `IN_TRAINING`'s)
    source: str


# memo's attention kernels (`memo.attention.KERNELS`, `--attention`) -> the published kernel whose speeds time them;
# the one place that maps them ("efficient", fp32 only, has no published bf16 speeds)
TIMED_AS = {
    "flash": "flash2",  # PyTorch's SDPA flash backend is FlashAttention-2 (since PyTorch 2.2)
    "cudnn": "cudnn",  # aten._scaled_dot_product_cudnn_attention: cuDNN's fused attention, as the FA3 paper times it
    # flash-attn-4 on sm90 is a CuTe-DSL reimplementation of FlashAttention-3's Hopper kernels with their tile sizes
    # (Dao-AILab/flash-attention: flash_attn/cute/flash_fwd.py "A reimplementation of hopper/flash_fwd_kernel_sm90.h
    # from Cutlass C++ to Cute-DSL"; interface.py `_tile_size_fwd_sm90` / `_tile_size_bwd_sm90`, "based on" FA3's).
    # No H100 speed of FA4 is published (its paper, Zadouri et al. 2026, arXiv 2603.05451, times B200 only): on
    # Hopper it is assumed to run at FlashAttention-3's published speeds
    "fa4": "fa3",
}
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
# H100 80GB SXM5, FP16/BF16, TFLOP/s at LENGTHS as printed on the bars of Shah et al. 2024, FlashAttention-3,
# arXiv 2407.08608 (https://arxiv.org/abs/2407.08608); the same forward figure is Dao-AILab/flash-attention
# assets/flash3_fp16_fwd.png. Fig. 5 (b) and (d): forward with causal mask, head dim 64 and 128.
_H100_FORWARD = {
    "flash2": {64: (180, 229, 262, 284, 295, 299), 128: (191, 260, 298, 319, 333, 335)},
    "cudnn": {64: (225, 288, 334, 363, 379, 388), 128: (315, 410, 484, 518, 529, 539)},
    "fa3": {64: (197, 265, 371, 420, 460, 473), 128: (292, 423, 521, 579, 602, 616)},
}
# Fig. 6 (a) and (b): backward without causal mask, head dim 64 and 128 (the paper's only backward figure)
_H100_BACKWARD_UNMASKED = {
    "flash2": {64: (198, 238, 264, 279, 287, 291), 128: (214, 260, 291, 310, 318, 322)},
    "cudnn": {64: (266, 348, 395, 417, 432, 433), 128: (305, 408, 465, 499, 518, 516)},
    "fa3": {64: (272, 363, 422, 453, 472, 474), 128: (316, 424, 501, 542, 559, 561)},
}
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


def _causal_h100(kernel: str, head_dim: int, flash2: tuple[tuple, tuple]) -> tuple[tuple, tuple]:
    """Returns a kernel's causal (forward, backward) tables on H100: its published causal forward, and its unmasked
    backward slowed as the causal mask slows FlashAttention-2's (`flash2`: the one kernel published both ways;
    the FA3 paper times backward unmasked only), never made faster than unmasked."""
    masked = [speed for _, speed in flash2[1]]
    slowdown = [min(1.0, m / u) for m, u in zip(masked, _H100_BACKWARD_UNMASKED["flash2"][head_dim])]
    backward = tuple(b * r for b, r in zip(_H100_BACKWARD_UNMASKED[kernel][head_dim], slowdown))
    return tuple(zip(LENGTHS, _H100_FORWARD[kernel][head_dim])), tuple(zip(LENGTHS, backward))


_A100_ATTENTION = {
    kernel: {d: _split(v, _A100_FORWARD_OVER_BACKWARD) for d, v in table.items()}
    for kernel, table in {"flash2": _FA2_A100, **_OTHERS_A100}.items()
}
_FA2_H100_ATTENTION = {d: _apart(v, _H100_FORWARD["flash2"][d]) for d, v in _FA2_H100.items()}
_H100_ATTENTION = {
    "flash2": _FA2_H100_ATTENTION,
    **{k: {d: _causal_h100(k, d, _FA2_H100_ATTENTION[d]) for d in (64, 128)} for k in ("cudnn", "fa3")},
}
SPEEDS: dict[str, KernelSpeeds] = {
    "A100": KernelSpeeds(
        attention=_A100_ATTENTION,
        auto="flash",
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
        auto="cudnn",  # memo's run-time choice on sm90 takes cuDNN before flash (fa4 first, when installed)
        # sm_90 bf16 GEMMs measured by OpenXLA (xla/service/gpu/model/matmul_interpolator_data.h): 632 TFLOP/s
        # at 2048^3, 783 at 4096^3 (0.79); 794.5 at the best shape searched (ml-engineering)
        matmul=((1024, 524.0), (2048, 632.0), (4096, 783.0)),
        sms=132,
        hbm=0.80,
        host_link=0.86,  # 55.1 GB/s device-to-host of 64 on PCIe 5 x16 (nvbandwidth on H200, ml-engineering)
        nvlink=0.71,  # all-to-all bus bandwidth 320 GB/s of 450 on DGX H100 (NVIDIA GTC25 S72583)
        network=0.70,
        spread=0.10,
        source="FlashAttention-2/-3 papers (H100 attention: FlashAttention-2, cuDNN, FlashAttention-3), "
        "OpenXLA sm_90 GEMM table",
    ),
}
SPEEDS["A800"] = SPEEDS["A100"]  # the A100 die, NVLink cut to 400 GB/s (the spec's bandwidth, not its fraction)
SPEEDS["H200"] = SPEEDS["H100"]  # the H100 die with more and faster HBM: the kernels are compute-bound
GENERIC = Efficiency(matmul=0.6, attention_forward=0.4, attention_backward=0.4)
# What a whole training run's attention reaches of its kernel's published (microbenchmark) speed, at the band's
# slow end, middle and fast end. Calibrated on one run: TRL's Qwen3-8B at 1,048,576 tokens on one 8x H100 node,
# 380 s per step (huggingface/trl v1.13.0 release notes; context parallel 8 over SDPA, gradient checkpointing).
# The kernel is not named: FlashAttention-2 at its best published speed would take 565 s, so the run's kernel was
# faster; at cuDNN's published speeds the step is 358 s (0.94 of 380 s), at FlashAttention-3's 0.85 of it. The
# middle is the centre of that range, the fast end the published speed itself (never faster), the slow end the
# lower reading less `CALIBRATION_SPREAD` (run-to-run variation). Assumed for every kernel and GPU generation: the
# same fraction of its own benchmark (no whole-run timing of cuDNN, FA3 or FA4 at these lengths is published).
# The arithmetic and the runs that check it (not used to set it): docs/estimate.md, "In training".
IN_TRAINING = {"low": 0.85 * (1 - 0.05), "mid": (0.85 + 0.94) / 2, "high": 1.0}
CALIBRATION_SPREAD = 0.05


def _speeds(spec: GPUSpec) -> KernelSpeeds | None:
    """Returns the published speeds of `spec`'s GPU generation, None for a GPU without them."""
    return next((v for k, v in SPEEDS.items() if k.lower() in spec.name.lower()), None)


def attention_kernel(spec: GPUSpec, requested: str = "auto") -> str:
    """Returns memo's attention kernel whose speeds time `requested` on `spec`: "auto" is the one memo's run-time
    choice takes there without optional packages (cudnn on Hopper, flash elsewhere); it stays "auto" on a GPU
    without published speeds, where every kernel gets the generic efficiencies."""
    speeds = _speeds(spec)
    return speeds.auto if requested == "auto" and speeds else requested


def published_band(
    spec: GPUSpec,
    c: ModelConfig,
    tokens: int,
    heads: int,
    kernel: str = "flash",
    rows: int | None = None,
    length: float | None = None,
) -> Band:
    """Returns the efficiency band of `spec`'s kernels at one GPU's shape: attention over `tokens` tokens for
    `heads` query heads (all sequences of a micro-batch), `c`'s head dimension, and GEMMs of its hidden size
    over `rows` token rows at a time (a tile; default as many as the hidden size; a mixture of experts' grouped
    GEMMs as `_matmul_speed` times them). A GPU without published
    speeds gets `GENERIC`, wide. `kernel` names the attention kernel: one of memo's (`TIMED_AS`) or a published
    one of the tables (what older published runs used).

    `length` is the length the attention speeds are read at (default `tokens`): for packed documents, their
    length (`documents.DocumentLengths.attended`). The published benchmarks time each length over a batch of that
    many sequences of it (batch x length = 16K tokens: FlashAttention-2, arXiv 2307.08691, §4.1, and the
    FlashAttention-3 paper's benchmarks alike), which is what a sequence of packed documents of that length is to
    a variable-length kernel; below the shortest published length (512) its speed stands, an upper bound."""
    speeds = _speeds(spec)
    if speeds is None:
        return Band.around(GENERIC, 0.25, f"no published speeds for {spec.name}: generic efficiencies ±25%", kernel)
    timed = TIMED_AS.get(kernel, kernel)
    if timed not in speeds.attention:
        known = ", ".join(k for k, v in TIMED_AS.items() if v in speeds.attention)
        raise ValueError(f"no published speeds of the {kernel!r} attention kernel on {spec.name} (published: {known})")
    head_dim = min(speeds.attention[timed], key=lambda d: (abs(d - c.head_dim), d))
    forward, backward = speeds.attention[timed][head_dim]
    # fewer attention blocks than SMs leave SMs idle: the published runs always filled them
    fill = min(1.0, -(-tokens // 128) * heads / speeds.sms)
    peak = spec.peak_flops / 1e12
    published = Efficiency(
        matmul=_matmul_speed(speeds, c, rows or c.hidden_size) / peak,
        attention_forward=fill * _interpolate(forward, length or tokens) / peak,
        attention_backward=fill * _interpolate(backward, length or tokens) / peak,
        hbm=speeds.hbm,
        host_link=speeds.host_link,
        nvlink=speeds.nvlink,
        network=speeds.network,
    )
    longest = max(n for n, _ in forward)
    beyond = (
        f"{kernel} attention timed at its {longest // 1024}K speed; unmeasured beyond"
        if (length or tokens) > longest
        else ""
    )
    return Band(
        low=_in_training(published.scaled(1 - speeds.spread), IN_TRAINING["low"] / (1 - speeds.spread)),
        mid=_in_training(published, IN_TRAINING["mid"]),
        high=published,
        source=speeds.source,
        attention=kernel,
        note=beyond,
    )


def _matmul_speed(speeds: KernelSpeeds, c: ModelConfig, rows: int) -> float:
    """Returns the TFLOP/s of one layer's GEMMs over `rows` token rows at a time. The GEMM tables are of square
    shapes: a GEMM runs as the square of its smallest side, the hidden size or fewer rows (a tile). A mixture of
    experts' routed experts run as grouped GEMMs (`F.grouped_mm`), each expert's group of rows·k/E rows on average
    (routing balanced, as the load-balancing loss aims for) against its (h, f) weights: timed as the per-expert GEMMs
    they group, the square of the smallest of those rows, h and f (an assumption: no table of grouped GEMM speeds
    by shape is published for these GPUs; docs/estimate.md), and the layer's speed is the one that takes the time
    of both parts, its FLOPs split as `flops.linear_params_per_layer` counts them."""
    dense = _interpolate(speeds.matmul, min(c.hidden_size, rows))
    if not c.moe:
        return dense
    k, f = c.experts_per_token, c.expert_ffn
    grouped = _interpolate(speeds.matmul, min(c.hidden_size, f, max(1, rows * k // c.n_experts)))
    experts = sparse_share(c) * k * 3 * c.hidden_size * f / linear_params_per_layer(c, active=True)  # of the FLOPs
    return 1 / ((1 - experts) / dense + experts / grouped)


def _in_training(eff: Efficiency, fraction: float) -> Efficiency:
    """Returns `eff` with its attention at `fraction` of it: what a whole run reaches of the kernel's benchmark."""
    return dataclasses.replace(
        eff, attention_forward=eff.attention_forward * fraction, attention_backward=eff.attention_backward * fraction
    )


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
    # `memo calibrate` times the kernel memo's "auto" runs on that device
    return Band.around(mid, CALIBRATION_SPREAD, f"memo calibrate on {calibration.get('device')}{where}", "calibrated")
