"""benchmarks/gpu_check.py runs end to end the way the GPU machine runs it, and its time boxes hold.

The GPU machine has no highspy and no installed project: the end-to-end test runs a plain interpreter from
the repo root with PYTHONPATH=src and a sitecustomize that makes highspy unimportable in every process the
check starts (its section subprocesses, pytest, the sanitized step).
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

SECTIONS = ["environment", "bandwidth", "alpha", "strategies", "sanitizer", "gradient_tests", "arena", "planned"]
SECTIONS += ["prediction"]
ROWS = [
    "memo none",
    "memo full",
    "memo alpha=auto",
    "memo alpha=auto + arena",
    "memo offload-all",
    "autograd (reference)",
    "torch.utils.checkpoint",
    "save_on_cpu",
]


def _run_quick_without_highspy(tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict]:
    blocker = tmp_path / "no_highspy"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text('import sys\nsys.modules["highspy"] = None  # as on the GPU machine\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), "src"])}
    env.pop("OUT", None)
    out = tmp_path / "check.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    return done, json.loads(out.read_text())


@pytest.mark.slow
def test_quick_cpu_run_without_highspy_ends_every_section_ok_with_cuda_parts_marked_skipped(tmp_path):
    done, results = _run_quick_without_highspy(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(results) == ["run", "sections", *SECTIONS]
    assert list(results["sections"]) == SECTIONS
    for name, record in results["sections"].items():
        assert record["status"] == "ok", f"{name}: {record}"
    assert results["environment"]["packages"]["highspy"] is None  # the block reached the section processes

    bandwidth = results["bandwidth"]
    assert bandwidth["d2h_GBps"] > 0 and bandwidth["h2d_GBps"] > 0
    assert bandwidth["with_compute"].startswith("skipped: needs CUDA")

    for seq in ("128", "256"):
        assert 0.0 <= results["alpha"][seq]["alpha"] <= 1.0
        table = results["strategies"][seq]
        assert [row["name"] for row in table["rows"]] == ROWS
        assert all("error" not in row and row["step_s"] > 0 and row["mfu"] is None for row in table["rows"])
        assert set(table["offload_hiding"]) == {name for name in ROWS[1:5]}
    assert "causal attention counted as the half" in results["strategies"]["mfu_convention"]["mfu"]

    sanitizer = results["sanitizer"]
    assert sanitizer["passed"] and sanitizer["sanitizer"].startswith("skipped: needs CUDA")
    assert sanitizer["step"]["finite_gradients"] and sanitizer["step"]["bytes_offloaded"] > 0
    assert results["gradient_tests"]["passed"] and " passed" in results["gradient_tests"]["summary"]
    assert results["arena"]["caching_allocator"]["step_s"] > 0 and results["arena"]["arena"]["step_s"] > 0
    assert results["arena"]["arena_summary"]["phases"] > 0
    planned = results["planned"]
    assert planned["planned_allocator"]["last"]["arena_served"] > 0 and planned["arena_over_load"] <= 1.01
    assert planned["planned_over_caching_reserved"].startswith("skipped: needs CUDA")
    prediction = results["prediction"]
    assert {"device_bytes", "hbm_bytes", "step_seconds"} <= set(prediction["predicted"])
    assert prediction["step_measured_over_predicted"] > 0
    assert prediction["activation_measured_over_predicted"].startswith("skipped: needs CUDA")
    assert "strategies: ok" in done.stdout


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


def test_sections_past_the_global_budget_are_skipped_and_the_results_file_says_so(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--device", "cpu", "--quick", "--budget", "0", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert list(results["sections"]) == SECTIONS
    assert {record["status"] for record in results["sections"].values()} == {"skipped"}
    assert "global budget" in results["sections"]["environment"]["error"]


def test_only_a_failed_correctness_section_makes_the_exit_status_nonzero():
    def results(**status):
        sections = {name: {"status": status.get(name, "ok")} for name in SECTIONS}
        return {"sections": sections, "sanitizer": {"passed": True}, "gradient_tests": {"passed": True}}

    assert gpu_check.correctness_failed(results(strategies="error", arena="timeout")) == []
    assert gpu_check.correctness_failed(results(sanitizer="skipped", gradient_tests="skipped")) == []
    assert gpu_check.correctness_failed(results(sanitizer="timeout", gradient_tests="error")) == [
        "sanitizer",
        "gradient_tests",
    ]
    failing = results()
    failing["gradient_tests"]["passed"] = False
    assert gpu_check.correctness_failed(failing) == ["gradient_tests"]
