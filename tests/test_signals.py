"""Ctrl-C and SIGTERM during `memo train` (a real subprocess): the run stops after its step with a checkpoint,
says how to resume, exits 130 / 143, and the resumed run gives the uninterrupted run's losses. Every test here sets
the dispositions it tests: run under `nohup`, pytest (and each child it starts) inherits an ignored SIGHUP, which
memo rightly keeps ignored."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG

from memo.cli import main
from memo.train import checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def hangup_handled():
    """Runs each test with SIGHUP handled, as under a terminal, whatever pytest inherited. A handler that does
    nothing rather than the default: a real hangup meanwhile still leaves pytest running, and a child started
    meanwhile gets the default (exec resets handlers)."""
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: None)
    yield
    signal.signal(signal.SIGHUP, previous)


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


# Every long verb, in this process: the signal is sent from inside the verb's work (a hook on a function it calls),
# so it arrives at a known point; the handlers `memo.cli.main` installs turn it into an exception there.
TRAIN = ["train", "--model", "tiny", "--seq-len", "64", "--batch-size", "2", "--eval-every", "1000"]


def _signal_once(monkeypatch, signum: int, *hooks) -> None:
    """Makes the first call of any `(owner, name)` of `hooks` send `signum` to this process, then do its work."""
    sent = []

    def hook(original):
        def hooked(*args, **kwargs):
            if not sent:
                sent.append(signum)
                os.kill(os.getpid(), signum)
            return original(*args, **kwargs)

        return hooked

    for owner, name in hooks:
        monkeypatch.setattr(owner, name, hook(getattr(owner, name)))


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp" in p.name]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("signals") / "done"
    assert main([*TRAIN, "--steps", "1", "--out", str(run)]) == 0
    return run


def _outputs(run: Path, out: Path) -> dict[str, list[str]]:
    """Each long verb's arguments, writing one output `out` (with the suffix its format needs)."""
    csv = out.parent / "buffers.csv"
    csv.write_text("id,lower,upper,size\n0,0,2,4\n1,1,3,4\n")
    return {
        "export": ["export", str(run), "--out", f"{out}.safetensors"],
        "export --hf": ["export", str(run), "--hf", str(out)],
        "dsa": ["dsa", str(csv), "--out", f"{out}.csv"],
        "plan": ["plan", "--model", "tiny", "--seq", "128", "--plot", f"{out}.png"],
        "calibrate": ["calibrate", "--device", "cpu", "--model", "tiny", "--seq", "128", "--out", f"{out}.json"],
        "eval": ["eval", str(run), "--lengths", "128", "--depths", "0.5", "--trials", "1", "--plot", f"{out}.png"],
    }


