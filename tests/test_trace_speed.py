"""The cost model's fast traces equal the direct ones: the op memo (`plan.meta_ops`) and a model sized without a
first step trace what a model that ran a step traces with every meta kernel run; a step extended from two shorter
traces (`plan.extend`) is the direct trace at its length, event by event, and so are its LOAD, allocator overheads,
arena and memory-bound bytes; the caching allocator's simulator replays as a plain list of blocks does."""

import dataclasses
import os
import random

import numpy as np
import pytest
import torch

from memo.config import ModelConfig
from memo.cost import memory
from memo.cost.memory import Traced
from memo.device import meta_kernels
from memo.job import named_model
from memo.lora import LoraConfig, apply_lora
from memo.model import Transformer
from memo.parallel.ulysses import Ulysses
from memo.plan import bilevel, extend, meta_ops, worker
from memo.plan.caching_sim import CachingAllocator, replay, round_size, segment_size
from memo.plan.extend import events, growth, measure, program
from memo.plan.extend import tokens as trace_tokens
from memo.plan.greedy import ORDERS, greedy, order_by, place_greedy
from memo.plan.problem import Problem, max_load, peak
from memo.plan.trace import TILE, TILES_DONE, trace_iteration, windows
from memo.policy import ActivationPolicy

TINY, GPT = ModelConfig.preset("tiny"), ModelConfig.preset("tiny-gpt")
CHUNK = 64  # loss chunk of the small steps: a few chunks per tile
STEPS = {  # the steps the cost model traces, on small models: strategies, tiles, α's split, Ulysses, LoRA, dtypes
    "memo-checkpoint-tiled": (TINY, Traced(checkpoint=True, tile=128, heads=1)),
    "memo-untiled": (TINY, Traced(tile=None, heads=2)),
    "none": (GPT, Traced("none")),
    "full-tiled": (TINY, Traced("full", tile=256, heads=1)),
    "memo-ulysses": (TINY, Traced(checkpoint=True, tile=128, sp=2, heads=1)),
    "memo-lora": (TINY, Traced(checkpoint=True, tile=128, heads=1, lora=LoraConfig(rank=4))),
    "memo-fp32-efficient": (GPT, Traced(tile=128, heads=4, dtype=torch.float32)),
    "memo-cpu-kernels": (TINY, Traced(checkpoint=True, tile=128, heads=4, kernels="cpu")),
    # cuDNN's dense copies of each head chunk; tiles so short that a unit is one loss chunk (ALST's tiles of the
    # hidden size: 64 rows of `tiny` in 4096-token chunks)
    "memo-cudnn-short-tiles": (TINY, Traced(checkpoint=True, tile=16, heads=1, attention="cudnn")),
}


def _events(trace) -> list[tuple]:
    """Returns a trace's events without the tile marks (which only the traces extended from carry)."""
    return [(e.kind, e.tensor, e.nbytes, str(e.op)) for e in trace.events if e.op not in (TILE, TILES_DONE)]


def _outputs(trace) -> list:
    return [e.output for e in trace.events if e.op not in (TILE, TILES_DONE)]


def _after_a_step(c: ModelConfig, tokens: int, traced: Traced, monkeypatch) -> tuple:
    """Returns (the trace, the held inputs) as the cost model made them before: a model that ran a first forward
    and backward, every meta kernel run (no memo). Both pause the cyclic collector (`trace.no_cycle_collection`):
    what it frees, it frees at no fixed point of a step."""
    monkeypatch.setattr(meta_ops, "call", lambda func, args, kwargs: (func(*args, **kwargs), False))
    layers = min(c.n_layers, memory.TRACE_LAYERS)
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(c, n_layers=layers), traced.policy(layers), CHUNK).to(traced.dtype)
    if traced.lora is not None:
        apply_lora(model, traced.lora)
    if traced.sp > 1:
        for layer in model.layers:
            layer.seq_parallel = Ulysses.traced(traced.sp, c.n_heads, c.n_kv_heads)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with meta_kernels(traced.kernels):
        model(ids, labels=ids).backward()
        step = trace_iteration(model, ids, scratch=traced.kernels == "cuda")
    monkeypatch.undo()
    return step, model.store.layout.kept_input_bytes


@pytest.mark.parametrize("name", list(STEPS))
def test_memo_and_a_sized_model_trace_what_a_fresh_model_after_its_first_step_traces(name, monkeypatch):
    c, traced = STEPS[name]
    memory._traced_step.__wrapped__(c, 300, traced, CHUNK)  # the model is kept: traced at another length first
    fast = memory._traced_step.__wrapped__(c, 400, traced, CHUNK)
    direct, held = _after_a_step(c, 400, traced, monkeypatch)
    assert fast.held == held and fast.trace.calls == direct.calls
    assert _events(fast.trace) == _events(direct) and _outputs(fast.trace) == _outputs(direct)


