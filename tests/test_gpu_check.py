"""benchmarks/gpu_check.py runs end to end the way the GPU machine runs it, and its time boxes hold.

The GPU machine has no highspy and no installed project: the end-to-end test runs a plain interpreter from
the repo root with PYTHONPATH=src and a sitecustomize that makes highspy unimportable in every process the
check starts (its section subprocesses, pytest, the training runs).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

SECTIONS = ["preflight", "correctness", "bandwidth", "strategies", "planned"]


def _run_quick_without_highspy(tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict, Path]:
    blocker = tmp_path / "no_highspy"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text('import sys\nsys.modules["highspy"] = None  # as on the GPU machine\n')
    temporary = tmp_path / "tmp"  # where the check's temporary folder goes: empty again at the end
    temporary.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), "src"]), "TMPDIR": str(temporary)}
    env.pop("OUT", None)
    out = tmp_path / "results" / "check.json"
    out.parent.mkdir()
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done, json.loads(out.read_text()), temporary


@pytest.mark.slow
def test_quick_cpu_run_without_highspy_ends_every_section_ok_with_cuda_parts_marked_skipped(tmp_path):
    done, results, temporary = _run_quick_without_highspy(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(results) == ["run", "sections", *SECTIONS, "build_extension"]
    for name, record in results["sections"].items():
        assert record["status"] == "ok", f"{name}: {record}"
    assert list(temporary.iterdir()) == []  # training runs, pytest's folders: all in the removed temporary folder
    folder = tmp_path / "results"
    assert sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) < 100 << 20
    assert results["run"]["results_bytes"] < 100 << 20

    preflight = results["preflight"]
    assert preflight["packages"]["highspy"] is None  # the block reached the section processes
    assert preflight["passed"] and "cgroup_memory_limit" in preflight and preflight["free_disk_bytes"]["tmp"] > 0
    assert preflight["ops"]["attention flash float32"]["passed"] and preflight["ops"]["rms_norm bfloat16"]["passed"]
    assert preflight["ops"]["attention fa4 bfloat16"]["skipped"].startswith("not installed")
    assert all(model["passed"] for model in preflight["models"].values()) and len(preflight["models"]) == 4

    correctness = results["correctness"]
    assert correctness["passed"]
    assert correctness["equivalence"]["offload-all"]["bitwise"] and correctness["equivalence"]["verdict"]["passed"]
    assert correctness["sanitizer"]["sanitizer"].startswith("skipped: needs CUDA")
    assert correctness["sanitizer"]["step"]["bytes_offloaded"] > 0
    assert " passed" in correctness["tests"]["summary"]

    bandwidth = results["bandwidth"]
    assert bandwidth["d2h_GBps"] > 0 and bandwidth["h2d_GBps"] > 0
    assert bandwidth["with_compute"].startswith("skipped: needs CUDA")
    assert bandwidth["pinning"] == {"skipped": "skipped: needs CUDA"}
    assert bandwidth["attention"]["flash"]["forward_s"] > 0 and bandwidth["attention"]["auto"] == "flash"

    strategies = results["strategies"]
    assert [row["name"] for row in strategies["128"]["rows"]] == [*gpu_check.MEMO_ROWS, *gpu_check.REFERENCE_ROWS]
    assert [row["name"] for row in strategies["256"]["rows"]] == list(gpu_check.MEMO_ROWS)
    for seq in ("128", "256"):
        assert all("error" not in row and row["step_s"] > 0 and row["mfu"] is None for row in strategies[seq]["rows"])
    memo = strategies["128"]["rows"][2]
    assert any("solved plan" in line for line in memo["solver_log"]) and len(memo["solver_log"]) <= 2
    assert memo["profile"] == memo["layer_seconds"] == {"skipped": "skipped: needs CUDA"}
    assert memo["prediction"]["predicted_step_s"] > 0
    assert "causal attention counted as the half" in strategies["mfu_convention"]["mfu"]

    planned = results["planned"]
    for run in ("caching_allocator", "planned_allocator"):
        assert planned[run]["exit_code"] == 0 and planned[run]["steps"] == 5
        assert planned[run]["written"]["checkpoints"] == 0  # --no-save-final
    assert planned["planned_allocator"]["last"]["arena_served"] > 0 and planned["arena_over_load"] <= 1.01
    assert planned["reserved_planned_over_caching"].startswith("skipped: needs CUDA")
    assert results["build_extension"]["built"] and not results["build_extension"]["killed_at_end"]

    rows = done.stdout.splitlines()
    assert "strategies 128 memo none: " in done.stdout and "planned 128 planned_allocator: " in done.stdout
    assert sum(line.startswith("strategies ") and " inside: " not in line for line in rows) == 11  # one per row
    assert "strategies 128 memo alpha=auto inside: skipped: needs CUDA" in rows
    assert "strategies: ok" in done.stdout and "results: " in done.stdout


def test_the_section_boxes_fit_the_default_budget():
    assert sum(box for box, _ in gpu_check.SECTIONS.values()) <= gpu_check.BUDGET_S == 450
    assert list(gpu_check.SECTIONS) == SECTIONS


def test_a_section_past_its_time_box_is_killed_with_its_children(tmp_path, wait_until):
    grandchild = "[sys.executable, '-c', 'import time; time.sleep(3600)']"  # outlives the wait below unless killed
    child = f"import subprocess, sys, time; c = subprocess.Popen({grandchild}); print(c.pid, flush=True)"
    child += "; time.sleep(3600)"
    cmd = [sys.executable, "-c", child]
    log = tmp_path / "hang.log"
    # boxes that double until the child has started its grandchild inside one: a busy machine starts Python slowly
    for box in (3, 6, 12, 24, 48, 96):
        assert gpu_check.run_child(cmd, timeout=box, log_path=log) == "timeout"
        if log.read_text().strip():
            break
    grandchild = int(log.read_text().split()[0])
    wait_until(lambda: not _alive(grandchild), "the grandchild to end")


def _alive(pid: int) -> bool:
    """Returns whether `pid` runs (a zombie waiting for its reaper has stopped running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_childs_row_lines_are_relayed_to_stdout_and_its_other_output_stays_in_the_log(tmp_path, capsys):
    code = f"print('noise'); print({gpu_check.ROW!r} + 'strategies 64K memo none: 1.00 s', flush=True)"
    log = tmp_path / "child.log"
    assert gpu_check.run_child([sys.executable, "-c", code], timeout=60, log_path=log, relay=True) == "ok"
    assert capsys.readouterr().out == "strategies 64K memo none: 1.00 s\n"
    assert "noise" in log.read_text()


def test_a_long_log_keeps_its_head_and_tail_within_the_cap(tmp_path):
    log = tmp_path / "long.log"
    log.write_bytes(b"start\n" + b"x" * 10_000 + b"\nthe end\n")
    gpu_check.cap_log(log, cap=1000)
    text = log.read_text()
    assert text.startswith("start") and text.endswith("the end\n") and "bytes cut" in text
    assert len(text) < 1100


def test_sections_past_the_global_budget_are_skipped_and_the_results_file_says_so(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--budget", "0", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert list(results["sections"]) == SECTIONS
    assert {record["status"] for record in results["sections"].values()} == {"skipped"}
    assert "global budget" in results["sections"]["preflight"]["error"]


def test_only_a_failed_correctness_check_makes_the_exit_status_nonzero():
    def results(**status):
        sections = {name: {"status": status.get(name, "ok")} for name in SECTIONS}
        return {"sections": sections, "preflight": {"passed": True}, "correctness": {"passed": True}}

    assert gpu_check.correctness_failed(results(strategies="error", planned="timeout", bandwidth="error")) == []
    assert gpu_check.correctness_failed(results(preflight="skipped", correctness="skipped")) == []
    assert gpu_check.correctness_failed(results(preflight="timeout", correctness="error")) == [
        "preflight",
        "correctness",
    ]
    failing = results()
    failing["correctness"]["passed"] = False
    assert gpu_check.correctness_failed(failing) == ["correctness"]


def _difference(bitwise: bool, relative: float, finite: bool = True) -> dict:
    return {"bitwise": bitwise, "max_relative": relative, "finite": finite}


def test_offload_all_must_be_bitwise_equal_only_where_strategy_none_is_itself_deterministic():
    deterministic = {"none again": _difference(True, 0.0)}
    verdict = gpu_check.equivalence_verdict
    ok = {**deterministic, "offload-all": _difference(True, 0.0), "alpha=0.5": _difference(False, 3e-3)}
    assert verdict(ok)["passed"]
    assert not verdict({**ok, "offload-all": _difference(False, 1e-6)})["passed"]  # deterministic, yet not equal
    assert not verdict({**ok, "alpha=0.5": _difference(False, 2e-2)})["passed"]
    assert not verdict({**ok, "alpha=0.5": _difference(False, 3e-3, finite=False)})["passed"]
    noisy = {**ok, "none again": _difference(False, 1e-4), "offload-all": _difference(False, 1e-4)}
    assert verdict(noisy) == {
        **verdict(ok),
        "deterministic": False,
        "offload_all_checked": "within 1e-2: none is not deterministic here",
    }
    assert verdict(ok)["offload_all_checked"] == "bitwise"


def _event(cat: str, name: str, stream: int, ts: float, dur: float, nbytes: int = 0) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "bytes": nbytes}}


