"""Training integrity: a run never ends in success on nan/inf (and never saves a non-finite state over a good
one), one trainer owns a run folder, files are checked against their content, and expected failures of every
verb are one line with exit code 2 that leave no temporary file behind. The main case of each runs as a real
`memo` process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from memo.cli import main
from memo.token_files import read_token_file
from memo.train import checkpoint
from memo.train.data import write_token_file

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
SMALL = ["--seq-len", "64", "--batch-size", "2", "--eval-every", "1000"]
BLOW_UP = [*SMALL, "--lr", "1e30", "--schedule", "constant", "--warmup-steps", "0"]  # step 2's loss is nan


def _memo(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "memo", *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=300)


def _one_line(result: subprocess.CompletedProcess, verb: str = "train") -> str:
    """Returns the error line of a failed run, after checking that it is the only line and exit code 2."""
    lines = [line for line in result.stderr.splitlines() if line.strip() and "warning:" not in line]
    lines = [line for line in lines if not line.startswith("train: ")]  # the progress bar
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"memo {verb}: error: "), result.stderr
    return lines[0]


# ---- non-finite values ----------------------------------------------------------------------------------------


def test_a_nan_loss_stops_the_run_at_that_step_and_the_last_checkpoint_stays_finite(tmp_path):
    run = tmp_path / "run"
    result = _memo("train", *BLOW_UP, "--steps", "5", "--save-every", "1", "--out", str(run))
    line = _one_line(result)
    assert "step 2: the loss is nan" in line and "step-0000001, is untouched" in line
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step-0000001"]
    weights = load_file(run / "checkpoints" / "step-0000001" / "model.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())


def test_skip_nonfinite_skips_up_to_n_steps_counting_them_then_stops(tmp_path):
    run = tmp_path / "run"
    result = _memo("train", *BLOW_UP, "--steps", "6", "--skip-nonfinite", "2", "--out", str(run), "--json")
    assert "step 4: the loss is nan after skipping 2 such step(s)" in _one_line(result)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped_steps") for r in records if "predicted" not in r] == [None, 1, 2]
    assert result.stderr.count("warning: step") == 2


def test_skipped_steps_update_nothing_and_a_finished_run_saves_the_last_finite_weights(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *BLOW_UP, "--steps", "3", "--skip-nonfinite", "5", "--out", str(run), "--json"]) == 0
    after_one = run / "one"
    assert main(["train", *BLOW_UP, "--steps", "1", "--out", str(after_one), "--json"]) == 0
    last, first = (load_file(p / "checkpoints" / n / "model.safetensors") for p, n in
                   ((run, "step-0000003"), (after_one, "step-0000001")))  # fmt: skip
    assert all(torch.equal(last[k], first[k]) for k in first)  # steps 2 and 3 changed nothing


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr", "inf"], "argument --lr: 'inf' is not a finite number"),
        (["--beta1", "nan"], "argument --beta1: 'nan' is not a finite number"),
        (["--grad-clip=-inf"], "argument --grad-clip: '-inf' is not a finite number"),
    ],
)
def test_float_options_must_be_finite(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(["train", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, message",
    [
        ("weight_decay: .nan\n", "`--weight-decay` must be a finite number, got nan"),
        ("seq_len: null\n", "`seq_len` needs a value, got null"),
        ("out: ''\n", "`--out` must not be empty"),
        ("model: null\n", "`model` needs a value, got null"),
    ],
)
def test_config_files_are_checked_against_the_fields_types(tmp_path, capsys, text, message):
    (tmp_path / "run.yaml").write_text(text)
    assert main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    assert message in capsys.readouterr().err


# ---- one trainer per run folder -------------------------------------------------------------------------------


def _logged(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return sum('"loss"' in line for line in metrics.read_text().splitlines()) if metrics.exists() else 0


def _group_ended(group: int) -> bool:
    """Returns whether every process of `group` (the launcher's ranks too) has ended."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_second_trainer_on_a_folder_in_use_exits_at_once_naming_the_holder(tmp_path, wait_until, capsys):
    run = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "memo", "train", *SMALL, "--steps", "100000", "--nproc", "2", "--out", str(run)],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        wait_until(lambda: _logged(run) >= 2, "two logged steps", first)
        holder = json.loads((run / ".lock").read_text())
        for argv in (["train", *SMALL, "--steps", "3", "--out", str(run)], ["train", "--resume", str(run)]):
            line = _one_line(_memo(*argv))
            assert f"{run} is in use by another `memo train` (pid {holder['pid']} on host {holder['host']})" in line
        assert first.poll() is None  # the holder goes on
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # no clean-up: the kernel releases the lock
        first.wait()
        wait_until(lambda: _group_ended(first.pid), "the killed trainer's ranks to end")
    assert main(["train", *SMALL, "--steps", "1", "--out", str(run), "--json"]) == 2
    # not "in use" (the kernel dropped the lock), and not started afresh over: it holds no checkpoint to resume
    assert "is a `memo train` run killed before its first checkpoint" in capsys.readouterr().err


