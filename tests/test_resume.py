"""A resume cannot silently change what a run trains, and flags that cannot take effect are refused: every
`TrainConfig` field is of one kind (`memo.train.resume`), a change of what trains is one line naming the flag
with the run left as it was, a change of how it runs is said, and a checkpoint tensor left unread is an error."""

import dataclasses
import hashlib
import re
import shutil
from pathlib import Path

import pytest

from memo.cli import main
from memo.train import checkpoint
from memo.train.config import TrainConfig
from memo.train.loop import Trainer
from memo.train.resume import GROWS, RUNS, TRAINS

TEXT = Path(__file__).parent / "data" / "pretrained-tiny" / "finetune.txt"
RUN = ["--steps", "2", "--seq-len", "64", "--batch-size", "2", "--eval-batches", "1", "--warmup-steps", "1"]


def _one_line(capsys, pattern: str) -> str:
    err = capsys.readouterr().err.strip()
    assert re.search(pattern, err), err
    assert len(err.splitlines()) == 1, err
    return err


def _digest(folder) -> str:
    """Returns a hash of every file under `folder` (names and bytes): "nothing changed on disk"."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != ".lock"):
        digest.update(str(path.relative_to(folder)).encode() + path.read_bytes())
    return digest.hexdigest()


def test_every_field_is_what_trains_or_how_it_runs():
    kinds = [TRAINS, GROWS, RUNS]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    named = [name for kind in kinds for name in kind]
    assert sorted(named) == sorted(fields)  # each field once, none left out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    assert main(["train", *RUN, "--lora-rank", "4", "--lora-targets", "q,v", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--lora-rank", "0"], r"`--lora-rank 0` changes the adapters .* -> none: every weight trains"),
        (["--lora-targets", "q"], r"`--lora-targets q` changes the adapters .*on q,v.* -> .*on q,"),
        (["--lora-rank", "8"], r"`--lora-rank 8` changes the adapters .*r=4.* -> r=8"),
        (["--lora-alpha", "64"], r"`--lora-alpha 64.0` changes the adapters .*alpha=16.* -> .*alpha=64"),
        (["--lora-targets", "q,v,k"], r"`--lora-targets q,v,k` changes the adapters"),
        (["--seed", "3"], r"`--seed 3` changes what run .* trains \(0\)"),
        (["--batch-size", "4"], r"`--batch-size 4` changes what run .* trains \(2\)"),
        (["--lr", "1e-4"], r"`--lr 0.0001` changes what run .* trains \(0.003\)"),  # not "--min-lr above --lr"
        (["--data", str(TEXT)], r"`--data .*finetune.txt` changes what run .* trains \(the generated task\)"),
    ],
    ids=["rank-0", "fewer-targets", "rank-8", "alpha", "more-targets", "seed", "batch", "lr", "data"],
)
def test_a_resume_that_changes_what_trains_is_one_line_and_changes_nothing(lora_run, tmp_path, capsys, flags, named):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    before = _digest(run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "3", *flags]) == 2
    _one_line(capsys, named)
    assert _digest(run) == before


def test_a_resume_that_changes_how_it_runs_says_so_and_trains(lora_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--steps", "3", "--strategy", "full", "--lora-alpha", "16"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"resuming run .* with `--strategy full` \(was memo: how it runs", err), err
    assert "`--steps 3` (was 2" in err and "--lora-alpha" not in err  # alpha 16 is the run's own: no change
    assert checkpoint.load_latest(run).step == 3


def test_a_checkpoint_tensor_the_model_has_no_place_for_is_an_error(lora_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    recorded = checkpoint.load_latest(run).state["config"]
    fewer = TrainConfig.from_dict({**recorded, "lora_targets": "q", "steps": 3})  # past the config's own check
    with pytest.raises(
        ValueError, match=r"does not fit this model: it holds 8 tensor\(s\) .* no place for \(layers.0.wv.lora_A,"
    ):
        Trainer(fewer, resume=True)


def test_a_run_resumes_without_its_base_folder(tmp_path, capsys):
    from tests.test_hf import _saved

    base = tmp_path / "base"
    _saved(base, vocab_size=256)  # the generated task's byte ids
    out = tmp_path / "run"
    assert main(["train", *RUN, "--model", str(base), "--out", str(out), "--json"]) == 0
    shutil.rmtree(base)
    assert main(["train", "--resume", str(out), "--steps", "3", "--json"]) == 0
    assert "is gone: resuming with the model its checkpoint recorded" in capsys.readouterr().err
    assert checkpoint.load_latest(out).step == 3


@pytest.mark.parametrize(
    "argv, named",
    [
        (["train", *RUN, "--lora-targets", "q,v"], r"`--lora-targets` applies to LoRA's adapters: give `--lora-rank`"),
        (["train", *RUN, "--lora-alpha", "32"], r"`--lora-alpha` applies to LoRA's adapters"),
        (["train", *RUN, "--lora-dropout", "0.1"], r"`--lora-dropout` applies to LoRA's adapters"),
        (
            ["train", *RUN, "--model", "tiny-gpt", "--lora-rank", "4", "--lora-targets", "gate"],
            r"`--lora-targets` names gate, which tiny-gpt's layers lack",
        ),
        (
            ["train", *RUN, "--strategy", "full", "--plan", "keep,keep,keep,keep"],
            r"`--plan` .* only with `--strategy memo`",
        ),
        (["train", *RUN, "--strategy", "full", "--alpha", "0.3"], r"`--alpha` applies only to strategy 'memo'"),
        (["train", *RUN, "--strategy", "none", "--host-budget", "1G"], r"`--host-budget` bounds the host memory"),
        (["train", *RUN, "--max-documents-per-sequence", "3"], r"`--max-documents-per-sequence` .* mask"),
        (
            ["estimate", "--model", "tiny", "--gpu", "h100", "--gpus", "1", "--seq", "4K", "--lora-targets", "q"],
            r"`--lora-targets` applies to LoRA's adapters",
        ),
        (
            ["estimate", "--model", "tiny", "--gpu", "h100", "--gpus", "1", "--seq", "4K", "--sweep"],
            r"`--sweep` .* `--seq`",
        ),
        (
            ["estimate", "--model", "tiny", "--gpu", "h100", "--gpus", "1", "--sweep", "--max-seq"],
            r"`--sweep` .* `--max-seq`",
        ),
        (
            ["estimate", "--model", "tiny", "--gpu", "h100", "--gpus", "1", "--seq", "4K", "--max-seq"],
            r"`--max-seq` .* `--seq`",
        ),
        (
            ["estimate", "--model", "tiny", "--gpu", "h100", "--gpus", "1", "--seq", "4K", "--host-memory", "1"],
            r"`--host-memory` 1B pins 0B per GPU .* less than one layer's offload at 4K tokens",
        ),
        (["eval", "runs/none", "--bucket-size", "128"], r"`--bucket-size` applies to the loss by position"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_flag_that_cannot_take_effect_is_refused_in_one_line(tmp_path, monkeypatch, capsys, argv, named):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    _one_line(capsys, named)
    assert not any(tmp_path.iterdir())  # nothing written


def test_flags_given_with_the_run_they_apply_to_are_taken():
    cfg = TrainConfig(strategy="full", offload_states=True, host_budget="1G", lora_rank=4, lora_targets=("q",))
    assert cfg.lora().targets == ("q",) and cfg.lora().alpha == 16.0  # memo's default scale kept
