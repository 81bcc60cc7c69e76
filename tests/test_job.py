"""One `Job` is what `memo train` runs and what `memo estimate` prices: built from either's flags or from a live
model, it is the same record, and it refuses bad input once, in the user's flag names."""

import pytest
import torch

from memo.config import ModelConfig
from memo.cost.estimate import estimate
from memo.cost.hardware import GPUS
from memo.cost.predict import predict_run
from memo.cost.request import EstimateRequest
from memo.job import Job, named_model
from memo.lora import LoraConfig, apply_lora, lora_of_flags
from memo.model import Transformer
from memo.policy import ActivationPolicy
from memo.train.config import TrainConfig

TINY = ModelConfig.preset("tiny")


def test_train_and_estimate_flags_make_the_same_job():
    trained = TrainConfig(model="tiny", seq_len=4096, batch_size=1, lora_rank=8, offload_states=True).job()
    priced = EstimateRequest(model="tiny", seq=4096, gpus=1, gpu="h100", sp=1, lora_rank=8, offload_states=True).job()
    same = ("model", "seq", "micro_batch", "gpus", "sp", "lora", "offload_states", "documents", "attention")
    assert {k: getattr(trained, k) for k in same} == {k: getattr(priced, k) for k in same}


def test_a_live_model_gives_its_job_without_flags():
    model = Transformer(TINY, ActivationPolicy("memo", alpha=0.25)).to(torch.bfloat16)
    lora = LoraConfig(4)
    apply_lora(model, lora)
    job = Job.of_model(model, 2048, lora=lora)
    assert (job.model, job.policy.alpha, job.dtype, job.lora) == (TINY, 0.25, "bfloat16", lora)
    assert predict_run(job, "cpu")["device_peak_bytes"] > 0
    assert estimate(job, GPUS["H100-SXM"]).job is job


@pytest.mark.parametrize(
    "fields, flag",
    [
        ({"gpus": 0}, "`--gpus`"),
        ({"gpus": 8, "sp": 3}, "`--sp` (3) must divide `--gpus` (8)"),
        ({"gpus": 2, "sp": 2, "seq": 1025}, "`--seq` (1025) must be a positive multiple of `--sp` (2)"),
        ({"attention": "magic"}, "`--attention`"),
        ({"host_memory": -1}, "`--host-memory`"),
        ({"dtype": "int8"}, "`--dtype`"),
        ({"grad_accum": 0}, "`--grad-accum`"),
        ({"lora": LoraConfig(128)}, "`--lora-rank` (128) must be at most 64"),
    ],
)
def test_a_job_refuses_bad_fields_naming_the_flag(fields, flag):
    with pytest.raises(ValueError, match="^" + flag.replace("(", r"\(").replace(")", r"\)")):
        Job(**{"model": TINY, "seq": 1024, **fields})


def test_lora_flags_are_checked_once_for_train_and_estimate():
    for make in (
        lambda: TrainConfig(lora_rank=-1),
        lambda: EstimateRequest(model="tiny", gpus=1, gpu="h100", seq=4096, lora_rank=-1),
    ):
        with pytest.raises(ValueError, match="`--lora-rank` must not be negative"):
            make()
    with pytest.raises(ValueError, match="`--lora-targets`"):
        lora_of_flags(0, targets=("q",))
    assert lora_of_flags(0) is None  # (a run saved with LoRA's defaults and no rank: memo.train.resume drops them)


def test_named_model_reads_presets_and_refuses_what_is_neither_file_nor_preset(tmp_path):
    assert named_model("tiny") == TINY
    with pytest.raises(ValueError, match="neither a preset"):
        named_model(str(tmp_path / "missing"))
