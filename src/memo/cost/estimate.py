"""Does a model fit at a sequence length on some GPUs, with which layout and α, how fast, at what MFU — for
MEMO and the systems users would run otherwise, each as it ships, under one model (docs/method.md §3, §7).

Every system trains one sequence of `seq` tokens per sequence-parallel group of `sp` GPUs, with
`gpus / sp` such groups in data parallel, and each searches its own layouts (`layouts`), keeping the best
that fits and saying which:

- `memo`: Ulysses sequence parallelism (all-to-all before/after attention) of any degree that divides the
  heads, parameters, gradients and optimizer states sharded over all GPUs (FSDP2), MEMO token-wise offload
  with α solved per GPU, the chunked loss.
- `megatron` (Megatron-LM / Megatron-Core): tensor + sequence parallelism inside a node, context parallelism
  (ring attention) over the rest, selective or full recomputation, distributed optimizer; the logits of the
  local sequence materialised with their fp32 copy, the sequence-parallel all-gather buffer.
- `alst` (Arctic Long Sequence Training, DeepSpeed's recipe for Hugging Face models, arXiv 2506.13996, as its
  snowflakedb/ArcticTraining projects/sequence-parallelism recipes run Llama-3.1-8B): Ulysses of a degree that
  divides the heads (query and key/value), FlashAttention-2, every layer recomputed whole with its input
  checkpointed to the host, the MLP tiled in rows of the hidden size (TiledMLP's ceil(s / h) shards), the loss
  tiled, ZeRO-3 with the states in host memory and the optimizer on the CPU (priced as FSDP2's CPU offload,
  `Job.offload_states`; ALST's 8-GPU recipes offload the optimizer alone).
- `megatron-deepspeed` (DeepSpeed-Ulysses on Megatron-DeepSpeed as shipped): Ulysses of a degree that divides the
  heads (query and key/value), ZeRO-3 with the states on the GPUs, full or no recomputation, the logits
  materialised over the whole vocabulary in fp32.
- `offload-all`: as `memo` but every skeletal tensor of every layer goes to host (α = 1, nothing recomputed).

Time per layer = matmuls and causal attention forward and backward at per-phase efficiencies (published for
the GPU, shape and attention kernel, `efficiency.published_band`, or measured by `memo calibrate`), plus
recomputation, plus the part of each host copy that does not hide behind the layer's compute, plus
communication (all-to-all and tensor-parallel collectives on the critical path; parameter gathers and
context-parallel rings overlapped with compute). Data-parallel gradient reduction and the optimizer step on the
GPU are left out (once per step, overlapped with backward in every system alike). Every time comes as a range
from the efficiency band.

Packed documents (`Job.documents`, `DocumentLengths`): a sequence made of documents that attend only within
themselves does E[Σ d_i²] of attention work instead of s²: every attention FLOP (model FLOPs, step time, recompute,
MFU) counts E[Σ d_i²] / s tokens attended per token in place of s, and attention runs at the published speed of that
length (`efficiency.published_band`'s `length`). Memory does not change: activations are per token. Sliding
windows count and time the same way (`ModelConfig.attended`, `flops.MFU_WINDOWED`).

memo (and offload-all) also estimate two more ways of training (`Job.lora`, `Job.offload_states`): LoRA (a
frozen bf16 base, adapters trained; frozen linears compute no weight gradient) and model states in host memory
(FSDP2's CPU offload; the weights' copies share the host link with the activations' and hide behind
the layers' compute as FSDP2 prefetches, the CPU optimizer step after the backward hides behind nothing).

Device memory = model states + the activation store's buffers for the plan (`swap.store_layout`, what `memo
train` allocates) + the traced step's transient peak (kernel scratch in it; the baselines' materialised loss
where it is higher) + what the allocator takes beyond that step's LOAD (the caching allocator's fragmentation,
`plan.caching_sim`, with expandable segments for memo as `memo train` runs it; or memo's planned arena) + the
runtime (CUDA context, cuBLAS and NCCL buffers, NVLink SHARP buffers on NVSwitch GPUs); FSDP2's gathered root
unit, its gradients and the reduce-scatter in flight are model-state terms (`states.device_terms`). Memory has
a band (`memory_range`): LOAD at the low end, the upper published runtime figures and `TRANSIENT_ERROR` of the
transient at the high end; `max_seq_range` answers at the high end. Speeds have theirs (`efficiency.IN_TRAINING`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..attention import CHOICES
from ..config import ModelConfig
from ..device import HOST_USABLE
from ..job import Job
from ..policy import ActivationPolicy, plan_costs, solve_plan
from ..swap import plan_problem
from ..units import format_bytes, format_count
from .efficiency import POINTS, TIMED_AS, Band, Efficiency, attention_kernel, published_band
from .flops import (
    HFU,
    LORA_FLOPS,
    MFU_CAUSAL,
    MFU_FULL,
    MFU_PACKED,
    MFU_PACKED_FULL,
    adapter_work,
    experts_backward_flops,
    layer_forward_flops,
    linear_params_per_layer,
    model_flops_per_token,
    recompute_flops,
    token_local_flops,
)
from .hardware import GPUSpec, pin_seconds, runtime_bytes
from .memory import (
    Traced,
    fragmentation_bytes,
    layer_specs,
    store_bytes,
    traffic_bytes,
    transient_floor,
    transient_peak,
)
from .states import device_terms as state_device_terms
from .states import host_bytes as state_host_bytes
from .states import layer_traffic, optimizer_seconds, root_traffic

SYSTEMS = ("memo", "alst", "megatron", "megatron-deepspeed", "offload-all")
ATTENTION_CHOICES = tuple(k for k in CHOICES if k == "auto" or k in TIMED_AS)  # kernels with published bf16 speeds
CONVENTIONS = {"mfu": MFU_CAUSAL, "mfu_full": MFU_FULL, "hfu": HFU, "lora": LORA_FLOPS}
PACKED_CONVENTIONS = {**CONVENTIONS, "mfu": MFU_PACKED, "mfu_full": MFU_PACKED_FULL}  # estimates of packed documents
RECOMPUTE = {  # what each system can recompute, as it ships
    "memo": ("memo",),  # a plan of keep / memo / checkpoint layers with α (docs/method.md §3)
    "megatron": ("selective", "full"),  # --recompute-granularity: core attention, or the whole layer
    "alst": ("host-checkpoint",),  # every layer's input to the host, the layer run again before its backward
    "megatron-deepspeed": ("none", "full"),  # activation checkpointing off or on
    "offload-all": ("offload",),
}
TRACED = {
    "memo": "memo",
    "offload": "memo",
    "host-checkpoint": "memo",
    "full": "full",
    "selective": "none",
    "none": "none",
}
OFFLOADS = ("memo", "offload", "host-checkpoint")  # the recomputations that keep skeletal tensors in host memory
MEMO_LAYER = ("memo", "offload-all")  # the systems that run memo's explicit layer (the others: autograd's)
STATES = ("memo", "offload-all", "alst")  # the systems estimated with LoRA or offloaded states (`Job.full_states`)
MEMO_TILES = (None, 16384, 4096)  # memo's token tiles searched (None: the whole sequence shard)
# the caching allocator's mode each system runs: `memo train` turns on expandable segments on CUDA (as
# torchtitan does); Megatron-LM and DeepSpeed leave PyTorch's default
EXPANDABLE = ("memo", "offload-all")
ALLOCATOR_NAMES = {
    "caching": "PyTorch's caching allocator, default settings",
    "expandable": "PyTorch's caching allocator, expandable segments",
    "arena": "memo's planned arena (memo train --arena)",
}
# DeepSpeed ZeRO-3 defaults (deepspeed/runtime/zero/config.py): `stage3_prefetch_bucket_size` 5e7 parameters
# gathered ahead of the current module, `reduce_bucket_size` 5e8 elements held in bf16 (stage3.py)
ZERO3_PREFETCH_PARAMETERS = 5 * 10**7
ZERO3_REDUCE_BUCKET_BYTES = 2 * 5 * 10**8
ATTENTION_BACKWARD = 2.5  # flash backward runs 5 matmuls to forward's 2
# how far above the traced prediction a measured step's transient peak lay: 1.11x with memo (tiny-gpt, 1024
# tokens, `memo train --arena` on CPU: docs/estimate.md, "Predicted against measured"); the upper end of memory
# adds it
TRANSIENT_ERROR = 0.11
# what `--max-seq` keeps free on the device beyond the upper end of memory (`--headroom`): room for what no trace
# of the step and no runtime figure above covers, and a run adds after its step is planned: one more NCCL
# communicator with its NVLink SHARP buffers (an evaluation's or a checkpoint's group: `NCCL_COMMUNICATOR_HIGH_BYTES`
# + `NVLS_BYTES`, 2.9 GiB), or a profiler's or another library's CUDA context and workspaces. A longest length
# answered to the last byte of the device is one no run should be started at.
HEADROOM = 3 << 30
MAX_SEQ_RANGE = (
    "the longest length that fits with memory at the upper end of its band and {headroom} of the device kept free "
    "(--headroom); low at the slow end of the efficiency band, high at the fast end with memory at LOAD (no "
    "caching-allocator fragmentation) and nothing kept free"
)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one system splits a sequence over its GPUs, what it recomputes, and its token tile."""

    system: str = "memo"
    tp: int = 1  # tensor (+ sequence) parallel
    cp: int = 1  # context parallel: ring attention
    ulysses: int = 1  # Ulysses all-to-all sequence parallel
    recompute: str = "full"
    tile: int | None = None  # rows of token-local work at a time (None: untiled, the GPU's whole shard)

    @property
    def sp(self) -> int:
        return self.tp * self.cp * self.ulysses

    def __str__(self) -> str:
        split = " ".join(f"{k}={v}" for k, v in (("tp", self.tp), ("cp", self.cp), ("ulysses", self.ulysses)) if v > 1)
        what = "plan" if self.recompute == "memo" else "recompute"
        tiles = f", tiles of {format_count(self.tile)}" if self.tile else ""
        return f"{split or 'no sequence split'}, {self.recompute} {what}{tiles}"


