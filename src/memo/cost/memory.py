"""Per-GPU memory: model states, the activation store's buffers and host pool, and the traced transient peak.

Activation terms come from the real model: the skeletal tensor list of `DecoderLayer.skeletal_specs`, the
bytes the store allocates for a plan (`swap.store_layout`, the code `memo train` sizes its buffers with),
and an allocation trace of a steady-state training step on the `meta` device (no memory needed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..attention import heads_per_call
from ..config import ModelConfig
from ..device import meta_kernels
from ..job import Job
from ..layer import DecoderLayer, SkeletalSpec, bytes_by_role
from ..lora import LoraConfig, apply_lora
from ..model import Transformer
from ..parallel.ulysses import Ulysses
from ..plan.caching_sim import replay
from ..plan.greedy import greedy
from ..plan.problem import Problem, max_load, peak
from ..plan.trace import SCRATCH, trace_iteration, windows
from ..policy import ActivationPolicy
from ..swap import StoreLayout, layer_swaps, store_layout
from ..units import format_bytes, format_count
from .hardware import GPUS
from .states import trained

TRACE_LAYERS = 4  # a steady-state step of 4 layers shows every phase; deeper models add only kept inputs
TRACE_TOKENS = 1 << 18  # longest step traced (a trace's cost grows with the length); past it, extrapolated
TRACE_TILES = 16  # tiles of the longest tiled step traced, unless its phases are not linear there yet


@dataclass(frozen=True)
class Traced:
    """The step a memory term is traced from: a strategy, for `memo` the modes of the traced layers (a
    checkpointed layer first when the plan has one), the tile length (None: the whole sequence, as the
    baselines run), the Ulysses degree (one rank of `sp`: its all-to-all buffers, no process group), the
    query heads per attention call (None: the default at each traced length), LoRA's adapters (frozen base
    weights: no weight gradient computed), the dtype and whose attention kernels (a device type) run. `of` fixes the heads a run makes at its length, so that the traces
    around it make the same calls and each phase stays linear in tokens."""

    strategy: str = "memo"
    checkpoint: bool = False
    tile: int | None = None
    sp: int = 1
    heads: int | None = None
    lora: LoraConfig | None = None
    dtype: torch.dtype = torch.bfloat16
    kernels: str = "cuda"  # whose attention kernels' allocations the step makes (a device type)

    @classmethod
    def of(
        cls,
        c: ModelConfig,
        tokens: int,
        strategy: str,
        checkpoint=False,
        tile=None,
        sp=1,
        kernels="cuda",
        lora=None,
        dtype=torch.bfloat16,
    ) -> "Traced":
        """Returns the step of a run of `tokens` tokens per GPU: its attention calls as they are at that length."""
        heads = heads_per_call(c.n_heads // sp, tokens * sp, tile or tokens, torch.device(kernels))
        return cls(
            strategy, checkpoint=checkpoint, tile=tile, sp=sp, heads=heads, lora=lora, dtype=dtype, kernels=kernels
        )

    def policy(self, layers: int) -> ActivationPolicy:
        every = dict(tile_tokens=self.tile, attention_heads=self.heads)
        if self.strategy != "memo":
            return ActivationPolicy(self.strategy, **every)
        plan = ("checkpoint" if self.checkpoint else "memo",) + ("memo",) * (layers - 1)
        return ActivationPolicy("memo", alpha=0.5, plan=plan, host_budget_bytes=1 << 60, **every)


@lru_cache(maxsize=1024)
def layer_specs(c: ModelConfig, tokens: int, dtype=torch.bfloat16) -> dict[str, SkeletalSpec]:
    """Returns one layer's skeletal tensors for `tokens` tokens (whole-length), as the store sizes them."""
    with torch.device("meta"):
        layer = DecoderLayer(c, 0)
    return layer.skeletal_specs(1, tokens, dtype, "meta")


def skeletal_bytes(c: ModelConfig, tokens: int, dtype=torch.bfloat16) -> dict[str, int]:
    """Returns one layer's skeletal bytes by role ("input", "attention", "other") for `tokens` tokens."""
    return bytes_by_role(layer_specs(c, tokens, dtype))