def test_overlap_summary_of_a_hand_worked_trace():
    # compute stream 7: kernels on [0, 40) and [50, 100) µs (idle 10 of its 100); a side stream's small kernel;
    # copies on stream 20: DtoH [30, 60) (20 of its 30 µs under compute), HtoD [95, 105) (5 of 10)
    events = [
        _event("kernel", "gemm", 7, 0, 40),
        _event("kernel", "gemm", 7, 50, 50),
        _event("kernel", "pack", 20, 60, 2),
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 20, 30, 30, 3000),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20, 95, 10, 1000),
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 7, 40, 5),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 500, "args": {}},
    ]
    summary = gpu_check.overlap_summary(events)
    assert summary["compute_stream"] == "7"
    assert summary["copy_s"] == pytest.approx({"DtoH": 30e-6, "HtoD": 10e-6})
    assert summary["copy_bytes"] == {"DtoH": 3000, "HtoD": 1000}
    assert summary["copy_concurrent_with_compute_share"] == pytest.approx(25 / 40)
    assert summary["compute_span_s"] == pytest.approx(100e-6) and summary["compute_idle_s"] == pytest.approx(10e-6)
    assert summary["compute_idle_share"] == pytest.approx(0.1)
    assert summary["streams"]["20"] == pytest.approx({"kernel_s": 2e-6, "copy_s": 40e-6})


def test_attention_flops_are_the_calibration_convention():
    forward, backward = gpu_check.attention_flops(1024, 32, 128)
    assert forward == 4 * 1024 * 1024 * 32 * 128 / 2 and backward == 2.5 * forward
