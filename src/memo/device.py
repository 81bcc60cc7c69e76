"""The few CUDA-only calls (streams, events, pinning, timing), each degrading to synchronous CPU behaviour.

Every other module calls these, so the swap engine runs the same code on CPU, CUDA and `meta`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import os
import re
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path, PurePosixPath

import torch

from .units import format_bytes

log = logging.getLogger(__name__)

_META_KERNELS: ContextVar[str] = ContextVar("memo_meta_kernels", default="cpu")

PAGE = mmap.PAGESIZE
REGISTER_CHUNK = 64 << 30  # bytes per cudaHostRegister call (a multiple of PAGE): calls of >= 512 GiB fail
PREFAULT_PIECE = 64 << 20  # the fewest bytes worth a thread of their own when faulting pages in
MADV_POPULATE_WRITE = 23  # madvise: fault a range in for writing (Linux >= 5.14)
CUDA_STREAM_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit sync with the legacy default stream
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # `--dtype` names


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


@contextlib.contextmanager
def meta_kernels(device_type: str):
    """Makes ops on `meta` tensors stand for the kernels of `device_type`, so a meta trace of a CUDA step
    allocates what the CUDA kernels allocate (the phase planner and the cost model plan a run before it happens)."""
    token = _META_KERNELS.set(device_type)
    try:
        yield
    finally:
        _META_KERNELS.reset(token)


def kernel_device_type(device: torch.device) -> str:
    """Returns the device type whose kernels run for tensors on `device`: its own, or on `meta` the one
    `meta_kernels` names (default cpu)."""
    return meta_kernel_type() if device.type == "meta" else device.type


def meta_kernel_type() -> str:
    """Returns the device type whose kernels ops on `meta` tensors stand for (`meta_kernels`; default cpu)."""
    return _META_KERNELS.get()


def has_fused_kernel(op: str, device_type: str) -> bool:
    """Returns whether `op` ("aten::name") has a kernel of its own for `device_type`, not a decomposition.

    CUDA builds of torch >= 2.11 have the fused norm and attention kernels (and memo's FA4 op registers one);
    assuming them lets a CPU-only build trace a GPU step on meta. Elsewhere the dispatcher is asked (a test may
    register a kernel to mimic CUDA on CPU).
    """
    return device_type == "cuda" or torch._C._dispatch_has_kernel_for_dispatch_key(op, device_type.upper())


_SPARE_STREAMS: dict[int, list[int]] = {}  # device index -> handles of memo's streams whose wrappers died


def new_stream(device: torch.device) -> torch.cuda.Stream | None:
    """Returns a side stream of memo's own on CUDA; None elsewhere (copies then run in program order).

    Not `torch.cuda.Stream()`: it hands out 32 pooled streams per priority in turn (getStreamFromPool in
    c10/cuda/CUDAStream.cpp), the pool ProcessGroupNCCL takes its stream from, so a copy could queue behind a
    collective. A handle whose wrapper dies is kept for the next call, never destroyed: the caching allocator
    remembers each block's stream and synchronises it when it unmaps an expandable segment.
    """
    if not is_cuda(device):
        return None
    runtime = cuda_runtime()
    if runtime is None:  # a torch that links the runtime statically: the pool is all there is
        return torch.cuda.Stream(device=device)
    index = torch.cuda.current_device() if device.index is None else device.index
    spare = _SPARE_STREAMS.setdefault(index, [])
    handle = spare.pop() if spare else _create_stream(runtime, index)
    stream = torch.cuda.ExternalStream(handle, device=index)
    weakref.finalize(stream, spare.append, handle)
    return stream


def _create_stream(runtime: ctypes.CDLL, index: int) -> int:
    """Returns a new non-blocking cudaStream_t on device `index` (non-blocking like torch's pooled streams)."""
    handle = ctypes.c_void_p()
    with torch.cuda.device(index):
        error = runtime.cudaStreamCreateWithFlags(ctypes.byref(handle), CUDA_STREAM_NON_BLOCKING)
    if error:
        raise RuntimeError(f"could not create a CUDA stream on cuda:{index} (cudaStreamCreateWithFlags error {error})")
    return handle.value


def on_stream(stream: torch.cuda.Stream | None):
    """Returns a context that makes `stream` current (a null context without one)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def record_event(device: torch.device, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event | None:
    """Returns an event recorded on `stream` (default: the current stream); None off CUDA."""
    if not is_cuda(device):
        return None
    event = torch.cuda.Event()
    event.record(stream if stream is not None else torch.cuda.current_stream(device))
    return event


def wait_event(event: torch.cuda.Event | None, stream: torch.cuda.Stream | None = None, device=None) -> None:
    """Makes `stream` (default: `device`'s current stream) wait for `event`; nothing to wait for off CUDA."""
    if event is None:
        return
    (stream if stream is not None else torch.cuda.current_stream(device)).wait_event(event)


def host_device_for(device: torch.device) -> torch.device:
    """Returns where host copies of `device` tensors live: `meta` stays `meta` so tracing allocates nothing."""
    return torch.device("meta") if device.type == "meta" else torch.device("cpu")


def pins(device: torch.device) -> bool:
    """Returns whether host buffers for copies from `device` are page-locked (CUDA only)."""
    return is_cuda(device)


def _cudart():
    return torch.cuda.cudart()


CUDART = re.compile(r"libcudart(-[0-9a-f]+)?\.so(\.\d+)*")  # a CUDA runtime's file name


@functools.cache
def cuda_runtime() -> ctypes.CDLL | None:
    """Returns the CUDA runtime torch calls, for what torch.cuda.cudart() lacks: the process's global namespace
    where it defines cudaMallocAsync (torch opens libtorch_global_deps, which depends on libcudart, with
    RTLD_GLOBAL: torch/__init__.py `_load_global_deps`; the dynamic linker binds torch's own calls to that
    definition), else the first libcudart this process mapped; None without one."""
    process = ctypes.CDLL(None)
    if hasattr(process, "cudaMallocAsync"):
        return process
    loaded = cudart_paths("\n".join(_lines(Path("/proc/self/maps"))))
    return ctypes.CDLL(loaded[0]) if loaded else None


def cudart_paths(maps: str) -> list[str]:
    """Returns the CUDA runtime libraries among the files a /proc/<pid>/maps text lists, in its order, once each:
    libcudart.so[.N...], or libcudart-<hash>.so[.N...] as wheels that bundle it rename it."""
    paths = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path (which may hold spaces)
        path = fields[5] if len(fields) == 6 else ""
        if CUDART.fullmatch(Path(path).name) and not path.endswith(" (deleted)") and path not in paths:
            paths.append(path)
    return paths


def _clear_cuda_error() -> None:
    """Resets this thread's last CUDA runtime error (cudaGetLastError), which the next kernel launch would raise."""
    runtime = cuda_runtime()
    if runtime is not None:
        runtime.cudaGetLastError()


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


class HostBuffer:
    """Host bytes for copies from `device`, page-locked for exactly the life of this object on CUDA.

    Pinning registers exactly `nbytes` (cudaHostRegister) rather than using `pin_memory=True`, whose caching
    host allocator rounds every request up to a power of two and keeps freed blocks: a 17 GiB pool would lock
    32 GiB and never give it back. This object owns the registration: views of `data` keep only its storage,
    so the registration must not hang on any tensor's Python object (a view would outlive it and copy from
    pageable memory). `release` (or the object's death) unregisters only after the device has finished every
    queued copy, on every stream, that may still touch the bytes.

    The pages are faulted in on every core first (`fault_seconds`), then registered as `chunks` of at most
    REGISTER_CHUNK bytes each (`pin_seconds`): one call faults pages in on one thread at 2-4 GB/s, and a call
    of 512 GiB or more fails on recent drivers.
    """

    def __init__(self, nbytes: int, device: torch.device):
        self.data = _page_aligned(nbytes, host_device_for(device))
        self.chunks = chunk_ranges(self.data.data_ptr(), nbytes, REGISTER_CHUNK)
        self.pinned = pins(device) and nbytes > 0
        start = time.perf_counter()
        if self.data.device.type == "cpu":
            prefault(self.data)
        faulted = time.perf_counter()
        if self.pinned:
            _register(self.chunks, nbytes)
        self.fault_seconds, self.pin_seconds = faulted - start, time.perf_counter() - faulted
        if self.pinned:
            log.info(
                "pinned %s of host memory: pages faulted in %.1f s, registered in %.1f s",
                format_bytes(nbytes),
                self.fault_seconds,
                self.pin_seconds,
            )
        # runs before `data` is dropped (weak references die first), so the bytes are never freed while pinned
        ptrs = [ptr for ptr, _ in self.chunks]
        self._unpin = weakref.finalize(self, _unregister, ptrs, device) if self.pinned else None

    def release(self) -> None:
        """Unpins now (idempotent), after synchronising the device; `data` stays usable as pageable memory."""
        if self._unpin is not None:
            self._unpin()


def _page_aligned(nbytes: int, device: torch.device) -> torch.Tensor:
    """Returns `nbytes` uninitialised bytes that start a page and own every page they touch, so no other
    allocation's registration can overlap theirs."""
    raw = torch.empty(-(-nbytes // PAGE) * PAGE + PAGE, dtype=torch.uint8, device=device)
    at = -raw.data_ptr() % PAGE
    return raw[at : at + nbytes]


def chunk_ranges(ptr: int, nbytes: int, cap: int) -> list[tuple[int, int]]:
    """Returns (address, bytes) of consecutive pieces of at most `cap` bytes that cover [ptr, ptr + nbytes)."""
    return [(ptr + at, min(cap, nbytes - at)) for at in range(0, nbytes, cap)]


def prefault(data: torch.Tensor) -> None:
    """Backs every page of `data` (host bytes that start a page) with memory now, on all cores: each thread asks
    the kernel to fault in one piece (MADV_POPULATE_WRITE); before Linux 5.14 one byte per page is written
    instead, on torch's threads. Threads of our own, since torchrun sets OMP_NUM_THREADS=1."""
    threads = max(1, min(_cores(), data.numel() // PREFAULT_PIECE))
    step = max(PAGE, -(-data.numel() // (threads * PAGE)) * PAGE)
    with ThreadPoolExecutor(threads) as pool:
        populated = all(pool.map(_populate, [data[at : at + step] for at in range(0, data.numel(), step)]))
    if not populated:
        data[::PAGE].fill_(0)


def _populate(piece: torch.Tensor) -> bool:
    """Returns whether the kernel faulted in `piece` for writing (Linux >= 5.14 only)."""
    return sys.platform == "linux" and _libc().madvise(piece.data_ptr(), piece.numel(), MADV_POPULATE_WRITE) == 0


def _cores() -> int:
    """Returns the cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _register(chunks: list[tuple[int, int]], nbytes: int) -> None:
    """Page-locks every chunk. On a failure it unpins those done and clears the error CUDA latched (the next
    kernel launch would raise it), then raises one line naming the size and `--host-budget`."""
    for i, (ptr, size) in enumerate(chunks):
        error = int(_cudart().cudaHostRegister(ptr, size, 0))
        if error:
            for done, _ in chunks[:i]:
                _cudart().cudaHostUnregister(done)
            _clear_cuda_error()
            raise RuntimeError(
                f"could not pin {format_bytes(nbytes)} of host memory (cudaHostRegister error {error} at "
                f"{format_bytes(ptr - chunks[0][0])}); lower `--host-budget` (or `--alpha`) or free host memory"
            )


def _unregister(ptrs: list[int], device: torch.device) -> None:
    synchronize(device)
    for ptr in ptrs:
        _cudart().cudaHostUnregister(ptr)


def synchronize(device: torch.device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int = 1) -> float:
    """Returns the mean wall seconds of `fn()` over `repeats` runs, after one warm-up run."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / repeats


EXPANDABLE = "expandable_segments:True"


def use_expandable_segments() -> str:
    """Returns the CUDA caching allocator's settings for this process, after turning on expandable segments
    unless the user set PYTORCH_CUDA_ALLOC_CONF: a pool grows one segment instead of cutting new ones, so a
    long-context step's large, varied tensors leave far less reserved-but-unusable memory (torchtitan and
    DeepSpeed's long-sequence recipes do the same)."""
    given = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if given:
        return given
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE  # read when the allocator starts
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # started already: change it in place
        torch.cuda.memory._set_allocator_settings(EXPANDABLE)
    return EXPANDABLE


# Of a node's host memory, what memo may pin (the activations' pool and offloaded model states). Pinned pages
# cannot be swapped or reclaimed; the rest stays for the OS and page cache, each rank's own memory (CUDA
# context, Python, data loading) and a checkpoint's staging copy of the states (docs/estimate.md, host memory)
HOST_USABLE = 0.75


def available_host_bytes(root: str | Path = "/") -> int:
    """Returns the host memory this process may still fill: the least of what the OS reports available and the
    headroom of each memory cgroup it is in, whose limit gets the process killed however much RAM the machine
    has free. `root` stands for / (tests give a fake tree)."""
    root = Path(root)
    return min([_mem_available(root), *cgroup_headrooms(root)])


def _mem_available(root: Path) -> int:
    """Returns MemAvailable of root/proc/meminfo, or total RAM if unknown."""
    for line in _lines(root / "proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_CGROUP_FILES = {  # limit, usage, and the memory.stat key of page cache the kernel drops before it kills
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    "v2": ("memory.max", "memory.current", "inactive_file"),
}


def cgroup_headrooms(root: Path) -> list[int]:
    """Returns limit - usage (inactive page cache counted as free) for this process's memory cgroup and each
    ancestor that has a limit: cgroup v1's memory controller where mounted, else cgroup v2's; [] if neither."""
    entries = [line.split(":", 2) for line in _lines(root / "proc/self/cgroup") if line.count(":") >= 2]
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            return _headrooms(root / "sys/fs/cgroup/memory", path, _CGROUP_FILES["v1"])
    for hierarchy, _, path in entries:
        if hierarchy == "0":
            return _headrooms(root / "sys/fs/cgroup", path, _CGROUP_FILES["v2"])
    return []


def _headrooms(base: Path, path: str, files: tuple[str, str, str]) -> list[int]:
    """Returns the headroom of the cgroup at `path` under `base` and of its ancestors, those found with a limit
    (a container sees its own cgroup at `base`, however deep the path it is listed under)."""
    limit_file, usage_file, cache_key = files
    parts = PurePosixPath(path).parts[1:]
    found = []
    for depth in range(len(parts), -1, -1):
        folder = base.joinpath(*parts[:depth])
        limit, usage = _read_int(folder / limit_file), _read_int(folder / usage_file)
        if limit is not None and usage is not None:  # an absurd limit (v1's 2^63) never wins the min
            found.append(max(0, limit - usage + _stat(folder / "memory.stat", cache_key)))
    return found


def _stat(path: Path, key: str) -> int:
    """Returns the value of `key` in a memory.stat file (0 if absent)."""
    for line in _lines(path):
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _read_int(path: Path) -> int | None:
    """Returns the number in a cgroup file; None if it is missing or says "max" (no limit)."""
    text = "".join(_lines(path)).strip()
    return int(text) if text.isdigit() else None


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


def check_device(name: str) -> torch.device:
    """Returns `torch.device(name)` once this machine is known to have it; ValueError naming `--device` if not."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"`--device` {name!r} is not a torch device; use cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return device
    backend = torch.backends.mps if device.type == "mps" else getattr(torch, device.type, None)
    if backend is None or not backend.is_available():
        raise ValueError(f"`--device {name}`: this machine has no {device.type} device; use `--device cpu`")
    count = torch.cuda.device_count() if device.type == "cuda" else 1
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"`--device {name}`: this machine has {count} {device.type} device(s), {device.type}:0 to {count - 1}"
        )
    return device


def free_memory_bytes(device: torch.device) -> int | None:
    """Returns the memory a run on `device` can still take: free device memory on CUDA, available host memory
    on CPU; None where unknown."""
    if device.type == "cpu":
        return available_host_bytes()
    if is_cuda(device):
        return torch.cuda.mem_get_info(device)[0]
    return None