def store_bytes(
    c: ModelConfig,
    tokens: int,
    modes: list[str],
    alphas: list[float],
    tile: int,
    offload_last: bool = False,
    dtype=torch.bfloat16,
) -> StoreLayout:
    """Returns the device and host bytes the activation store allocates for a plan (`swap.store_layout`)."""
    tile = min(tile, tokens)
    return store_layout(layer_specs(c, tokens, dtype), layer_swaps(modes, alphas, tokens, tile, offload_last), tile)


def transient_peak(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int = 4096) -> int:
    """Returns the peak bytes allocated during a steady-state step beyond the store's buffers (layer inputs
    held for recomputation are the store's). The step is traced at two lengths around `tokens` (`_bracket`)
    and each phase's peak (a layer's forward or backward, or the rest: embedding and loss) read on the line
    through its two traced peaks: a phase's tensors are token rows, tiles and the loss chunk are fixed, so each
    phase's peak is linear in tokens once the whole-length tensors outweigh a tile's (the step's, their
    maximum, need not be); past the longest traced length the line is taken where it is so (`_linear_top`).
    A few traces then serve any length (a search over lengths and plans included), in `traced`'s dtype and
    kernels."""
    lo, hi = _bracket(tokens, traced.tile)
    if tokens > hi:
        lo, hi = _linear_top(c, traced, loss_chunk_tokens, hi)
    at_lo, at_hi = (_traced_step(c, n, traced, loss_chunk_tokens).peaks for n in (lo, hi))
    return max(_line(at_lo[k], at_hi[k], lo, hi, tokens) for k in at_hi)


def transient_floor(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int = 4096) -> int:
    """Returns a peak that a step of `tokens` tokens cannot stay below: the traced peak at the longest length
    `transient_peak` traces that is not past `tokens` (every phase's peak grows with the tokens). One trace,
    which `transient_peak` makes too: a search refuses a length that cannot fit before extrapolating to it."""
    lo, hi = _bracket(tokens, traced.tile)
    return max(_traced_step(c, hi if hi <= tokens else lo, traced, loss_chunk_tokens).peaks.values())