def _direct(c: ModelConfig, tokens: int, traced: Traced) -> dict:
    """Returns what the cost model reads of the step traced whole at `tokens`, computed from its events."""
    step = memory._traced_step(c, tokens, traced, CHUNK)
    allocs = [(e.kind, e.tensor, e.nbytes) for e in step.trace.events if e.kind != "mark"]
    written = [e.nbytes if e.kind == "alloc" and memory._written(e.op) else 0 for e in step.trace.events]
    in_layers = sum(sum(written[lo:hi]) for lo, hi in windows(step.trace).values())
    cached, expandable = replay(allocs), replay(allocs, expandable_segments=True)
    return {
        "events": _events(step.trace),
        "load": step.trace.peak - step.held,
        "caching": cached.peak_reserved - cached.peak_allocated,
        "expandable": expandable.peak_reserved - expandable.peak_allocated,
        "traffic": (in_layers // min(c.n_layers, memory.TRACE_LAYERS), sum(written) - in_layers),
    }


def _fast(c: ModelConfig, tokens: int, traced: Traced) -> dict:
    return {
        "events": _events(events(memory._program(c, tokens, traced, CHUNK)[0])),
        "load": memory.transient_peak(c, tokens, traced, CHUNK),
        "caching": memory.fragmentation_bytes(c, tokens, traced, CHUNK, "caching"),
        "expandable": memory.fragmentation_bytes(c, tokens, traced, CHUNK, "expandable"),
        "traffic": memory.traffic_bytes(c, tokens, traced, CHUNK),  # of the untiled step
    }


def _long(traced: Traced) -> int:
    """Returns a length many units past the shorter traces a step is extended from, with a partial tile or chunk."""
    return 6 * memory._unit(traced, CHUNK) + 100


def _traced_lengths(monkeypatch, module, name: str, length) -> list[int]:
    """Returns the list where the lengths that `module.name`, a tracing function, traces at (`length(args)`) go."""
    lengths, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        lengths.append(length(args))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return lengths


@pytest.mark.parametrize("name", list(STEPS))
def test_a_step_extended_from_two_shorter_traces_is_the_direct_trace(name, monkeypatch):
    c, traced = STEPS[name]
    tokens = _long(traced)
    lengths = _traced_lengths(monkeypatch, memory, "_traced_step", lambda args: args[1])
    fast = _fast(c, tokens, traced)
    assert tokens not in lengths  # extended, not traced whole
    monkeypatch.undo()
    direct = _direct(c, tokens, traced)
    direct["traffic"] = _direct(c, tokens, dataclasses.replace(traced, tile=None))["traffic"]
    assert fast == direct


def test_the_arena_of_an_extended_step_is_the_direct_traces():
    c, traced = STEPS["memo-checkpoint-tiled"]
    tokens = _long(traced)
    problem = memory._traced_step(c, tokens, traced, CHUNK).trace.to_problem()
    direct = peak(problem, greedy(problem)[0]) - max_load(problem)
    assert memory.fragmentation_bytes(c, tokens, traced, CHUNK, "arena") == direct


def test_measure_skips_repeated_passes_and_reads_what_the_written_out_trace_gives(monkeypatch):
    c, traced = STEPS["memo-checkpoint-tiled"]
    a, b = (memory._traced_step(c, n, traced, CHUNK).trace for n in (708, 964))
    grown = growth(extend.tokens(a), extend.tokens(b))
    passes = _traced_lengths(monkeypatch, extend._Replay, "_pass", lambda args: len(args[1]))
    for units in (3, 40):  # 40 units: runs long enough to be skipped
        p = grown.program(units)
        whole = events(p)
        allocs = [(e.kind, e.tensor, e.nbytes) for e in whole.events if e.kind != "mark"]
        for allocator in ("caching", "expandable"):
            r = replay(allocs, expandable_segments=allocator == "expandable")
            assert measure(p, memory._written, allocator).overhead == r.peak_reserved - r.peak_allocated
        measured = measure(p, memory._written)
        written = [e.nbytes if e.kind == "alloc" and memory._written(e.op) else 0 for e in whole.events]
        in_layers = sum(sum(written[lo:hi]) for lo, hi in windows(whole).values())
        assert (measured.load, measured.written_in_layers, measured.written_outside) == (
            whole.peak,
            in_layers,
            sum(written) - in_layers,
        )
    assert len(passes) < 3 * sum(times for _, times in grown.program(40))  # three measures, most passes skipped
    assert measure(program(extend.tokens(a)), memory._written).load == a.peak


def test_measure_skips_cycles_of_passes_that_leave_the_allocator_as_a_pass_before_did(monkeypatch):
    # each pass allocates, then frees the last pass's block: the caching allocator serves the two blocks in turn,
    # so the state repeats every second pass, never after one
    big = 4 << 20
    p = [((("alloc", "x", big), ("alloc", "y", 512)), 1), ((("alloc", "x", big), ("free", "", 3)), 1000)]
    p.append(((("free", "", 2), ("free", "", 2002)), 1))  # the last block, then y
    allocs = [(e.kind, e.tensor, e.nbytes) for e in events(p).events]
    passes = _traced_lengths(monkeypatch, extend._Replay, "_pass", lambda args: len(args[1]))
    for allocator in ("caching", "expandable"):
        r = replay(allocs, expandable_segments=allocator == "expandable")
        measured = measure(p, memory._written, allocator)
        assert (measured.load, measured.overhead) == (2 * big + 512, r.peak_reserved - r.peak_allocated)
    assert len(passes) < 2 * 20  # of 2 x 1002


def test_traces_that_do_not_differ_as_longer_loops_do_are_not_extended():
    c, traced = STEPS["memo-checkpoint-tiled"]
    a = memory._traced_step(c, 708, traced, CHUNK).trace
    other = memory._traced_step(c, 708, dataclasses.replace(traced, checkpoint=False), CHUNK).trace
    assert growth(extend.tokens(a), extend.tokens(other)) is None
    assert growth(extend.tokens(a), extend.tokens(a)) is not None


@pytest.mark.parametrize("strategy", ["memo", "full"])
def test_memo_plans_step_extended_is_the_direct_trace(strategy, monkeypatch):
    policy = ActivationPolicy(strategy, alpha=0.5 if strategy == "memo" else None, tile_tokens=2048)
    tokens = 6 * 4096 + 1000  # units of two tiles, the loss chunk: 4096 tokens
    lengths = _traced_lengths(monkeypatch, bilevel, "trace_iteration", lambda args: args[1].shape[-1])
    step, store = bilevel.step_trace(TINY, policy, tokens)
    assert tokens not in lengths  # extended, not traced whole
    monkeypatch.undo()
    with meta_kernels("cuda"):
        model, ids = bilevel.meta_model(TINY, policy, tokens)
        direct = trace_iteration(model, ids, bilevel.meta_optimizer(model), scratch=True)
    assert _events(step) == _events(direct) and store == model.swap_stats().device_skeletal_bytes


def test_the_second_of_both_is_computed_in_the_child_or_here_as_the_first():
    first, second = worker.both(os.getpid, (), ())
    assert first == os.getpid() and (second != first) == (worker._get() is not None)
    assert worker.both(divmod, (7, 2), (9, 4)) == ((3, 1), (2, 1))
    with pytest.raises(ZeroDivisionError):  # raised there: met here again
        worker.both(divmod, (7, 2), (1, 0))
    assert worker.both(divmod, (7, 2), (9, 4)) == ((3, 1), (2, 1))


def _scan_placement(p, order: np.ndarray, best_fit: bool) -> np.ndarray:
    """Returns the greedy placement by scanning every placed buffer for each (what `plan.greedy` did first)."""
    offsets, placed = np.full(len(p), -1, dtype=np.int64), np.zeros(len(p), dtype=bool)
    for i in order:
        live = np.flatnonzero(placed & (p.lower < p.upper[i]) & (p.lower[i] < p.upper))
        by_address = live[np.argsort(offsets[live], kind="stable")]
        reach, gaps = 0, []
        for j in by_address:
            gaps.append((offsets[j] - reach, reach))
            reach = max(reach, offsets[j] + p.size[j])
        fits = [g for g in gaps if g[0] >= p.size[i]]
        offsets[i] = (min(fits, key=lambda g: g[0]) if best_fit else fits[0])[1] if fits else reach
        placed[i] = True
    return offsets


def test_greedy_placement_finds_the_buffers_a_scan_of_every_placed_one_finds():
    rng = np.random.default_rng(0)
    for trial in range(60):
        n = int(rng.integers(1, 150))
        lower = rng.integers(0, 100, n)
        p = Problem(tuple(range(n)), lower, lower + rng.integers(1, 60, n), rng.choice([8, 16, 24, 40], n))
        for key in ORDERS:
            for best_fit in (True, False):
                order = order_by(p, key)
                assert (place_greedy(p, order, best_fit) == _scan_placement(p, order, best_fit)).all()


class _ListAllocator:
    """The caching allocator's rules over plain lists of blocks (what `plan.caching_sim` implemented first)."""

    def __init__(self, expandable: bool):
        self.expandable, self.segments, self.pool, self.reserved, self.allocated = expandable, {}, {}, 0, 0
        self.next_address = 0

    def malloc(self, nbytes: int) -> list:
        size = round_size(nbytes)
        small = size <= 1 << 20
        free = sorted(
            (b[1], b[0], s) for s, blocks in self.segments.items() if self.pool[s] == small for b in blocks if b[2]
        )
        fit = next((f for f in free if f[0] >= size), None)
        if fit is None:
            self._grow(size, small)
            return self.malloc(nbytes)
        blocks = self.segments[fit[2]]
        i = next(i for i, b in enumerate(blocks) if b[0] == fit[1])
        rest = blocks[i][1] - size
        if (rest >= 512) if (small or self.expandable) else (rest > 1 << 20):
            blocks.insert(i + 1, [blocks[i][0] + size, rest, True])
            blocks[i][1] = size
        blocks[i][2] = False
        self.allocated += blocks[i][1]
        return [fit[2], blocks[i][0]]

    def _grow(self, size: int, small: bool) -> None:
        if not self.expandable:
            seg = len(self.pool)
            self.pool[seg], self.segments[seg] = small, [[self.next_address, segment_size(size), True]]
            self.next_address += segment_size(size)
            self.reserved += segment_size(size)
            return
        seg = next((s for s, is_small in self.pool.items() if is_small == small), None)
        if seg is None:
            seg = len(self.pool)
            self.pool[seg], self.segments[seg] = small, []
        blocks = self.segments[seg]
        tail = blocks[-1][1] if blocks and blocks[-1][2] else 0
        page = (2 << 20) if small else (20 << 20)
        grow = -(-(size - tail) // page) * page
        self.reserved += grow
        if tail:
            blocks[-1][1] += grow
        else:
            blocks.append([blocks[-1][0] + blocks[-1][1] if blocks else seg << 48, grow, True])

    def release(self, at: list) -> None:
        blocks = self.segments[at[0]]
        i = next(i for i, b in enumerate(blocks) if b[0] == at[1])
        blocks[i][2] = True
        self.allocated -= blocks[i][1]
        if i + 1 < len(blocks) and blocks[i + 1][2]:
            blocks[i][1] += blocks.pop(i + 1)[1]
        if i > 0 and blocks[i - 1][2]:
            blocks[i - 1][1] += blocks.pop(i)[1]


@pytest.mark.parametrize("expandable", [False, True])
def test_the_simulator_replays_as_a_plain_list_of_blocks(expandable):
    rng = random.Random(0)
    sizes = [600, 5000, 1 << 20, (1 << 20) + 1, 3 << 20, 12 << 20]
    for _ in range(40):
        reference, sim, live = _ListAllocator(expandable), CachingAllocator(None, expandable), {}
        for tensor in range(300):
            if live and rng.random() < 0.45:
                at, block = live.pop(rng.choice(sorted(live)))
                reference.release(at)
                sim.release(block)
            else:
                nbytes = rng.choice([*sizes, rng.randint(1, 40 << 20)])
                at, block = reference.malloc(nbytes), sim.malloc(nbytes)
                assert [block.segment, block.address] == at
                live[tensor] = (at, block)
            assert (sim.allocated, sim.reserved) == (reference.allocated, reference.reserved)


@pytest.mark.slow
@pytest.mark.parametrize("tile, kernel", [(16384, "cudnn"), (4096, "flash"), (None, "cudnn")])  # memo's, ALST's
def test_a_production_step_extended_is_the_direct_trace(tile, kernel):
    c, tokens = named_model("llama3.1-8b"), 3700 * 1024 // 8  # memo estimate --seq 3700K --gpus 8: ulysses=8
    traced = Traced.of(c, tokens, "memo", True, tile, 8, attention=kernel)
    p = memory._program(c, tokens, traced, 4096)[0]
    step = memory._traced_step(c, tokens, traced, 4096)
    assert _events(events(p)) == _events(step.trace)
    assert memory.transient_peak(c, tokens, traced) == memory.traced_transient_peak(c, tokens, traced)


def test_a_loops_second_pass_is_not_read_as_the_passes_a_longer_step_repeats():
    # one loss chunk, then two: the second chunk frees the first's tensors, a pass shorter than it, so its distances
    # back are not those of the third and later chunks; the cost model extends from two chunks and three
    c, traced = STEPS["memo-cudnn-short-tiles"]
    unit, rest = memory._unit(traced, CHUNK), _long(traced) % CHUNK
    assert unit == CHUNK and memory._shortest(_long(traced), traced, CHUNK) == rest + 2 * unit
    one, two, three = (trace_tokens(memory._traced_step(c, rest + k * unit, traced, CHUNK).trace) for k in (1, 2, 3))
    assert growth(one, two) is None
    assert growth(two, three) is not None
