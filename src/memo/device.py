"""The few CUDA-only calls (streams, events, pinning, timing), each degrading to synchronous CPU behaviour.

Every other module calls these, so the swap engine runs the same code on CPU, CUDA and `meta`.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from contextvars import ContextVar

import torch

_META_KERNELS: ContextVar[str] = ContextVar("memo_meta_kernels", default="cpu")


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


@contextlib.contextmanager
def meta_kernels(device_type: str):
    """Makes ops on `meta` tensors stand for the kernels of `device_type`, so a meta trace of a CUDA step
    allocates what the CUDA kernels allocate (the arena and the cost model plan a run before it happens)."""
    token = _META_KERNELS.set(device_type)
    try:
        yield
    finally:
        _META_KERNELS.reset(token)


def kernel_device_type(device: torch.device) -> str:
    """Returns the device type whose kernels run for tensors on `device`: its own, or on `meta` the one
    `meta_kernels` names (default cpu)."""
    return _META_KERNELS.get() if device.type == "meta" else device.type


def has_fused_kernel(op: str, device_type: str) -> bool:
    """Returns whether `op` ("aten::name") has a kernel of its own for `device_type`, not a decomposition.

    CUDA builds of torch >= 2.11 have the fused norm kernels; assuming them lets a CPU-only build trace a GPU
    step on meta. Elsewhere the dispatcher is asked (a test may register a kernel to mimic CUDA on CPU).
    """
    return device_type == "cuda" or torch._C._dispatch_has_kernel_for_dispatch_key(op, device_type.upper())


def new_stream(device: torch.device) -> torch.cuda.Stream | None:
    """Returns a side stream on CUDA; None elsewhere (copies then run in program order)."""
    return torch.cuda.Stream(device=device) if is_cuda(device) else None


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


class HostBuffer:
    """Host bytes for copies from `device`, page-locked for exactly the life of this object on CUDA.

    Pinning registers exactly `nbytes` (cudaHostRegister) rather than using `pin_memory=True`, whose caching
    host allocator rounds every request up to a power of two and keeps freed blocks: a 17 GiB pool would lock
    32 GiB and never give it back. This object owns the registration: views of `data` keep only its storage,
    so the registration must not hang on any tensor's Python object (a view would outlive it and copy from
    pageable memory). `release` (or the object's death) unregisters only after the device has finished every
    queued copy, on every stream, that may still touch the bytes.
    """

    def __init__(self, nbytes: int, device: torch.device):
        self.data = torch.empty(nbytes, dtype=torch.uint8, device=host_device_for(device))
        self.pinned = pins(device) and nbytes > 0
        if self.pinned and _cudart().cudaHostRegister(self.data.data_ptr(), nbytes, 0) != 0:
            raise RuntimeError(f"could not pin {nbytes} bytes of host memory (cudaHostRegister failed)")
        # runs before `data` is dropped (weak references die first), so the bytes are never freed while pinned
        self._unpin = weakref.finalize(self, _unregister, self.data.data_ptr(), device) if self.pinned else None

    def release(self) -> None:
        """Unpins now (idempotent), after synchronising the device; `data` stays usable as pageable memory."""
        if self._unpin is not None:
            self._unpin()


def _unregister(ptr: int, device: torch.device) -> None:
    synchronize(device)
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


def available_host_bytes() -> int:
    """Returns the host memory the OS reports as available (MemAvailable), or total RAM if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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
