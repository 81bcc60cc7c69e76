"""`memo train --offload-states`: FSDP2's CPU offload keeps parameters, gradients and AdamW state in host memory
and steps the optimizer there. On the CPU it moves nothing, so it must not change the arithmetic: one process
and two ranks (gloo) give the losses of the same runs without it, an offloaded run resumes exactly, and states
that do not fit in the host budget beside the activation pool are refused before any work. LoRA keeps its frozen
base in the training dtype there, its adapters fp32 with their moments.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import HANG
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

from memo import ModelConfig, Transformer
from memo import device as dev
from memo.cli import main
from memo.cost.memory import training_lower_bound
from memo.cost.states import host_bytes
from memo.job import Job
from memo.lora import LoraConfig, apply_lora
from memo.train.config import TrainConfig
from memo.train.loop import Trainer, check_memory
from memo.train.metrics import read_metrics
from memo.units import format_bytes

RUN = dict(seq_len=64, batch_size=2, steps=4, warmup_steps=2, eval_batches=1, eval_every=2, save_every=2)
FLAGS = ["--seq-len", "64", "--batch-size", "2", "--steps", "4", "--warmup-steps", "2", "--eval-batches", "1"]
FLAGS += ["--eval-every", "2", "--json"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU even on a GPU machine


def _train(out, **fields) -> Trainer:
    """Returns the closed Trainer of a finished one-process run of RUN (its model and optimizer kept)."""
    trainer = Trainer(TrainConfig.from_dict({**RUN, **fields, "out": str(out)}))
    try:
        for _ in trainer.records():
            pass
    finally:
        trainer.close()
    return trainer


def _losses(records) -> dict[int, tuple[float, ...]]:
    """Returns (loss, grad norm) by step and (eval loss,) by -step."""
    out = {}
    for r in records:
        if "loss" in r:
            out[r["step"]] = (r["loss"], r["grad_norm"])
        elif "eval_loss" in r:
            out[-r["step"]] = (r["eval_loss"],)
    return out


def _logged(run) -> dict[int, tuple[float, ...]]:
    return _losses(read_metrics(run / "metrics.jsonl"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Four steps of one process with its states on the device and offloaded, checkpointed every two."""
    root = tmp_path_factory.mktemp("one")
    _train(root / "plain")
    offloaded = _train(root / "offloaded", offload_states=True)
    return root, offloaded


def test_offloaded_states_give_one_process_the_losses_of_states_on_the_device(one_process):
    root, offloaded = one_process
    want = _logged(root / "plain")
    assert sorted(want) == [-4, -2, 1, 2, 3, 4]
    assert _logged(root / "offloaded") == want  # equal, not close: the same arithmetic
    units = [m for m in offloaded.model.modules() if isinstance(m, FSDPModule)]
    assert len(units) == 1 + len(offloaded.model.layers)
    for unit in units:
        policy = unit._get_fsdp_state()._fsdp_param_group.offload_policy
        assert isinstance(policy, CPUOffloadPolicy) and not policy.pin_memory  # nothing to pin without a GPU
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in offloaded.model.parameters())
    moments = [s["exp_avg"] for s in offloaded.optimizer.adamw.state.values()]
    assert len(moments) == len(offloaded.optimizer.params) and all(m.device.type == "cpu" for m in moments)
    assert not offloaded.optimizer.separate  # the fp32 sharded parameters are their own masters


