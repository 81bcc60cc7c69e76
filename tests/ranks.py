"""What a rank that a test spawns sets before it joins its gloo group: the variables torchrun would give it."""

from __future__ import annotations

import os

import torch


def join(rank: int, world: int, port: int) -> None:
    """Sets the launch variables of `rank` of `world` ranks on this host (rendezvous at `port`), one CPU thread
    each: the ranks share the machine's cores."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
