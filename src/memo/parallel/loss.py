"""The loss of a batch spread over ranks: the mean over the target tokens of all of them (memo.loss)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class _SumAcross(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity: the global loss is Σ_r L_r, so ∂L/∂L_r = 1 and each
    rank backpropagates its own part; summing the parameter gradients over the ranks gives ∂L/∂θ."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = loss.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class GlobalTokenMean:
    """The `TokenReduction` of memo.loss over a process group: counts and partial losses are summed."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def sum_count(self, count: torch.Tensor) -> torch.Tensor:
        total = count.clone()
        dist.all_reduce(total, group=self.group)
        return total

    def sum_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return _SumAcross.apply(loss, self.group)