@pytest.mark.parametrize("verb", ["export", "export --hf", "dsa", "plan", "calibrate", "eval"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_a_verb_writes_its_output_leaves_neither_the_output_nor_a_temporary(
    tmp_path, capsys, monkeypatch, finished_run, verb, signum
):
    out = tmp_path / "out"
    # the output is whole in its temporary and about to be published (renamed): the latest moment to undo
    _signal_once(monkeypatch, signum, (os, "replace"), (os, "rename"))
    before = sorted(p.name for p in finished_run.rglob("*"))
    assert main(_outputs(finished_run, out)[verb]) == 128 + signum
    err = capsys.readouterr().err  # after any progress bar, one line
    assert err.splitlines()[-1] == f"memo {verb.split()[0]}: stopped by {signal.Signals(signum).name}", err
    assert "Traceback" not in err
    assert not list(tmp_path.glob("out*")) and _leftovers(tmp_path) == [] and _leftovers(finished_run) == []
    assert sorted(p.name for p in finished_run.rglob("*")) == before  # the run read from is untouched


@pytest.mark.parametrize(
    "signum, when",
    [
        (signal.SIGTERM, "MetricsLog"),  # the run folder and its config.json are written, the metrics log opens
        (signal.SIGHUP, "MetricsLog"),
        (signal.SIGINT, "MetricsLog"),
        (signal.SIGTERM, "Trainer._predict"),  # then the cost model traces the step it predicts
    ],
)
def test_a_signal_before_the_first_step_leaves_no_run_folder(tmp_path, capsys, monkeypatch, signum, when):
    from memo.train import loop

    owner, _, name = when.rpartition(".")
    _signal_once(monkeypatch, signum, (getattr(loop, owner) if owner else loop, name))
    run = tmp_path / "runs" / "new"
    assert main([*TRAIN, "--steps", "3", "--out", str(run)]) == 128 + signum
    err = capsys.readouterr().err.strip()
    said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    assert err == f"memo train: {said}", err
    assert not (tmp_path / "runs").exists()  # the folders this run made, `runs/` too, are gone


def test_sighup_during_training_stops_after_the_step_with_a_checkpoint(tmp_path, capsys, monkeypatch):
    from memo.train.loop import Trainer

    _signal_once(monkeypatch, signal.SIGHUP, (Trainer, "_train_step"))
    run = tmp_path / "run"
    assert main([*TRAIN, "--steps", "5", "--out", str(run)]) == 128 + signal.SIGHUP
    err = capsys.readouterr().err
    assert "stopped by SIGHUP after step 1; checkpoint" in err and "Traceback" not in err
    assert (run / "checkpoints" / "step-0000001" / "state.json").exists() and _leftovers(run) == []


def _signal_at_step(monkeypatch, capsys, step: int, *signums: int) -> list[str]:
    """Makes step `step` start by sending `signums` to this process, one after the other; returns a list that then
    holds what was printed by the time they were handled, before the step's work (read out of `capsys`)."""
    from memo.train.loop import Trainer

    said, original = [], Trainer._train_step

    def signalled(self):
        if self.step == step:
            for signum in signums:
                os.kill(os.getpid(), signum)
            said.append(capsys.readouterr().err)
        return original(self)

    monkeypatch.setattr(Trainer, "_train_step", signalled)
    return said


def _notice(signum: int, step: int) -> str:
    name = signal.Signals(signum).name
    again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {name} again"
    return f"memo train: {name}: finishing step {step}, then saving a checkpoint; {again} to stop now without saving"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_mid_step_is_answered_at_once_and_the_launchers_copy_of_it_changes_nothing(
    tmp_path, capsys, monkeypatch, signum
):
    said = _signal_at_step(monkeypatch, capsys, 2, signum, signum)  # the second as memo's launcher passes it on
    run = tmp_path / "run"
    assert main([*TRAIN, "--steps", "5", "--out", str(run)]) == 128 + signum
    err = said[0] + capsys.readouterr().err
    assert _notice(signum, 2) in said[0]  # before step 2 did its work
    assert err.count("finishing step") == 1 and "Traceback" not in err
    assert f"stopped by {signal.Signals(signum).name} after step 2; checkpoint" in err
    assert checkpoint.list_checkpoints(run)[-1].name == "step-0000002" and _leftovers(run) == []


@pytest.mark.parametrize(
    "signum, said",
    [(signal.SIGTERM, "stopped by SIGTERM"), (signal.SIGHUP, "stopped by SIGHUP"), (signal.SIGINT, "interrupted")],
)
def test_the_same_signal_again_stops_mid_step_and_keeps_the_last_checkpoint(
    tmp_path, capsys, monkeypatch, signum, said
):
    from memo.train import signals

    monkeypatch.setattr(signals, "REPEAT_SECONDS", 0.0)  # a person's second try, not the launcher's copy
    printed = _signal_at_step(monkeypatch, capsys, 2, signum, signum)
    run = tmp_path / "run"
    assert main([*TRAIN, "--steps", "5", "--save-every", "1", "--out", str(run)]) == 128 + signum
    err = "".join(printed) + capsys.readouterr().err
    assert err.splitlines()[-1].split("\r")[-1] == f"memo train: {said}", err
    assert _notice(signum, 2) in err and "Traceback" not in err
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step-0000001"] and _leftovers(run) == []
    assert _steps(run / "metrics.jsonl") == 1  # step 2 stopped before its end


def test_an_ignored_signal_stays_ignored(monkeypatch):
    """`nohup memo train` ignores SIGHUP: a closed terminal must not stop the run."""
    from memo.train.signals import Stopping

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with Stopping():
            os.kill(os.getpid(), signal.SIGHUP)
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
