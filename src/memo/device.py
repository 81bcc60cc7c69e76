"""The few CUDA-only calls (streams, events, pinning, timing), each degrading to synchronous CPU behaviour.

Every other module calls these, so the swap engine runs the same code on CPU, CUDA and `meta`.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref

import torch


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


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


def empty_host(nbytes: int, device: torch.device) -> torch.Tensor:
    """Returns a byte buffer in host memory for copies from `device`, page-locked when `device` is CUDA.

    Pinning registers exactly `nbytes` (cudaHostRegister) rather than using `pin_memory=True`, whose caching
    host allocator rounds every request up to a power of two and keeps freed blocks: a 17 GiB pool would
    lock 32 GiB and never give it back.
    """
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=host_device_for(device))
    if is_cuda(device) and nbytes:
        cudart = torch.cuda.cudart()
        ptr = buffer.data_ptr()
        if cudart.cudaHostRegister(ptr, nbytes, 0) != 0:
            raise RuntimeError(f"could not pin {nbytes} bytes of host memory (cudaHostRegister failed)")
        weakref.finalize(buffer, cudart.cudaHostUnregister, ptr)  # views keep `buffer` alive via ._base
    return buffer


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
