"""The planned allocator (memo.plan.allocator) against PyTorch's own CPU allocator on the same steps: losses and
every gradient bit-identical, every planned allocation served once the plan settles, the arena within 1% of the
recorded LOAD; a step of another shape re-plans, a tensor freed later than recorded is a counted pass-through
(its memory never handed out twice), tensors that outlive a step (optimizer state) stay out of the arena. The CUDA
path runs over host stand-ins for the CUDA runtime: the same service with and without memory pools, the pool told to
keep what is freed and its high-water marks read and reset, a device out of memory raised as torch.OutOfMemoryError
with the runtime's error cleared; the runtime's library is found among the mapped files by its name."""

from __future__ import annotations

import contextlib
import ctypes
from collections import Counter

import pytest
import torch

from memo import ActivationPolicy, ModelConfig, Transformer
from memo import device as dev
from memo.cli import main
from memo.plan import allocator
from memo.plan.allocator import PlannedAllocator

WORK = 1_000_000_000  # the plan's DSA budget in search work, not seconds: the same plan at any machine load
STEPS = 6  # steps 1 (which also makes the optimizer state) to 3 are recorded, 3 is planned, 4-6 are served


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: requests come in one order, so every planned one is served (with two, buffers that
    threads allocate side by side may swap places; `test_two_intra_op_threads...` checks the results then)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _policy(strategy: str) -> ActivationPolicy:
    return ActivationPolicy(strategy, alpha=0.5 if strategy == "memo" else None)


def _batch(step: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (2, seq), generator=g), torch.randint(0, 256, (2, seq), generator=g)


