"""Allocation traces: every tensor storage created while a function runs, with its size and lifetime.

`trace(fn)` runs `fn` under a dispatch mode that records an `alloc` event when an op returns a tensor
with a new storage and a `free` event when the last tensor on that storage is released. On the `meta`
device this needs no memory at all, so a 7B layer at 1M tokens traces in seconds (docs/method.md §5).
"""

from __future__ import annotations

import contextlib
import gc
import pickle
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import meta_ops
from .problem import Problem
from .scratch import kernel_scratch

SCRATCH = "kernel scratch"  # the op of the events a Tracer adds for an op's internal scratch


class Output(NamedTuple):
    """Where a new storage came from and what it held: enough to allocate it again by hand (the phase planner)."""

    call: int  # index of the op call in `Trace.calls`
    position: int  # index among the call's flattened outputs
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str  # device type


@dataclass(slots=True)
class Event:
    kind: str  # "alloc", "free" or "mark"
    tensor: int  # trace-local tensor id (-1 for marks)
    nbytes: int
    op: object  # the op that allocated, or a mark's label
    output: Output | None = None  # for allocations seen by the Tracer


@dataclass
class Trace:
    """Alloc/free events in program order; storages still alive at the end have no free event."""

    events: list[Event] = field(default_factory=list)
    calls: list = field(default_factory=list)  # every op called, in order (the Tracer's)

    @property
    def peak(self) -> int:
        """Returns the most bytes live at once (LOAD of the trace)."""
        live = best = 0
        for e in self.events:
            live += e.nbytes if e.kind == "alloc" else -e.nbytes if e.kind == "free" else 0
            best = max(best, live)
        return best

    @property
    def dispatch_peak(self) -> int:
        """Returns the LOAD of the tensors ops return, without kernel-internal scratch."""
        live = best = 0
        for e in self.events:
            sign = 0 if e.op == SCRATCH else 1 if e.kind == "alloc" else -1 if e.kind == "free" else 0
            live += sign * e.nbytes
            best = max(best, live)
        return best

    @property
    def live_at_end(self) -> int:
        return sum(e.nbytes if e.kind == "alloc" else -e.nbytes if e.kind == "free" else 0 for e in self.events)

    def to_problem(self) -> Problem:
        """Returns the DSA instance: each tensor lives [its alloc event, its free event) in event order."""
        start, rows = {}, []
        for i, e in enumerate(self.events):
            if e.kind == "alloc":
                start[e.tensor] = (i, e.nbytes)
            elif e.kind == "free":
                lo, nbytes = start.pop(e.tensor)
                rows.append((e.tensor, lo, i, nbytes))
        end = len(self.events)
        rows += [(t, lo, end, nbytes) for t, (lo, nbytes) in start.items()]
        return Problem.from_rows(sorted(rows, key=lambda r: r[1]))