# ---- files checked against their content ----------------------------------------------------------------------


@pytest.fixture
def token_file(tmp_path):
    (tmp_path / "a.txt").write_text("hello long context " * 20)
    (tmp_path / "b.txt").write_text("another document " * 20)
    write_token_file(tmp_path, tmp_path / "data.bin")
    return tmp_path / "data.bin"


def _edit_sidecar(path: Path, **fields) -> None:
    sidecar = path.with_suffix(".json")
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), **fields}))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: _edit_sidecar(p, max_token_id=7), "`max_token_id` is 7 but data.bin holds ids up to 120"),
        (lambda p: _edit_sidecar(p, dtype="uint32"), "size does not match `num_tokens`"),
        (lambda p: _edit_sidecar(p, dtype="float16"), "`dtype` is 'float16'"),
        (lambda p: _edit_sidecar(p, num_tokens="many"), "`num_tokens` must be a count"),
        (lambda p: p.with_suffix(".json").write_text("{oops"), "data.json: not valid JSON"),
        (lambda p: p.with_suffix(".json").write_text("[1, 2]"), "expected a JSON object of fields, got a list"),
        (lambda p: np.save(p.with_suffix(".docs.npy"), np.array([0, 5, 3])), "document starts must be"),
    ],
)
def test_token_files_are_checked_against_their_sidecar(token_file, damage, message):
    read_token_file(token_file)  # whole, it reads
    damage(token_file)
    with pytest.raises(ValueError) as err:
        read_token_file(token_file)
    assert message in str(err.value)


def test_the_largest_id_in_the_data_not_the_sidecar_is_checked_against_the_vocabulary(token_file, capsys):
    data = np.fromfile(token_file, dtype=np.uint16)
    data[3] = 4000  # the byte model's vocabulary is 256
    data.tofile(token_file)
    _edit_sidecar(token_file, max_token_id=4000)
    assert main(["train", "--data", str(token_file), *SMALL, "--eval-split", "0.5", "--steps", "1"]) == 2
    assert "data needs token ids up to 4000" in capsys.readouterr().err


def test_damaged_metrics_lines_and_foreign_checkpoint_entries_are_named_or_skipped(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *SMALL, "--steps", "2", "--save-every", "1", "--out", str(run), "--json"]) == 0
    with (run / "metrics.jsonl").open("a") as f:
        f.write('["a list"]\n{"no": "step"}\n{torn')
    for name in ("step-0000001-backup", "step-abc", "notes"):
        (run / "checkpoints" / name).mkdir()
    (run / "checkpoints" / "step-0000001-backup" / "state.json").write_text("{}")
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    # the prediction, two steps, an evaluation and the measurements against the prediction: then the damage
    assert "skipped line(s) 6, 7, 8, not metrics records" in capsys.readouterr().err
    assert [p.name for p in checkpoint.list_checkpoints(run)] == ["step-0000001", "step-0000002"]
    assert main(["train", "--resume", str(run), "--steps", "3", "--json"]) == 0


# ---- one error path, atomic outputs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    run = tmp_path_factory.mktemp("done") / "run"
    assert main(["train", *SMALL, "--steps", "1", "--out", str(run), "--json"]) == 0
    return run


@pytest.mark.parametrize(
    "argv, message",
    [
        (["export", "{run}", "--out", "{tmp}"], "is a folder: give a file path"),
        (["export", "{run}", "--hf", "{tmp}/file"], "is a file: give a folder path"),
        (["export", "{run}", "--out", "{tmp}/file/x.safetensors"], "{tmp}/file/x.safetensors: Not a directory"),
        (["report", "{run}", "--out", "{tmp}/file/r.png"], "{tmp}/file/r.png: Not a directory"),
        (["calibrate", "--device", "tpu9", "--out", "{tmp}/c.json"], "`--device` 'tpu9' is not a torch device"),
        (["train", *SMALL, "--out", "{tmp}/file/run"], "{tmp}/file/run: Not a directory"),
        (["export", ""], "argument run_dir: an empty path"),
        (
            ["estimate", "--model", "tiny", "--gpus", "1", "--gpu", "H200", "--seq", "1K", "--gpu-file", "{tmp}/file"],
            "{tmp}/file: not valid JSON",
        ),  # fmt: skip
    ],
)
def test_expected_failures_of_every_verb_are_one_line_and_leave_nothing_behind(done, tmp_path, argv, message):
    (tmp_path / "file").write_text("not json")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = _memo(*(a.format(run=done, tmp=tmp_path) for a in argv), cwd=tmp_path)
    assert message.format(tmp=tmp_path) in _one_line(result, argv[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not [p for p in done.rglob("*") if ".tmp" in p.name]


def test_outputs_replace_their_target_whole(done, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    out.write_text("old")
    assert main(["export", str(done), "--out", str(out), "--overwrite"]) == 0
    assert set(load_file(out)) == set(checkpoint.load_latest(done).model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
