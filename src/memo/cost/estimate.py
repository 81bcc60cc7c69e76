"""Does a model fit at a sequence length on some GPUs, with which α, how fast, at what MFU — for MEMO and
the systems users would run otherwise, under one model (memo-method.md §3, §7).

Every system trains one sequence of `seq` tokens per sequence-parallel group of `sp` GPUs, with
`gpus / sp` such groups in data parallel:

- `memo`: Ulysses sequence parallelism (all-to-all before/after attention), parameters, gradients and
  optimizer states sharded over all GPUs (FSDP / ZeRO-3), MEMO token-wise offload with α solved per GPU.
- `megatron`: tensor + sequence parallelism inside a node (tp = min(sp, GPUs per node)), context
  parallelism across nodes (cp = sp / tp), full recomputation, distributed optimizer.
- `deepspeed`: Ulysses sequence parallelism, ZeRO-3, full recomputation.
- `offload-all`: as `memo` but every skeletal tensor of every layer goes to host (α = 1, nothing recomputed).

Time per layer = matmuls and causal attention at calibrated efficiencies (backward 2× and 2.5× forward),
plus recomputation, plus the part of each host copy that does not hide behind the layer's compute, plus
communication (all-to-all and tensor-parallel collectives on the critical path; parameter gathers and
context-parallel rings overlapped with compute). Data-parallel gradient reduction and the optimizer step
are left out (once per step, overlapped with backward in all four systems alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ModelConfig
from ..policy import ActivationPolicy, AlphaProblem, solve_alpha
from .flops import (
    HFU,
    MFU_CAUSAL,
    MFU_FULL,
    layer_forward_flops,
    linear_params_per_layer,
    model_flops_per_token,
    recompute_flops,
)
from .hardware import Efficiency, GPUSpec
from .memory import (
    BYTES_PER_PARAM,
    host_bytes_per_gpu,
    persistent_activation_bytes,
    skeletal_bytes,
    transient_peak,
)

SYSTEMS = ("memo", "megatron", "deepspeed", "offload-all")
CONVENTIONS = {"mfu": MFU_CAUSAL, "mfu_full": MFU_FULL, "hfu": HFU}
STRATEGY = {"memo": "memo", "megatron": "full", "deepspeed": "full", "offload-all": "memo"}
DEVICE_RESERVE = 2 * 2**30  # CUDA context, kernels' workspaces, allocator slack
HOST_FRACTION = 0.9  # of a node's host memory that offload may use
ATTENTION_BACKWARD = 2.5  # flash backward runs 5 matmuls to forward's 2


@dataclass
class Estimate:
    system: str
    seq: int
    gpus: int
    sp: int
    fits: bool
    why: str
    alphas: list[float] | None
    device_bytes: dict[str, int]
    hbm_bytes: int
    host_bytes_per_node: int
    host_capacity_per_node: int
    step_seconds: float
    tokens_per_s: float
    mfu: float  # flops.MFU_CAUSAL
    seconds: dict[str, float] = field(default_factory=dict)
    mfu_full: float = 0.0  # flops.MFU_FULL
    hfu: float = 0.0  # flops.HFU

    def as_dict(self) -> dict:
        return {**self.__dict__, "conventions": CONVENTIONS}


class Unsupported(ValueError):
    """The system cannot split this model this way (a fact about the system, not bad input)."""


def _layout(c: ModelConfig, seq: int, gpus: int, gpu: GPUSpec, system: str, sp: int | None) -> tuple[int, int, int]:
    """Returns (sp, tp, cp) after checking that the split is possible."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")
    if gpus <= 0:
        raise ValueError(f"`--gpus` must be positive, got {gpus}")
    sp = gpus if sp is None else sp
    if sp <= 0 or gpus % sp:
        raise ValueError(f"`--sp` ({sp}) must divide `--gpus` ({gpus})")
    if seq <= 0 or seq % sp:
        raise ValueError(f"`--seq` ({seq}) must be a positive multiple of `--sp` ({sp})")
    tp = min(sp, gpu.gpus_per_node) if system == "megatron" else 1
    if sp % tp:
        raise ValueError(f"megatron: sp={sp} is not a multiple of the tensor-parallel size {tp}")
    heads_split = tp if system == "megatron" else sp
    if c.n_heads % heads_split:
        raise Unsupported(f"{c.n_heads} attention heads cannot be split over {heads_split} GPUs")
    return sp, tp, sp // tp


