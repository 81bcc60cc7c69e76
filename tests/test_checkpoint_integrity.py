"""Damaged checkpoints: `state.json` lists every file's size and SHA-256; `--resume`, `memo export` and `memo eval`
fall back to the newest intact checkpoint with a one-line warning (and resume exactly from it), fail with one line
when none is intact, and a full disk during a save is one line that leaves the previous checkpoint whole."""

import contextlib
import errno
import io
import json
import logging
import shutil
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import _wrap_exception

from memo.cli import main
from memo.train import checkpoint
from memo.train.signals import Terminated

SMALL = ["--seq-len", "64", "--batch-size", "2", "--warmup-steps", "2"]
RUN = [*SMALL, "--steps", "6", "--save-every", "2", "--keep-checkpoints", "3", "--json"]


def _losses(out: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, out.splitlines()) if "loss" in r}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 6-step run with checkpoints at steps 2, 4 and 6, and its (uninterrupted) losses."""
    out, printed = tmp_path_factory.mktemp("finished") / "run", io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["train", *RUN, "--out", str(out)]) == 0
    return out, _losses(printed.getvalue())


@pytest.fixture
def run(finished, tmp_path):
    """A copy of the finished run, to damage."""
    shutil.copytree(finished[0], tmp_path / "run")
    return tmp_path / "run"


def _file(run, step: int, name: str):
    return checkpoint.checkpoint_dir(run) / f"step-{step:07d}" / name


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_middle(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _garble_header(path):
    data = bytearray(path.read_bytes())
    data[8:24] = b"\xff" * 16
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name, damage, reason",
    [
        ("model.safetensors", _truncate, "model.safetensors: "),
        ("optimizer.safetensors", _flip_middle, "optimizer.safetensors: checksum mismatch"),
        ("model.safetensors", lambda p: p.unlink(), "model.safetensors: missing"),
        ("optimizer.safetensors", _garble_header, "optimizer.safetensors: header unreadable"),
    ],
    ids=["truncated", "flipped-byte", "deleted", "bad-header"],
)
def test_resume_falls_back_to_the_newest_intact_checkpoint_with_a_warning(run, finished, capsys, name, damage, reason):
    damage(_file(run, 6, name))
    assert main(["train", "--resume", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith(f"memo train: warning: checkpoint step-0000006 is damaged ({reason}")
    assert line.endswith("); falling back to step-0000004")
    resumed, straight = _losses(captured.out), finished[1]
    assert sorted(resumed) == [5, 6] and all(resumed[s] == straight[s] for s in resumed), (resumed, straight)


def test_export_and_eval_skip_a_damaged_checkpoint_too(run, capsys):
    _flip_middle(_file(run, 6, "model.safetensors"))
    assert main(["export", str(run), "--out", str(run / "w.safetensors")]) == 0
    assert "memo export: warning: checkpoint step-0000006 is damaged (model.safetensors: checksum mismatch)" in (
        capsys.readouterr().err
    )
    assert checkpoint.load_latest(run).step == 4
    assert main(["eval", str(run), "--trials", "1", "--lengths", "128", "--depths", "0.5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"].endswith("(step 4)")


def test_every_checkpoint_damaged_is_one_error_line_and_no_fresh_start(run, capsys):
    for step in (2, 4, 6):
        _flip_middle(_file(run, step, "optimizer.safetensors"))
    _truncate(_file(run, 4, "model.safetensors"))
    assert main(["train", "--resume", str(run), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"memo train: error: every checkpoint in {run / 'checkpoints'} is damaged: "
        "step-0000006 (optimizer.safetensors: checksum mismatch), "
        f"step-0000004 (model.safetensors: {_file(run, 4, 'model.safetensors').stat().st_size} bytes, saved as "
        f"{_file(run, 2, 'model.safetensors').stat().st_size}), "
        "step-0000002 (optimizer.safetensors: checksum mismatch)"
    ]


def test_checkpoints_saved_before_checksums_are_checked_by_headers_and_sizes(run, finished, capsys):
    for step in (2, 4, 6):
        state = json.loads(_file(run, step, "state.json").read_text())
        del state["files"]
        _file(run, step, "state.json").write_text(json.dumps(state))
    assert checkpoint.damage(_file(run, 6, "")) is None
    size = _file(run, 6, "model.safetensors").stat().st_size
    _truncate(_file(run, 6, "model.safetensors"))
    assert main(["train", "--resume", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"memo train: warning: checkpoint step-0000006 is damaged (model.safetensors: {size // 2} bytes, its header "
        f"describes {size}); falling back to step-0000004"
    ]
    resumed = _losses(captured.out)
    assert sorted(resumed) == [5, 6] and all(resumed[s] == finished[1][s] for s in resumed)


def test_a_distributed_checkpoint_has_every_file_checksummed(tmp_path, caplog):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        for step in (1, 2):
            model = {"w": torch.full((4, 3), float(step))}
            optimizer = {"w.exp_avg": torch.zeros(4, 3), "w.exp_avg_sq": torch.ones(4, 3)}
            checkpoint.save_sharded(tmp_path, step, model, optimizer, {"config": {}}, keep=2)
    finally:
        dist.destroy_process_group()
    newest = checkpoint.load_latest(tmp_path)
    assert newest.sharded and newest.step == 2
    files = newest.state["files"]
    on_disk = {p.relative_to(newest.path).as_posix() for p in newest.path.rglob("*") if p.is_file()}
    assert set(files) == on_disk - {"state.json"} and any(f.startswith("model/") for f in files)
    shard = next(f for f in files if f.startswith("model/") and f.endswith(".safetensors"))
    data = (newest.path / shard).read_bytes()
    (newest.path / shard).write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # a byte of a tensor, not the header
    with caplog.at_level(logging.WARNING, logger="memo.train.checkpoint"):
        fallback = checkpoint.load_latest(tmp_path)
    assert fallback.step == 1 and torch.equal(fallback.model["w"], torch.full((4, 3), 1.0))
    assert [r.getMessage() for r in caplog.records if r.name == checkpoint.log.name] == [
        f"checkpoint step-0000002 is damaged ({shard}: checksum mismatch); falling back to step-0000001"
    ]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, lambda: Terminated(signal.SIGTERM)], ids=["ctrl-c", "sigterm"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["raised", "as-dcp-reports-it"])
def test_a_second_signal_during_a_distributed_save_leaves_no_partial_folder(tmp_path, monkeypatch, wrapped, stop):
    dcp = checkpoint._dcp()

    def interrupted(state, storage_writer):  # the shards are written, then the second Ctrl-C (or SIGTERM) arrives
        dcp.save(state, storage_writer=storage_writer)
        if wrapped:  # DCP catches what a rank raises inside its write and reports every rank's in one exception
            raise dcp.CheckpointException("write_data", {0: _wrap_exception(stop())})
        raise stop()

    tensors = ({"w": torch.ones(4, 3)}, {"w.exp_avg": torch.zeros(4, 3)})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        checkpoint.save_sharded(tmp_path, 1, *tensors, {"config": {}}, keep=2)
        stopping = SimpleNamespace(HuggingFaceStorageWriter=dcp.HuggingFaceStorageWriter, save=interrupted)
        monkeypatch.setattr(checkpoint, "_dcp", lambda: stopping)
        with pytest.raises(type(stop())):  # as itself, not as DCP's exception: the run ends as that signal
            checkpoint.save_sharded(tmp_path, 2, *tensors, {"config": {}}, keep=2)
    finally:
        dist.destroy_process_group()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-0000001"]
    assert checkpoint.load_latest(tmp_path).step == 1


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, capsys, monkeypatch):
    real = checkpoint.save_file

    def disk_fills_at_step_4(tensors, path):
        if "step-0000004" in path and path.endswith("optimizer.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", disk_fills_at_step_4)
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--steps", "4", "--save-every", "2", "--out", str(out), "--json"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"memo train: error: cannot save checkpoint step-0000004 in {out / 'checkpoints'}: optimizer.safetensors: "
        "No space left on device (step-0000002 is intact)"
    ]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-0000002"]
    assert checkpoint.damage(out / "checkpoints" / "step-0000002") is None
    monkeypatch.setattr(checkpoint, "save_file", real)
    assert main(["train", "--resume", str(out), "--json"]) == 0
    assert sorted(_losses(capsys.readouterr().out)) == [3, 4]


def test_resume_with_steps_behind_the_checkpoint_is_an_error_and_equal_steps_a_finished_run(run, capsys):
    assert main(["train", "--resume", str(run), "--steps", "3"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "memo train: error: `--steps 3` is not past the checkpoint's step 6: nothing to train; give a larger `--steps`"
    ]
    assert main(["train", "--resume", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        f"memo train: {run} is already complete at step 6: nothing to train (give a larger `--steps` to go on)"
    ]


def test_export_of_a_run_without_checkpoints_does_not_talk_of_resuming(tmp_path, capsys):
    assert main(["export", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"memo export: error: run {tmp_path} has no checkpoint to export yet (looked in {tmp_path / 'checkpoints'})"
    ]
