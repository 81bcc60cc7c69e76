"""The golden set: outputs of `memo estimate --json`, `memo train --json`'s prediction and the default run's first
losses that a change of structure must leave byte-identical (`python tests/golden.py` rewrites them)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from memo import cli
from memo.train.config import TrainConfig
from memo.train.loop import Trainer

HERE = Path(__file__).parent / "data" / "golden"
SMALL_GPU = HERE / "small-gpu.json"  # a 4 GiB GPU: the estimate's sizes near its limits at small shapes
ESTIMATES = {
    "estimate-8b-128k-all": "--model llama3-8b --gpus 8 --gpu h100 --seq 128K --sp 8",
    "estimate-tiny-lora-offload": f"--model tiny --gpus 1 --gpu S4 --gpu-file {SMALL_GPU} --seq 64K --system memo "
    "--lora-rank 8 --offload-states",
    "estimate-tiny-gpt-packed": "--model tiny-gpt --gpus 4 --gpu h200 --seq 32K --mean-document-tokens 2K "
    "--system memo --system megatron --arena --sp 4",
    "estimate-tiny-max-seq": "--model tiny --gpus 2 --gpu h100 --max-seq --system memo --sp 2",
    "estimate-tiny-sweep": "--model tiny --gpus 2 --gpu h100 --sweep --system memo",
    "estimate-8b-512k-production": "--model llama3.1-8b --gpus 8 --gpu h100 --seq 512K --system memo "
    "--system megatron-deepspeed --sp 8",
}
TRAINS = {
    "train-predicted-default": "--steps 1",
    "train-predicted-lora-plan": "--steps 1 --lora-rank 4 --plan checkpoint,memo,memo,keep --alpha 0.3 "
    "--dtype bfloat16",
}
FIRST_LOSSES = 5


def estimate_json(flags: str) -> str:
    """Returns what `memo estimate FLAGS --json` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["estimate", *flags.split(), "--json"]) == 0
    return out.getvalue()


def train_predicted(flags: str) -> str:
    """Returns the `predicted` line `memo train FLAGS --json` prints first."""
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(out):
        assert cli.main(["train", *flags.split(), "--json", "--no-save-final", "--out", f"{tmp}/run"]) == 0
    return next(line for line in out.getvalue().splitlines() if '"predicted"' in line) + "\n"


def first_losses() -> str:
    """Returns the first `FIRST_LOSSES` losses of the default run (`memo train` with no flags)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(TrainConfig(out=f"{tmp}/run"))
        records = trainer.records()
        losses = [next(records)["loss"] for _ in range(FIRST_LOSSES)]  # evaluations come every 100 steps
        records.close()
    return json.dumps(losses) + "\n"


def golden() -> dict[str, str]:
    """Returns every golden case's name and its output now."""
    cases = {name: lambda f=flags: estimate_json(f) for name, flags in ESTIMATES.items()}
    cases.update({name: lambda f=flags: train_predicted(f) for name, flags in TRAINS.items()})
    cases["train-first-losses"] = first_losses
    return cases


if __name__ == "__main__":
    HERE.mkdir(parents=True, exist_ok=True)
    for name, make in golden().items():
        if len(sys.argv) < 2 or name in sys.argv[1:]:
            (HERE / f"{name}.txt").write_text(make())
            print("wrote", name)