def _train(preset, strategy, dtype, planned: bool, seqs=(64,) * STEPS, keep_at: int | None = None):
    """Trains `len(seqs)` steps; returns per step (loss, gradients, the allocator's counters after it, the tensor
    kept past its step or None), with the planned allocator or PyTorch's."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.preset(preset), _policy(strategy)).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    arena = PlannedAllocator(time_limit=None, work_limit=WORK) if planned else None
    out, kept = [], []
    with arena or contextlib.nullcontext():
        for step, seq in enumerate(seqs, 1):
            ids, targets = _batch(step, seq)
            hook = model.layers[0].register_forward_hook(lambda m, i, o: kept.append(o)) if step == keep_at else None
            with arena.step() if arena else contextlib.nullcontext():
                loss = model(ids, targets=targets)
                loss.backward()
                grads = [p.grad.clone() for p in model.parameters()]
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if hook:
                hook.remove()
            counters = arena.counters() if arena else {}
            out.append((loss.item(), grads, counters, arena.plan if arena else None, kept[0].clone() if kept else None))
            kept.clear()
        state = [s["exp_avg"] for s in optimizer.state.values()]
    return out, state


def _same(planned, reference) -> None:
    for step, (got, want) in enumerate(zip(planned, reference), 1):
        assert got[0] == want[0], f"step {step}: loss {got[0]} != {want[0]}"
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1])), f"step {step}: gradients differ"


def _served(before: dict, after: dict) -> int:
    return after["served"] - before["served"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["none", "full", "memo"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_planned_steps_match_the_default_allocator_bit_for_bit_and_are_all_served(preset, strategy, dtype):
    planned, _ = _train(preset, strategy, dtype, planned=True)
    reference, _ = _train(preset, strategy, dtype, planned=False)
    _same(planned, reference)
    plan = planned[-1][3]
    assert plan.arena_bytes <= 1.01 * plan.load_bytes
    assert planned[1][3] is None  # steps 1 and 2 differ: nothing is planned before two agree
    for step in (4, 5, 6):  # every planned allocation served, no miss
        before, after = planned[step - 2][2], planned[step - 1][2]
        assert _served(before, after) == plan.planned and after["misses"] == before["misses"], step


def test_a_step_of_another_length_leaves_the_plan_and_the_next_is_served_from_a_new_one():
    seqs = (64, 64, 64, 128, 128, 128, 128)
    planned, _ = _train("tiny", "memo", torch.float32, planned=True, seqs=seqs)
    reference, _ = _train("tiny", "memo", torch.float32, planned=False, seqs=seqs)
    _same(planned, reference)
    counters = [c for _, _, c, _, _ in planned]
    assert counters[3]["misses"] == counters[2]["misses"] + 1  # step 4 derails once, the rest passes through
    # step 4 also makes the RoPE table of the new length (it outlives the step): 5 and 6 agree, 6 is planned
    assert planned[3][3] is None and planned[5][3].load_bytes > planned[2][3].load_bytes
    assert _served(counters[5], counters[6]) == planned[6][3].planned


def test_a_tensor_freed_later_than_recorded_is_passed_through_never_overwritten():
    planned, _ = _train("tiny", "memo", torch.float32, planned=True, keep_at=4)
    reference, _ = _train("tiny", "memo", torch.float32, planned=False, keep_at=4)
    _same(planned, reference)
    assert planned[3][2]["collisions"] > 0  # regions it still held went to the default allocator instead
    assert torch.equal(planned[3][4], reference[3][4])  # and what it holds was not overwritten


def test_tensors_that_outlive_their_step_stay_outside_the_arena():
    planned, state = _train("tiny", "memo", torch.float32, planned=True)
    counters, plan = planned[-1][2], planned[-1][3]
    start, end = counters["arena_address"], counters["arena_address"] + counters["arena_bytes"]
    assert state and all(not start <= t.data_ptr() < end for t in state)  # AdamW's moments, made in step 1
    assert plan.planned < plan.requests  # the loss outlives the step: it passes through


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_intra_op_threads_give_the_same_results_planned_or_not(dtype):
    torch.set_num_threads(2)
    planned, _ = _train("tiny-gpt", "memo", dtype, planned=True)
    reference, _ = _train("tiny-gpt", "memo", dtype, planned=False)
    _same(planned, reference)
    assert _served(planned[1][2], planned[-1][2]) > 0  # the plan serves at two threads too


def test_memo_train_arena_records_its_service_per_step(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--arena", "--seq-len", "64", "--batch-size", "2", "--steps", "5", "--out", str(run)]) == 0
    assert "0 misses, 0 collisions" in capsys.readouterr().out
    records = [
        r for r in map(__import__("json").loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]
    last = records[-1]
    assert (
        last["arena_served"] > 0
        and last["arena_misses"] == 0
        and last["arena_bytes"] <= 1.01 * last["arena_load_bytes"]
    )


def test_without_a_compiler_arena_is_one_line_and_the_rest_works(monkeypatch, tmp_path, capsys):
    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension: g++ not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    allocator.extension.cache_clear()
    try:
        argv = ["train", "--seq-len", "64", "--batch-size", "2", "--steps", "1", "--out", str(tmp_path / "a")]
        assert main([*argv, "--arena"]) == 2
        err = capsys.readouterr().err
        assert "`--arena` needs a C++ compiler" in err and len(err.strip().splitlines()) == 1
        assert main([*argv[:-1], str(tmp_path / "b"), "--json"]) == 0
    finally:
        allocator.extension.cache_clear()


# ---- the CUDA path, run on the CPU: the device core over host stand-ins for the CUDA runtime, called through the
# C function CUDAPluggableAllocator loads ------------------------------------------------------------------------

STREAM, SIDE = 0x1000, 0x2000  # two stream handles: the step's, and a side stream's
POOL = 0x9000  # the stand-in device's default memory pool
OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation
LIBC = ctypes.CDLL(None)
LIBC.malloc.restype, LIBC.malloc.argtypes, LIBC.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
_INT, _PTR, _OUT = ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
SIGNATURES = {  # the CUDA runtime's (cudaError_t and its enums are ints): result type first
    "cudaMallocAsync": (_INT, _OUT, ctypes.c_size_t, _PTR),
    "cudaFreeAsync": (_INT, _PTR, _PTR),
    "cudaMalloc": (_INT, _OUT, ctypes.c_size_t),
    "cudaFree": (_INT, _PTR),
    "cudaGetLastError": (_INT,),
    "cudaGetErrorString": (_PTR, _INT),  # a const char* the stand-in keeps alive
    "cudaDeviceGetAttribute": (_INT, ctypes.POINTER(_INT), _INT, _INT),
    "cudaDeviceGetDefaultMemPool": (_INT, _OUT, _INT),
    "cudaMemPoolSetAttribute": (_INT, _PTR, _INT, _PTR),
    "cudaMemPoolGetAttribute": (_INT, _PTR, _INT, _PTR),
}
RELEASE_THRESHOLD, RESERVED, RESERVED_HIGH, USED, USED_HIGH = 4, 5, 6, 7, 8  # cudaMemPoolAttr values


class HostCuda:
    """Host stand-ins for the CUDA runtime functions the device core calls, behaving as the runtime documents them:
    memory from malloc, at most `capacity` bytes at once (past it a request fails with cudaErrorMemoryAllocation,
    which stays the runtime's last error until cudaGetLastError reads it), `error` the code every allocation fails
    with if set, and where the device has memory `pools` one default pool that keeps what it reserved, with its
    release threshold as set and its reserved and used bytes and their high-water marks (setting a mark to 0 resets
    it to the current value)."""

    def __init__(self, pools: bool = True, capacity: int = 1 << 30, error: int = 0):
        self.pools, self.capacity, self.error = pools, capacity, error
        self.calls: Counter = Counter()
        self.sizes: dict[int, int] = {}  # live allocation -> bytes
        self.last_error = 0
        self.threshold = None
        self.reserved = self.reserved_high = self.used_high = 0
        self._message = ctypes.create_string_buffer(b"a stand-in CUDA error")
        self.functions = {name: ctypes.CFUNCTYPE(*sig)(self._counted(name)) for name, sig in SIGNATURES.items()}
        allocator.make_device_core({name: ctypes.cast(f, ctypes.c_void_p).value for name, f in self.functions.items()})

    def _counted(self, name):
        def call(*args):
            self.calls[name] += 1
            return getattr(self, name)(*args)

        return call

    def cudaMallocAsync(self, data, n, stream):
        failed = self.error or (OUT_OF_MEMORY if sum(self.sizes.values()) + n > self.capacity else 0)
        if failed:
            self.last_error = failed
            return failed
        data[0] = LIBC.malloc(n)
        self.sizes[data[0]] = n
        used = sum(self.sizes.values())
        self.reserved, self.used_high = max(self.reserved, used), max(self.used_high, used)
        self.reserved_high = max(self.reserved_high, self.reserved)
        return 0

    def cudaMalloc(self, data, n):
        return self.cudaMallocAsync(data, n, None)

    def cudaFreeAsync(self, data, stream):
        del self.sizes[data]
        LIBC.free(data)
        return 0

    def cudaFree(self, data):
        return self.cudaFreeAsync(data, None)

    def cudaGetLastError(self):
        error, self.last_error = self.last_error, 0
        return error

    def cudaGetErrorString(self, error):
        return ctypes.addressof(self._message)

    def cudaDeviceGetAttribute(self, value, attribute, device):
        value[0] = int(self.pools and attribute == 115)  # cudaDevAttrMemoryPoolsSupported
        return 0

    def cudaDeviceGetDefaultMemPool(self, pool, device):
        pool[0] = POOL
        return 0

    def cudaMemPoolSetAttribute(self, pool, attribute, value):
        value = ctypes.cast(value, ctypes.POINTER(ctypes.c_uint64))[0]
        if attribute == RELEASE_THRESHOLD:
            self.threshold = value
        elif attribute == RESERVED_HIGH and value == 0:
            self.reserved_high = self.reserved
        elif attribute == USED_HIGH and value == 0:
            self.used_high = sum(self.sizes.values())
        return 0 if pool == POOL else 1  # cudaErrorInvalidValue

    def cudaMemPoolGetAttribute(self, pool, attribute, value):
        now = {RESERVED: self.reserved, RESERVED_HIGH: self.reserved_high, USED: sum(self.sizes.values())}
        ctypes.cast(value, ctypes.POINTER(ctypes.c_uint64))[0] = {**now, USED_HIGH: self.used_high}[attribute]
        return 0 if pool == POOL else 1


@pytest.fixture(scope="module")
def device_lib():
    """The extension's C functions, as CUDAPluggableAllocator loads them (device_malloc: memo_device_malloc, whose
    C++ exceptions reach Python as they reach PyTorch's bindings)."""
    lib = ctypes.CDLL(allocator.extension().__file__)
    lib.memo_device_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return lib


def _malloc(n: int, stream: int = STREAM) -> int:
    return allocator.extension().device_malloc(n, 0, stream)


def _device_step(lib, arena, first: int = 4096, side: bool = False) -> dict[str, int]:
    """A toy step on the device: a and b alive together, a freed, c in a's place, then b and c freed; the step
    returns `kept` (it outlives the step). Every buffer is written, as kernels would."""

    def malloc(n, stream=STREAM):
        ptr = _malloc(n, stream)
        ctypes.memset(ptr, 7, n)
        return ptr

    with arena.step():
        a, b = malloc(first), malloc(8192)
        lib.memo_device_free(a, first, 0, STREAM)
        c = malloc(first)
        if side:  # another stream's request: never planned, never in the log
            lib.memo_device_free(malloc(1024, SIDE), 1024, 0, SIDE)
        for ptr, n in ((b, 8192), (c, first)):
            lib.memo_device_free(ptr, n, 0, STREAM)
        kept = malloc(512)
    return {"a": a, "b": b, "c": c, "kept": kept}


@pytest.mark.parametrize("pools", [True, False], ids=["memory-pools", "no-memory-pools"])
def test_the_device_path_plans_the_steps_stream_and_serves_it_from_one_arena(device_lib, pools):
    cuda = HostCuda(pools=pools)
    arena = PlannedAllocator(torch.device("cuda"), install=False)
    arena._stream = lambda: STREAM
    kept = []
    with arena:
        for _ in range(2):
            kept.append(_device_step(device_lib, arena)["kept"])
        plan = arena.plan
        assert (plan.requests, plan.planned, plan.load_bytes, plan.arena_bytes) == (4, 3, 12288, 12288)
        before = arena.counters()
        got = _device_step(device_lib, arena, side=True)
        kept.append(got["kept"])
        after = arena.counters()
        assert _served(before, after) == 3 and after["misses"] == before["misses"]
        start, end = after["arena_address"], after["arena_address"] + after["arena_bytes"]
        assert all(start <= got[k] < end for k in "abc") and not start <= got["kept"] < end
        assert got["c"] == got["a"]  # at LOAD, c can only take a's place
        assert arena.recorded() == [[4096, 0, 2], [8192, 1, 4], [4096, 3, 5], [512, 6, -1]]  # the side request is not
        before = arena.counters()
        kept.append(_device_step(device_lib, arena, first=2048)["kept"])  # another shape: a miss, recorded anew
        assert arena.counters()["misses"] == before["misses"] + 1 and arena.plan is None
    for ptr in kept:
        device_lib.memo_device_free(ptr, 512, 0, STREAM)
    assert arena.counters()["live_in_arena"] == 0 and not cuda.sizes
    async_calls = cuda.calls["cudaMallocAsync"] + cuda.calls["cudaFreeAsync"]
    plain_calls = cuda.calls["cudaMalloc"] + cuda.calls["cudaFree"]
    assert (async_calls > 0, plain_calls > 0) == (pools, not pools)  # without pools: cudaMalloc and cudaFree


def test_the_device_pool_keeps_what_is_freed_and_reports_its_high_water_marks(device_lib):
    cuda = HostCuda()
    assert allocator.pool_high_water() is None  # no request yet: the core has not met its device's pool
    a, b = _malloc(4096), _malloc(8192)
    assert cuda.threshold == 2**64 - 1  # keep everything, as PyTorch's cudaMallocAsync backend sets it
    for ptr, n in ((a, 4096), (b, 8192)):
        device_lib.memo_device_free(ptr, n, 0, STREAM)
    assert allocator.pool_high_water() == {"reserved": 12288, "reserved_peak": 12288, "used": 0, "used_peak": 12288}
    allocator.reset_pool_high_water()
    assert allocator.pool_high_water() == {"reserved": 12288, "reserved_peak": 12288, "used": 0, "used_peak": 0}
    with pytest.raises(RuntimeError, match="one GPU per process: cuda:0, not cuda:1"):
        allocator.extension().device_malloc(512, 1, STREAM)


def test_without_memory_pools_there_are_no_pool_figures(device_lib):
    cuda = HostCuda(pools=False)
    device_lib.memo_device_free(_malloc(4096), 4096, 0, STREAM)
    assert allocator.pool_high_water() is None and cuda.threshold is None and cuda.calls["cudaMalloc"] == 1


def test_device_out_of_memory_raises_torch_out_of_memory_and_clears_the_runtimes_error(device_lib):
    cuda = HostCuda(capacity=10_000)
    held = _malloc(8192)
    with pytest.raises(torch.OutOfMemoryError, match="could not get 4096 bytes for a request"):
        _malloc(4096)
    assert cuda.last_error == 0  # read and cleared: the next kernel launch check does not report it
    with pytest.raises(torch.OutOfMemoryError, match="could not get 16384 bytes for the planned arena"):
        allocator.extension().set_plan("device", [16384], [0], 16384)
    device_lib.memo_device_free(held, 8192, 0, STREAM)
    device_lib.memo_device_free(_malloc(4096), 4096, 0, STREAM)  # the freed memory serves the next request
    assert cuda.last_error == 0 and not cuda.sizes


def test_a_cuda_error_other_than_out_of_memory_is_raised_with_the_runtimes_message_and_cleared(device_lib):
    cuda = HostCuda(error=1)  # cudaErrorInvalidValue
    with pytest.raises(RuntimeError, match="cudaMallocAsync failed: a stand-in CUDA error") as err:
        _malloc(4096)
    assert not isinstance(err.value, torch.OutOfMemoryError) and cuda.last_error == 0


# ---- finding the CUDA runtime torch loaded ------------------------------------------------------------------


def test_the_cuda_runtime_is_found_among_the_mapped_files_by_its_file_name():
    maps = "\n".join(
        [
            "7f0000000000-7f0000001000 r-xp 00000000 08:01 11  /usr/lib/x86_64-linux-gnu/libc.so.6",
            "7f0000001000-7f0000002000 r--p 00000000 08:01 22  /venv/nvidia/cu13/lib/libcudart.so.13",
            "7f0000002000-7f0000003000 r-xp 00001000 08:01 22  /venv/nvidia/cu13/lib/libcudart.so.13",
            "7f0000003000-7f0000004000 r-xp 00000000 08:01 33  /opt/my libs/libcudart-9335f6a2.so.12.1.105",
            "7f0000004000-7f0000005000 r-xp 00000000 08:01 44  /tmp/libcudart.so.12 (deleted)",
            "7f0000005000-7f0000006000 r-xp 00000000 08:01 55  /usr/lib/libcudart.so.12.txt",
            "7f0000006000-7f0000007000 rw-p 00000000 00:00 0 ",
            "7f0000007000-7f0000008000 rw-p 00000000 00:00 0   [heap]",
        ]
    )
    assert dev.cudart_paths(maps) == [
        "/venv/nvidia/cu13/lib/libcudart.so.13",  # once, though mapped twice
        "/opt/my libs/libcudart-9335f6a2.so.12.1.105",  # as a wheel that bundles it names it
    ]


def test_the_runtimes_functions_are_taken_by_name_from_the_library():
    lib = ctypes.CDLL(allocator.extension().__file__)
    found = allocator._addresses(lib, ("memo_device_malloc", "memo_device_free"))
    assert all(found.values())
    assert found == {name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in found}


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch loads a CUDA runtime")
def test_without_a_cuda_runtime_the_device_core_is_refused_in_one_line():
    with pytest.raises(ValueError, match="needs the CUDA runtime") as err:
        allocator._cuda_runtime()
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="needs cudaMallocAsync") as err:  # a runtime older than CUDA 11.2
        allocator._addresses(ctypes.CDLL(None), allocator.CUDA_FUNCTIONS)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("strategy", ["memo", "none"])
def test_memo_train_measures_the_steps_transient_peak_against_the_cost_models(tmp_path, capsys, strategy):
    run = tmp_path / "run"
    argv = ["train", "--model", "tiny-gpt", "--strategy", strategy, "--arena", "--seq-len", "512", "--steps", "5"]
    assert main([*argv, "--batch-size", "2", "--out", str(run)]) == 0
    out = capsys.readouterr()
    assert "predicted per rank: device peak" in out.out and "step transient" in out.out
    records = [__import__("json").loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "predicted" in records[0]
    (compared,) = [r["measured_vs_predicted"] for r in records if "measured_vs_predicted" in r]
    assert abs(compared["rows"]["step_transient_bytes"]["ratio"] - 1) < 0.15 and not compared["warnings"]