def estimate(
    c: ModelConfig,
    seq: int,
    gpus: int,
    gpu: GPUSpec,
    system: str = "memo",
    sp: int | None = None,
    eff: Efficiency = Efficiency(),
) -> Estimate:
    """Returns the predicted memory, step time and MFU of training `c` on `seq`-token sequences."""
    try:
        sp, tp, cp = _layout(c, seq, gpus, gpu, system, sp)
    except Unsupported as err:  # this system cannot run the layout; the others may
        nan = float("nan")
        return Estimate(
            system, seq, gpus, sp or gpus, False, str(err), None, {"total": 0}, gpu.hbm_bytes, 0, 0, nan, 0.0, 0.0
        )
    tokens = seq // sp  # per GPU
    node_gpus = min(gpus, gpu.gpus_per_node)
    host_capacity = int(HOST_FRACTION * gpu.host_memory_per_node)
    t = _compute_seconds(c, seq, tokens, gpu, eff)
    why, alphas, host = "", None, 0
    if STRATEGY[system] == "memo":
        offloaded = _layout_policy(system).offloaded_layers(c.n_layers)
        if system == "offload-all":
            alphas = [1.0] * c.n_layers
        else:
            alphas, why = _solve_alphas(c, tokens, t["forward"], gpu, eff, host_capacity // node_gpus, offloaded)
        host = host_bytes_per_gpu(c, tokens, alphas, offloaded) * node_gpus if alphas else 0
        if host > host_capacity:
            why = f"host memory: offload needs {host / 2**40:.2f} TiB per node, {host_capacity / 2**40:.2f} TiB usable"
    device = _device_bytes(c, tokens, system, gpus, tp, cp)
    if not why and device["total"] > gpu.hbm_bytes:
        why = f"device memory: needs {device['total'] / 2**30:.1f} GiB of {gpu.hbm_bytes / 2**30:.0f} GiB"
    seconds = _step_seconds(c, seq, tokens, system, gpus, sp, tp, cp, gpu, eff, t, alphas)
    step = sum(seconds.values())
    dp = gpus // sp
    utilisation = dp / (step * gpus * gpu.peak_flops)  # of one FLOP per sequence
    reloaded = _layout_policy(system).reloaded_layers(c.n_layers) if alphas else ()
    again = recompute_flops(c, seq, STRATEGY[system], alphas, reloaded, causal=True)
    return Estimate(
        system,
        seq,
        gpus,
        sp,
        not why,
        why,
        alphas,
        device,
        gpu.hbm_bytes,
        host,
        host_capacity,
        step,
        dp * seq / step,
        model_flops_per_token(c, seq) * seq * utilisation,
        seconds,
        model_flops_per_token(c, seq, causal=False) * seq * utilisation,
        (model_flops_per_token(c, seq) * seq + again) * utilisation,
    )


def _compute_seconds(c: ModelConfig, seq: int, tokens: int, gpu: GPUSpec, eff: Efficiency) -> dict[str, float]:
    """Returns one layer's forward matmul/attention seconds on one GPU (causal attention does half the matrix)."""
    matmul, attention = layer_forward_flops(c, seq, tokens)
    mm = matmul / (gpu.peak_flops * eff.matmul)
    attn = attention / 2 / (gpu.peak_flops * eff.attention)
    return {"matmul": mm, "attention": attn, "forward": mm + attn}


def _solve_alphas(c, tokens, layer_seconds, gpu: GPUSpec, eff: Efficiency, host_budget: int, offloaded):
    """Returns (α per layer, "") or (None, why) from the §3 constraints for one GPU."""
    b = skeletal_bytes(c, tokens)
    problem = AlphaProblem(
        b["input"], b["attention"], b["other"], _host_bandwidth(gpu, eff), layer_seconds, host_budget, len(offloaded)
    )
    try:
        alpha = solve_alpha(problem)
    except ValueError as err:
        return None, f"host memory: {err}"
    return [alpha if i in offloaded else 1.0 for i in range(c.n_layers)], ""


def _host_bandwidth(gpu: GPUSpec, eff: Efficiency) -> float:
    return gpu.host_link_bytes_per_s * eff.host_link / gpu.host_link_shared_by


def _device_bytes(c: ModelConfig, tokens: int, system: str, gpus: int, tp: int, cp: int) -> dict[str, int]:
    """Returns the per-GPU device memory: model states, persistent and transient activations, total."""
    params = c.num_parameters()
    layer_params = linear_params_per_layer(c)
    if system == "megatron":
        dp_cp = gpus // tp
        states = params * (2 + 4) / tp + params * 12 / (tp * dp_cp)
    else:  # ZeRO-3 / FSDP over every GPU, plus two gathered bf16 layers (current and prefetched)
        states = params * BYTES_PER_PARAM / gpus + 2 * 2 * layer_params
    strategy = STRATEGY[system]
    persistent = persistent_activation_bytes(c, tokens, strategy)
    transient = transient_peak(c, tokens, strategy)
    total = int(states + persistent + transient + DEVICE_RESERVE)
    return {
        "model_states": int(states),
        "skeletal_buffers": persistent,
        "transient_peak": transient,
        "reserve": DEVICE_RESERVE,
        "total": total,
    }


def _step_seconds(c, seq, tokens, system, gpus, sp, tp, cp, gpu: GPUSpec, eff: Efficiency, t, alphas):
    """Returns the step time split into compute, recompute, exposed copy and communication (seconds)."""
    n = c.n_layers
    fwd, bwd = t["forward"], 2 * t["matmul"] + ATTENTION_BACKWARD * t["attention"]
    recompute = [0.0] * n
    if STRATEGY[system] == "full":
        recompute = [fwd] * n
    elif system == "memo":
        local = 1 - c.ffn_hidden_size * c.hidden_size / linear_params_per_layer(c)  # all but w_down
        kept = alphas or [0.0] * n  # no feasible α: time it as α = 0 (the estimate already says it does not fit)
        reloaded = set(_layout_policy(system).reloaded_layers(n))
        recompute = [(1 - kept[i]) * t["matmul"] * local if i in reloaded else 0.0 for i in range(n)]
    copy = [0.0] * n
    if STRATEGY[system] == "memo" and alphas:
        b = skeletal_bytes(c, tokens)
        policy = _layout_policy(system)
        reloaded = set(policy.reloaded_layers(n))
        bw = _host_bandwidth(gpu, eff)
        for i in policy.offloaded_layers(n):
            seconds = (b["input"] + b["attention"] + alphas[i] * b["other"]) / bw
            prefetch = max(0.0, seconds - (bwd + recompute[i])) if i in reloaded else 0.0
            copy[i] = max(0.0, seconds - fwd) + prefetch
    comm = n * _layer_comm_seconds(c, seq, tokens, system, gpus, sp, tp, cp, gpu, eff, fwd, bwd, t)
    head = 3 * 2 * c.vocab_size * c.hidden_size * tokens / (gpu.peak_flops * eff.matmul)
    return {
        "compute": n * (fwd + bwd) + head,
        "recompute": sum(recompute),
        "exposed_copy": sum(copy),
        "communication": comm,
    }


def _layout_policy(system: str) -> ActivationPolicy:
    """Returns which layers a memo-style system offloads and reloads, as the swap engine decides it."""
    return ActivationPolicy("memo", offload_last_layers=system == "offload-all")


def _link(gpus: int, gpu: GPUSpec, eff: Efficiency) -> float:
    """Returns the per-GPU bandwidth of a collective over `gpus` GPUs (NVLink inside a node, else network)."""
    return gpu.nvlink_bytes_per_s * eff.nvlink if gpus <= gpu.gpus_per_node else gpu.network_bytes_per_s * eff.network


def _layer_comm_seconds(c, seq, tokens, system, gpus, sp, tp, cp, gpu, eff, fwd, bwd, t) -> float:
    """Returns one layer's communication seconds on the critical path (forward + backward + recompute)."""
    d, a, g = c.head_dim, c.n_heads, c.n_kv_heads
    if system == "megatron":
        # 2 all-gathers + 2 reduce-scatters of the (s/cp, h) activations per pass; passes: fwd, recompute, bwd
        tp_bytes = 4 * (seq // cp) * c.hidden_size * 2 * (tp - 1) / tp
        seconds = 3 * tp_bytes / _link(tp, gpu, eff)
        if cp > 1:  # ring exchange of k, v: overlapped with attention, forward (twice, recompute) and backward
            ring = 2 * g * d * tokens * 2 * (cp - 1) / _link(gpus, gpu, eff)
            seconds += 2 * max(0.0, ring - t["attention"]) + max(0.0, 2 * ring - ATTENTION_BACKWARD * t["attention"])
        return seconds
    seconds = 0.0
    if sp > 1:  # Ulysses: q, k, v in and the output back, in forward and backward (+ recompute for deepspeed)
        a2a = (2 * a + 2 * g) * d * tokens * 2 * (sp - 1) / sp / _link(sp, gpu, eff)
        seconds += a2a * (3 if system == "deepspeed" else 2)
    if gpus > 1:  # ZeRO-3 / FSDP: gather bf16 weights for forward and backward, reduce-scatter gradients
        move = linear_params_per_layer(c) * 2 * (gpus - 1) / gpus / _link(gpus, gpu, eff)
        seconds += max(0.0, move - fwd) + max(0.0, 2 * move - bwd)
    return seconds


def max_seq(
    c: ModelConfig,
    gpus: int,
    gpu: GPUSpec,
    system: str,
    sp: int | None = None,
    eff: Efficiency = Efficiency(),
    limit: int = 1 << 26,
) -> int:
    """Returns the longest sequence (a multiple of 1K·sp) that fits, or 0 if none does."""
    step = 1024 * (gpus if sp is None else sp)
    lo, hi = 0, step
    while hi <= limit and estimate(c, hi, gpus, gpu, system, sp, eff).fits:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + step)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if estimate(c, mid, gpus, gpu, system, sp, eff).fits else (lo, mid)
    return lo
