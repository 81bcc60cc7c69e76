"""Static memory plans of one training step (docs/method.md §5), traced on the `meta` device from the real
model (so a 7B model at 512K tokens plans in seconds without memory): forward, backward and the optimizer
step, with the scratch CUDA kernels take inside an op (`plan.scratch`).

- flat: one DSA over every tensor of the step, what the planned allocator (`plan.allocator`) serves;
- bi-level, the paper's: level 1 packs one layer's forward and, separately, its backward; level 2 packs the
  whole step with every layer's forward (backward) as one block of the level-1 peak, beside the embedding,
  layer outputs, gradients, loss chunks and optimizer temporaries. Composing the levels costs the gap
  between a block's full height and what its phase really holds where it meets its neighbours.

The caching-allocator simulator replays the same step for comparison.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..device import meta_kernels
from ..model import Transformer
from ..policy import ActivationPolicy
from . import extend
from .budget import PLAN_WORK, SAFETY_SECONDS
from .caching_sim import SimResult, replay
from .dsa import Solution, solve
from .extend import events, growth
from .problem import Problem
from .trace import Trace, trace_iteration, windows


@dataclass
class Plan:
    forward: Solution  # level 1: the largest layer forward (each phase gets its own block)
    backward: Solution  # level 1: the largest layer backward
    iteration: Solution  # level 2: the step, layers as blocks
    problem: Problem  # the level-2 instance
    flat: Solution  # one DSA over every tensor of the step
    load: int  # LOAD of the step on the device: every tensor on its own, kernel scratch included
    dispatch_load: int  # LOAD of the tensors ops return (what a dispatch-level trace sees)
    caching: SimResult  # PyTorch's caching allocator replaying the raw iteration trace
    store_bytes: int  # rounding buffers / scratch allocated once, outside the step
    trace: Trace
    trace_seconds: float
    work: int  # search work all the solves spent
    clock_cut: bool  # the safety time limit ended one of them before its work: not reproducible


def meta_model(config: ModelConfig, policy: ActivationPolicy, tokens: int, batch: int = 1, dtype=torch.bfloat16):
    """Returns a model on `meta` as after one step (buffers sized, grads created) and its input: what a first
    forward and backward would leave, without their cost."""
    with torch.device("meta"):
        model = Transformer(config, dataclasses.replace(policy, host_budget_bytes=1 << 62)).to(dtype)
    ids = torch.zeros(batch, tokens, dtype=torch.long, device="meta")
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    model.store.begin_step(model.layers, batch, tokens, dtype, ids.device)
    return model, ids


def step_trace(config: ModelConfig, policy: ActivationPolicy, tokens: int, batch: int = 1) -> tuple[Trace, int]:
    """Returns the trace of one training step on `meta` with CUDA kernels (the optimizer's update in it) and the
    bytes of the store's device buffers. A step of many tiles is extended from two of four tiles and more, a unit
    apart (`plan.extend`, as the cost model's), their attention calls those of the true length, where every
    layer's α moves its split by whole tiles per unit (0, ½, 1): the trace it gives is the direct one, event by
    event (tests compare them)."""
    with meta_kernels("cuda"):  # plan what a GPU step allocates, CUDA attention kernels included
        model, ids = meta_model(config, policy, tokens, batch)
        tile, heads = model.store.tiling(model.layers[0], tokens, ids.device)
        unit = math.lcm(2 * tile, model.loss_chunk_tokens)
        short = tokens % unit + 2 * unit
        if tokens > short + unit and all(swap.alpha * unit % tile == 0 for swap in model.store.swaps):
            fixed = dataclasses.replace(policy, attention_heads=heads)
            grown = growth(*(_tokens_at(config, fixed, n, batch) for n in (short, short + unit)))
            step = None if grown is None else events(grown.program((tokens - short) // unit))
            if step is not None:
                return step, model.swap_stats().device_skeletal_bytes
        step = trace_iteration(model, ids, meta_optimizer(model), scratch=True)
    return step, model.swap_stats().device_skeletal_bytes


def _tokens_at(config: ModelConfig, policy: ActivationPolicy, tokens: int, batch: int) -> list[tuple]:
    """Returns the step at `tokens` tokens as `plan.extend` tokens, traced with its tile marks."""
    model, ids = meta_model(config, policy, tokens, batch)
    return extend.tokens(trace_iteration(model, ids, meta_optimizer(model), scratch=True, tiles=True))


def meta_optimizer(model: Transformer) -> torch.optim.Optimizer:
    """Returns AdamW over the model's parameters with its state made (as after a first step). Gradients stay in
    persistent buffers, as Megatron-LM's and DDP's do (sharded over the GPUs in a real run, so a one-GPU trace of
    them would say nothing about the plan), and the update runs one parameter at a time: the step's plan is
    about activations and the temporaries of forward, backward and update."""
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    optimizer.step()
    return optimizer


def level_problems(t: Trace) -> tuple[dict[tuple[str, int], Problem], list[tuple], dict]:
    """Returns (each layer phase's transient problem, the tensors outside every phase, the phase windows)."""
    rows = _lifetimes(t)
    spans = windows(t)
    inside = {key: [r for r in rows if lo <= r[1] and r[2] <= hi] for key, (lo, hi) in spans.items()}
    internal = {r[0] for rs in inside.values() for r in rs}
    outer = [r for r in rows if r[0] not in internal]
    phases = {
        key: Problem.from_rows(rs or [("none", lo, lo + 1, 1)])
        for (key, rs), (lo, _) in zip(inside.items(), spans.values())
    }
    return phases, outer, spans


def _solve_phases(phases: dict[tuple[str, int], Problem], limits: dict) -> dict[tuple[str, int], Solution]:
    """Returns a level-1 solution per layer phase; phases with the same allocation sequence share one."""
    solved, by_shape = {}, {}
    for key, p in phases.items():
        shape = (tuple(p.size), tuple(p.lower - p.lower.min()), tuple(p.upper - p.lower.min()))
        if shape not in by_shape:
            by_shape[shape] = solve(p, **limits)
        solved[key] = by_shape[shape]
    return solved


def _share(time_limit: float | None, work_limit: int, parts: int) -> dict:
    """Returns one of `parts` equal shares of the limits, as `solve`'s keyword arguments."""
    return {"time_limit": None if time_limit is None else time_limit / parts, "work_limit": max(work_limit // parts, 1)}


def _lifetimes(t: Trace) -> list[tuple]:
    p = t.to_problem()
    return list(zip(p.ids, p.lower.tolist(), p.upper.tolist(), p.size.tolist()))


def plan(
    config: ModelConfig,
    policy: ActivationPolicy,
    tokens: int,
    batch: int = 1,
    time_limit: float | None = SAFETY_SECONDS,
    work_limit: int = PLAN_WORK,
) -> Plan:
    """Returns the flat and the bi-level plan of one training step of `config` at `tokens` tokens per GPU.

    The solves share `work_limit` units of search work and, as a safety net, `time_limit` seconds (`dsa.solve`).
    """
    start = time.perf_counter()
    step, store_bytes = step_trace(config, policy, tokens, batch)
    traced = time.perf_counter() - start
    phases, outer, spans = level_problems(step)
    level1 = _solve_phases(phases, _share(time_limit, work_limit, 8))
    # a block spans the events strictly after its start mark: the next layer's backward starts on the mark
    # that ends this one's (both hooks fire on the same gradient), so the two must not overlap
    blocks = [
        (f"{phase}{layer}", lo + 1, hi, level1[(phase, layer)].peak) for (phase, layer), (lo, hi) in spans.items()
    ]
    level2 = Problem.from_rows([(f"t{r[0]}", *r[1:]) for r in outer] + blocks)
    allocs = [(e.kind, e.tensor, e.nbytes) for e in step.events if e.kind != "mark"]
    fwd = max((level1[k] for k in level1 if k[0] == "fwd"), key=lambda s: s.peak)
    bwd = max((level1[k] for k in level1 if k[0] == "bwd"), key=lambda s: s.peak)
    iteration = solve(level2, **_share(time_limit, work_limit, 4))
    flat = solve(step.to_problem(), **_share(time_limit, work_limit, 4))
    solved = list({id(s): s for s in level1.values()}.values()) + [iteration, flat]  # phases may share a solve
    return Plan(
        fwd,
        bwd,
        iteration,
        level2,
        flat,
        step.peak,
        step.dispatch_peak,
        replay(allocs),
        store_bytes,
        step,
        traced,
        sum(s.work for s in solved),
        any(s.clock_cut for s in solved),
    )
