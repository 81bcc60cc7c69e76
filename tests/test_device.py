"""Pinned host memory stays registered while any copy can touch it, checked with a fake `cudart` on CPU.

The fake stands in for CUDA's host registration: it logs register / unregister / device synchronisation, and
a dispatch mode logs every copy that touches host memory, so a test sees the order CUDA would see. The bytes
are faulted in before they are registered (mincore(2) says whether they were) and registered in capped chunks.
"""

import ctypes
import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memo import ActivationPolicy, ModelConfig, Transformer
from memo import device as dev
from memo.swap import measure_copy_bandwidth


class FakeCudart:
    """Logs cudaHostRegister / cudaHostUnregister and refuses what CUDA refuses (double registration)."""

    def __init__(self, log: list):
        self.log, self.pinned = log, {}

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        if any(p < ptr + nbytes and ptr < p + n for p, n in self.pinned.items()):
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.pinned[ptr] = nbytes
        self.log.append(("register", ptr))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        if self.pinned.pop(ptr, None) is None:
            return 713  # cudaErrorHostMemoryNotRegistered
        self.log.append(("unregister", ptr))
        return 0

    def is_pinned(self, t: torch.Tensor) -> bool:
        at = t.data_ptr()
        return any(p <= at < p + n for p, n in self.pinned.items())


class CopyLog(TorchDispatchMode):
    """Logs each copy with whether its host side (destination, else source) was pinned at that moment."""

    def __init__(self, fake: FakeCudart, host_ranges):
        super().__init__()
        self.fake, self.host_ranges = fake, host_ranges

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            for t in args[:2]:
                at = t.data_ptr()
                owner = next((p for p, n in self.host_ranges() if p <= at < p + n), None)
                if owner is not None:
                    self.fake.log.append(("copy", owner, self.fake.is_pinned(t)))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_cuda(monkeypatch):
    """Makes CPU host buffers go through the pinning path with a fake cudart; returns it."""
    log = []
    fake = FakeCudart(log)
    monkeypatch.setattr(dev, "pins", lambda device: True)
    monkeypatch.setattr(dev, "_cudart", lambda: fake)
    monkeypatch.setattr(dev, "synchronize", lambda device: log.append(("sync",)))
    return fake


def _check_order(log: list) -> None:
    """Every host-side copy hit pinned memory, and each unregister follows a sync that follows its last copy."""
    assert all(entry[2] for entry in log if entry[0] == "copy"), "a copy touched host memory that was not pinned"
    for i, entry in enumerate(log):
        if entry[0] != "unregister":
            continue
        last_copy = max((j for j in range(i) if log[j][:2] == ("copy", entry[1])), default=-1)
        assert any(log[j] == ("sync",) for j in range(last_copy + 1, i)), f"unpinned at {i} without a sync"


def test_bandwidth_is_measured_into_memory_that_stays_pinned_until_the_device_is_done(fake_cuda):
    ranges = []
    real = dev.HostBuffer.__init__

    def remember(self, nbytes, device):
        real(self, nbytes, device)
        ranges.append((self.data.data_ptr(), nbytes))

    with pytest.MonkeyPatch.context() as mp, CopyLog(fake_cuda, lambda: ranges):
        mp.setattr(dev.HostBuffer, "__init__", remember)
        assert measure_copy_bandwidth(torch.randn(4096)) > 0
    kinds = [e[0] for e in fake_cuda.log]
    assert kinds.count("copy") == 4 and kinds.count("register") == kinds.count("unregister") == 1
    _check_order(fake_cuda.log)
    assert fake_cuda.pinned == {}


@pytest.mark.parametrize("offload_last_layers", [False, True])
def test_swap_engine_unpins_an_old_pool_only_after_the_device_is_synchronised(fake_cuda, offload_last_layers):
    model = Transformer(
        ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.5, offload_last_layers=offload_last_layers)
    )

    store = model.store

    def pool_range():
        pool = store.pool
        return [] if pool is None else [(pool.buffer.data_ptr(), pool.nbytes)]

    with CopyLog(fake_cuda, pool_range):
        for seq in (16, 24, 24, 32, 16):  # a longer shape replaces the pool; a shorter one is served from it
            ids = torch.randint(0, 256, (1, seq))
            model(ids, labels=ids).backward()
    kinds = [e[0] for e in fake_cuda.log]
    assert kinds.count("register") == 3 and kinds.count("unregister") == 2 and kinds.count("copy") > 0
    _check_order(fake_cuda.log)
    assert fake_cuda.is_pinned(model.store.pool.buffer)
    model = store = None  # drop the engine: its pool must unpin
    gc.collect()
    assert fake_cuda.pinned == {}  # the last pool is released with its engine
    _check_order(fake_cuda.log)


