"""Per-GPU memory: model states, the activation store's buffers and host pool, and the traced transient peak.

Activation terms come from the real model: the skeletal tensor list of `DecoderLayer.skeletal_specs`, the
bytes the store allocates for a plan (`swap.store_layout`, the code `memo train` sizes its buffers with),
and an allocation trace of a steady-state training step on the `meta` device (no memory needed). A trace costs
its op calls, one pass of each token loop per tile: a long step's trace is that of two short ones extended to its
length (`plan.extend`), event by event the direct trace, which the memory terms are read from.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..attention import check_choice, choose, heads_per_call
from ..config import ModelConfig
from ..device import meta_kernels
from ..job import Job
from ..layer import DecoderLayer, SkeletalSpec, bytes_by_role
from ..lora import LoraConfig, apply_lora
from ..model import Transformer
from ..parallel.ulysses import Ulysses
from ..plan.extend import Measure, Program, events, growth, measure, program
from ..plan.extend import tokens as trace_tokens
from ..plan.problem import max_load, peak
from ..plan.trace import SCRATCH, Trace, no_cycle_collection, trace_iteration
from ..plan.worker import both
from ..policy import ActivationPolicy
from ..swap import StoreLayout, layer_swaps, pack_layout, store_layout
from ..units import format_bytes, format_count
from .hardware import GPUS
from .states import trained

log = logging.getLogger(__name__)

TRACE_LAYERS = 4  # a steady-state step of 4 layers shows every phase; deeper models add only kept inputs
TRACE_TOKENS = 1 << 18  # longest of the traces a step is extended from (a trace costs its op calls: tiles, chunks)
TRACE_TILES = 4  # tiles of the shorter of two traces a longer tiled step is extended from, at least (`_shortest`)


@dataclass(frozen=True)
class Traced:
    """The step a memory term is traced from: a strategy, for `memo` the modes of the traced layers (a
    checkpointed layer first when the plan has one), the tile length (None: the whole sequence, as the
    baselines run), the Ulysses degree (one rank of `sp`: its all-to-all buffers, no process group), the
    query heads per attention call (None: the default at each traced length), LoRA's adapters (frozen base
    weights: no weight gradient computed), the dtype, whose kernels (a device type) run and which attention kernel
    (`attention.KERNELS`; "auto": memo's choice on `kernels` of a GPU it does not know): each kernel's backward
    allocates its scratch, and a cuDNN step also dense copies of its head chunks. `of` fixes the heads a run
    makes at its length, so that the shorter traces it is extended from make the same calls."""

    strategy: str = "memo"
    checkpoint: bool = False
    tile: int | None = None
    sp: int = 1
    heads: int | None = None
    lora: LoraConfig | None = None
    dtype: torch.dtype = torch.bfloat16
    kernels: str = "cuda"  # whose attention kernels' allocations the step makes (a device type)
    attention: str = "auto"

    def __post_init__(self) -> None:
        if self.attention == "auto":  # one name per kernel: the traces of "auto" and of its kernel are one
            with meta_kernels(self.kernels):
                object.__setattr__(self, "attention", choose("auto", torch.device("meta"), self.dtype))
        check_choice(self.attention)

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
        attention="auto",
    ) -> "Traced":
        """Returns the step of a run of `tokens` tokens per GPU: its attention calls as they are at that length."""
        heads = heads_per_call(c.n_heads // sp, tokens * sp, tile or tokens, torch.device(kernels))
        every = dict(heads=heads, lora=lora, dtype=dtype, kernels=kernels, attention=attention)
        return cls(strategy, checkpoint=checkpoint, tile=tile, sp=sp, **every)

    def policy(self, layers: int) -> ActivationPolicy:
        every = dict(tile_tokens=self.tile, attention_heads=self.heads, attention=self.attention)
        if self.strategy != "memo":
            return ActivationPolicy(self.strategy, **every)
        plan = ("checkpoint" if self.checkpoint else "memo",) + ("memo",) * (layers - 1)
        return ActivationPolicy("memo", alpha=0.5, plan=plan, host_budget_bytes=1 << 60, **every)


@lru_cache(maxsize=1024)
def _kind_specs(c: ModelConfig, tokens: int, dtype, sparse: bool) -> dict[str, SkeletalSpec]:
    """Returns the skeletal tensors of the first layer whose MLP is (`sparse`) or is not a mixture of experts."""
    with torch.device("meta"):
        layer = DecoderLayer(c, next(i for i in range(c.n_layers) if c.sparse(i) == sparse))
    return layer.skeletal_specs(1, tokens, dtype, "meta")


@lru_cache(maxsize=1024)
def each_layer_specs(c: ModelConfig, tokens: int, dtype=torch.bfloat16) -> list[dict[str, SkeletalSpec]]:
    """Returns every layer's skeletal tensors for `tokens` tokens (whole-length): a mixture of experts' dense layers
    (`ModelConfig.dense_layers`) have the dense MLP's, its sparse layers the routing's and the experts'."""
    return [_kind_specs(c, tokens, dtype, c.sparse(i)) for i in range(c.n_layers)]


@lru_cache(maxsize=1024)
def layer_specs(c: ModelConfig, tokens: int, dtype=torch.bfloat16) -> dict[str, SkeletalSpec]:
    """Returns one layer's skeletal tensors for `tokens` tokens (whole-length), as the store sizes them: where a
    mixture of experts mixes dense and sparse layers, the larger kind's (the store's buffers fit it)."""
    return max(each_layer_specs(c, tokens, dtype), key=lambda specs: pack_layout(specs)[1])


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
    empty: bool = False,
) -> StoreLayout:
    """Returns the device and host bytes the activation store allocates for a plan (`swap.store_layout`)."""
    tile = min(tile, tokens)
    specs = each_layer_specs(c, tokens, dtype)
    return store_layout(specs, layer_swaps(modes, alphas, tokens, tile, offload_last, empty), tile)


