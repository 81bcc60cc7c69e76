"""The phase planner (docs/method.md §5, at the dispatch level): a layer phase's transient tensors live in one
pre-allocated buffer at offsets solved offline, so the allocator never sees them and cannot fragment. It is a
pass over a finished model (`attach`), kept as a debugging path: `memo train --arena` plans a whole step below
PyTorch instead, with the planned allocator (`allocator.py`).

A layer phase (its forward, or its recompute + backward) is first traced on `meta` with the same shapes,
which gives every op call and every new tensor with its lifetime. The tensors that die inside the phase
and come from an op with an `out=` overload (or a factory such as `empty`) become a DSA instance; its
solution is the buffer layout. At run time a dispatch mode follows the recorded op sequence and hands each
planned op a view of the buffer as its `out=`. Whatever cannot be planned (no `out=` overload, a tensor
that outlives the phase, a host tensor) is allocated as usual and listed in `PhasePlan.unplanned`.

A phase whose trace fails on `meta` (an op without a meta kernel), or whose ops at run time leave the traced
sequence (a kernel that refused a shape and fell back to another), runs unplanned from then on, with ordinary
allocation: logged once with the reason and listed in `PhasePlanner.summary()`; the other phases keep their plans.

With `debug`, every tensor that points into the buffer is reference-counted at run time: handing out a
region that overlaps a live planned tensor, or touching a region whose tensor is dead, raises.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..attention import choose
from ..device import meta_kernels
from ..model import Transformer
from .budget import PHASE_WORK
from .dsa import Solution, solve
from .problem import Problem
from .trace import Output, trace

aten = torch.ops.aten
log = logging.getLogger(__name__)
ALIGN = 512  # bytes; every planned tensor starts on this boundary (the CUDA caching allocator's granule)
FACTORIES = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
COPIES = {aten._to_copy.default}  # dtype/device conversions: copy_ into the planned tensor does the same


@functools.cache
def out_overload(func) -> tuple[object, tuple[str, ...]] | None:
    """Returns (the `out=` overload of `func` with the same inputs, its out argument names), or None."""
    want = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        args = candidate._schema.arguments
        outs = tuple(a.name for a in args if a.is_out)
        same_inputs = [(a.name, str(a.type)) for a in args if not a.is_out] == want
        if outs and same_inputs and len(outs) == len(func._schema.returns):
            return candidate, outs
    return None


@dataclass(frozen=True)
class Slot:
    """One new tensor of a planned op call: its place in the buffer (None: allocated as usual) and layout."""

    tensor: int
    offset: int | None
    nbytes: int
    output: Output


@dataclass
class PhasePlan:
    """The op sequence of one phase and the slots of the op calls whose outputs come from the buffer."""

    calls: list
    slots: dict[int, list[Slot]]  # op call -> its outputs in order
    problem: Problem  # the planned tensors, in ALIGN units
    solution: Solution | None
    unplanned: list[tuple[str, int, str]]  # (op, bytes, why)
    planned_bytes: int = 0  # summed sizes of the planned tensors, each on its own

    @property
    def buffer_bytes(self) -> int:
        return self.solution.peak * ALIGN if self.solution else 0


def plan_phase(phase_trace, time_limit: float = 2.0, work_limit: int = PHASE_WORK) -> PhasePlan:
    """Returns the plan of a traced phase: a DSA over its plannable transient tensors, in ALIGN units, solved
    within `work_limit` (`time_limit` seconds a safety net: `dsa.solve`)."""
    frees = {e.tensor: i for i, e in enumerate(phase_trace.events) if e.kind == "free"}
    by_call: dict[int, list] = {}
    for i, e in enumerate(phase_trace.events):
        if e.kind == "alloc":
            by_call.setdefault(e.output.call, []).append((i, e))
    rows, planned, unplanned = [], {}, []
    for call, outs in by_call.items():
        func = phase_trace.calls[call]
        why = _unplannable(func, [e for _, e in outs], frees)
        if why:
            unplanned += [(str(func), e.nbytes, why) for _, e in outs]
            continue
        planned[call] = sorted((e for _, e in outs), key=lambda e: e.output.position)
        for i, e in outs:
            if e.tensor in frees:
                rows.append((e.tensor, i, frees[e.tensor], -(-e.nbytes // ALIGN)))
            else:
                unplanned.append((str(func), e.nbytes, "outlives the phase"))
    problem = Problem.from_rows(rows)
    solution = solve(problem, time_limit, work_limit=work_limit) if rows else None
    offsets = dict(zip((r[0] for r in rows), solution.offsets.tolist())) if rows else {}
    slots = {
        call: [
            Slot(e.tensor, offsets[e.tensor] * ALIGN if e.tensor in offsets else None, e.nbytes, e.output) for e in outs
        ]
        for call, outs in planned.items()
    }
    return PhasePlan(phase_trace.calls, slots, problem, solution, unplanned, sum(r[3] for r in rows) * ALIGN)


def _unplannable(func, outs, frees) -> str | None:
    """Returns why an op call's new tensors cannot come from the buffer, or None when they can."""
    if any(e.output.device != "meta" for e in outs):
        return "host tensor"
    if all(e.tensor not in frees for e in outs):
        return "outlives the phase"
    if func in FACTORIES or func in ZEROS or func in COPIES:
        return None
    if out_overload(func) is None:
        return "no out= overload"
    returns = func._schema.returns
    if len(outs) != len(returns) or any(str(r.type) != "Tensor" for r in returns):
        return "returns a view or a non-tensor"
    return None


