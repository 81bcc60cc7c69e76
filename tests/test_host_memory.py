"""How much host memory a run may take, and how fast it can fill it: the least of MemAvailable and the memory
cgroups' headroom (fake cgroup trees), the copy bandwidth every rank of a node agrees on (2 gloo ranks), and on
a GPU the streams and pinned chunks those copies use."""

from __future__ import annotations

import ctypes
import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memo import device as dev
from memo.swap import measure_copy_bandwidth

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams and host registration")
GIB = 1 << 30
UNLIMITED_V1 = "9223372036854771712"  # what cgroup v1 reports for "no limit"


def _tree(root, cgroup: str, files: dict[str, str], available: int = 100 * GIB):
    """Writes a fake / under `root`: /proc/meminfo with MemAvailable, /proc/self/cgroup, and cgroup `files`."""
    for path, text in {
        "proc/meminfo": f"MemTotal: {200 * GIB // 1024} kB\nMemAvailable: {available // 1024} kB\n",
        "proc/self/cgroup": cgroup,
        **files,
    }.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_cgroup_v1_headroom_is_the_tightest_ancestor_with_inactive_page_cache_counted_free(tmp_path):
    job = "sys/fs/cgroup/memory/slurm/job_7"
    root = _tree(
        tmp_path,
        "4:memory:/slurm/job_7\n1:cpu,cpuacct:/slurm/job_7\n0::/\n",
        {
            f"{job}/memory.limit_in_bytes": UNLIMITED_V1,
            f"{job}/memory.usage_in_bytes": str(GIB),
            "sys/fs/cgroup/memory/slurm/memory.limit_in_bytes": str(6 * GIB),
            "sys/fs/cgroup/memory/slurm/memory.usage_in_bytes": str(5 * GIB),
            "sys/fs/cgroup/memory/slurm/memory.stat": f"cache {3 * GIB}\ntotal_inactive_file {GIB // 2}\n",
            "sys/fs/cgroup/memory.max": str(GIB),  # a v2 file the hybrid layout's v1 memory controller overrides
        },
    )
    assert dev.available_host_bytes(root) == 6 * GIB - 5 * GIB + GIB // 2


def test_cgroup_v2_limit_below_memavailable_wins_even_listed_under_a_host_path(tmp_path):
    v2 = {"memory.max": str(8 * GIB), "memory.current": str(3 * GIB), "memory.stat": f"inactive_file {GIB}\n"}
    own = _tree(
        tmp_path / "own",
        "0::/user.slice/job.scope\n",
        {f"sys/fs/cgroup/user.slice/job.scope/{name}": text for name, text in v2.items()},
    )
    assert dev.available_host_bytes(own) == 6 * GIB
    # a container without its own cgroup namespace: listed under the host's path, its cgroup mounted at the root
    container = _tree(
        tmp_path / "container",
        "0::/system.slice/docker-1a2b.scope\n",
        {f"sys/fs/cgroup/{name}": text for name, text in v2.items()},
    )
    assert dev.available_host_bytes(container) == 6 * GIB


@pytest.mark.parametrize(
    "cgroup, files",
    [
        ("0::/job\n", {"sys/fs/cgroup/job/memory.max": "max\n", "sys/fs/cgroup/job/memory.current": str(GIB)}),
        (
            "4:memory:/\n",
            {
                "sys/fs/cgroup/memory/memory.limit_in_bytes": UNLIMITED_V1,
                "sys/fs/cgroup/memory/memory.usage_in_bytes": str(GIB),
            },
        ),
        ("0::/job\n", {}),  # listed, but no cgroup files mounted
        (None, {}),  # no /proc/self/cgroup at all
    ],
    ids=["v2-max", "v1-unlimited", "files-missing", "no-cgroup"],
)
def test_without_a_cgroup_limit_the_budget_is_memavailable(tmp_path, cgroup, files):
    root = _tree(tmp_path, cgroup or "", files, available=12 * GIB)
    if cgroup is None:
        (root / "proc/self/cgroup").unlink()
    assert dev.available_host_bytes(root) == 12 * GIB


def test_on_this_machine_the_budget_is_at_most_memavailable():
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert 0 < dev.available_host_bytes() <= available + (256 << 20)  # other processes come and go meanwhile


def _measure_on_rank(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        seconds, real = [], dev.timed

        def slower_on_later_ranks(fn, device, repeats=1):  # rank r measures r seconds more than its copies took
            seconds.append(real(fn, device, repeats) + rank)
            return seconds[-1]

        src = torch.randn(1 << 16)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dev, "timed", slower_on_later_ranks)
            agreed = measure_copy_bandwidth(src)
        own = src.numel() * src.element_size() / seconds[0]
        every = [None] * world
        dist.all_gather_object(every, (own, agreed))
        assert len(seconds) == 1 and len({own for own, _ in every}) == world
        assert all(agreed == min(own for own, _ in every) for _, agreed in every)
    finally:
        dist.destroy_process_group()


def test_ranks_copy_together_and_agree_on_the_slowest_bandwidth(free_port):
    mp.spawn(_measure_on_rank, args=(2, free_port()), nprocs=2)


@CUDA
def test_on_a_gpu_memo_streams_are_its_own_non_blocking_ones_and_are_reused_once_dropped():
    device = torch.device("cuda")
    ours = [dev.new_stream(device) for _ in range(3)]
    pooled = {torch.cuda.Stream(device=device).cuda_stream for _ in range(64)}  # each default-priority one, twice
    handles = {s.cuda_stream for s in ours}
    assert len(handles) == 3 and not handles & pooled
    for handle in handles:
        flags = ctypes.c_uint()
        assert dev.cuda_runtime().cudaStreamGetFlags(ctypes.c_void_p(handle), ctypes.byref(flags)) == 0
        assert flags.value == dev.CUDA_STREAM_NON_BLOCKING
    ours = None
    gc.collect()
    again = [dev.new_stream(device) for _ in range(3)]
    assert {s.cuda_stream for s in again} == handles


@CUDA
def test_on_a_gpu_copies_on_memo_streams_across_pinned_chunks_are_exact(monkeypatch):
    device = torch.device("cuda")
    monkeypatch.setattr(dev, "REGISTER_CHUNK", 1 << 20)
    host = dev.HostBuffer(4 << 20, device)
    assert len(host.chunks) == 4 and host.data.is_pinned()
    x = torch.randn(1 << 20, device=device)  # 4 MiB: crosses every chunk boundary
    stream = dev.new_stream(device)
    ready = dev.record_event(device)
    with dev.on_stream(stream):
        dev.wait_event(ready, stream)
        host.data.view(torch.float32).copy_(x, non_blocking=True)
        done = dev.record_event(device, stream)
    done.synchronize()
    assert torch.equal(host.data.view(torch.float32), x.cpu())
    host.release()


@CUDA
def test_on_a_gpu_a_refused_registration_leaves_no_error_for_the_next_kernel():
    device = torch.device("cuda")
    host = dev.HostBuffer(1 << 20, device)
    with pytest.raises(RuntimeError, match="`--host-budget`"):
        dev._register(host.chunks, 1 << 20)  # the same bytes again: CUDA refuses, they are registered already
    torch.ones(4, device=device).add_(1)  # raises CUDA's latched error if it was not cleared
    torch.cuda.synchronize(device)
    assert host.data.is_pinned()  # the first registration stands
    host.release()
