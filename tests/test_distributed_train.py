"""`memo train` on several ranks (gloo on CPU, torchrun subprocesses): sp and dp×sp runs give the losses of one
process training the same global batches (torchtitan's loss-parity rule), their DCP checkpoints resume on
another number of ranks (one included) with the losses of an uninterrupted run, and bad layouts are clear
errors. The runs are shared by the tests of this module: each torchrun start costs seconds on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import partial

import pytest
import torch
from conftest import HANG
from safetensors.torch import load_file

from memo import ModelConfig, Transformer
from memo.cli import main
from memo.train import checkpoint

COMMON = ["--seq-len", "64", "--batch-size", "4", "--eval-batches", "1", "--warmup-steps", "2", "--eval-every", "2"]
COMMON += ["--save-every", "2", "--json"]
TOL = dict(rtol=1e-5, atol=0)  # sharded sums and row-sliced matmuls round differently: float32 noise only
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU even on a GPU machine


def _memo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memo", *args], capture_output=True, text=True, env=ENV, timeout=HANG)


def _two_nodes(port: int, *args: str) -> subprocess.CompletedProcess:
    """Runs `memo` as nodes 0 and 1 of a two-node run over 127.0.0.1:`port` (one rank each); returns node 0's
    result with node 1's stdout and stderr after its own."""
    launch = [sys.executable, "-m", "memo", *args, "--nnodes", "2", "--master-addr", "127.0.0.1"]
    launch += ["--master-port", str(port)]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    other = subprocess.Popen([*launch, "--node-rank", "1"], **pipes, env=ENV)
    first = subprocess.run([*launch, "--node-rank", "0"], capture_output=True, text=True, env=ENV, timeout=HANG)
    out, err = other.communicate(timeout=HANG)
    code = first.returncode or other.returncode
    return subprocess.CompletedProcess(launch, code, first.stdout + out, first.stderr + err)


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return subprocess.run([*launch, "-m", "memo", *args], capture_output=True, text=True, env=ENV, timeout=HANG)


# Seen in two of seven full-suite runs on 2 cores, each time in a distributed resume (4 ranks; 2 via --nproc):
# one gloo rank aborted with this (a C++ thread torn down while joinable) after the run's last record, the
# same runs passing alone. Until the cause is found (see the session note), that one failure, and only it, is
# retried once on a fresh copy of the run.
GLOO_ABORT = "terminate called without an active exception"


def _resumed(launch, run, to, *flags: str) -> subprocess.CompletedProcess:
    """Returns the result of `launch("train", "--resume", ...)` on an interrupted copy of `run` at `to`."""
    result = launch("train", "--resume", str(_interrupted_copy(run, to)), *flags)
    if result.returncode != 0 and GLOO_ABORT in result.stderr:
        shutil.rmtree(to)
        result = launch("train", "--resume", str(_interrupted_copy(run, to)), *flags)
    return result


def _losses(stdout: str) -> dict[int, tuple[float, ...]]:
    """Returns (loss, grad norm) by step and (eval loss, eval accuracy) by -step."""
    out = {}
    for record in map(json.loads, stdout.splitlines()):
        if "loss" in record:
            out[record["step"]] = (record["loss"], record["grad_norm"])
        elif "eval_loss" in record:
            out[-record["step"]] = (record["eval_loss"], record["eval_accuracy"])
    return out


def _ok(result: subprocess.CompletedProcess) -> str:
    # the ranks' own lines come first, torchrun's summary last; the records say how far the run got
    why = (
        f"stderr head:\n{result.stderr[:3000]}\nstderr tail:\n{result.stderr[-2000:]}\n"
        f"stdout tail:\n{result.stdout[-1500:]}"
    )
    assert result.returncode == 0, why
    return result.stdout