@lru_cache(maxsize=64)
def _linear_top(c: ModelConfig, traced: Traced, loss_chunk_tokens: int, top: int) -> tuple[int, int]:
    """Returns the two traced lengths (from `top`, doubled at most twice) whose lines extend past them: where
    every phase's peak grows by the same bytes per token as at half the length (within 1%)."""
    lo, hi = top // 2, top
    for _ in range(2):
        a, b, d = (_traced_step(c, n, traced, loss_chunk_tokens).peaks for n in (lo // 2, lo, hi))
        if all(abs((d[k] - b[k]) - 2 * (b[k] - a[k])) <= 0.01 * abs(d[k] - b[k]) + (1 << 20) for k in d):
            break
        lo, hi = hi, 2 * hi
    return lo, hi


ALLOCATORS = {  # how a run's device memory is served, and the StepTrace field of what it costs beyond LOAD
    "caching": "fragmentation",  # PyTorch's CUDA caching allocator, default settings
    "expandable": "expandable",  # the same with expandable_segments (what `memo train` turns on)
    "arena": None,  # memo's planned allocator (`memo train --arena`): one arena for the step
}


def fragmentation_bytes(
    c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int = 4096, allocator: str = "caching"
) -> int:
    """Returns the bytes an allocator (`ALLOCATORS`) takes beyond the step's LOAD: the caching allocator's
    reserved beyond its allocated peak, the traced step replayed through `plan.caching_sim`; or the planned
    arena's size beyond LOAD, the traced step placed by `plan.greedy` (the planned allocator's first answer;
    its search only improves on it). Read on the line between the two traced lengths as in `transient_peak`."""
    if allocator == "arena":
        lo, hi = _bracket(tokens, traced.tile)
        return _line(*(_arena_overhead(c, n, traced, loss_chunk_tokens) for n in (lo, hi)), lo, hi, tokens)
    return _on_line(c, tokens, traced, loss_chunk_tokens, ALLOCATORS[allocator])


@lru_cache(maxsize=64)
def _arena_overhead(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int) -> int:
    """Returns how far a greedy placement of the traced step lies above its LOAD."""
    problem = _traced_step(c, tokens, traced, loss_chunk_tokens).problem
    return peak(problem, greedy(problem)[0]) - max_load(problem)


def traffic_bytes(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int = 4096) -> tuple[int, int]:
    """Returns (per layer, outside the layers) bytes that the step's memory-bound ops write, from its trace: the
    outputs of every op but matmuls, attention and empty allocations (norms, activations, residual adds, RoPE,
    casts, the loss's softmax...), which run at HBM speed, not at tensor-core speed. Tiles split the same work
    into rows: the untiled step's trace serves."""
    whole = dataclasses.replace(traced, tile=None)
    return tuple(_on_line(c, tokens, whole, loss_chunk_tokens, k) for k in ("traffic_layer", "traffic_outside"))


def _on_line(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int, field: str) -> int:
    lo, hi = _bracket(tokens, traced.tile)
    at_lo, at_hi = (getattr(_traced_step(c, n, traced, loss_chunk_tokens), field) for n in (lo, hi))
    return _line(at_lo, at_hi, lo, hi, tokens)


def _line(at_lo: int, at_hi: int, lo: int, hi: int, tokens: int) -> int:
    return at_hi if hi == lo else max(0, at_lo + (at_hi - at_lo) * (tokens - lo) // (hi - lo))


def _bracket(tokens: int, tile: int | None = None) -> tuple[int, int]:
    """Returns the traced lengths whose lines give the peaks at `tokens`: (t, t) when `tokens` is traced itself;
    at most `TRACE_TOKENS`, and for tiled steps at most `TRACE_TILES` tiles (a trace's cost grows with the
    number of tiles; past that, every phase is linear in tokens)."""
    top = TRACE_TOKENS if tile is None else max(min(TRACE_TOKENS, TRACE_TILES * tile), 1024)
    if tokens >= top:
        return (top, top) if tokens == top else (top // 2, top)
    hi = 1 << max(tokens - 1, 1).bit_length()
    return (hi, hi) if hi == tokens else (hi // 2, hi)


def traced_transient_peak(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int = 4096) -> int:
    """Returns the peak bytes allocated during a steady-state step (after buffers are sized) beyond the store's
    buffers, on `meta`, kernel scratch (`plan.scratch`: the flash backward's fp32 accumulators) included.

    The step is traced with `TRACE_LAYERS` layers; parameter gradients already exist (accumulated), as in
    training.
    """
    return max(_traced_step(c, tokens, traced, loss_chunk_tokens).peaks.values())


COMPUTE_BOUND = ("mm", "attention", "empty")  # op names holding these: timed at FLOP/s, or writing nothing


@dataclass(frozen=True)
class StepTrace:
    """What one traced step gives the cost model (see the callers)."""

    peaks: dict  # phase -> its peak bytes beyond the store: ("fwd" | "bwd", layer), and "rest"
    fragmentation: int  # the caching allocator's reserved beyond its peak, default settings
    expandable: int  # the same with expandable segments
    traffic_layer: int  # memory-bound bytes written per layer
    traffic_outside: int  # and outside the layers
    problem: Problem  # the step's tensors as a DSA instance (what an arena places)


@lru_cache(maxsize=256)
def _traced_step(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int) -> StepTrace:
    """Returns the peaks, fragmentation and traffic of one steady-state step traced on `meta`."""
    dtype, kernels = traced.dtype, traced.kernels
    layers = min(c.n_layers, TRACE_LAYERS)
    small = dataclasses.replace(c, n_layers=layers)
    with torch.device("meta"):
        model = Transformer(small, traced.policy(layers), loss_chunk_tokens=loss_chunk_tokens).to(dtype)
    if traced.lora is not None:
        apply_lora(model, traced.lora)
    if traced.sp > 1:
        for layer in model.layers:
            layer.seq_parallel = Ulysses.traced(traced.sp, c.n_heads, c.n_kv_heads)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with meta_kernels(kernels):  # a GPU step allocates what the CUDA attention kernels allocate
        model(ids, labels=ids).backward()  # sizes the store and creates .grad
        step = trace_iteration(model, ids, scratch=kernels == "cuda")
    held = model.store.layout.kept_input_bytes  # layer inputs `recompute` holds: the store's, counted there
    events = [(e.kind, e.tensor, e.nbytes) for e in step.events if e.kind != "mark"]
    cached, expandable = replay(events), replay(events, expandable_segments=True)
    written = [
        e.nbytes if e.kind == "alloc" and e.op != SCRATCH and not any(k in str(e.op) for k in COMPUTE_BOUND) else 0
        for e in step.events
    ]
    spans = windows(step)
    in_layers = sum(sum(written[lo:hi]) for lo, hi in spans.values())
    return StepTrace(
        peaks={k: v - held for k, v in _phase_peaks(step, spans).items()},
        fragmentation=cached.peak_reserved - cached.peak_allocated,
        expandable=expandable.peak_reserved - expandable.peak_allocated,
        traffic_layer=in_layers // layers,
        traffic_outside=sum(written) - in_layers,
        problem=step.to_problem(),
    )


def _phase_peaks(step, spans: dict) -> dict:
    """Returns the most bytes live during each layer phase of the trace, and during the rest of the step."""
    phase_of = {}
    for key, (lo, hi) in spans.items():
        for i in range(lo, hi + 1):
            phase_of.setdefault(i, key)
    peaks: dict = {}
    live = 0
    for i, e in enumerate(step.events):
        live += e.nbytes if e.kind == "alloc" else -e.nbytes if e.kind == "free" else 0
        key = phase_of.get(i, "rest")
        peaks[key] = max(peaks.get(key, 0), live)
    return peaks


def training_lower_bound(job: Job) -> dict[str, int]:
    """Returns bytes a training run needs at least, without tracing: model states (weights, gradients, AdamW m and v,
    fp32 masters of 16-bit weights, and with several micro-batches (`job.grad_accum`) the masters' fp32 gradients,
    which sum the micro-batches' 16-bit ones: `MasterAdamW.accumulate`; sharded over `job.gpus` ranks), the
    store's device buffers for one rank's tokens and its host pool, for the policy's plan and α (the least a
    solved plan can take where they are to be solved: `ActivationPolicy.least_host_plan`). With LoRA only the
    adapters have gradients and AdamW state; the frozen base is its weights alone. Transients and the loss are
    left out."""
    c, policy, dtype = job.model, job.policy, job.torch_dtype
    tokens = job.tokens(job.sp or 1)
    size = dtype.itemsize
    masters = 4 if dtype != torch.float32 else 0
    master_grads = masters if job.grad_accum > 1 else 0  # alive through every micro-batch's backward
    train, frozen = trained(job)
    states = (train * (2 * size + 8 + masters + master_grads) + frozen * size) // job.gpus
    modes, alphas = policy.least_host_plan(c.n_layers)
    layout = store_bytes(c, tokens, modes, alphas, policy.tile_for(tokens), policy.offload_last_layers, dtype)
    return {"states": states, "activations": layout.device_bytes, "host_pool": layout.host_total}


PLAN_MAX_TOKENS = 4 << 20  # tokens per GPU `memo plan` traces (a trace takes seconds per million)


def check_plan_length(job: Job) -> None:
    """Refuses a `memo plan` step (one GPU's `job.micro_batch` sequences of `job.seq` tokens) that no listed GPU
    holds, or too long to trace in seconds: the plan traces every token."""
    tokens, batch = job.seq, job.micro_batch
    if tokens * batch > PLAN_MAX_TOKENS:
        raise ValueError(
            f"`--seq` / `--tp` x `--batch` is {format_count(tokens * batch)} tokens per GPU; the plan traces each "
            f"of them, at most {format_count(PLAN_MAX_TOKENS)}: raise `--tp` or lower `--seq`"
        )
    largest = max(GPUS.values(), key=lambda g: g.hbm_bytes)
    need = training_lower_bound(job)["activations"]
    if need > largest.hbm_bytes:
        raise ValueError(
            f"`--seq` {format_count(tokens)} per GPU needs at least {format_bytes(need)} of activations with "
            f"`--policy {job.policy.strategy}`, more than the largest listed GPU ({largest.name}, "
            f"{format_bytes(largest.hbm_bytes)}): raise `--tp` or lower `--seq`"
        )
