"""The planned allocator at run time (docs/method.md §5): a training step allocates the same tensors in the same
order every time, so one step's allocations, recorded at PyTorch's allocator where every one of them is seen
(kernel scratch included), are planned once as a flat Dynamic Storage Allocation problem and the next steps are
served from one arena at the solved offsets: no fragmentation, and a footprint at the step's LOAD.

The C++ core (`csrc/planned_allocator.cpp`, built on first use with torch's cpp_extension and cached) replaces the
CPU allocator, or on CUDA is PyTorch's allocator through `CUDAPluggableAllocator` (over the CUDA runtime's stream-
ordered cudaMallocAsync for what it does not plan, from the device's default memory pool, which keeps what is freed
as PyTorch's own cudaMallocAsync backend has it keep; set up before the process's first CUDA allocation; memory the
device cannot give raises torch.OutOfMemoryError; `pool_high_water()` reads the pool's peaks). Inside
`step()` it logs every request (size, order, when it is freed); once two steps in a row made the same requests (the
first step also makes the optimizer state, a curriculum changes lengths), the last one is solved here with
`dsa.solve` and later steps get the k-th request at base + offset[k]. A step that leaves the plan drops it (and its
arena) and recording starts again: steps are never served and recorded at once for long, which would hold both
memories. Tensors that outlive their step (optimizer state, returned values) and everything outside a step pass
through to PyTorch's allocator. A request whose size differs from the plan switches the rest of the step to pass-
through, and one whose region a late-freed tensor still holds passes through too: the plan can cost memory, never
correctness.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .. import device as dev
from .budget import ALLOCATOR_WORK
from .problem import Problem, max_load

ALIGN = {"cpu": 64, "device": 512}  # bytes each planned tensor starts on: the CPU allocator's, the CUDA caching one's
CUDA_FUNCTIONS = (  # what the device core calls (csrc/planned_allocator.cpp, CudaRuntime)
    "cudaMallocAsync",
    "cudaFreeAsync",
    "cudaMalloc",
    "cudaFree",
    "cudaGetLastError",
    "cudaGetErrorString",
    "cudaDeviceGetAttribute",
    "cudaDeviceGetDefaultMemPool",
    "cudaMemPoolSetAttribute",
    "cudaMemPoolGetAttribute",
)
SOURCE = Path(__file__).with_name("csrc") / "planned_allocator.cpp"
log = logging.getLogger(__name__)


@functools.cache
def extension():
    """Returns the compiled core (built once per machine into torch's extension cache, about 25 s); a
    ValueError saying so when this machine cannot build it."""
    from torch.utils.cpp_extension import load

    tools = str(Path(sys.executable).parent)  # the environment's own ninja (a dependency), venv activated or not
    if tools not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([tools, os.environ.get("PATH", "")])
    try:
        return load(name="memo_planned_allocator", sources=[str(SOURCE)], extra_cflags=["-O2"])
    except (OSError, RuntimeError, ImportError) as err:
        raise ValueError(f"`--arena` needs a C++ compiler to build memo's planned allocator ({err})") from None


def make_device_core(functions: dict[str, int]) -> None:
    """Makes the device core over the CUDA runtime functions at these addresses (`CUDA_FUNCTIONS`, by name)."""
    extension().make_device_core(functions)


@functools.cache
def install_cuda() -> None:
    """Makes PyTorch's CUDA allocator the device core over the CUDA runtime torch loaded (once per process; it
    cannot be undone, and must come before the process's first CUDA allocation)."""
    make_device_core(_addresses(_cuda_runtime(), CUDA_FUNCTIONS))
    planned = torch.cuda.memory.CUDAPluggableAllocator(extension().__file__, "memo_device_malloc", "memo_device_free")
    try:
        torch.cuda.memory.change_current_allocator(planned)
    except RuntimeError as err:
        raise ValueError(f"`--arena` must take over CUDA memory before its first allocation ({err})") from None


def pool_high_water() -> dict[str, int] | None:
    """Returns the bytes of the CUDA memory pool the planned allocator takes memory from, as the driver counts them:
    `reserved_peak` (cudaMemPoolAttrReservedMemHigh: the most the pool held from the GPU since the last
    `reset_pool_high_water()`: the process's device footprint), `used_peak` (cudaMemPoolAttrUsedMemHigh: the most
    handed out at once), and `reserved` and `used` now. For a run on PyTorch's caching allocator the same footprint
    is torch.cuda.max_memory_reserved() (with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync it reads this very
    attribute: c10/cuda/CUDAMallocAsyncAllocator.cpp getDeviceStats). None where no pool answers: the planned
    allocator is not this process's CUDA allocator, has not allocated yet, or the GPU has no memory pools (it then
    uses cudaMalloc, and `PlannedAllocator.counters()` hold its bytes)."""
    if not extension.cache_info().currsize:  # the core was never loaded: no planned allocator in this process
        return None
    return dict(extension().pool(False)) or None


def reset_pool_high_water() -> None:
    """Resets the peaks of `pool_high_water()` to the pool's bytes now (what torch.cuda.reset_peak_memory_stats does
    for PyTorch's cudaMallocAsync backend); does nothing where there is no pool."""
    if extension.cache_info().currsize:
        extension().pool(True)


def _cuda_runtime() -> ctypes.CDLL:
    """Returns the CUDA runtime torch calls (`device.cuda_runtime`); ValueError naming `--arena` without one."""
    runtime = dev.cuda_runtime()
    if runtime is None:
        raise ValueError("`--arena` on CUDA needs the CUDA runtime (libcudart) that torch loads; none is loaded")
    return runtime


def _addresses(library: ctypes.CDLL, names: tuple[str, ...]) -> dict[str, int]:
    """Returns the address of each function `names` lists in `library`; a ValueError names the first it lacks."""
    found = {}
    for name in names:
        try:
            found[name] = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
        except AttributeError:
            where = library._name or "this process"
            raise ValueError(f"`--arena` on CUDA needs {name} (CUDA 11.2 or later); {where} lacks it") from None
    return found


@dataclass(frozen=True)
class Plan:
    """The solved layout of one recorded step."""

    requests: int  # allocations in the step
    planned: int  # those served from the arena (the others outlive the step)
    arena_bytes: int
    load_bytes: int  # the recorded step's LOAD: the most bytes of planned tensors alive at once
    seconds: float


class PlannedAllocator:
    """Plans the allocations of `device` (cpu or cuda). On the CPU it takes over while entered; on CUDA it takes
    over when made (before any CUDA allocation) for the rest of the process. `with allocator.step():` marks one
    training step. `plan` is the layout in use (None until two recorded steps agree)."""

    def __init__(
        self,
        device: torch.device = torch.device("cpu"),
        time_limit: float | None = 30.0,
        install: bool = True,
        work_limit: int = ALLOCATOR_WORK,
    ):
        self.core = "cpu" if device.type == "cpu" else "device"
        self.device = device
        self.time_limit, self.work_limit = time_limit, work_limit  # the plan's DSA safety net and budget (`dsa.solve`)
        self.plan: Plan | None = None
        self._ext = extension()
        self._recorded: list[int] | None = None  # the sorted sizes of the last recorded step
        if self.core == "device" and install:
            install_cuda()

    def __enter__(self) -> "PlannedAllocator":
        if self.core == "cpu":
            self._ext.install_cpu()
        else:
            self._ext.forget_plan(self.core)  # a new run plans its own steps
        return self

    def __exit__(self, *exc) -> None:
        if self.core == "cpu":
            self._ext.uninstall_cpu()

    @contextmanager
    def step(self) -> Iterator[None]:
        """Marks one step: served from the plan, or recorded (and planned once two recorded steps agree)."""
        self._ext.reset_peak(self.core)
        self._ext.begin_step(self.core, self._stream())
        try:
            yield
        finally:
            recorded = self._ext.end_step(self.core)
        if not recorded:
            return
        if self.plan is not None:  # it left the plan: drop it, record anew
            self._ext.forget_plan(self.core)
            self.plan, self._recorded = None, None
        rows = self.recorded()
        sizes = sorted(row[0] for row in rows)  # the same requests, in whatever order threads made them
        if sizes == self._recorded:
            self.plan = self._solve(rows)
        self._recorded = sizes

    def _stream(self) -> int:
        """Returns the stream whose requests the step plans (CUDA: the current one; 0 on the CPU)."""
        return torch.cuda.current_stream(self.device).cuda_stream if self.core == "device" else 0

    def _on_device(self):
        """Returns a context on the planned device: on a GPU without memory pools the core allocates the arena with
        cudaMalloc, which takes the current device."""
        index = self.device.index if self.core == "device" else None
        return torch.cuda.device(index) if index is not None else nullcontext()

    def recorded(self) -> list[list[int]]:
        """Returns the last step's requests as [size, born, freed] on one event clock (freed -1: it outlived
        the step): the trace the plan is solved from."""
        return self._ext.log(self.core)

    def counters(self) -> dict[str, int]:
        """Returns the core's counters since it was made: served, misses, collisions, passed (requests),
        arena_bytes, arena_address, pass_live_bytes, pass_peak_bytes (since the step began), live_in_arena."""
        return dict(self._ext.counters(self.core))

    def _solve(self, rows: list[list[int]]) -> Plan:
        """Plans the requests freed inside the step (survivors pass through) and hands the layout to the core."""
        from .dsa import solve  # the search kernel (numba) loads with the first plan

        start, align = time.perf_counter(), ALIGN[self.core]
        log_ = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        sizes, born, freed = log_[:, 0], log_[:, 1], log_[:, 2]
        inside = np.flatnonzero(freed >= 0)
        units = -(-sizes[inside] // align)
        problem = Problem(tuple(inside.tolist()), born[inside], freed[inside], units)
        offsets = np.full(len(sizes), -1, dtype=np.int64)
        arena = load = 0
        if len(problem):
            solution = solve(problem, self.time_limit, use_mip=False, work_limit=self.work_limit)
            offsets[inside] = solution.offsets * align
            arena, load = solution.peak * align, max_load(problem) * align
        with self._on_device():
            kept = self._ext.set_plan(self.core, sizes.tolist(), offsets.tolist(), int(arena))
        if not kept:
            log.warning("the arena could not change while tensors lived in it: the next steps are recorded again")
        plan = Plan(len(sizes), len(inside), int(arena), int(load), time.perf_counter() - start)
        log.info("planned %d of %d allocations: arena %d B for LOAD %d B", plan.planned, plan.requests, arena, load)
        return plan
