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
    assert "(default: 75% of free)" in out  # each flag names its default once
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


# Errors raised by the libraries memo calls (real ones, from torch and safetensors) end a verb as one line, exit 2.
def _failing_verb(monkeypatch, failure) -> None:
    """Makes `memo dsa` run `failure()` in place of its work (the verb's own error handling stays)."""
    from memo.plan import dsa

    monkeypatch.setattr(dsa, "solve", lambda *args, **kwargs: failure())


def _host_out_of_memory():
    import torch

    return torch.empty(2**55, dtype=torch.uint8)  # 32 PiB: the CPU allocator refuses


def _device_out_of_memory():
    import torch  # the type (and first line) the caching allocator raises; no CPU op raises it

    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore lines of advice")


def _unreadable_safetensors(path: Path):
    from safetensors.torch import load_file

    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    return load_file(path)


@pytest.mark.parametrize(
    "failure, said",
    [
        (lambda tmp: _host_out_of_memory, "memo dsa: error: the host ran out of memory (32.00PiB at once); lower "),
        (lambda tmp: lambda: _unreadable_safetensors(tmp / "w.safetensors"), "memo dsa: error: a safetensors file "),
        (lambda tmp: _device_out_of_memory, "memo dsa: error: the device ran out of memory (CUDA out of memory. "),
        (lambda tmp: lambda: [0][1], None),  # a bug keeps its traceback
    ],
)
def test_library_errors_are_one_line_and_bugs_keep_their_traceback(tmp_path, capsys, monkeypatch, failure, said):
    _failing_verb(monkeypatch, failure(tmp_path))
    csv = tmp_path / "b.csv"
    csv.write_text("id,lower,upper,size\n0,0,2,4\n")
    if said is None:
        with pytest.raises(IndexError):
            main(["dsa", str(csv)])
        return
    assert main(["dsa", str(csv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and len(err.strip().splitlines()) == 1, err
