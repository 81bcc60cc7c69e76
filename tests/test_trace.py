import torch

from memo.plan.problem import check_placement, max_load
from memo.plan.trace import trace


def test_trace_records_allocations_frees_and_peak_on_meta():
    x = torch.empty(1024, device="meta")  # made before tracing: not ours

    def fn():
        a = x * 2  # 4 KiB
        b = a + 1  # 4 KiB, a still alive
        del a
        c = b.view(32, 32)  # a view: no new storage
        d = torch.empty(2048, device="meta")  # 8 KiB
        return c, d

    tr, (c, d) = trace(fn)
    kinds = [(e.kind, e.nbytes) for e in tr.events]
    assert kinds == [("alloc", 4096), ("alloc", 4096), ("free", 4096), ("alloc", 8192)]
    assert tr.peak == 4096 + 8192 and tr.live_at_end == 4096 + 8192


def test_trace_converts_to_a_dsa_instance_with_the_same_load():
    def fn():
        keep = []
        for i in range(6):
            keep.append(torch.empty(256 * (i + 1), device="meta"))
            if len(keep) > 2:
                keep.pop(0)
        return keep

    tr, _ = trace(fn)
    problem = tr.to_problem()
    assert len(problem) == 6 and max_load(problem) == tr.peak
    stacked = torch.tensor(problem.size).cumsum(0) - torch.tensor(problem.size)
    assert check_placement(problem, stacked.numpy()) == []  # everything side by side is always valid
