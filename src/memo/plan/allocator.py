"""The planned allocator at run time (memo-method.md §5): a training step allocates the same tensors in the same
order every time, so one step's allocations, recorded at PyTorch's allocator where every one of them is seen
(kernel scratch included), are planned once as a flat Dynamic Storage Allocation problem and the next steps are
served from one arena at the solved offsets: no fragmentation, and a footprint at the step's LOAD.

The C++ core (`csrc/planned_allocator.cpp`, built on first use with torch's cpp_extension and cached) replaces
the CPU allocator. Inside `step()` it logs every request (size, order, when it is freed); once two steps in a
row made the same requests (the first step also makes the optimizer state, a curriculum changes lengths), the
last one is solved here with `dsa.solve` and later steps get the k-th request at base + offset[k]. A step
that leaves the plan drops it (and its arena) and recording starts again: steps are never served and
recorded at once for long, which would hold both memories. Tensors that outlive their step (optimizer state,
returned values) and everything outside a step pass through to PyTorch's allocator. A request whose size
differs from the plan switches the rest of the step to pass-through, and one whose region a late-freed
tensor still holds passes through too: the plan can cost memory, never correctness.
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .problem import Problem, max_load

ALIGN = 64  # bytes: every planned tensor starts on this boundary (PyTorch's CPU allocator's alignment)
SOURCE = Path(__file__).with_name("csrc") / "planned_allocator.cpp"
log = logging.getLogger(__name__)


@functools.cache
def extension():
    """Returns the compiled core (built once per machine into torch's extension cache, about a minute); a
    ValueError saying so when this machine cannot build it."""
    from torch.utils.cpp_extension import load

    try:
        return load(name="memo_planned_allocator", sources=[str(SOURCE)], extra_cflags=["-O2"])
    except (OSError, RuntimeError, ImportError) as err:
        raise ValueError(f"`--arena` needs a C++ compiler to build memo's planned allocator ({err})") from None


@dataclass(frozen=True)
class Plan:
    """The solved layout of one recorded step."""

    requests: int  # allocations in the step
    planned: int  # those served from the arena (the others outlive the step)
    arena_bytes: int
    load_bytes: int  # the recorded step's LOAD: the most bytes of planned tensors alive at once
    seconds: float


class PlannedAllocator:
    """While entered, every CPU allocation goes through the planned allocator; `with allocator.step():` marks
    one training step. `plan` is the layout in use (None before the first step ends)."""

    def __init__(self, time_limit: float = 5.0):
        self.time_limit = time_limit
        self.plan: Plan | None = None
        self._core = extension()
        self._recorded: list[int] | None = None  # the sorted sizes of the last recorded step

    def __enter__(self) -> "PlannedAllocator":
        self._core.install()
        return self

    def __exit__(self, *exc) -> None:
        self._core.uninstall()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Marks one step: served from the plan, or recorded (and planned once two recorded steps agree)."""
        self._core.reset_peak()
        self._core.begin_step()
        try:
            yield
        finally:
            recorded = self._core.end_step()
        if not recorded:
            return
        if self.plan is not None:  # it left the plan: drop it, record anew
            self._core.forget_plan()
            self.plan, self._recorded = None, None
        rows = self.recorded()
        sizes = sorted(row[0] for row in rows)  # the same requests, in whatever order threads made them
        if sizes == self._recorded:
            self.plan = self._solve(rows)
        self._recorded = sizes

    def recorded(self) -> list[list[int]]:
        """Returns the last step's requests as [size, born, freed] on one event clock (freed -1: it outlived
        the step): the trace the plan is solved from."""
        return self._core.log()

    def counters(self) -> dict[str, int]:
        """Returns the core's counters since install: served, misses, collisions, passed (requests), arena_bytes,
        arena_address, pass_live_bytes, pass_peak_bytes (since the step began), live_in_arena."""
        return dict(self._core.counters())

    def _solve(self, rows: list[list[int]]) -> Plan:
        """Plans the requests freed inside the step (survivors pass through) and hands the layout to the core."""
        from .dsa import solve  # the search kernel (numba) loads with the first plan

        start = time.perf_counter()
        log_ = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        sizes, born, freed = log_[:, 0], log_[:, 1], log_[:, 2]
        inside = np.flatnonzero(freed >= 0)
        units = -(-sizes[inside] // ALIGN)
        problem = Problem(tuple(inside.tolist()), born[inside], freed[inside], units)
        offsets = np.full(len(sizes), -1, dtype=np.int64)
        arena = load = 0
        if len(problem):
            solution = solve(problem, self.time_limit, use_mip=False)
            offsets[inside] = solution.offsets * ALIGN
            arena, load = solution.peak * ALIGN, max_load(problem) * ALIGN
        if not self._core.set_plan(sizes.tolist(), offsets.tolist(), int(arena)):
            log.warning("the arena could not grow while tensors lived in it: the next step is recorded again")
        plan = Plan(len(sizes), len(inside), int(arena), int(load), time.perf_counter() - start)
        log.info("planned %d of %d allocations: arena %d B for LOAD %d B", plan.planned, plan.requests, arena, load)
        return plan
