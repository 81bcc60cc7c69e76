"""Host memory is shared by every GPU of a node (docs/method.md §3): each local rank offloads into its share."""

from __future__ import annotations

import torch
from torch import nn

from .. import device as dev
from ..swap import layer_swaps, store_layout
from ..units import format_bytes
from .mesh import local_world_size


def host_budget_per_rank(node_bytes: int | None = None) -> int:
    """Returns this rank's host budget for offload: the node's (default: `device.HOST_USABLE` of the host memory
    available to this process, its container's limit included) divided among its local ranks."""
    node = int(dev.HOST_USABLE * dev.available_host_bytes()) if node_bytes is None else node_bytes
    return node // local_world_size()


def offload_bytes(model: nn.Module, batch: int, seq: int, dtype: torch.dtype) -> int:
    """Returns the host bytes one rank's activation store needs for a local batch (batch, seq): its plan and α,
    or, where they are solved, the least a solved plan can take (`ActivationPolicy.least_host_plan`)."""
    policy, n = model.policy, len(model.layers)
    device = next(model.parameters()).device
    specs = [layer.skeletal_specs(batch, seq, dtype, device) for layer in model.layers]  # dense and sparse may mix
    modes, alphas = policy.least_host_plan(n)
    tile = policy.tile_for(seq)
    swaps = layer_swaps(modes, alphas, seq, tile, policy.offload_last_layers, policy.empty_buffers)
    return store_layout(specs, swaps, tile).host_total


def check_host_budget(model: nn.Module, batch: int, seq: int, dtype: torch.dtype, budget: int, states: int = 0) -> None:
    """Raises ValueError, before any training, when this node's ranks cannot hold their offload in `budget`
    bytes each (host_budget_per_rank); `batch`, `seq` are one rank's local batch and sequence shard, `states`
    the bytes of its offloaded model states (`cost.states.host_bytes`; 0 when they stay on the device)."""
    check_host_fits(states, offload_bytes(model, batch, seq, dtype), budget)


def check_host_fits(states: int, pool: int, budget: int) -> None:
    """Raises ValueError (one line) when one rank's offloaded model states and activation pool do not fit
    together in its `budget` bytes of the host."""
    if states + pool <= budget:
        return
    ranks = local_world_size()
    if not states:
        raise ValueError(
            f"host memory cannot hold the offload: {ranks} local rank(s) x {format_bytes(pool)} each, but each "
            f"rank's share of the node budget is {format_bytes(budget)}; lower `--alpha`, raise `--sp`, shorten "
            "the sequence or keep more layers on the device"
        )
    raise ValueError(
        f"host memory cannot hold the offloaded model states beside the activation pool: states "
        f"{format_bytes(states)} + activation pool {format_bytes(pool)} > host budget {format_bytes(budget)} per "
        f"rank ({ranks} local rank(s)); raise `--host-budget`, train on more nodes, lower `--alpha` or leave "
        "out `--offload-states`"
    )
