"""Parameter sharding with FSDP2 (`fully_shard`) over all dp×sp ranks, as ZeRO-3 does.

Each decoder layer is one FSDP unit (its parameters are gathered just before its forward and its backward,
its gradients reduce-scattered right after), the root holds embedding, final norm and head. Gradients are
summed, not averaged: the loss is already the mean over the tokens of every rank (parallel.loss), and the
sp ranks of a dp group see different tokens of the same sequences, so their gradients add up too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mixed_precision: bool = False, reshard_after_forward=True) -> None:
    """Shards `model` (a memo.Transformer) over the 1-D `mesh`; `mixed_precision` gathers bf16 parameters
    and reduces gradients in float32 (the float32 master parameters stay sharded)."""
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed_precision else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM(1.0)
    if model.policy.strategy == "memo" and model.policy.alpha is None:
        # solving α times layer 0's forward when the store sizes itself, outside that layer's FSDP hooks
        model.register_forward_pre_hook(lambda module, args: module.layers[0].unshard())


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Returns the global gradient norm (a plain tensor, the same on every rank) after clipping to `max_norm`."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Returns every parameter's whole gradient by name, gathered from its shards (collective: every rank)."""
    return {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in model.named_parameters()
        if p.grad is not None
    }
