"""Pinned host memory stays registered while any copy can touch it, checked with a fake `cudart` on CPU.

The fake stands in for CUDA's host registration: it logs register / unregister / device synchronisation, and
a dispatch mode logs every copy that touches host memory, so a test sees the order CUDA would see.
"""

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
        for seq in (16, 24, 24, 16):  # every shape change replaces the pool
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
