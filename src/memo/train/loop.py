"""The training loop: builds the model, data, optimizer and run directory from a `TrainConfig`, and yields one
metrics record per optimizer step (and one per evaluation). Resuming restores everything the next step
depends on (weights, AdamW state, fp32 masters, solved α, RNG; data and learning rate are functions of the
step), so a resumed run's losses equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Iterator

import torch

from ..config import PRESETS, ModelConfig
from ..cost.flops import model_flops_per_token
from ..cost.hardware import GPUS
from ..model import Transformer
from . import checkpoint
from .config import TrainConfig, read_config_file
from .data import check_vocab, make_source, retrieval_accuracy
from .metrics import MetricsLog
from .optim import MasterAdamW, learning_rate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_model(cfg: TrainConfig, alphas: list[float] | None = None) -> Transformer:
    """Returns the model of `cfg.model` (preset, config file or Hugging Face folder) on its device and dtype."""
    torch.manual_seed(cfg.seed)
    policy, path = cfg.policy(alphas), Path(cfg.model)
    if cfg.model in PRESETS:
        model = Transformer(ModelConfig.preset(cfg.model), policy)
    elif path.is_dir():
        from ..hf import from_hf

        try:
            model = from_hf(path, policy=policy)
        except FileNotFoundError as err:
            raise ValueError(str(err)) from None
    elif path.is_file():
        try:
            model = Transformer(ModelConfig(**read_config_file(path)), policy)
        except TypeError as err:
            raise ValueError(f"model config {path}: {err}") from None
    else:
        raise ValueError(f"`--model` {cfg.model!r} is neither a preset ({', '.join(PRESETS)}) nor a file or folder")
    return model.to(device=torch.device(cfg.device), dtype=DTYPES[cfg.dtype])


class Trainer:
    """One run: `records()` trains from the current step to `cfg.steps`, checkpointing as configured."""

    def __init__(self, cfg: TrainConfig, resume: bool = False):
        self.cfg = cfg
        self.run_dir = Path(cfg.out) if cfg.out else _new_run_dir()
        saved = checkpoint.load_latest(self.run_dir) if resume else None
        if not resume and checkpoint.list_checkpoints(self.run_dir):
            raise ValueError(f"{self.run_dir} already holds a run: `--resume {self.run_dir}` or another `--out`")
        self.device = torch.device(cfg.device)
        self.model = build_model(cfg, saved.state.get("alphas") if saved else None)
        self.source = make_source(cfg.data, cfg.seq_len, cfg.seed, cfg.tokenizer, cfg.text_key)
        check_vocab(self.source, self.model.config.vocab_size, cfg.model)
        self.optimizer = MasterAdamW(self.model, cfg)
        self.step = 0
        if saved:
            self._restore(saved)
        self.arena = self.model.plan_memory() if cfg.arena else None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.run_dir / "config.json", cfg.to_dict())
        self.log = MetricsLog(self.run_dir, cfg.tensorboard, resume_after=self.step)
        self.flops_per_token = model_flops_per_token(self.model.config, cfg.seq_len)
        self.peak_flops = _peak_flops(self.device)

    def records(self) -> Iterator[dict]:
        """Trains; yields each step's record, then (at evaluation steps) an evaluation record."""
        try:
            while self.step < self.cfg.steps:
                self.step += 1
                record = self._train_step()
                self.log.write(record)
                yield record
                if self._evaluates() and (self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps):
                    record = {"step": self.step, **self.evaluate()}
                    self.log.write(record)
                    yield record
                if self.step == self.cfg.steps or (self.cfg.save_every and self.step % self.cfg.save_every == 0):
                    self.save()
        finally:
            self.log.close()

    def _evaluates(self) -> bool:
        return hasattr(self.source, "eval_batches")  # the generated task has a held-out stream; files do not

    def evaluate(self) -> dict:
        """Returns the held-out loss and answer accuracy of the generated task (never trained on)."""
        batches = self.source.eval_batches(self.cfg.eval_batches, self.cfg.batch_size // self.cfg.grad_accum)
        with torch.no_grad():
            losses = [self.model(ids.to(self.device), labels=labels.to(self.device)).item() for ids, labels in batches]
            accuracy = retrieval_accuracy(self.model, batches)
        return {"eval_loss": sum(losses) / len(losses), "eval_accuracy": accuracy}

    def _train_step(self) -> dict:
        cfg, model = self.cfg, self.model
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        ids, labels = self.source.batch(self.step, cfg.batch_size)
        total = torch.zeros((), device=self.device)
        for micro_ids, micro_labels in zip(ids.chunk(cfg.grad_accum), labels.chunk(cfg.grad_accum)):
            loss = model(micro_ids.to(self.device), labels=micro_labels.to(self.device)) / cfg.grad_accum
            loss.backward()
            total += loss.detach().float()
        lr = learning_rate(cfg, self.step)
        grad_norm = self.optimizer.step(lr, cfg.grad_clip)
        loss_value = total.item()  # synchronises the device: the step is done
        seconds = time.perf_counter() - start
        tokens = cfg.batch_size * cfg.seq_len
        flops = self.flops_per_token * tokens / seconds
        stats = model.swap_stats()
        record = {
            "step": self.step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_norm,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "tflops": flops / 1e12,
            "mfu": flops / self.peak_flops if self.peak_flops else None,
            "host_pool_bytes": stats.host_pool_bytes,
            "bytes_offloaded": stats.bytes_offloaded,
            "bytes_recomputed": stats.bytes_recomputed,
            "alphas": stats.alphas,
        }
        if self.device.type == "cuda":
            record["device_peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
            record["device_peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
        return record

    def save(self) -> Path:
        """Writes a checkpoint of the current step (atomically)."""
        state = {
            "config": self.cfg.to_dict(),
            "alphas": self.model.swap_stats().alphas or None,
            "rng": _rng_state(),
            "data": {"next_step": self.step + 1},
        }
        return checkpoint.save(
            self.run_dir,
            self.step,
            self.model.state_dict(),
            self.optimizer.state_tensors(),
            state,
            self.cfg.keep_checkpoints,
        )

    def _restore(self, saved: checkpoint.Checkpoint) -> None:
        try:
            self.model.load_state_dict(saved.model)
            self.optimizer.load_state_tensors(saved.optimizer)
        except (RuntimeError, KeyError) as err:
            raise ValueError(f"checkpoint {saved.path} does not fit this model: {err}") from None
        _set_rng_state(saved.state["rng"])
        self.step = saved.step


def resume_config(run_dir: str | Path, overrides: dict) -> TrainConfig:
    """Returns the config saved in `run_dir` with `overrides` (flags given with --resume) applied."""
    saved = checkpoint.load_latest(Path(run_dir))
    return TrainConfig.from_dict({**saved.state["config"], **overrides, "out": str(run_dir)}, f"{run_dir}")


def _new_run_dir() -> Path:
    """Returns runs/<date-time>, with a suffix if a run started in the same second."""
    base = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _peak_flops(device: torch.device) -> float | None:
    """Returns the dense bf16 peak of a known GPU (for MFU), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((spec.peak_flops for key, spec in GPUS.items() if key.split("-")[0] in name), None)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _write_json(path: Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)