def _interrupted_copy(run, to):
    """Returns a copy of `run` as if it had died before its step-4 checkpoint."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "checkpoints" / "step-0000004")
    return to


@pytest.mark.parametrize("flags", [[], ["--no-offload-states"]])
def test_an_offloaded_run_resumes_to_the_losses_of_an_uninterrupted_one(one_process, capsys, flags):
    root, _ = one_process
    copy = _interrupted_copy(root / "offloaded", root / f"resumed{len(flags)}")
    assert main(["train", "--resume", str(copy), "--json", *flags]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    resumed = _losses(records)
    assert sorted(resumed) == [-4, 3, 4]
    assert resumed == {k: v for k, v in _logged(root / "offloaded").items() if k in resumed}


def _two_ranks(out, *flags: str) -> dict[int, tuple[float, ...]]:
    cmd = [sys.executable, "-m", "memo", "train", *FLAGS, "--nproc", "2", "--out", str(out), *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=HANG)
    assert result.returncode == 0, result.stderr[-3000:]
    return _losses(map(json.loads, result.stdout.splitlines()))


@pytest.mark.slow  # two launches of two ranks
def test_offloaded_states_give_two_ranks_the_losses_of_states_on_the_devices(tmp_path):
    sharded = _two_ranks(tmp_path / "sharded")
    assert sorted(sharded) == [-4, -2, 1, 2, 3, 4]
    assert _two_ranks(tmp_path / "offloaded", "--offload-states") == sharded


def _host_state_bytes(model: torch.nn.Module, ranks: int, dtype: torch.dtype) -> int:
    """Returns one rank's even shard of the model's states in host memory, counted from its parameters: a trainable
    one's fp32 value, gradient and two AdamW moments (16 bytes), a frozen one's value in the training `dtype`."""
    return sum(p.numel() * (16 if p.requires_grad else dtype.itemsize) for p in model.parameters()) // ranks


def test_states_that_do_not_fit_beside_the_activation_pool_are_refused_in_one_line(tmp_path, capsys):
    with torch.device("meta"):
        states = _host_state_bytes(Transformer(ModelConfig.preset("tiny")), 1, torch.float32)
    cfg = TrainConfig.from_dict({**RUN, "alpha": 0.5})
    job = Job(model=ModelConfig.preset("tiny"), seq=64, micro_batch=2, dtype="float32", policy=cfg.policy())
    pool = training_lower_bound(job)["host_pool"]
    budget = max(states, pool) + min(states, pool) // 2  # either fits alone, not both
    out = tmp_path / "run"
    flags = [*FLAGS, "--alpha", "0.5", "--offload-states", "--host-budget", str(budget), "--out", str(out)]
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err.strip()
    terms = f"states {format_bytes(states)} + activation pool {format_bytes(pool)} > host budget {format_bytes(budget)}"
    assert terms in err and len(err.splitlines()) == 1, err
    assert not out.exists()  # refused before any folder, model or step


def test_offloaded_states_leave_on_the_device_only_the_weights_fsdp_gathers(monkeypatch):
    cfg = TrainConfig.from_dict({**RUN, "dtype": "bfloat16"})
    job = Job(model=ModelConfig.preset("tiny"), seq=64, micro_batch=2, dtype="bfloat16", policy=cfg.policy())
    need = training_lower_bound(job)
    monkeypatch.setattr(dev, "free_memory_bytes", lambda device: need["activations"] + need["states"] // 2)
    with pytest.raises(ValueError, match="needs at least"):
        check_memory(cfg, cfg.job(), torch.device("cuda"), None)  # sharded over one GPU, the states would not fit
    offloaded = TrainConfig.from_dict({**RUN, "dtype": "bfloat16", "offload_states": True})
    check_memory(offloaded, offloaded.job(), torch.device("cuda"), None)


def test_lora_offloads_fp32_adapters_with_their_moments_and_a_frozen_base_in_the_training_dtype(tmp_path):
    trainer = _train(tmp_path, steps=2, save_every=0, lora_rank=4, dtype="bfloat16", offload_states=True)
    params = list(trainer.model.parameters())
    assert {(p.dtype, p.requires_grad) for p in params} == {(torch.bfloat16, False), (torch.float32, True)}
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params)
    assert all(math.isfinite(r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r)
    # what the host budget counts is what FSDP and AdamW hold (the gradients: fp32 shards of the adapters)
    trainable = [p for p in params if p.requires_grad]
    moments = [t for s in trainer.optimizer.adamw.state.values() for k, t in s.items() if k != "step"]
    held = sum(p.to_local().nbytes for p in params) + sum(4 * p.numel() for p in trainable)
    held += sum(m.to_local().nbytes for m in moments)
    assert host_bytes(trainer.job) == held  # the trainer's own count of its host budget's states


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host states and a CPU optimizer step of a GPU run")
def test_on_a_gpu_states_live_in_pinned_host_memory_and_train_to_the_losses_of_states_on_the_gpu(tmp_path):
    _train(tmp_path / "plain", steps=2, device="cuda")
    offloaded = _train(tmp_path / "offloaded", steps=2, device="cuda", offload_states=True)  # a checkpoint too
    assert all(p.device.type == "cpu" and p.to_local().is_pinned() for p in offloaded.model.parameters())
    got, want = _logged(tmp_path / "offloaded"), _logged(tmp_path / "plain")
    assert sorted(got) == sorted(want) == [-2, 1, 2]
    for step in want:  # the optimizer steps on the CPU instead of the GPU: float32 rounding apart
        torch.testing.assert_close(got[step], want[step], rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lora", [None, LoraConfig(8)], ids=["full", "lora"])
def test_the_cost_models_host_states_are_the_bytes_of_the_models_parameters(lora, dtype):
    """cost.states counts from the config what the real model's parameters take (ranks that split rows evenly)."""
    config = ModelConfig.preset("llama3.2-1b")
    with torch.device("meta"):
        model = Transformer(config)
    if lora is not None:
        apply_lora(model, lora)
    for ranks in (1, 2):
        job = Job(model=config, seq=1024, gpus=ranks, dtype=dtype, lora=lora, offload_states=True)
        assert host_bytes(job) == _host_state_bytes(model, ranks, job.torch_dtype)