def transient_peak(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int = 4096) -> int:
    """Returns the peak bytes allocated during a steady-state step of `tokens` tokens beyond the store's buffers
    (layer inputs held for recomputation are the store's): the LOAD of the step's trace at that length, traced
    whole or extended from two shorter traces (`_program`), in `traced`'s dtype and kernels."""
    measured, held = _measured(c, tokens, traced, loss_chunk_tokens)
    return measured.load - held


def transient_floor(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int = 4096) -> int:
    """Returns a peak that a step of `tokens` tokens cannot stay below, for a search to refuse a length before it
    prices it: the transient peak itself, which two short traces give at any length."""
    return transient_peak(c, tokens, traced, loss_chunk_tokens)


ALLOCATORS = (  # how a run's device memory is served
    "caching",  # PyTorch's CUDA caching allocator, default settings
    "expandable",  # the same with expandable_segments (what `memo train` turns on)
    "arena",  # memo's planned allocator (`memo train --arena`): one arena for the step
)


def fragmentation_bytes(
    c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int = 4096, allocator: str = "caching"
) -> int:
    """Returns the bytes an allocator (`ALLOCATORS`) takes beyond the step's LOAD: the caching allocator's
    reserved beyond its allocated peak, the step replayed through `plan.caching_sim`; or the planned arena's size
    beyond LOAD, the step placed by `plan.greedy` (the planned allocator's first answer; its search only improves
    on it)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"unknown allocator {allocator!r}; choose one of {', '.join(ALLOCATORS)}")
    if allocator == "arena":
        return _arena_overhead(c, tokens, traced, loss_chunk_tokens)
    return _measured(c, tokens, traced, loss_chunk_tokens, allocator)[0].overhead


@lru_cache(maxsize=64)
def _arena_overhead(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int) -> int:
    """Returns how far a greedy placement of the step lies above its LOAD."""
    from ..plan.greedy import greedy  # numba: loads with the first arena priced

    with no_cycle_collection():
        problem = events(_program(c, tokens, traced, loss_chunk_tokens)[0]).to_problem()
    return peak(problem, greedy(problem)[0]) - max_load(problem)


def traffic_bytes(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int = 4096) -> tuple[int, int]:
    """Returns (per layer, outside the layers) bytes that the step's memory-bound ops write, from its trace: the
    outputs of every op but matmuls, attention and empty allocations (norms, activations, residual adds, RoPE,
    casts, the loss's softmax...), which run at HBM speed, not at tensor-core speed. Tiles split the same work
    into rows: the untiled step's trace serves."""
    whole = dataclasses.replace(traced, tile=None)
    measured = _measured(c, tokens, whole, loss_chunk_tokens)[0]
    return measured.written_in_layers // min(c.n_layers, TRACE_LAYERS), measured.written_outside


def traced_transient_peak(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int = 4096) -> int:
    """Returns the peak bytes allocated during a steady-state step (after buffers are sized) beyond the store's
    buffers, on `meta`, kernel scratch (`plan.scratch`: the attention backward's fp32 accumulators) included, traced
    whole at `tokens` (what `transient_peak` extends shorter traces to).

    The step is traced with `TRACE_LAYERS` layers; parameter gradients already exist (accumulated), as in
    training.
    """
    step = _traced_step(c, tokens, traced, loss_chunk_tokens)
    return step.trace.peak - step.held


COMPUTE_BOUND = ("mm", "attention", "empty")  # op names holding these: timed at FLOP/s, or writing nothing


def _written(op) -> bool:
    """Returns whether an op's outputs count as memory-bound bytes written (`traffic_bytes`)."""
    return op != SCRATCH and not any(k in str(op) for k in COMPUTE_BOUND)


@lru_cache(maxsize=8192)  # a few numbers each: every length a search prices
def _measured(
    c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int, allocator: str | None = None
) -> tuple[Measure, int]:
    """Returns the step's `plan.extend.Measure` (replayed through `allocator`'s mode of the caching allocator, if
    given) and the bytes of layer inputs its store holds."""
    with no_cycle_collection():
        p, held = _program(c, tokens, traced, loss_chunk_tokens)
        return measure(p, _written, allocator), held


def _program(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int) -> tuple[Program, int]:
    """Returns the step of `tokens` tokens as a program (`plan.extend`) and the bytes of layer inputs its store
    holds: extended from two shorter traces of the same remainder (`_growth`; the held inputs are token rows: they
    grow by the same bytes per unit), or traced whole when it is at most a unit past them."""
    unit = _unit(traced, loss_chunk_tokens)
    first = _shortest(tokens, traced, loss_chunk_tokens)
    grown = _growth(c, first, traced, loss_chunk_tokens) if tokens > first + unit else None
    if grown is not None and tokens > grown[1] + unit:
        growing, short, held, more = grown
        units = (tokens - short) // unit
        return growing.program(units), held + more * units
    step = _traced_step(c, tokens, traced, loss_chunk_tokens)
    return program(trace_tokens(step.trace)), step.held


@lru_cache(maxsize=512)
def _growth(c: ModelConfig, first: int, traced: Traced, loss_chunk_tokens: int) -> tuple | None:
    """Returns (how the step grows per unit, the length it grows from, the held bytes there, and per unit): from
    the traces at `first` tokens and a unit on (or, if they do not differ as passes of longer loops do, at lengths a
    unit on, up to `TRACE_TOKENS`); every length of the same remainder shares them. None if no two do (the step is
    then traced whole)."""
    unit = _unit(traced, loss_chunk_tokens)
    for short in range(first, TRACE_TOKENS - unit + 1, unit):
        a, b = both(_tokens_of, (c, short, traced, loss_chunk_tokens), (c, short + unit, traced, loss_chunk_tokens))
        grown = growth(a[0], b[0])
        if grown is not None:
            return grown, short, a[1], b[1] - a[1]
    log.warning(
        "no two traces of %s up to %d tokens grow as longer loops do: longer steps are traced whole",
        traced,
        TRACE_TOKENS,
    )
    return None


def _shortest(tokens: int, traced: Traced, loss_chunk_tokens: int) -> int:
    """Returns the shortest length of `tokens`' remainder a step is extended from: `TRACE_TILES` tiles and two loss
    chunks at least. A loop's first pass frees nothing of a pass before it and its second frees the first's, so only
    from the third on are passes alike: the passes a unit adds to a trace that makes fewer are not those that a
    longer step repeats (`plan.extend`)."""
    unit = _unit(traced, loss_chunk_tokens)
    tiles = -(-TRACE_TILES * traced.tile // unit) if traced.tile else 1
    return tokens % unit + max(tiles, -(-2 * loss_chunk_tokens // unit)) * unit


def _unit(traced: Traced, loss_chunk_tokens: int) -> int:
    """Returns the tokens between the lengths a step is extended from: two tiles (two loss chunks untiled: α's split
    then falls at the same row of its tile), and whole loss chunks."""
    return math.lcm(2 * (traced.tile or loss_chunk_tokens), loss_chunk_tokens)


@dataclass(frozen=True)
class StepTrace:
    """One steady-state step traced on `meta` (tile marks in it: `plan.extend` cuts there) and the bytes of the
    layer inputs its store holds for recomputation (the store's, counted there)."""

    trace: Trace
    held: int


@lru_cache(maxsize=16)
def _traced_step(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int) -> StepTrace:
    """Returns one steady-state step traced on `meta` (`_sized_model`)."""
    with no_cycle_collection():  # building the model imports torch._dynamo on a first call: much garbage
        model, ids = _sized_model(c, tokens, traced, loss_chunk_tokens)
        with meta_kernels(traced.kernels):  # a GPU step allocates what the CUDA attention kernels allocate
            step = trace_iteration(model, ids, scratch=traced.kernels == "cuda", tiles=True)
    return StepTrace(step, model.store.layout.kept_input_bytes)


def _tokens_of(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int) -> tuple[list[tuple], int]:
    """Returns `_traced_step`'s trace as tokens (`plan.extend.tokens`) and its held bytes: what `plan.worker`'s child
    sends back."""
    step = _traced_step(c, tokens, traced, loss_chunk_tokens)
    return trace_tokens(step.trace), step.held


def _sized_model(c: ModelConfig, tokens: int, traced: Traced, loss_chunk_tokens: int):
    """Returns (`_model`, its input of `tokens` tokens) with the store sized for them, as after a first step at
    that length (what a first forward and backward would do, without their cost)."""
    model = _model(c, traced, loss_chunk_tokens)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with meta_kernels(traced.kernels):
        model.store.begin_step(model.layers, 1, tokens, traced.dtype, ids.device)
    return model, ids


@lru_cache(maxsize=8)
def _model(c: ModelConfig, traced: Traced, loss_chunk_tokens: int) -> Transformer:
    """Returns the model of `TRACE_LAYERS` layers on `meta` a step is traced with, every parameter gradient made
    (the store, sized again for each length, keeps nothing of a step after the next begins)."""
    layers = min(c.n_layers, TRACE_LAYERS)
    with torch.device("meta"):
        model = Transformer(c.with_layers(layers), traced.policy(layers), loss_chunk_tokens)
        model = model.to(traced.dtype)
    if traced.lora is not None:
        apply_lora(model, traced.lora)
    if traced.sp > 1:
        for layer in model.layers:
            layer.seq_parallel = Ulysses.traced(traced.sp, c.n_heads, c.n_kv_heads)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return model


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
    layout = store_bytes(
        c, tokens, modes, alphas, policy.tile_for(tokens), policy.offload_last_layers, dtype, policy.empty_buffers
    )
    return {"states": states, "activations": layout.device_bytes, "host_pool": layout.host_total}


PLAN_MAX_TOKENS = 4 << 20  # tokens per GPU `memo plan` plans (its instances hold every tensor of every tile)


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
