"""Distributed training: a dp × sp device mesh, Ulysses sequence parallelism inside the MEMO layer, FSDP2
parameter sharding over all ranks, and each rank's share of the node's host memory.

A training loop (launched by torchrun) uses it as

    mesh = init_mesh(sp)
    budget = host_budget_per_rank()                        # before building the policy
    model = Transformer(config, ActivationPolicy("memo", alpha, host_budget_bytes=budget)).to(device)
    parallelize(model, mesh)
    check_host_budget(model, local_batch, seq // sp, dtype, budget)
    optimizer = torch.optim.AdamW(model.parameters())      # over the sharded parameters
    ids, targets = shard_batch(global_ids, global_labels, mesh)
    loss = model(ids, targets=targets)                     # the global token mean, the same on every rank
    loss.backward()
    norm = clip_grad_norm(model, 1.0)
    optimizer.step()

With `--offload-states` (`init_mesh(sp, offload=True)`, or one process alone on `init_local_mesh(device)`),
`parallelize(model, mesh, offload_states=True)` shards the model even over one rank: FSDP keeps its states in
host memory (`cost.states.host_bytes`, counted in each rank's host budget beside the activation pool).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .host import check_host_budget, check_host_fits, host_budget_per_rank, offload_bytes
from .loss import GlobalTokenMean
from .mesh import (
    Shard,
    flat_mesh,
    init_local_mesh,
    init_mesh,
    launched,
    local_rank,
    local_world_size,
    rank,
    shard_batch,
    shard_of,
    shard_sequence,
    world_size,
)
from .ulysses import Ulysses, apply_ulysses

__all__ = [
    "GlobalTokenMean",
    "Shard",
    "Ulysses",
    "apply_fsdp",
    "apply_ulysses",
    "check_host_budget",
    "check_host_fits",
    "clip_grad_norm",
    "flat_mesh",
    "full_gradients",
    "gathered_bytes",
    "host_budget_per_rank",
    "init_local_mesh",
    "init_mesh",
    "launched",
    "local_rank",
    "local_world_size",
    "offload_bytes",
    "parallelize",
    "rank",
    "shard_batch",
    "shard_of",
    "shard_sequence",
    "world_size",
]


def __getattr__(name: str):
    """Loads FSDP (and DTensor, which pulls in sympy: half a second) on first use, not with every command."""
    if name in ("apply_fsdp", "clip_grad_norm", "full_gradients", "gathered_bytes"):
        from . import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parallelize(
    model: nn.Module, mesh: DeviceMesh, mixed_precision: bool | None = None, offload_states: bool = False
) -> nn.Module:
    """Returns `model` (a memo.Transformer, built the same on every rank) made to train on `mesh`: Ulysses over
    "sp", the loss a mean over the tokens of all ranks, parameters sharded over dp×sp. `mixed_precision`
    (bf16 parameters, float32 gradient reduction) defaults to on for CUDA; `offload_states` keeps parameters,
    gradients and so the optimizer state in host memory. A one-rank mesh changes nothing unless offloading."""
    if mesh.size() == 1 and not offload_states:
        return model
    flat = flat_mesh(mesh)
    if mesh.size() > 1:  # one rank: its loss and gradients are already whole
        apply_ulysses(model.layers, mesh["sp"].get_group())
        model.token_reduction = GlobalTokenMean(flat.get_group())
    from .fsdp import apply_fsdp

    mixed = mesh.device_type == "cuda" if mixed_precision is None else mixed_precision
    apply_fsdp(model, flat, mixed, offload=offload_states)
    return model