class Tracer(TorchDispatchMode):
    """Records allocations while active; `mark(label)` inserts a labelled event (e.g. a layer boundary). With
    `scratch`, the kernel-internal scratch of registered ops (`plan.scratch`) is a tensor living for the call,
    beside its outputs (the CUDA kernels allocate those first). The trace ends where the mode does: what dies
    later (the results, a reference cycle's tensors) is not freed in it."""

    def __init__(self, scratch: bool = False) -> None:
        super().__init__()
        self.trace = Trace()
        self.scratch = scratch
        self._ids: dict[int, tuple[int, int]] = {}  # storage key -> (tensor id, nbytes)
        self._refs: dict[int, int] = {}  # storage key -> tensors on it still alive
        self._watched: dict[int, weakref.ref] = {}  # a weak reference per tracked tensor, alive until it dies
        self._names: dict = {}  # op -> its name
        self._before: dict = {}  # storage key -> storage, of an input that is not ours (held: the key stays its own)
        self._next_id = 0
        self._ended = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # nothing compiles under a trace: no Dynamo guard around every op

    def __exit__(self, *exc):
        self._ended = True
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        scratch = kernel_scratch(func, args) if self.scratch else 0
        if scratch:
            tid, self._next_id = self._next_id, self._next_id + 1
            self.trace.events.append(Event("alloc", tid, scratch, SCRATCH))
        kwargs = kwargs or {}
        out, fresh = meta_ops.call(func, args, kwargs)
        call = len(self.trace.calls)
        self.trace.calls.append(func)
        inputs = set() if fresh else None  # storages of the call's tensors, once an output's is not ours yet
        for position, t in enumerate(_leaves(out)):
            if not isinstance(t, torch.Tensor):
                continue
            key = _key(t)
            if key not in self._ids:
                if key in self._before:
                    continue
                inputs = set(meta_ops.storages((args, kwargs))) if inputs is None else inputs
                if key in inputs:  # a view of a tensor made before tracing (parameter, input): not ours
                    self._before[key] = t.untyped_storage()
                    continue
                if not self._new(t, key, func, call, position):
                    continue  # empty: no memory
            self._refs[key] = self._refs.get(key, 0) + 1
            ref = weakref.ref(t, lambda ref, key=key: self._release(ref, key))
            self._watched[id(ref)] = ref
        if scratch:  # the kernels allocate their outputs first: the scratch lives beside them until the call ends
            self.trace.events.append(Event("free", tid, scratch, SCRATCH))
        return out

    def _new(self, t: torch.Tensor, key: int, func, call: int, position: int) -> bool:
        """Records the allocation of `t`'s storage; False for an empty one (no memory)."""
        nbytes = t.untyped_storage().nbytes()
        if nbytes == 0:
            return False
        self._ids[key] = (self._next_id, nbytes)
        output = Output(call, position, tuple(t.shape), t.stride(), t.dtype, t.device.type)
        name = self._names.get(func) or self._names.setdefault(func, str(func))
        self.trace.events.append(Event("alloc", self._next_id, nbytes, name, output))
        self._next_id += 1
        return True

    def mark(self, label) -> None:
        self.trace.events.append(Event("mark", -1, 0, label))

    def _release(self, ref, key: int) -> None:
        if self._ended:
            return
        del self._watched[id(ref)]
        self._refs[key] -= 1
        if self._refs[key] == 0 and key in self._ids:
            tid, nbytes = self._ids.pop(key)
            del self._refs[key]
            self.trace.events.append(Event("free", tid, nbytes, ""))


def _leaves(out) -> tuple | list:
    """Returns `tree_flatten(out)[0]`, without its cost for a tensor or a flat tuple (what ops return)."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if type(out) is tuple and not any(type(x) in (tuple, list, dict) for x in out):
        return out
    return tree_flatten(out)[0]


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def trace(fn, *args, **kwargs) -> tuple[Trace, object]:
    """Returns (the allocation trace of `fn(*args, **kwargs)`, its result)."""
    tracer = Tracer()
    with tracer:
        result = fn(*args, **kwargs)
    return tracer.trace, result


def trace_iteration(
    model: torch.nn.Module,
    ids: torch.Tensor,
    optimizer: torch.optim.Optimizer | None = None,
    scratch: bool = False,
    tiles: bool = False,
) -> Trace:
    """Returns the allocation trace of one training step (and `optimizer`'s update, if given), with marks where
    each layer's forward and backward start and end (module hooks for the forward, gradient hooks on its
    output and input for the backward); `scratch` adds kernel-internal scratch (`plan.scratch`); `tiles` marks
    each pass of the layers' token loops (`TILE`) and their ends (`TILES_DONE`), where `plan.extend` cuts it."""
    tracer = Tracer(scratch)

    def pre(module, args):
        tracer.mark(("fwd", module.index, "start"))

    def post(module, args, output):
        tracer.mark(("fwd", module.index, "end"))
        if output.requires_grad:
            output.register_hook(lambda g, i=module.index: tracer.mark(("bwd", i, "start")))
        if args[0].requires_grad:
            args[0].register_hook(lambda g, i=module.index: tracer.mark(("bwd", i, "end")))

    handles = [
        h for layer in model.layers for h in (layer.register_forward_pre_hook(pre), layer.register_forward_hook(post))
    ]
    store = model.store
    if tiles:
        model.store = _MarkingStore(store, tracer)
    try:
        with no_cycle_collection(), tracer:
            model(ids, labels=ids).backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
    finally:
        model.store = store
        for h in handles:
            h.remove()
    return tracer.trace


