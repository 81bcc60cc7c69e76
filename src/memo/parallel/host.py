"""Host memory is shared by every GPU of a node (docs/method.md §3): each local rank offloads into its share."""

from __future__ import annotations

import os

import torch
from torch import nn

from .. import device as dev
from ..swap import store_layout
from ..units import format_bytes


def local_ranks() -> int:
    """Returns how many ranks share this node (torchrun's LOCAL_WORLD_SIZE; 1 when not set)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def host_budget_per_rank(node_bytes: int | None = None) -> int:
    """Returns this rank's host budget for offload: the node's (default: 80% of the memory the OS reports
    available, as the swap engine assumes for one process) divided among its local ranks."""
    node = int(0.8 * dev.available_host_bytes()) if node_bytes is None else node_bytes
    return node // local_ranks()


def offload_bytes(model: nn.Module, batch: int, seq: int, dtype: torch.dtype) -> int:
    """Returns the host bytes one rank's activation store needs for a local batch (batch, seq): its plan and α,
    or, where they are solved, the least a solved plan can take (`ActivationPolicy.least_host_plan`)."""
    policy, n = model.policy, len(model.layers)
    specs = model.layers[0].skeletal_specs(batch, seq, dtype, next(model.parameters()).device)
    modes, alphas = policy.least_host_plan(n)
    return store_layout(specs, modes, alphas, policy.tile_for(seq), policy.offload_last_layers).host_total


def check_host_budget(model: nn.Module, batch: int, seq: int, dtype: torch.dtype, budget: int) -> None:
    """Raises ValueError, before any training, when this node's ranks cannot hold their offload in `budget`
    bytes each (host_budget_per_rank); `batch`, `seq` are one rank's local batch and sequence shard."""
    need = offload_bytes(model, batch, seq, dtype)
    if need > budget:
        ranks = local_ranks()
        raise ValueError(
            f"host memory cannot hold the offload: {ranks} local rank(s) x {format_bytes(need)} each, but each "
            f"rank's share of the node budget is {format_bytes(budget)}; lower `--alpha`, raise `--sp`, shorten "
            "the sequence or keep more layers on the device"
        )