def _meta_twin(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _signature(args) -> tuple:
    leaves, spec = tree_flatten(args)
    return (
        str(spec),
        tuple(
            (tuple(x.shape), x.stride(), x.dtype, x.device.type) if isinstance(x, torch.Tensor) else x for x in leaves
        ),
    )


@dataclass
class PhasePlanner:
    """One device buffer shared by every layer phase, and the plan of each phase signature met so far."""

    time_limit: float = 2.0  # the safety net of each phase's DSA solve; `work_limit` is its budget
    debug: bool = False
    work_limit: int = PHASE_WORK
    buffer: torch.Tensor | None = None
    plans: dict = field(default_factory=dict)
    unplanned: dict = field(default_factory=dict)  # phase signature -> why it runs with ordinary allocation
    _twins: dict = field(default_factory=dict)

    def run(self, layer, phase, *args):
        """Returns `phase(layer, *args)` with the phase's transient tensors carved from the buffer (with ordinary
        allocation where the phase cannot be planned)."""
        device, dtype = next(layer.parameters()).device, next(layer.parameters()).dtype
        kernel = layer.attention_ran or choose(layer.attention_kernel, device, dtype)  # the trace runs the same
        kind = (layer.window, layer.experts is not None)  # a windowed layer, a mixture of experts run other ops
        key = (phase.__name__, dtype, kernel, kind, _signature(args))
        if key not in self.plans and key not in self.unplanned:
            self._plan(key, layer, phase, args, device)
        if key in self.unplanned:
            return phase(layer, *args)
        plan = self.plans[key]
        if self.buffer is None or self.buffer.numel() < plan.buffer_bytes or self.buffer.device != device:
            self.buffer = None  # no planned tensor is alive between phases: the old buffer can go first
            self.buffer = torch.empty(max(plan.buffer_bytes, 1), dtype=torch.uint8, device=device)
        mode = _PlannedMode(self.buffer, plan, self.debug)
        with mode:
            result = phase(layer, *args)
        mode.finish()
        if mode.strayed:
            # tensors it placed before it strayed may outlive it: they keep this buffer, the next phase gets another
            self.buffer = None
            self._unplan(key, f"at run time {mode.strayed}")
        return result

    def _plan(self, key, layer, phase, args, device) -> None:
        """Plans the phase from its trace on `meta`, or marks it unplanned when it cannot be traced there."""
        if layer.experts is not None and key[1] != torch.bfloat16:
            self._unplan(key, "the grouped GEMM of its experts has a meta kernel in bf16 only")
            return
        try:
            twin = self._twin(layer, kernel=key[2])
            meta_args = tree_map(_meta_twin, args)
            with meta_kernels(device.type):
                phase_trace, _ = trace(phase, twin, *meta_args)
        except Exception as err:  # any refusal of meta tensors, by an op (no meta kernel) or by the phase's code
            first_line = str(err).partition("\n")[0]
            self._unplan(key, f"its trace on meta failed: {type(err).__name__}: {first_line}")
            return
        self.plans[key] = plan_phase(phase_trace, self.time_limit, self.work_limit)

    def _unplan(self, key, why: str) -> None:
        """Runs the phase with ordinary allocation from now on, and says why once (not once per layer shape)."""
        self.plans.pop(key, None)
        if (key[0], why) not in {(k[0], w) for k, w in self.unplanned.items()}:
            log.warning("phase planner: phase %s runs unplanned: %s", key[0], why)
        self.unplanned[key] = why

    def _twin(self, layer, kernel: str):
        """Returns a parameter-free copy of `layer` on `meta` (same code, same shapes, same window, no memory) that
        runs the attention kernel `kernel`."""
        key = (next(layer.parameters()).dtype, kernel, layer.window, layer.experts is not None)
        if key not in self._twins:
            with torch.device("meta"):
                self._twins[key] = type(layer)(layer.config, layer.index).to(key[0])
            self._twins[key].attention_kernel = kernel
        return self._twins[key]

    def summary(self) -> dict:
        """Returns the buffer size, what was planned, every op whose output could not be planned, and every phase
        that runs unplanned."""
        unplanned = Counter()
        for plan in self.plans.values():
            for op, nbytes, why in plan.unplanned:
                unplanned[(op, why)] += nbytes
        phases = sorted({(key[0], why) for key, why in self.unplanned.items()})
        return {
            "buffer_bytes": 0 if self.buffer is None else self.buffer.numel(),
            "phases": len(self.plans),
            "load_bytes": max((p.solution.lower_bound * ALIGN for p in self.plans.values() if p.solution), default=0),
            "planned_bytes": max((p.planned_bytes for p in self.plans.values()), default=0),
            "unplanned": [{"op": op, "why": why, "bytes": n} for (op, why), n in sorted(unplanned.items())],
            "unplanned_phases": [{"phase": name, "why": why} for name, why in phases],
        }


def attach(model: Transformer, debug: bool = False, time_limit: float = 2.0) -> PhasePlanner:
    """Returns the phase planner that from now on carves the transient tensors of every layer phase of `model`
    from one planned buffer; `debug` proves at run time that no two live planned tensors overlap."""
    if any(layer.seq_parallel is not None for layer in model.layers):
        raise ValueError("the phase planner does not support sequence parallelism (`--sp` > 1)")
    planner = PhasePlanner(time_limit, debug)
    for layer in model.layers:
        layer.phases = planner
    return planner


def _check_layout(func, out, slots: list[Slot]) -> None:
    """Raises if a planned op returned another shape or dtype than its plan: an out= op resizes or casts
    silently, and a resized buffer view would write over its neighbours."""
    for t, slot in zip(tree_flatten(out)[0], slots):
        o = slot.output
        if isinstance(t, torch.Tensor) and (tuple(t.shape) != o.shape or t.dtype != o.dtype):
            raise RuntimeError(
                f"phase planner: {func} returned {tuple(t.shape)} {t.dtype}, planned {o.shape} {o.dtype}: the run "
                "differs from its meta trace"
            )


class _PlannedMode(TorchDispatchMode):
    """Replays one phase's recorded op sequence, giving planned ops their buffer views as `out=`; from the first
    op that leaves the sequence on, every op allocates as usual (`strayed` says where)."""

    def __init__(self, buffer: torch.Tensor, plan: PhasePlan, debug: bool):
        super().__init__()
        self.buffer, self.plan, self.debug = buffer, plan, debug
        self.call = 0
        self.strayed: str | None = None
        self.live: dict[int, list] = {}  # debug: tensor id -> [start, end, references]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call, self.call = self.call, self.call + 1
        if self.strayed is None and (call >= len(self.plan.calls) or self.plan.calls[call] != func):
            expected = self.plan.calls[call] if call < len(self.plan.calls) else "the end of the phase"
            self.strayed = f"op {call} was {func} where its meta trace has {expected}"
        if self.strayed is not None:
            return func(*args, **kwargs)
        slots = self.plan.slots.get(call)
        if slots is None:
            out = func(*args, **kwargs)
            if self.debug:
                self._check_outputs(out)
            return out
        views = [self._view(slot) for slot in slots]
        if func in FACTORIES:
            out = views[0]
        elif func in ZEROS:
            out = views[0].zero_()
        elif func in COPIES:
            out = views[0].copy_(args[0])
        else:
            overload, names = out_overload(func)
            try:
                out = overload(*args, **kwargs, **dict(zip(names, views)))
            except (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", torch.OutOfMemoryError)):
                raise  # a device failure, not a plan that disagrees with the kernel
            except RuntimeError as err:  # the device kernel disagrees with the meta kernel (e.g. an out dtype)
                return self._demote(call, func, err, args, kwargs)
        _check_layout(func, out, slots)
        if self.debug:
            self._check_outputs(out)
        return out

    def _view(self, slot: Slot) -> torch.Tensor:
        """Returns the slot's tensor: a buffer view at its offset, or a fresh tensor if it is not planned."""
        o = slot.output
        if slot.offset is None:
            return torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device=self.buffer.device)
        if self.debug:
            self._claim(slot)
        return self.buffer[slot.offset : slot.offset + slot.nbytes].view(o.dtype).as_strided(o.shape, o.stride)

    def _demote(self, call: int, func, err: RuntimeError, args, kwargs):
        """Runs `func` as usual and drops its slots from the plan for good (a placement minus some tensors
        stays valid); the reason is listed with the unplanned ops."""
        why = f"its {self.buffer.device.type} kernel differs from the meta kernel: {str(err).splitlines()[0]}"
        for slot in self.plan.slots.pop(call):
            self.live.pop(slot.tensor, None)
            self.plan.unplanned.append((str(func), slot.nbytes, why))
        return func(*args, **kwargs)

    # ---- debug: prove at run time that no two live planned tensors overlap ------------------------------
    def _claim(self, slot: Slot) -> None:
        start, end = slot.offset, slot.offset + slot.nbytes
        for tensor, (s, e, _) in self.live.items():
            if s < end and start < e:
                raise RuntimeError(
                    f"phase buffer overlap: tensor {slot.tensor} at [{start}, {end}) meets live tensor {tensor} "
                    f"at [{s}, {e})"
                )
        self.live[slot.tensor] = [start, end, 0]

    def _check_outputs(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() == self._base():
                self._hold(t)

    def _base(self) -> int:
        return self.buffer.untyped_storage().data_ptr()

    def _hold(self, t: torch.Tensor) -> None:
        at = t.data_ptr() - self._base()
        owner = next((k for k, (s, e, _) in self.live.items() if s <= at < e), None)
        if owner is None:
            raise RuntimeError(f"phase planner: a tensor at offset {at} points into memory whose planned tensor died")
        self.live[owner][2] += 1
        weakref.finalize(t, self._release, owner)

    def _release(self, tensor: int) -> None:
        entry = self.live.get(tensor)
        if entry is not None:
            entry[2] -= 1
            if entry[2] == 0:
                del self.live[tensor]

    def finish(self) -> None:
        """Notes a phase that ended before its plan did as strayed; checks (debug) that a phase that kept to its
        plan left no planned tensor alive."""
        if self.strayed is None and self.call < len(self.plan.calls):
            self.strayed = f"it ran {self.call} of the {len(self.plan.calls)} ops of its meta trace"
        if self.strayed is None and self.debug and self.live:
            raise RuntimeError(f"phase planner: planned tensors {sorted(self.live)} outlive their phase")