def _assert_same(got: dict, want: dict, steps) -> None:
    assert sorted(got) == sorted(steps), (sorted(got), steps)
    for step in steps:
        torch.testing.assert_close(got[step], want[step], **TOL, msg=lambda m: f"step {step}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, free_port):
    """One process, sp=2 on two ranks (through `--nproc`), sp=2 × dp=2 on four ranks (torchrun), and sp=2 over
    two nodes of one rank each, 4 steps each."""
    root = tmp_path_factory.mktemp("runs")
    single = root / "single"
    result = _memo("train", *COMMON, "--steps", "4", "--out", str(single))
    sp2 = _memo("train", *COMMON, "--steps", "4", "--nproc", "2", "--sp", "2", "--out", str(root / "sp2"))
    dp2sp2 = _torchrun(4, "train", *COMMON, "--steps", "4", "--sp", "2", "--out", str(root / "dp2sp2"))
    nodes = _two_nodes(free_port(), "train", *COMMON, "--steps", "4", "--sp", "2", "--out", str(root / "nodes"))
    return root, _losses(_ok(result)), _losses(_ok(sp2)), _losses(_ok(dp2sp2)), _losses(_ok(nodes))


def test_sp_and_dp_x_sp_training_gives_the_losses_of_one_process(runs):
    root, single, sp2, dp2sp2, nodes = runs
    steps = [1, 2, 3, 4, -2, -4]
    _assert_same(sp2, single, steps)
    _assert_same(dp2sp2, single, steps)
    _assert_same(nodes, single, steps)  # node 1's rank prints nothing: each record once
    config = json.loads((root / "sp2" / "config.json").read_text())
    assert (config["sp"], config["nproc"]) == (2, 2)  # what the run really ran on
    metrics = [json.loads(line) for line in (root / "sp2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "loss" in r] == [1, 2, 3, 4]  # rank 0 alone writes
    config = json.loads((root / "nodes" / "config.json").read_text())
    assert (config["nnodes"], config["nproc"]) == (2, 1)


def test_a_two_node_checkpoint_resumes_on_one_process(runs, capsys):
    root, single, *_ = runs
    one = _interrupted_copy(root / "nodes", root / "nodes-on-1")
    assert main(["train", "--resume", str(one), "--sp", "1", "--json"]) == 0  # where it ran is not kept
    _assert_same(_losses(capsys.readouterr().out), single, [3, 4, -4])


def _interrupted_copy(run, to):
    """Returns a copy of `run` as if it had died before its step-4 checkpoint."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "checkpoints" / "step-0000004")
    return to


def test_a_two_rank_checkpoint_resumes_on_one_and_on_four_ranks(runs, capsys):
    root, single, *_ = runs
    saved = checkpoint.load_latest(root / "sp2")
    assert saved.sharded and sorted(p.name for p in saved.path.iterdir()) == ["model", "optimizer", "state.json"]
    assert not list(saved.path.rglob("*.metadata")) and not list(saved.path.rglob("*.pt"))  # no pickle
    one = _interrupted_copy(root / "sp2", root / "resume-1")
    assert main(["train", "--resume", str(one), "--nproc", "1", "--sp", "1", "--json"]) == 0
    _assert_same(_losses(capsys.readouterr().out), single, [3, 4, -4])
    resumed = _ok(_resumed(partial(_torchrun, 4), root / "sp2", root / "resume-4", "--sp", "2", "--json"))
    _assert_same(_losses(resumed), single, [3, 4, -4])


def test_a_one_process_checkpoint_resumes_on_two_ranks_and_exports(runs, capsys):
    root, single, *_ = runs
    two = root / "resume-2"
    resumed = _ok(_resumed(_memo, root / "single", two, "--nproc", "2", "--sp", "2", "--json"))
    _assert_same(_losses(resumed), single, [3, 4, -4])
    assert checkpoint.load_latest(two).sharded
    assert main(["export", str(two)]) == 0
    path = capsys.readouterr().out.strip()
    model = Transformer(ModelConfig.preset("tiny"))
    model.load_state_dict(load_file(path))  # whole tensors, the names of the model
    own, reference = checkpoint.load_latest(two).model, checkpoint.load_latest(root / "single").model
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, own[name]), name  # the shards, gathered
        torch.testing.assert_close(tensor, reference[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seq-len", "96", "--nproc", "4", "--sp", "3"], "`--sp` 3 does not divide the number of ranks (4)"),
        (["--sp", "2"], "`--sp` 2 does not divide the number of ranks (1): launch more ranks"),
        (["--seq-len", "66", "--sp", "4"], "`--seq-len` 66 is not a multiple of `--sp` 4"),
        (["--sp", "2", "--arena"], "`--arena` does not support sequence parallelism"),
        (["--nproc", "4", "--batch-size", "2"], "not a multiple of the data-parallel ranks x `--grad-accum` (4 x 1)"),
    ],
)
def test_bad_layouts_exit_2_with_one_clear_line(tmp_path, capsys, flags, message):
    assert main(["train", "--seq-len", "64", "--steps", "1", "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_torchrun_with_sp_not_dividing_the_world_fails_with_the_reason(tmp_path):
    result = _torchrun(2, "train", "--seq-len", "64", "--steps", "1", "--sp", "4", "--out", str(tmp_path))
    assert result.returncode != 0
    assert "memo train: error: `--sp` 4 does not divide the number of ranks (2)" in result.stderr
