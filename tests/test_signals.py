"""Ctrl-C and SIGTERM during `memo train` (a real subprocess): the run stops after its step with a checkpoint,
says how to resume, exits 130 / 143, and the resumed run gives the uninterrupted run's losses."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG

from memo.cli import main

ROOT = Path(__file__).resolve().parents[1]
# a constant learning rate, so that a shorter resumed run follows the same schedule as the long one
RUN = ["--seq-len", "64", "--batch-size", "2", "--eval-every", "1000", "--schedule", "constant", "--warmup-steps", "0"]


def _steps(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if '"loss"' in line)


def _interrupted_run(run: Path, signum: int, wait_until) -> tuple[subprocess.CompletedProcess, int]:
    """Starts a long `memo train`, signals it once three steps are logged; returns (result, last step)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "memo", "train", *RUN, "--steps", "100000", "--out", str(run)]
    proc = subprocess.Popen(cmd, cwd=run.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: _steps(run / "metrics.jsonl") >= 3, "three logged steps", proc)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=HANG)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), _steps(run / "metrics.jsonl")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_the_resume_matches_an_uninterrupted_run(
    tmp_path, capsys, signum, wait_until
):
    run = tmp_path / "run"
    done, last = _interrupted_run(run, signum, wait_until)
    assert done.returncode == 128 + signum, done.stderr
    assert 3 <= last < 100000
    assert f"after step {last}; checkpoint" in done.stderr
    assert f"resume with: memo train --resume {run}" in done.stderr
    assert "Traceback" not in done.stderr
    assert (run / "checkpoints" / f"step-{last:07d}" / "state.json").exists()

    assert main(["train", "--resume", str(run), "--steps", str(last + 2), "--json"]) == 0
    resumed = {r["step"]: r["loss"] for r in map(json.loads, capsys.readouterr().out.splitlines()) if "loss" in r}
    assert main(["train", *RUN, "--steps", str(last + 2), "--out", str(tmp_path / "straight"), "--json"]) == 0
    straight = {r["step"]: r["loss"] for r in map(json.loads, capsys.readouterr().out.splitlines()) if "loss" in r}
    assert sorted(resumed) == [last + 1, last + 2]
    assert all(resumed[s] == straight[s] for s in resumed), (resumed, straight)