def test_host_buffer_is_registered_page_aligned_in_chunks_within_the_cap_and_released_once(fake_cuda, monkeypatch):
    monkeypatch.setattr(dev, "REGISTER_CHUNK", 3 * dev.PAGE)
    nbytes = 10 * dev.PAGE + 5
    host = dev.HostBuffer(nbytes, torch.device("cpu"))
    assert host.data.numel() == nbytes and host.data.data_ptr() % dev.PAGE == 0
    ends = [ptr + size for ptr, size in host.chunks]
    assert [ptr for ptr, _ in host.chunks] == [host.data.data_ptr(), *ends[:-1]]  # consecutive, from the start
    assert ends[-1] == host.data.data_ptr() + nbytes and max(size for _, size in host.chunks) == 3 * dev.PAGE
    assert fake_cuda.pinned == dict(host.chunks) and host.pin_seconds >= 0 and host.fault_seconds >= 0
    host.release()
    host.release()
    assert fake_cuda.pinned == {} and [e[0] for e in fake_cuda.log] == ["register"] * 4 + ["sync"] + ["unregister"] * 4


def test_host_buffer_off_cuda_is_pageable_and_releases_idempotently():
    host = dev.HostBuffer(dev.PAGE + 1, torch.device("cpu"))
    assert not host.pinned and host.pin_seconds < 1 and [size for _, size in host.chunks] == [dev.PAGE + 1]
    host.release()
    host.release()
    host.data.fill_(7)  # still usable


class FailingCudart(FakeCudart):
    """Refuses the registration of one chunk, as a driver out of lockable memory does."""

    def __init__(self, log: list, fail_at: int):
        super().__init__(log)
        self.calls, self.fail_at = 0, fail_at

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls += 1
        return 2 if self.calls == self.fail_at else super().cudaHostRegister(ptr, nbytes, flags)  # out of memory


def test_a_failed_registration_unpins_what_it_pinned_clears_the_cuda_error_and_names_the_budget_flag(monkeypatch):
    log = []
    fake = FailingCudart(log, fail_at=3)
    monkeypatch.setattr(dev, "pins", lambda device: True)
    monkeypatch.setattr(dev, "_cudart", lambda: fake)
    monkeypatch.setattr(dev, "_clear_cuda_error", lambda: log.append(("clear",)))
    monkeypatch.setattr(dev, "REGISTER_CHUNK", 2 * dev.PAGE)
    with pytest.raises(RuntimeError, match=r"could not pin 40\.00KiB .*`--host-budget`") as error:
        dev.HostBuffer(10 * dev.PAGE, torch.device("cpu"))
    assert "\n" not in str(error.value)
    assert fake.pinned == {} and [e[0] for e in log] == ["register"] * 2 + ["unregister"] * 2 + ["clear"]


def _resident_pages(t: torch.Tensor) -> int:
    """Returns how many pages of `t` (page-aligned host bytes) are backed by memory, as mincore(2) reports."""
    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    pages = (ctypes.c_ubyte * (-(-t.numel() // dev.PAGE)))()
    assert libc.mincore(t.data_ptr(), t.numel(), pages) == 0
    return sum(p & 1 for p in pages)


@pytest.mark.parametrize("kernel_populates", [True, False], ids=["madvise", "write-a-byte-per-page"])
def test_prefault_backs_every_page_with_memory(monkeypatch, kernel_populates):
    if not kernel_populates:
        monkeypatch.setattr(dev, "_populate", lambda piece: False)  # a kernel older than 5.14
    monkeypatch.setattr(dev, "PREFAULT_PIECE", 1 << 20)  # several threads
    data = dev._page_aligned((64 << 20) + 5, torch.device("cpu"))  # above malloc's mmap threshold: fresh pages
    pages = -(-data.numel() // dev.PAGE)
    assert _resident_pages(data) < pages
    dev.prefault(data)
    assert _resident_pages(data) == pages
