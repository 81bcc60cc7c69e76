"""Faults of a distributed `memo train` (real launches, gloo on CPU): a failure injected on rank 1 of 2 ends every
rank within seconds, on one node or across two, with that rank's one line (or the launcher's, for a rank killed
outright) and its exit code; a full disk on rank 1 during a save is one line, the previous checkpoint kept; Ctrl-C
to the terminal's process group saves on every rank (rank 0 alone saying so at once), a second one stops at once.
Without the fault watch the surviving rank would wait in its collective for gloo's 30-minute timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import HANG

from memo.train import checkpoint

ROOT = Path(__file__).resolve().parents[1]
RUN = ["train", "--seq-len", "64", "--batch-size", "2", "--eval-every", "1000", "--json"]
RUN += ["--schedule", "constant", "--warmup-steps", "0"]  # a resumed run follows the long run's schedule
# a sitecustomize (imported by every Python started with it on the path) that makes rank 1 fail at step 2, or (disk)
# its writes of step 2's checkpoint fail as on a full disk
INJECT = """
import os
if os.environ.get("RANK") == "1" and os.environ["FAULT"] == "disk":
    import errno
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    write = HuggingFaceStorageWriter.write_data
    def full(self, plan, planner):
        if "step-0000002" in str(self.path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, plan, planner)
    HuggingFaceStorageWriter.write_data = full
elif os.environ.get("RANK") == "1":
    import signal
    from memo.train import loop
    step = loop.Trainer._train_step
    def failing(self):
        if self.step == 2:
            if os.environ["FAULT"] == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError("injected fault on rank 1")
        return step(self)
    loop.Trainer._train_step = failing
"""
# Without the fault watch a run that ends on a fault would wait 30 minutes in gloo's collective: HANG is shorter


def _env(tmp_path: Path, fault: str | None = None) -> dict[str, str]:
    paths = [str(ROOT / "src")]
    if fault:
        (tmp_path / "sitecustomize.py").write_text(INJECT)
        paths.append(str(tmp_path))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "FAULT": fault or "", "CUDA_VISIBLE_DEVICES": ""}


def _memo(env: dict, *args: str, **popen) -> subprocess.Popen:
    out = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.Popen([sys.executable, "-m", "memo", *args], env=env, **out, **popen)


def _errors(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "fault, code, line",
    [("raise", 2, "memo train: error: injected fault on rank 1"), ("kill", 137, "rank 1 was killed by SIGKILL")],
)
def test_a_failure_on_rank_1_of_2_ends_both_ranks_with_its_message(tmp_path, fault, code, line):
    launcher = _memo(_env(tmp_path, fault), *RUN, "--steps", "50", "--nproc", "2", "--out", str(tmp_path / "run"))
    out, err = launcher.communicate(timeout=HANG)
    assert launcher.returncode == code, err
    # only the failing rank's line: rank 0 ended by the watch, not by a collective's timeout error
    assert _errors(err) == [line if fault == "raise" else f"memo train: error: {line}"]
    assert [r["step"] for r in map(json.loads, out.splitlines()) if "loss" in r] == [1]


def test_a_failure_on_the_second_node_ends_the_first(tmp_path, free_port):
    env = _env(tmp_path, "raise")
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    args = [*RUN, "--steps", "50", "--out", str(tmp_path / "run"), *nodes]
    second = _memo(env, *args, "--node-rank", "1")
    first = _memo(env, *args, "--node-rank", "0")
    out, err = first.communicate(timeout=HANG)
    _, second_err = second.communicate(timeout=HANG)
    assert (first.returncode, second.returncode) == (2, 2)
    assert _errors(err) == []  # the failing rank says why, once
    assert _errors(second_err) == ["memo train: error: injected fault on rank 1"]
    assert [r["step"] for r in map(json.loads, out.splitlines()) if "loss" in r] == [1]


def test_a_full_disk_on_rank_1_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    run = tmp_path / "run"
    args = [*RUN, "--steps", "2", "--save-every", "1", "--nproc", "2", "--out", str(run)]
    launcher = _memo(_env(tmp_path, "disk"), *args)
    _, err = launcher.communicate(timeout=HANG)
    assert launcher.returncode == 2, err
    assert _errors(err) == [
        f"memo train: error: cannot save checkpoint step-0000002 in {run / 'checkpoints'}: No space left on device "
        "(step-0000001 is intact)"
    ]
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step-0000001"]
    assert checkpoint.damage(run / "checkpoints" / "step-0000001") is None
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]


def _logged(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return sum('"loss"' in line for line in metrics.read_text().splitlines()) if metrics.exists() else 0


def _losses(stdout: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, stdout.splitlines()) if "loss" in r}


def _saved(run: Path) -> int:
    """Returns the newest whole checkpoint's step (0 for none): a folder `step-N` appears only once renamed whole."""
    return max((int(p.name[5:]) for p in (run / "checkpoints").glob("step-*")), default=0)