@dataclass(frozen=True, kw_only=True)
class Pricing:
    """Which speeds and memory model price a job: a measured efficiency `band` (`memo calibrate`; None: the
    published one at each layout's shape), its `point` (low, mid, high) that decides the plan and α, and the
    point of the device-memory band that decides the fit (`memory_range`: low is LOAD, as an arena serves it)."""

    band: Band | None = None
    point: str = "mid"
    memory: str = "mid"  # of the device-memory band (`memory_range`): low (LOAD), mid, high
    headroom: int = 0  # device bytes kept free beyond that point (`max_seq_range`: HEADROOM)


@dataclass(kw_only=True)
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
    layout: str = ""
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)  # low and high efficiency band
    dominant: str = ""  # the largest share of the step, e.g. "97% attention"
    efficiency: dict = field(default_factory=dict)  # the central per-phase efficiencies and their source
    plan: list[str] | None = None  # memo: each layer's mode (keep, memo, checkpoint)
    tile: int | None = None  # tokens per tile of token-local work (None: untiled)
    binds: str = ""  # the budget nearest its limit, e.g. "host memory 1.79 of 1.80 TiB per node"
    allocator: str = ""  # how device memory is served: which caching-allocator mode, or an arena at LOAD
    tokens_per_step: int = 0  # every GPU's tokens of one optimizer step (micro-batch x data-parallel groups)
    states: str = "full fine-tuning"  # what trains and where its states live (Job.states)
    host_state_bytes_per_node: int = 0  # of host_bytes_per_node: offloaded model states (the rest: activations)
    attention_kernel: str = ""  # whose attention speeds time the step (efficiency.TIMED_AS; "calibrated")
    speeds_note: str = ""  # what the published speeds do not cover at this shape (`Band.note`)
    documents: str = ""  # packed documents (DocumentLengths), "" for sequences that attend whole
    attention_fraction: float = 1.0  # of the attention work of whole sequences left: E[Σ d_i²] / s²
    attention_flops: float = 0.0  # model FLOPs of attention in one step on all GPUs (causal, forward + backward)
    device_range: tuple[int, int] = (0, 0)  # the device total at the low (LOAD) and high ends of memory
    host_least_per_node: int = 0  # the pinned host of the plan that pins least at this length (states included)
    pin_seconds: float = 0.0  # pinning the chosen plan's host, every rank at once (`hardware.pin_seconds`)
    job: Job | None = field(default=None, repr=False, compare=False)  # what was priced (not in the JSON)

    def as_dict(self) -> dict:
        fields = {k: v for k, v in self.__dict__.items() if k != "job"}
        return {**fields, "conventions": PACKED_CONVENTIONS if self.documents else CONVENTIONS}


