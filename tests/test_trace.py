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


def test_snapshot_import_reads_a_synthetic_snapshot_and_refuses_code(tmp_path):
    import os
    import pickle

    import pytest

    from memo.plan.trace import load_snapshot

    trace_entries = [
        {"action": "segment_alloc", "addr": 0, "size": 2 << 20, "stream": 0, "frames": []},
        {"action": "alloc", "addr": 0, "size": 1024, "stream": 0, "frames": [{"filename": "x.py", "line": 1}]},
        {"action": "alloc", "addr": 1024, "size": 512, "stream": 0, "frames": []},
        {"action": "free_requested", "addr": 0, "size": 1024, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": 0, "size": 1024, "stream": 0, "frames": []},
        {"action": "alloc", "addr": 0, "size": 2048, "stream": 0, "frames": []},  # address reused
    ]
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace_entries]}))
    t = load_snapshot(path)
    assert [(e.kind, e.tensor, e.nbytes) for e in t.events] == [
        ("alloc", 0, 1024),
        ("alloc", 1, 512),
        ("free", 0, 1024),
        ("alloc", 2, 2048),
    ]
    assert t.peak == 512 + 2048

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path.write_bytes(pickle.dumps({"device_traces": [[Evil()]]}))
    with pytest.raises(ValueError, match="refusing to load"):
        load_snapshot(path)
