import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memo.cli import main
from memo.train.config import TrainConfig

BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs without --out go to ./runs: keep them out of the work tree


def test_memo_help_lists_train(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "train" in capsys.readouterr().out


def test_memo_train_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps help text
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name.replace('_', '-')}" in out
        assert " ".join(f.metadata["help"].replace("%%", "%").split()[:4]) in out
    for flag in ("--config", "--resume", "--json"):
        assert flag in out
    assert "(default: 80% of free)" in out  # each flag names its default once
    assert not re.search(r"\(default: [^()]*\) \(default:", out)


def test_console_script_is_installed():
    done = subprocess.run([str(BIN / "memo"), "train", "--help"], capture_output=True, text=True, check=True)
    assert "--strategy" in done.stdout


@pytest.mark.parametrize("strategy", ["none", "full", "memo"])
def test_short_training_run_prints_loss_and_throughput(capsys, strategy):
    assert main(["train", "--steps", "3", "--seq-len", "64", "--batch-size", "2", "--strategy", strategy]) == 0
    out = capsys.readouterr().out
    assert "loss" in out and "tokens/s" in out


def test_json_output_is_one_record_per_step(capsys):
    assert main(["train", "--steps", "2", "--seq-len", "64", "--batch-size", "1", "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert [r["step"] for r in records if "eval_accuracy" in r] == [2]  # held-out check at the end
    assert "predicted" in records[0] and "measured_vs_predicted" in records[-1]  # the cost model's, around them
    assert records[1]["bytes_offloaded"] > 0


def test_auto_alpha_is_solved_on_cpu(capsys):
    assert main(["train", "--steps", "1", "--seq-len", "64", "--alpha", "auto", "--json"]) == 0
    alphas = json.loads(capsys.readouterr().out.splitlines()[1])["alphas"]  # the first step's record
    assert all(0.0 <= a <= 1.0 for a in alphas)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--alpha", "1.5"], "`--alpha` must be in [0, 1], got 1.5"),
        (["train", "--seq-len", "0"], "`--seq-len` must be positive"),
        (["train", "--strategy", "full", "--alpha", "0.3"], "only to strategy 'memo'"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