def recipe(job: Job) -> Job:
    """Returns `job` as ALST's published recipe runs it: FlashAttention-2 (PyTorch's flash kernel is FA2),
    model states offloaded with the optimizer on the CPU (`Job.offload_states`)."""
    return dataclasses.replace(job, attention="flash", offload_states=True)


def _timed_kernel(job: Job, gpu: GPUSpec) -> str:
    """Returns the kernel whose published speeds time memo's attention: over packed documents "auto" runs
    PyTorch's flash kernel, the one variable-length call (`memo.attention`)."""
    return attention_kernel(gpu, "flash" if job.documents and job.attention == "auto" else job.attention)


def _check(job: Job, system: str) -> None:
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")
    if not job.full_states and system not in STATES:
        raise ValueError(
            f"`--lora-rank` and `--offload-states` are estimated for {', '.join(STATES[:-1])} and {STATES[-1]}, "
            f"not for {system} "
            "(estimated as it ships)"
        )


def layouts(job: Job, gpu: GPUSpec, system: str) -> list[Layout]:
    """Returns every layout `system` supports for this job (only those of `job.sp` GPUs per sequence when it
    says): the constraints each checks at start-up."""
    _check(job, system)
    c, seq, gpus, sp = job.model, job.seq, job.gpus, job.sp
    degrees = [d for d in range(1, gpus + 1) if gpus % d == 0 and (sp is None or d == sp) and seq % d == 0]
    if system == "megatron":  # tp within a node dividing query and key/value heads; causal cp needs 2·cp chunks
        return [
            Layout(system=system, tp=tp, cp=d // tp, recompute=r)
            for d in degrees
            for tp in (1, 2, 4, 8)
            if d % tp == 0
            and tp <= gpu.gpus_per_node
            and c.n_heads % tp == 0
            and c.n_kv_heads % tp == 0
            and (d == tp or seq % (2 * (d // tp)) == 0)
            for r in RECOMPUTE[system]
        ]
    # DeepSpeed's all-to-all scatters query and key/value heads alike; memo's repeats key/value heads to fit
    heads = (c.n_heads, c.n_kv_heads) if system in ("megatron-deepspeed", "alst") else (c.n_heads,)
    return [
        Layout(system=system, ulysses=d, recompute=r, tile=tile)
        for d in degrees
        if all(h % d == 0 for h in heads)
        for r in RECOMPUTE[system]
        for tile in _tiles(system, c, seq // d)
    ]


def _tiles(system: str, c: ModelConfig, shard: int) -> tuple[int | None, ...]:
    """Returns the tile lengths a system runs a GPU's `shard` of tokens in: memo searches `MEMO_TILES`, ALST's
    TiledMLP cuts ceil(shard / hidden size) shards (rows of the hidden size), the others run it whole."""
    tiles = MEMO_TILES if system == "memo" else (c.hidden_size,) if system == "alst" else (None,)
    shorter = tuple(t for t in tiles if t is None or t < shard)
    return shorter or (None,)


def estimate(
    job: Job, gpu: GPUSpec, system: str = "memo", pricing: Pricing = Pricing(), layout: Layout | None = None
) -> Estimate:
    """Returns the predicted memory, step time and MFU of training `job` with `system` on `gpu`s: of `layout`,
    or of the best of the system's layouts (the fastest that fits; if none fits, the one needing least memory).

    Of each node's host memory (`job.host_memory`, default the GPU spec's) `device.HOST_USABLE` may hold
    offloaded tensors and model states (pinned), and the plan pins the least that keeps its step within
    `policy.HOST_SLACK` of the fastest plan's; with `job.arena` memo runs its planned allocator, not the caching one.
    Attention is timed at the published speeds of `job.attention` (`efficiency.attention_kernel`), over packed
    `job.documents` when given.
    """
    _check(job, system)
    if layout and layout.system != system:
        raise ValueError(f"a {layout.system} layout cannot price system {system}")
    if system == "alst":
        job = recipe(job)
    kernel = _timed_kernel(job, gpu)
    candidates = [layout] if layout else layouts(job, gpu, system)
    if not candidates:
        return _unsupported(job, gpu, system)
    fragmentation = "arena" if job.arena and system == "memo" else "expandable" if system in EXPANDABLE else "caching"
    priced = [
        Priced(
            pricing.band or _band(job, lay, gpu, kernel), pricing.point, fragmentation, pricing.memory, pricing.headroom
        )
        for lay in candidates
    ]
    floors = [(_floor_seconds(job, lay, gpu, p.efficiency), i) for i, (lay, p) in enumerate(zip(candidates, priced))]
    results, best = [], None
    for floor, i in sorted(floors):  # the fastest first; stop once none left can beat the best that fits
        if best is not None and floor >= best.step_seconds:
            break
        results.append(_evaluate(job, candidates[i], gpu, priced[i]))
        if results[-1].fits and (best is None or results[-1].step_seconds < best.step_seconds):
            best = results[-1]
    fitting = [e for e in results if e.fits]
    if fitting:
        return max(fitting, key=lambda e: e.tokens_per_s)
    return min(results, key=lambda e: (e.device_bytes["total"], e.step_seconds))


@dataclass(frozen=True)
class Priced:
    """A layout's efficiency band, the point of it that decides, the allocator whose overhead counts
    (`memory.ALLOCATORS`) and the point of the memory band that decides the fit."""

    band: Band
    point: str
    fragmentation: str
    memory: str = "mid"
    headroom: int = 0

    def need(self, device: dict[str, int], layout: Layout, gpus: int) -> int:
        """Returns the device bytes that decide the fit: `device`'s total at this point of its band, and the
        headroom kept free."""
        low, high = memory_range(device, layout, gpus)
        return {"low": low, "mid": device["total"], "high": high}[self.memory] + self.headroom

    @property
    def efficiency(self) -> Efficiency:
        return getattr(self.band, self.point)


def _floor_seconds(job: Job, layout: Layout, gpu: GPUSpec, eff: Efficiency) -> float:
    """Returns a layout's step time with nothing recomputed or copied (what keeping every layer would take): no
    plan of it is faster, so layouts whose floor is past a fitting one's time need no memory estimate."""
    seconds = _step_seconds(job, layout, gpu, eff, None)
    return sum(seconds.values()) - seconds["recompute"] - seconds["exposed_copy"]


def _band(job: Job, layout: Layout, gpu: GPUSpec, kernel: str) -> Band:
    """Returns the published efficiency band at a layout's shape: `kernel`'s attention over the whole sequence
    (Ulysses, tp) or its context-parallel chunk for the GPU's heads, at the speed of the packed documents' length
    when shorter (E[Σ d_i²] / s), and the token-local matmuls over a tile's rows."""
    c = job.model
    heads = job.micro_batch * c.n_heads // (layout.tp * layout.ulysses)
    chunk = job.seq // layout.cp
    whole = job.documents.attended(job.seq) if job.documents else job.seq  # what a full layer attends to
    rows = layout.tile or job.tokens(layout.sp)
    band = published_band(gpu, c, chunk, heads, kernel, rows=rows, length=min(whole, chunk))
    sliding = [i for i in range(c.n_layers) if c.slides(i)]
    windowed = c.layer_attended(sliding[0], job.seq, whole) if sliding else whole
    if windowed >= whole:
        return band
    # a windowed layer runs flash (the kernel that takes a window) at the length that stands for its work
    window = published_band(gpu, c, chunk, heads, "flash", rows=rows, length=min(windowed, chunk))
    share = len(sliding) * windowed / (len(sliding) * windowed + (c.n_layers - len(sliding)) * whole)
    return band.blended(window, share)


def _unsupported(job: Job, gpu: GPUSpec, system: str) -> Estimate:
    """Returns the estimate of a system that has no layout here (a fact about the system, not bad input)."""
    c, split = job.model, job.sp or job.gpus
    kv = system in ("megatron-deepspeed", "alst")
    heads = f"{c.n_heads} attention heads" + (f" ({c.n_kv_heads} key/value)" if kv else "")
    why = f"{heads} cannot be split over {split} GPUs" if job.sp else f"no layout of {system} fits {job.gpus} GPUs"
    nan = float("nan")
    return Estimate(
        system=system,
        seq=job.seq,
        gpus=job.gpus,
        sp=split,
        fits=False,
        why=why,
        alphas=None,
        device_bytes={"total": 0},
        hbm_bytes=gpu.hbm_bytes,
        host_bytes_per_node=0,
        host_capacity_per_node=0,
        step_seconds=nan,
        tokens_per_s=0.0,
        mfu=0.0,
        job=job,
    )


def _evaluate(job: Job, layout: Layout, gpu: GPUSpec, priced: Priced) -> Estimate:
    """Returns the estimate of one layout of `job`, priced at `priced`'s point of its band."""
    c, seq, gpus = job.model, job.seq, job.gpus
    eff, band = priced.efficiency, priced.band
    node_gpus = min(gpus, gpu.gpus_per_node)
    host_capacity = int(HOST_USABLE * (job.host_memory or gpu.host_memory_per_node))
    held = state_host_bytes(job)  # per GPU: offloaded model states come first, the pool gets the rest
    budget = host_capacity // node_gpus - held
    plan, why = (None, "host memory: no room left for the activations")
    if budget >= 0:
        plan, why = _plan(job, layout, gpu, eff, Budgets(host=budget))
    device = device_bytes(job, layout, gpu, plan, priced.fragmentation, gpu.hbm_bytes)
    room = gpu.hbm_bytes - priced.need(device, layout, gpus)
    if plan and layout.recompute == "memo" and room > 0:  # the layers the device can hold besides: kept
        plan, _ = _plan(job, layout, gpu, eff, Budgets(host=budget, device=room))
        device = device_bytes(job, layout, gpu, plan, priced.fragmentation)
    need = priced.need(device, layout, gpus)
    pinned = (_store(job, layout, plan).host_total if plan else 0) + held  # per GPU
    host = pinned * node_gpus
    if why and held:
        why = _host_refusal(why, held * node_gpus, host_capacity)
    if not why and need > gpu.hbm_bytes:
        least = "more than " if device.get("lower_bound") else ""
        point = "" if priced.memory == "mid" else f" at the {priced.memory} end of memory"
        hbm, kept = gpu.hbm_bytes / 2**30, priced.headroom / 2**30
        of = (
            f"of the {hbm - kept:.1f} GiB left of {hbm:.0f} GiB with {kept:.1f} GiB kept free"
            if kept
            else f"of {hbm:.0f} GiB"
        )
        why = f"device memory: needs {least}{need / 2**30 - kept:.1f} GiB{point} {of}"
    if not why and host > host_capacity:
        why = f"host memory: offload needs {host / 2**40:.2f} TiB per node, {host_capacity / 2**40:.2f} TiB usable"
        why = _host_refusal(why, held * node_gpus, host_capacity) if held else why
    timed = {p: _step_seconds(job, layout, gpu, getattr(band, p), plan) for p in POINTS}
    seconds = timed[priced.point]
    step = sum(seconds.values())
    sequences = gpus // layout.sp * job.micro_batch  # per step
    per_flop = sequences / (gpus * gpu.peak_flops)  # utilisation of one FLOP per sequence per second
    modes, alphas = plan or (_baseline_modes(layout, c.n_layers), [0.0] * c.n_layers)
    offload = layout.recompute == "offload"
    attended = job.attended
    again = recompute_flops(c, attended, modes, alphas, offload, tokens=seq, causal=True, tile=layout.tile)
    attention = c.n_layers * layer_forward_flops(c, attended, seq, causal=True)[1]  # one sequence's, forward
    if layout.recompute == "selective":
        again = attention
    if layout.system in MEMO_LAYER:
        again += c.n_layers * experts_backward_flops(c, seq)
    model = model_flops_per_token(c, attended, lora=job.lora) * seq
    slow, fast = (sum(timed[p].values()) for p in ("low", "high"))
    use = {"device memory": (need, gpu.hbm_bytes), "host memory": (host, host_capacity)}
    tightest = max(use, key=lambda k: use[k][0] / use[k][1])
    return Estimate(
        system=layout.system,
        seq=seq,
        gpus=gpus,
        sp=layout.sp,
        fits=not why,
        why=why,
        alphas=alphas if plan else None,
        device_bytes=device,
        device_range=memory_range(device, layout, gpus),
        hbm_bytes=gpu.hbm_bytes,
        host_bytes_per_node=host,
        host_capacity_per_node=host_capacity,
        step_seconds=step,
        tokens_per_s=sequences * seq / step,
        mfu=model * per_flop / step,
        seconds=seconds,
        mfu_full=model_flops_per_token(c, attended, causal=False, lora=job.lora) * seq * per_flop / step,
        hfu=(model + again) * per_flop / step,
        layout=str(layout),
        ranges={
            "step_seconds": (fast, slow),
            "tokens_per_s": (sequences * seq / slow, sequences * seq / fast),
            "mfu": (model * per_flop / slow, model * per_flop / fast),
        },
        dominant=dominant(seconds),
        efficiency={**dataclasses.asdict(eff), "source": band.source},
        plan=modes if plan else None,
        tile=layout.tile,
        binds=f"{tightest} {format_bytes(use[tightest][0])} of {format_bytes(use[tightest][1])}"
        + (" per node" if tightest == "host memory" else " per GPU"),
        allocator=ALLOCATOR_NAMES[priced.fragmentation],
        tokens_per_step=sequences * seq,
        states=job.states,
        host_state_bytes_per_node=held * node_gpus,
        attention_kernel=band.attention,
        speeds_note=band.note,
        documents=str(job.documents or ""),
        attention_fraction=attended / seq,
        attention_flops=3 * attention * sequences,
        host_least_per_node=(_least_host(job, layout) + held) * node_gpus,
        pin_seconds=pin_seconds(pinned),
        job=job,
    )


def _least_host(job: Job, layout: Layout) -> int:
    """Returns the activations' host bytes per GPU, as the store allocates them, of the plan that pins least at
    this length: every buffered layer checkpointed at α = 0 for memo (`ActivationPolicy.least_host_plan`), their
    one plan for offload-all and alst, nothing for the systems that do not offload."""
    if layout.recompute not in OFFLOADS:
        return 0
    n = job.model.n_layers
    return _store(job, layout, _fixed_plan(layout, n) or ActivationPolicy("memo").least_host_plan(n)).host_total


def _host_refusal(why: str, states: int, capacity: int) -> str:
    """Returns a host-memory refusal that names the offloaded model states beside the activations' pool."""
    usable = format_bytes(capacity)
    if states > capacity:
        return f"host memory: the model states alone need {format_bytes(states)} per node, {usable} usable"
    return f"{why} (model states take {format_bytes(states)} of the {usable} usable per node)"


def _baseline_modes(layout: Layout, n: int) -> list[str]:
    """Returns the store modes that model a baseline's layers: inputs kept (full recompute) or everything."""
    return ["recompute" if layout.recompute == "full" else "keep"] * n


@dataclass(frozen=True)
class Budgets:
    """One GPU's bytes for a plan: host memory for its offload, and device memory beyond the plan's buffers for
    layers kept whole (0: none)."""

    host: int
    device: int = 0


def _plan(job: Job, layout: Layout, gpu: GPUSpec, eff: Efficiency, budgets: Budgets):
    """Returns ((modes, α) per layer, "") for a layout that offloads, (None, why) when its host cannot hold even
    the layer inputs, and (None, "") for one that does not offload."""
    fixed = _fixed_plan(layout, job.model.n_layers)
    if layout.recompute == "offload":
        return fixed, ""
    if layout.recompute not in OFFLOADS:
        return None, ""
    try:
        return solve_plan(_plan_problem(job, layout, gpu, eff, budgets), fixed and fixed[0]), ""
    except ValueError as err:
        return None, f"host memory: {err}"


def _fixed_plan(layout: Layout, n: int) -> tuple[list[str], list[float]] | None:
    """Returns the one plan of a system that offloads without choosing: offload-all sends every tensor of every
    layer, alst every layer's input alone (checkpointed); None for memo's solved plans and the systems that do
    not offload."""
    if layout.recompute == "offload":
        return ["memo"] * n, [1.0] * n
    if layout.recompute == "host-checkpoint":
        return ["checkpoint"] * n, [0.0] * n
    return None


def _plan_problem(job: Job, layout: Layout, gpu: GPUSpec, eff: Efficiency, budgets: Budgets = Budgets(0)):
    """Returns the plan problem of one GPU (policy.py) with the layer's predicted seconds. Offloaded model states
    share the host link: a layer's activation copies hide behind what is left of its forward and backward once
    its weights' copies (`states.layer_traffic`) have had the link."""
    c, tokens = job.model, job.tokens(layout.sp)
    t = _compute_seconds(job, tokens, gpu, eff, layout.system in MEMO_LAYER)
    bandwidth = _host_bandwidth(gpu, eff)
    forward, backward = (b / bandwidth for b in layer_traffic(job))
    seconds = {**t, "forward": max(0.0, t["forward"] - forward), "backward": max(0.0, t["backward"] - backward)}
    specs = layer_specs(c, tokens)
    return plan_problem(specs, c.n_layers, seconds, bandwidth, budgets.host, budgets.device, tile=layout.tile)


def _traced(job: Job, layout: Layout, gpu: GPUSpec, plan) -> Traced:
    """Returns the step whose trace gives a layout's transient memory: its strategy, a checkpointed layer when
    the plan has one, its tiles, Ulysses' all-to-all buffers, its attention calls on a GPU by the kernel that
    times them (`_timed_kernel`), LoRA's adapters."""
    checkpoint = bool(plan) and "checkpoint" in plan[0]
    tokens = job.tokens(layout.sp)
    recompute = TRACED[layout.recompute]
    kernel = _timed_kernel(job, gpu)
    return Traced.of(
        job.model, tokens, recompute, checkpoint, layout.tile, layout.ulysses, lora=job.lora, attention=kernel
    )


def _store(job: Job, layout: Layout, plan):
    """Returns the activation store's layout (swap.StoreLayout) of a layout and its plan."""
    c, tokens = job.model, job.tokens(layout.sp)
    modes, alphas = plan or (_baseline_modes(layout, c.n_layers), [0.0] * c.n_layers)
    return store_bytes(c, tokens, modes, alphas, layout.tile or tokens, layout.recompute == "offload")


def dominant(seconds: dict[str, float]) -> str:
    """Returns the largest part of a step and its share, e.g. "97% attention"."""
    name = max(seconds, key=seconds.get)
    return f"{seconds[name] / sum(seconds.values()):.0%} {name.replace('_', ' ')}"


def _compute_seconds(job: Job, tokens: int, gpu: GPUSpec, eff: Efficiency, memo_layer: bool = True) -> dict[str, float]:
    """Returns one layer's seconds on one GPU: forward and backward matmuls and causal attention of `tokens` tokens
    attending to `job.attended` each (the sequence length; packed documents' E[Σ d_i²] / s; the half of the
    matrix a causal kernel computes), each phase at its own efficiency, and the token-local matmuls a recompute
    runs again (`qkv` before attention, `mlp` after it). With LoRA the frozen projections' backward computes the
    input gradient alone (1 × forward, not 2 ×), and the adapters' rank-r GEMMs run at the slower of their FLOPs
    at GEMM speed and their bytes at HBM speed. A mixture of experts' matmuls are those of its active weights
    (`flops.layer_forward_flops`); memo's layer (`memo_layer`) runs the experts' down projections and the router
    again in its backward (`flops.experts_backward_flops`), where autograd keeps what they give."""
    c, lora = job.model, job.lora
    matmul, attention = layer_forward_flops(c, job.attended, tokens, causal=True)
    gemm = gpu.peak_flops * eff.matmul
    mm = matmul / gemm
    attn = attention / (gpu.peak_flops * eff.attention_forward)
    attn_bwd = ATTENTION_BACKWARD * attention / (gpu.peak_flops * eff.attention_backward)
    qkv, mlp = (f / gemm for f in token_local_flops(c, tokens))
    hbm = gpu.hbm_bytes_per_s * eff.hbm
    low_fwd, low_bwd = (max(f / gemm, b / hbm) for f, b in adapter_work(c, lora, tokens).values())
    rerun = experts_backward_flops(c, tokens) / gemm if memo_layer else 0.0
    fwd, bwd = mm + low_fwd, (1 if lora else 2) * mm + low_bwd + rerun
    return {
        "matmul": fwd,
        "matmul_backward": bwd,
        "attention": attn,
        "attention_backward": attn_bwd,
        "forward": fwd + attn,
        "backward": bwd + attn_bwd,
        "qkv": qkv,
        "mlp": mlp,
    }


def _host_bandwidth(gpu: GPUSpec, eff: Efficiency) -> float:
    return gpu.host_link_bytes_per_s * eff.host_link / gpu.host_link_shared_by


def device_bytes(
    job: Job,
    layout: Layout,
    gpu: GPUSpec,
    plan=None,
    fragmentation: str | None = "caching",
    capacity: int | None = None,
) -> dict[str, int]:
    """Returns the per-GPU device memory of a system's layout (memo: and its `plan` of modes and α), by term, and
    the total.

    Model states by term as each system holds them (`_model_states`); the activation store's buffers are what
    `memo train`'s store allocates for the plan (`swap.store_layout`); the transient peak and the allocator's
    overhead (`fragmentation`: an allocator of `memory.ALLOCATORS`, or None for none) come from a traced step of
    the same tiles and modes; the runtime is the CUDA context's and NCCL's, NVLink SHARP buffers included on
    `gpu`s that have them. When the terms known without a trace already exceed `capacity`, the step is not
    traced: its terms are 0 and the total a lower bound (`"lower_bound": 1`); so too when they and the peak of
    one shorter traced step (`memory.transient_floor`) exceed it, with that peak as the transient term."""
    c, tokens = job.model, job.tokens(layout.sp)
    store = _store(job, layout, plan)
    static = {
        **_model_states(job, layout),
        "skeletal_buffers": store.device_bytes,
        "runtime": runtime_bytes(_communicators(layout, job.gpus), _nvls(layout, job.gpus, gpu)),
    }
    traced = _traced(job, layout, gpu, plan)
    if capacity is not None:
        floor = 0 if sum(static.values()) > capacity else transient_floor(c, tokens, traced)
        if sum(static.values()) + floor > capacity:
            least = {**static, "transient_peak": floor, "fragmentation": 0}
            return {**least, "total": sum(least.values()), "lower_bound": 1}
    transient = transient_peak(c, tokens, traced)
    if layout.system in ("megatron", "megatron-deepspeed"):
        transient = max(transient, _loss_peak(c, tokens, layout))
    terms = {
        **static,
        "transient_peak": transient,
        # Megatron's output layer gathers the sequence-parallel input into a global buffer that only grows
        # (megatron/core/utils.py GlobalMemoryBuffer; tensor_parallel/layers.py, the "mpu" buffer)
        "gather_buffer": tokens * layout.tp * c.hidden_size * 2 if layout.tp > 1 else 0,
        "fragmentation": fragmentation_bytes(c, tokens, traced, allocator=fragmentation) if fragmentation else 0,
    }
    return {**terms, "total": sum(terms.values())}


def memory_range(device: dict[str, int], layout: Layout, gpus: int) -> tuple[int, int]:
    """Returns (low, high) of a device-memory estimate: low is the step's LOAD (nothing lost to the allocator,
    as a planned arena serves it); high adds the upper ends of the published runtime figures
    (`hardware.runtime_bytes`) and `TRANSIENT_ERROR` of the traced transient peak."""
    total = device["total"]
    communicators = _communicators(layout, gpus)
    runtime = runtime_bytes(communicators, high=True) - runtime_bytes(communicators)
    return total - device.get("fragmentation", 0), total + runtime + int(TRANSIENT_ERROR * device["transient_peak"])


def _communicators(layout: Layout, gpus: int) -> int:
    """Returns the NCCL communicators of more than one GPU a rank joins: one per parallel dimension, the
    data-parallel one, and the world (FSDP / ZeRO-3 / the distributed optimizer)."""
    return sum(n > 1 for n in (layout.tp, layout.cp, layout.ulysses, gpus // layout.sp, gpus))


def _nvls(layout: Layout, gpus: int, gpu: GPUSpec) -> int:
    """Returns the NVLink SHARP buffers a rank holds: NCCL sets them up for each communicator of more than two
    GPUs that reduces (Megatron's tensor-parallel group and its data x context group of the distributed
    optimizer; FSDP / ZeRO-3's world), on GPUs that have them; all-to-all and ring exchanges do not use them."""
    groups = (layout.tp, gpus // layout.tp) if layout.system == "megatron" else (gpus,)
    return gpu.nvls_bytes * sum(n > 2 for n in groups)


def _loss_peak(c: ModelConfig, tokens: int, layout: Layout) -> int:
    """Returns the transient bytes at the loss of a system that materialises the logits (beyond the layers'
    kept tensors, which are the store's): the final hidden state and its norm, and per logit (each GPU holds
    `tokens` × V of them; with tensor parallelism (s / cp) × (V / tp), as many):

    - Megatron-LM (core >= 0.8): bf16 logits and the fp32 copy `vocab_parallel_cross_entropy` works in, in
      place (megatron/core/tensor_parallel/cross_entropy.py): 2 + 4 bytes;
    - Megatron-DeepSpeed: `output.float()` (gpt_model.py, `--fp16-lm-cross-entropy` off), then under Ulysses
      a new fp32 softmax and its log (core/sequence_parallel/cross_entropy.py): 2 + 4 + 4 + 4 bytes; without
      Ulysses Megatron's older loss, which subtracts the maximum out of place: 2 + 4 + 4.
    """
    per_logit = 6 if layout.system == "megatron" else 14 if layout.ulysses > 1 else 10
    return 2 * tokens * c.hidden_size * 2 + tokens * c.vocab_size * per_logit


def _model_states(job: Job, layout: Layout) -> dict[str, int]:
    """Returns bytes of weights, gradients and optimizer states per GPU as each system shards them: FSDP2's and
    one process's by term (`states.device_terms`), Megatron's and ZeRO-3's as one."""
    c, gpus = job.model, job.gpus
    params = c.num_parameters()
    if layout.system == "megatron":  # bf16 weights and fp32 gradient buffer over tp; distributed optimizer over dp·cp
        return {"model_states": int(params * (2 + 4) / layout.tp + params * 12 / gpus)}
    layer = linear_params_per_layer(c)
    if (
        layout.system == "megatron-deepspeed"
    ):  # ZeRO-3 (deepspeed/runtime/zero/config.py defaults): bf16 gradient partitions,
        # the current layer gathered plus the prefetch bucket, and the persistent bf16 reduce bucket
        gathered = 2 * (layer + ZERO3_PREFETCH_PARAMETERS) + ZERO3_REDUCE_BUCKET_BYTES
        return {"model_states": int(params * (2 + 2 + 12) / gpus + gathered)}
    terms = state_device_terms(job)
    return {"model_states": terms["states"], "gathered_weights": terms["gathered"], "gradients": terms["gradients"]}


def _step_seconds(job: Job, layout: Layout, gpu: GPUSpec, eff: Efficiency, plan) -> dict[str, float]:
    """Returns the step time split into attention, matmul, memory-bound ops, recompute, exposed copy (the
    activations' and offloaded model states' host copies that do not hide), communication and the CPU
    optimizer step of offloaded states."""
    c, gpus, tokens = job.model, job.gpus, job.tokens(layout.sp)
    n = c.n_layers
    t = _compute_seconds(job, tokens, gpu, eff, layout.system in MEMO_LAYER)
    fwd, bwd = t["forward"], t["backward"]
    costs = {"recompute": 0.0, "exposed_copy": 0.0}
    if layout.recompute == "full":
        costs["recompute"] = n * fwd
    elif layout.recompute == "selective":
        costs["recompute"] = n * t["attention"]
    elif layout.recompute in OFFLOADS and plan:
        problem = _plan_problem(job, layout, gpu, eff)
        costs = plan_costs(dataclasses.replace(problem, offload_last_layers=layout.recompute == "offload"), *plan)
    checkpointed = plan[0].count("checkpoint") if plan else n if layout.recompute == "full" else 0
    plain, rerun = (_layer_comm_seconds(job, layout, gpu, eff, t, again) for again in (False, True))
    head = (2 if job.lora else 3) * 2 * c.vocab_size * c.hidden_size * tokens / (gpu.peak_flops * eff.matmul)
    per_layer_bytes, outside = traffic_bytes(c, tokens, _traced(job, layout, gpu, plan))
    node_gpus = min(gpus, gpu.gpus_per_node)
    return {
        "attention": n * (t["attention"] + t["attention_backward"]),
        "matmul": n * (t["matmul"] + t["matmul_backward"]) + head,
        # what the trace's memory-bound ops write is read once more: twice those bytes at HBM speed
        "memory_bound": 2 * (n * per_layer_bytes + outside) / (gpu.hbm_bytes_per_s * eff.hbm),
        "recompute": costs["recompute"],
        "exposed_copy": costs["exposed_copy"] + _state_copy_seconds(job, gpu, eff, fwd, bwd),
        "communication": (n - checkpointed) * plain + checkpointed * rerun,
        "optimizer": optimizer_seconds(job, node_gpus),
    }


def _state_copy_seconds(job: Job, gpu: GPUSpec, eff: Efficiency, fwd: float, bwd: float) -> float:
    """Returns the seconds of offloaded model states' host copies that do not hide: what a layer's weight copies
    take of the host link beyond its forward and its backward (FSDP2 prefetches the next layer's during the
    current one's compute; the activations' copies get what is left, `_plan_problem`), and the root unit's
    copies before the first layer and after the last."""
    bandwidth = _host_bandwidth(gpu, eff)
    forward, backward = (b / bandwidth for b in layer_traffic(job))
    per_layer = max(0.0, forward - fwd) + max(0.0, backward - bwd)
    return job.model.n_layers * per_layer + root_traffic(job) / bandwidth


def _link(gpus: int, gpu: GPUSpec, eff: Efficiency) -> float:
    """Returns the per-GPU bandwidth of a collective over `gpus` GPUs (NVLink inside a node, else network)."""
    return gpu.nvlink_bytes_per_s * eff.nvlink if gpus <= gpu.gpus_per_node else gpu.network_bytes_per_s * eff.network


def _layer_comm_seconds(job: Job, layout: Layout, gpu: GPUSpec, eff: Efficiency, t: dict, again: bool) -> float:
    """Returns one layer's communication seconds on the critical path: forward + backward, and the recomputed
    forward when the layer runs `again` (whole-layer recomputation); `t` is the layer's `_compute_seconds`."""
    c, gpus, tokens = job.model, job.gpus, job.tokens(layout.sp)
    d, a, g = c.head_dim, c.n_heads, c.n_kv_heads
    tp, cp = layout.tp, layout.cp
    passes = 3 if again else 2  # forward, backward, and the recomputed forward
    seconds = 0.0
    if tp > 1:  # 2 all-gathers + 2 reduce-scatters of the (s/cp, h) activations per pass
        tp_bytes = 4 * tokens * tp * c.hidden_size * 2 * (tp - 1) / tp
        seconds += passes * tp_bytes / _link(tp, gpu, eff)
    if cp > 1:  # ring exchange of k, v: overlapped with attention forward (twice if recomputed) and backward
        ring = 2 * g * d * tokens * 2 * (cp - 1) / _link(gpus, gpu, eff)
        forwards = 1 if layout.recompute == "none" else 2
        seconds += forwards * max(0.0, ring - t["attention"]) + max(0.0, 2 * ring - t["attention_backward"])
    sp = layout.ulysses
    if sp > 1:  # Ulysses: q, k, v in and the output back, per pass
        a2a = (2 * a + 2 * g) * d * tokens * 2 * (sp - 1) / sp / _link(sp, gpu, eff)
        seconds += a2a * passes
    if layout.system != "megatron" and gpus > 1:  # ZeRO-3 / FSDP: gather weights for forward and backward
        move = linear_params_per_layer(c) * 2 * (gpus - 1) / gpus / _link(gpus, gpu, eff)
        seconds += max(0.0, move - t["forward"]) + max(0.0, 2 * move - t["backward"])
    return seconds


@dataclass(frozen=True)
class Longest:
    """The longest sequence that fits, and why the next length tried does not (or the shortest, when none fits)."""

    tokens: int
    why_not: str


def max_seq(job: Job, gpu: GPUSpec, system: str, pricing: Pricing = Pricing(), limit: int = 1 << 26) -> Longest:
    """Returns the longest sequence (a multiple of 1K·sp, or of 1K·gpus when layouts are searched) that `job`
    trains with `system` (its `seq` is not read), 0 if none does, with what stops the next length; of packed
    `job.documents` when given (their attention is less work, so memo's copies have less compute to hide behind)."""
    step = 1024 * (job.gpus if job.sp is None else job.sp)
    _check(job.at(step), system)
    why = {}

    def fits(seq: int) -> bool:
        e = estimate(job.at(seq), gpu, system, pricing)
        why[seq] = e.why
        return e.fits

    lo, hi = 0, step
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + step)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if lo + step not in why and lo + step <= limit:
        fits(lo + step)
    return Longest(lo, why.get(lo + step) or f"the search stops at {format_count(limit)} tokens")


def max_seq_range(job: Job, gpu: GPUSpec, system: str, band: Band | None = None, headroom: int = HEADROOM) -> dict:
    """Returns the longest sequence that fits: "mid" at the middle of the efficiency band (memo's plan and α,
    and so its host memory, depend on speed) with memory at the upper end of its band (`memory_range`) and
    `headroom` bytes of the device kept free, "low" at the slow end with the same memory, "high" at the fast end
    with memory at LOAD (as a planned arena serves it) and nothing kept free; "why_not": what stops the length
    after "mid"; "attention_kernel": whose attention speeds time the steps. Of packed `job.documents` when given."""
    upper = dict(band=band, memory="high", headroom=headroom)
    mid = max_seq(job, gpu, system, Pricing(**upper))
    return {
        "low": max_seq(job, gpu, system, Pricing(point="low", **upper)).tokens,
        "mid": mid.tokens,
        "high": max_seq(job, gpu, system, Pricing(band=band, point="high", memory="low")).tokens,
        "why_not": mid.why_not,
        "headroom": headroom,
        "attention_kernel": band.attention if band else _timed_kernel(job, gpu),
    }