@contextlib.contextmanager
def no_cycle_collection():
    """Pauses Python's cyclic garbage collector: a trace records frees where the last reference goes, and what a
    collection frees (a reference cycle's tensors) it would free at no fixed point of the step, after a count of
    allocations that the process's history sets; each collection of the oldest generation would also walk every
    object of the process (torch's, sympy's). A trace with it paused leaves such tensors alive to its end."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


TILE = "tile"  # the mark where a layer's token loop starts a tile (`trace_iteration`'s `tiles`)
TILES_DONE = "tiles done"  # and where it has run its last one


class _MarkingStore:
    """A model's store (layer.Store) whose tiles mark each pass of the layer's token loops in the trace."""

    def __init__(self, store, tracer: Tracer) -> None:
        self.store, self.tracer = store, tracer

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def slots(self, index: int, x: torch.Tensor):
        t, tiles = self.store.slots(index, x)
        return t, _MarkingTiles(tiles, self.tracer)

    def before_backward(self, index: int, step: int):
        t, aux, tiles, recompute = self.store.before_backward(index, step)
        return t, aux, _MarkingTiles(tiles, self.tracer), recompute


class _MarkingTiles:
    """A layer's tiles (layer.Tiles) whose `ranges` marks the start of each tile and the end of the loop."""

    def __init__(self, tiles, tracer: Tracer) -> None:
        self.tiles, self.tracer = tiles, tracer

    def __getattr__(self, name: str):
        return getattr(self.tiles, name)

    def ranges(self, start: int = 0):
        for rows in self.tiles.ranges(start):
            self.tracer.mark(TILE)
            yield rows
        self.tracer.mark(TILES_DONE)


def windows(t: Trace) -> dict[tuple[str, int], tuple[int, int]]:
    """Returns (phase, layer) -> (first event, last event) of each layer's forward and backward."""
    opened, spans = {}, {}
    for i, e in enumerate(t.events):
        if e.kind == "mark" and isinstance(e.op, tuple):
            phase, layer, edge = e.op
            if edge == "start":
                opened[(phase, layer)] = i
            elif (phase, layer) in opened:
                spans[(phase, layer)] = (opened.pop((phase, layer)), i)
    return spans


class _DataOnlyUnpickler(pickle.Unpickler):
    """Unpickles plain data (dicts, lists, strings, numbers) and refuses every class or function."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a memory snapshot holds plain data only")


def load_snapshot(path: str | Path, device: int = 0) -> Trace:
    """Returns the allocation trace in a `torch.cuda.memory._snapshot()` pickle (its `device_traces`).

    Nothing executable is loaded. Allocations are `alloc` entries; a block is freed at `free_completed`
    (or `free` in older snapshots); addresses are reused, so every allocation gets its own tensor id.
    """
    try:
        with open(path, "rb") as f:
            snapshot = _DataOnlyUnpickler(f).load()
    except (OSError, pickle.UnpicklingError, EOFError) as err:
        raise ValueError(f"cannot read memory snapshot {path}: {err}") from None
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if not traces or device >= len(traces):
        raise ValueError(f"{path}: no allocation trace for device {device} (record with _record_memory_history)")
    result, live, next_id = Trace(), {}, 0
    for entry in traces[device]:
        action, addr, size = entry.get("action"), entry.get("addr"), int(entry.get("size", 0))
        if action == "alloc":
            live[addr] = (next_id, size)
            result.events.append(Event("alloc", next_id, size, "snapshot"))
            next_id += 1
        elif action in ("free_completed", "free") and addr in live:
            tid, nbytes = live.pop(addr)
            result.events.append(Event("free", tid, nbytes, "snapshot"))
    return result
