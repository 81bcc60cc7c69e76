"""The optimizer's defaults by what a run starts from (memo.train.defaults): fine-tuning a pretrained checkpoint with
them does not make it worse, where the from-scratch defaults do.

The checkpoint is tests/data/pretrained-tiny (benchmarks/pretrained_checkpoint.py): `tiny` pretrained on generated
farm sentences, with held-out text of the same generator and fine-tuning text about the same farm.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from memo.cli import main
from memo.eval import load
from memo.train import defaults
from memo.train.config import TrainConfig
from memo.train.defaults import OptimizerDefaults, with_defaults

DATA = Path(__file__).parent / "data" / "pretrained-tiny"
MODEL = DATA / "model"
TEXTS = {"fine-tuning": DATA / "finetune.txt", "held-out pretraining": DATA / "pretrain-heldout.txt"}
SHORT = ["--seq-len", "64", "--batch-size", "4", "--strategy", "none", "--eval-every", "1000", "--eval-batches", "1"]
OLD = ["--lr", "3e-3", "--min-lr", "3e-4", "--warmup-steps", "20", "--beta2", "0.95"]  # every run's, before these
OPTIMIZER = ("lr", "min_lr", "warmup_steps", "beta2")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _losses(path) -> dict[str, float]:
    """Returns the loss of the model in `path` (a run or a Hugging Face folder) on fixed batches of each text: its
    first 8 sequences of 64 bytes."""
    model = load(path, torch.device("cpu"), torch.float32).model
    losses = {}
    for name, text in TEXTS.items():
        ids = torch.tensor(list(text.read_bytes()[: 8 * 64])).view(8, 64)
        with torch.inference_mode():
            losses[name] = model(ids, labels=ids).item()
    return losses


def _fine_tune(out: Path, *flags: str) -> dict[str, float]:
    """Returns `_losses` of `--model` pretrained-tiny after `memo train` on the fine-tuning text with `flags`."""
    args = ["train", "--model", str(MODEL), "--data", str(TEXTS["fine-tuning"]), *SHORT, "--out", str(out), *flags]
    assert main([*args, "--json"]) == 0
    return _losses(out)


def _optimizer_fields(cfg: TrainConfig) -> tuple:
    return tuple(getattr(cfg, name) for name in OPTIMIZER)


def test_fine_tuning_defaults_leave_a_pretrained_checkpoint_no_worse_where_the_old_defaults_hurt_it(tmp_path):
    before = _losses(MODEL)
    tuned = _fine_tune(tmp_path / "defaults", "--steps", "8")
    old = _fine_tune(tmp_path / "old", "--steps", "8", *OLD)
    assert tuned["fine-tuning"] < before["fine-tuning"]
    assert tuned["held-out pretraining"] < 1.01 * before["held-out pretraining"]  # forgetting at the noise level
    assert old["held-out pretraining"] > 1.5 * before["held-out pretraining"]


def test_defaults_follow_what_the_run_starts_from(tmp_path):
    (tmp_path / "model.yaml").write_text("preset: tiny\n")
    for model in ("tiny", str(tmp_path / "model.yaml")):  # random weights: memo's own, as before
        assert _optimizer_fields(with_defaults(TrainConfig(model=model))) == (3e-3, 3e-4, 20, 0.95)
    hf = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}  # the reference: transformers' Trainer
    fine_tuning = (2e-5, 2e-6, hf["warmup_steps"], hf["adam_beta2"])  # lr: TRL's SFTConfig (not installed here)
    assert _optimizer_fields(with_defaults(TrainConfig(model=str(MODEL)))) == fine_tuning
    lora = with_defaults(TrainConfig(model=str(MODEL), lora_rank=4))
    assert _optimizer_fields(lora) == (2e-4, 2e-5, hf["warmup_steps"], hf["adam_beta2"])  # TRL: 10x for LoRA
    given = with_defaults(TrainConfig(model=str(MODEL), lr=1e-3, warmup_steps=5, beta2=0.9))
    assert _optimizer_fields(given) == (1e-3, 1e-4, 5, 0.9)
    assert with_defaults(given) is given  # nothing left to set: resolved once
    assert (hf["weight_decay"], hf["adam_beta1"], hf["max_grad_norm"]) == (0.0, 0.9, 1.0)  # memo's already
    assert (TrainConfig.weight_decay, TrainConfig.beta1, TrainConfig.grad_clip) == (0.0, 0.9, 1.0)


def test_lr_alone_is_a_schedule_ending_at_a_tenth_of_it_and_a_min_lr_above_the_default_is_refused():
    for model in ("tiny", str(MODEL)):
        assert TrainConfig.from_dict({"model": model, "lr": 1e-5}).optimizer().min_lr == 1e-6
    with pytest.raises(ValueError, match=r"^`--min-lr` 0.001 is above the default `--lr` 2e-05 of fine-tuning a "):
        TrainConfig(model=str(MODEL), min_lr=1e-3).optimizer()
    with pytest.raises(ValueError, match=r"^`--min-lr` must be in \[0, --lr 1e-05\], got 0.001$"):
        TrainConfig(lr=1e-5, min_lr=1e-3)


def test_a_run_saves_the_defaults_it_resolved_and_a_resume_keeps_them(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    flags = ["--model", str(MODEL), "--data", str(TEXTS["fine-tuning"]), *SHORT, "--out", str(out), "--json"]
    assert main(["train", *flags, "--steps", "1"]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert tuple(saved[name] for name in OPTIMIZER) == (2e-5, 2e-6, 0, 0.999)
    monkeypatch.setattr(defaults, "FINE_TUNING", OptimizerDefaults(lr=1.0, warmup_steps=7, beta2=0.5, starts_from=""))
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--steps", "2", "--json"]) == 0
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["lr"] for r in steps if r.get("step") == 2 and "lr" in r] == [pytest.approx(2e-6)]  # cosine's end
