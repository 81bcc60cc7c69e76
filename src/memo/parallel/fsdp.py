"""Parameter sharding with FSDP2 (`fully_shard`) over all dp×sp ranks, as ZeRO-3 does.

Each decoder layer is one FSDP unit (its parameters are gathered just before its forward and its backward,
its gradients reduce-scattered right after), the root holds embedding, final norm and head. Gradients are
summed, not averaged: the loss is already the mean over the tokens of every rank (parallel.loss), and the
sp ranks of a dp group see different tokens of the same sequences, so their gradients add up too.

With `offload` (`--offload-states`) FSDP's own CPUOffloadPolicy keeps every shard, its gradient and so the AdamW
state in host memory (pinned on CUDA), and the optimizer steps there; the device holds a unit's weights only
while the unit runs, gathered from the host shards.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, mixed_precision: bool = False, reshard_after_forward=True, offload=False
) -> None:
    """Shards `model` (a memo.Transformer) over the 1-D `mesh`; `mixed_precision` gathers bf16 parameters
    and reduces gradients in float32 (the float32 master parameters stay sharded); `offload` keeps the shards
    and their gradients in host memory."""
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed_precision else MixedPrecisionPolicy()
    # pinning needs an accelerator; on a CPU mesh the offload runs the same code, its copies no-ops
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    units = dict(mesh=mesh, mp_policy=policy, offload_policy=offload_policy)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **units)
    fully_shard(model, **units)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM(1.0)
    if model.policy.strategy == "memo" and model.policy.alpha is None:
        # solving α times layer 0's forward when the store sizes itself, outside that layer's FSDP hooks
        model.register_forward_pre_hook(lambda module, args: module.layers[0].unshard())


def gathered_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Returns the device bytes of an offloaded model's weights in a step: two layers gathered (the one running
    and the one prefetched) and the root's (embedding, final norm, head: gathered for the whole step), in the
    compute `dtype`."""
    layer = sum(p.numel() for p in model.layers[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - len(model.layers) * layer
    return (2 * layer + root) * dtype.itemsize


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
