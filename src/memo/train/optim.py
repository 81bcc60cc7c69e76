"""AdamW over fp32 master weights of the trainable parameters (all, or LoRA's adapters), and the learning-rate
schedule (linear warm-up, then cosine/linear/constant).

The layers run hand-written kernels in their parameters' dtype, so `torch.autocast` cannot lower their
precision; bf16 training instead keeps bf16 compute weights and an fp32 master copy that AdamW updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW's settings and the learning-rate schedule over `steps` (`TrainConfig.optimizer`: flags checked there)."""

    lr: float
    min_lr: float
    warmup_steps: int
    schedule: str
    steps: int
    weight_decay: float
    beta1: float
    beta2: float
    grad_clip: float


def learning_rate(cfg: OptimizerConfig, step: int) -> float:
    """Returns the learning rate of optimizer step `step` (1-based): a pure function of the step, so a
    resumed run follows the same schedule without scheduler state."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
    shape = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) if cfg.schedule == "cosine" else 1 - min(progress, 1)
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * shape


class MasterAdamW:
    """AdamW whose parameters are fp32 masters of the model's (possibly lower-precision) parameters.
    `clip_grad_norm(max_norm)` clips the gradients and returns their global norm (default: over the masters;
    memo.parallel.clip_grad_norm for a sharded model, whose parameters are its own masters)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: OptimizerConfig,
        clip_grad_norm: Callable[[float], torch.Tensor] | None = None,
    ):
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # frozen ones have no state
        self.names = [n for n, _ in trainable]
        self.params = [p for _, p in trainable]
        self.separate = any(p.dtype != torch.float32 for p in self.params)
        self.master = [p.detach().float().clone() if self.separate else p for p in self.params]
        decay = [m for m, p in zip(self.master, self.params) if p.dim() >= 2]
        flat = [m for m, p in zip(self.master, self.params) if p.dim() < 2]
        self.adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": flat, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            fused=True,  # one kernel over all tensors: on host-resident states ~8x the per-tensor loop (cpu_adam.py)
        )
        self.clip_grad_norm = clip_grad_norm or (lambda max_norm: torch.nn.utils.clip_grad_norm_(self.master, max_norm))

    def accumulate(self) -> None:
        """Adds the model's gradients (one micro-batch's) into the masters' fp32 gradients and drops them, so
        gradient accumulation sums in fp32, not in the compute dtype."""
        if not self.separate:
            return
        for m, p in zip(self.master, self.params):
            if p.grad is not None:
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None

    def step(self, lr: float, grad_clip: float, loss: torch.Tensor) -> tuple[float, float]:
        """Clips the global gradient norm, updates the masters, copies them to the model; returns (the step's
        `loss`, the norm), both read with one device sync. A loss or norm that is not finite (nan, inf) updates
        nothing: the weights and moments stay those of the last good step (the norm is then reported nan)."""
        self.accumulate()
        norm = self.clip_grad_norm(grad_clip)
        loss_value, norm_value = torch.stack((loss.float(), norm.float().to(loss.device))).tolist()
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            self.discard()
            return loss_value, norm_value if math.isfinite(loss_value) else math.nan
        for group in self.adamw.param_groups:
            group["lr"] = lr
        self.adamw.step()
        self.discard()
        if self.separate:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)
        return loss_value, norm_value

    def discard(self) -> None:
        """Drops the gradients (after an update, or instead of one)."""
        self.adamw.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Returns every tensor of the optimizer state (moments, step counts, masters) by a flat name."""
        index = {id(m): i for i, m in enumerate(self.master)}
        out = {}
        for m, state in self.adamw.state.items():
            for key, value in state.items():
                out[f"{self.names[index[id(m)]]}.{key}"] = value
        if self.separate:
            out.update({f"{name}.master": m for name, m in zip(self.names, self.master)})
        return out

    def empty_state_tensors(self, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
        """Returns tensors to load `state_tensors()` output into, for the names in `shapes` (a checkpoint's):
        moments and masters shaped (and sharded) like the masters, scalars (step counts) as float32."""
        out = {}
        for name, m in zip(self.names, self.master):
            for key in ("step", "exp_avg", "exp_avg_sq") + (("master",) if self.separate else ()):
                if f"{name}.{key}" in shapes:
                    empty = torch.zeros(()) if len(shapes[f"{name}.{key}"]) == 0 else torch.zeros_like(m)
                    out[f"{name}.{key}"] = empty
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restores `state_tensors()` output exactly (dtypes and values)."""
        by_param: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():  # "<param name>.<state key>", grouped once
            name, field = key.rsplit(".", 1)
            by_param.setdefault(name, {})[field] = t
        with torch.no_grad():
            for name, m, p in zip(self.names, self.master, self.params):
                if self.separate:
                    m.copy_(tensors[f"{name}.master"])
                    p.copy_(m)
                state = dict(by_param.get(name, {}))
                state.pop("master", None)
                if state:
                    self.adamw.state[m] = {k: v.to(m.device) for k, v in state.items()}  # fused: step there too
