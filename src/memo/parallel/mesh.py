"""The device mesh (data parallel × sequence parallel) and which part of a batch each rank holds.

Ranks are laid out dp-major: the sp ranks of one dp group are neighbours (on one node when sp ≤ GPUs per
node, so the all-to-alls stay on NVLink). Parameters are sharded over the flattened dp×sp mesh (ZeRO-3).

Where this process sits in a launched run is read here alone, from the variables torchrun (or `memo train
--nproc`, `train.launch`) sets: `rank`, `local_rank`, `world_size`, `local_world_size`, `launched`, `rendezvous`.
Outside a launch they say one process alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..loss import shift_labels


def rank() -> int:
    """Returns this process's rank in the run (RANK; 0 outside a launch)."""
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """Returns this process's rank on its node (LOCAL_RANK; 0 outside a launch): the GPU it drives."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size() -> int:
    """Returns the number of ranks the launcher started (WORLD_SIZE; 1 outside a launch)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """Returns how many ranks share this node (LOCAL_WORLD_SIZE; 1 when not set)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def launched() -> bool:
    """Returns whether a launcher started this process as a rank (LOCAL_RANK is set), even a run of one rank."""
    return "LOCAL_RANK" in os.environ


def rendezvous() -> tuple[str, int] | None:
    """Returns the (host, port) of the run's rendezvous store (MASTER_ADDR, MASTER_PORT), None without one."""
    if "MASTER_ADDR" not in os.environ:
        return None
    return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def init_mesh(sp: int = 1, timeout: timedelta | None = None, offload: bool = False) -> DeviceMesh:
    """Returns the ("dp", "sp") mesh of all ranks, dp = world / sp, starting the process group from the
    torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) if it is not started: nccl with one
    GPU per local rank (LOCAL_RANK) when CUDA is available, gloo on CPU otherwise; `timeout` bounds every
    collective (a rank that never arrives). `offload` (states in host memory) adds gloo beside nccl."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank())
    if not dist.is_initialized():
        dist.init_process_group(_backend("cuda" if cuda else "cpu", offload), timeout=timeout)
    world = dist.get_world_size()
    if not isinstance(sp, int) or sp < 1 or world % sp:
        raise ValueError(f"`--sp` must be a positive divisor of the world size ({world} ranks), got {sp}")
    return init_device_mesh("cuda" if cuda else "cpu", (world // sp, sp), mesh_dim_names=("dp", "sp"))


def init_local_mesh(device: torch.device) -> DeviceMesh:
    """Returns the ("dp", "sp") mesh of this process alone on `device`, starting a one-rank process group on an
    in-process store (no port, no file) if none is started: FSDP offloads states only on a mesh, even one with
    nothing to shard."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"`--offload-states` runs on a CPU or a CUDA device, not {device}")
    if device.index is not None and device.type == "cuda":  # FSDP gathers onto the current device
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(_backend(device.type, offload=True), store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device.type, (1, 1), mesh_dim_names=("dp", "sp"))


def _backend(device_type: str, offload: bool) -> str:
    """Returns the process group's backend: gloo on CPU, nccl on CUDA, and there with `offload` gloo for host
    tensors too (the norm of offloaded gradients, CPU DTensors of a CUDA mesh, reduces over it)."""
    if device_type == "cpu":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if offload else "nccl"


def flat_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Returns the 1-D mesh of all dp×sp ranks, over which parameters are sharded and gradients reduced."""
    return mesh["dp", "sp"]._flatten("dp_sp")


@dataclass(frozen=True)
class Shard:
    """The part of a global batch one rank holds: rows of its dp rank, contiguous tokens of its sp rank."""

    dp_rank: int
    dp_size: int
    sp_rank: int
    sp_size: int

    def rows(self, batch: int) -> slice:
        """Returns this rank's rows of a global batch of `batch` sequences."""
        if batch % self.dp_size:
            raise ValueError(
                f"the global batch ({batch}) must be a multiple of the data-parallel size ({self.dp_size})"
            )
        n = batch // self.dp_size
        return slice(self.dp_rank * n, (self.dp_rank + 1) * n)

    def tokens(self, seq: int) -> slice:
        """Returns this rank's tokens [r·s/sp, (r+1)·s/sp) of a sequence of `seq` tokens."""
        if seq % self.sp_size:
            raise ValueError(f"the sequence length ({seq}) must be a multiple of `--sp` ({self.sp_size})")
        n = seq // self.sp_size
        return slice(self.sp_rank * n, (self.sp_rank + 1) * n)


def shard_of(mesh: DeviceMesh) -> Shard:
    """Returns this rank's Shard of `mesh`."""
    return Shard(mesh["dp"].get_local_rank(), mesh["dp"].size(), mesh["sp"].get_local_rank(), mesh["sp"].size())


def shard_sequence(ids: torch.Tensor, labels: torch.Tensor, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (input ids, targets) of this rank's tokens from its dp group's batch (b, s), the same on every
    sp rank. Labels are shifted before the split: the last local token predicts the next rank's first."""
    tokens = shard_of(mesh).tokens(ids.shape[1])
    return ids[:, tokens], shift_labels(labels)[:, tokens]


def shard_batch(ids: torch.Tensor, labels: torch.Tensor, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (input ids, targets) of this rank from the global batch (B, s), the same on every rank."""
    rows = shard_of(mesh).rows(ids.shape[0])
    return shard_sequence(ids[rows], labels[rows], mesh)
