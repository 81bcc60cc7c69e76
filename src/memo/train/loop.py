"""The training loop: AdamW on a generated task, yielding one metrics dict per step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import ModelConfig
from ..model import Transformer
from ..policy import ActivationPolicy
from .data import copy_task_batch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TrainConfig:
    """What `memo train` runs; every field is a CLI flag of the same name."""

    model: str = "tiny"
    strategy: str = "memo"
    alpha: float | None = 0.5
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 200
    lr: float = 1e-3
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"`--{name.replace('_', '-')}` must be positive, got {getattr(self, name)}")
        if not self.grad_clip > 0:
            raise ValueError(f"`--grad-clip` must be positive, got {self.grad_clip}")
        if not self.lr > 0:
            raise ValueError(f"`--lr` must be positive, got {self.lr}")
        if self.dtype not in DTYPES:
            raise ValueError(f"`--dtype` must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        ModelConfig.preset(self.model)
        self.policy()

    def policy(self) -> ActivationPolicy:
        return ActivationPolicy(self.strategy, alpha=self.alpha if self.strategy == "memo" else None)


def train(cfg: TrainConfig) -> Iterator[dict]:
    """Trains and yields {step, loss, tokens_per_s, seconds, swap stats} after every step."""
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    model_cfg = ModelConfig.preset(cfg.model)
    model = Transformer(model_cfg, cfg.policy()).to(device=device, dtype=DTYPES[cfg.dtype])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    data = torch.Generator().manual_seed(cfg.seed)
    for step in range(1, cfg.steps + 1):
        ids, labels = (t.to(device) for t in copy_task_batch(cfg.batch_size, cfg.seq_len, data))
        start = time.perf_counter()
        loss = model(ids, labels=labels)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        seconds = time.perf_counter() - start
        yield {
            "step": step,
            "loss": loss_value,
            "grad_norm": grad_norm,
            "seconds": seconds,
            "tokens_per_s": cfg.batch_size * cfg.seq_len / seconds,
            **model.swap_stats().as_dict(),
        }