def _ctrl_c(env: dict, run: Path, presses: int, wait_until) -> tuple[subprocess.Popen, str, str]:
    """Starts a long two-rank run in a process group of its own, and once the checkpoint of step 3 is whole presses
    Ctrl-C as a terminal does (SIGINT to the whole group) `presses` times."""
    launcher = _memo(env, *RUN, "--steps", "100000", "--nproc", "2", "--save-every", "1", "--out", str(run),
                     start_new_session=True)  # fmt: skip
    # an event, not a time: on a loaded machine step 3 can be logged long before its checkpoint is whole
    wait_until(lambda: _saved(run) >= 3, "the checkpoint of step 3", launcher)
    for _ in range(presses):
        os.killpg(launcher.pid, signal.SIGINT)
        time.sleep(0.2)  # presses apart, as a person's are (two at once may reach a process as one)
    out, err = launcher.communicate(timeout=HANG)
    return launcher, out, err


def test_ctrl_c_saves_on_every_rank_and_the_run_resumes_to_the_same_losses(tmp_path, wait_until):
    env, run = _env(tmp_path), tmp_path / "run"
    launcher, _, err = _ctrl_c(env, run, 1, wait_until)
    assert launcher.returncode == 130, err
    last = _logged(run)
    assert f"after step {last}; checkpoint" in err and "Traceback" not in err
    # at once, from rank 0 alone
    [notice] = [line for line in err.splitlines() if "finishing step" in line]
    assert re.fullmatch(
        r"memo train: SIGINT: finishing step \d+, then saving a checkpoint; press Ctrl-C again to stop now without "
        "saving",
        notice,
    )
    saved = checkpoint.load_latest(run)
    assert saved.sharded and saved.step == last

    resumed = _memo(env, "train", "--resume", str(run), "--steps", str(last + 2), "--json")
    straight = _memo(env, *RUN, "--steps", str(last + 2), "--out", str(tmp_path / "straight"))
    losses = [_losses(p.communicate(timeout=HANG)[0]) for p in (resumed, straight)]
    assert sorted(losses[0]) == [last + 1, last + 2]
    for step in losses[0]:
        torch.testing.assert_close(losses[0][step], losses[1][step], rtol=1e-5, atol=0)


def test_a_second_ctrl_c_stops_at_once_and_leaves_the_checkpoints_whole(tmp_path, wait_until):
    run = tmp_path / "run"
    launcher, _, err = _ctrl_c(_env(tmp_path), run, 2, wait_until)
    # 130 from the ranks, or the launcher itself stopped by the second press once they had ended: a shell shows
    # 130 for both
    assert launcher.returncode in (130, -signal.SIGINT) and "Traceback" not in err, err
    saved = checkpoint.load_latest(run)  # verified: the newest whole checkpoint
    assert saved.step >= 3 and not list((run / "checkpoints").glob("*.tmp*"))
