"""A patched transformers model sharded by hand with FSDP2 (`fully_shard` on each decoder layer and the root, as
Accelerate's FSDP2 plugin does on GPUs; on the CPU Accelerate falls back to DDP) trains on two gloo ranks as the
unpatched, unsharded model trains on one: memo's layer work runs inside each layer's call, so the unshard and
reduce-scatter hooks fire, and the store sizes itself after sharding."""

import os
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from memo import ActivationPolicy, patch

transformers = pytest.importorskip("transformers")

STEPS, ROWS, SEQ = 3, 4, 20


def llama():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def train(model, rows: slice) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in batches():
        loss = model(input_ids=ids[rows], labels=ids[rows]).loss  # every token a target: equal counts per rank
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        model = patch(llama(), ActivationPolicy("memo", alpha=0.5, tile_tokens=7))
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        half = ROWS // 2
        losses = torch.stack(train(model, slice(rank * half, (rank + 1) * half)))
        dist.all_reduce(losses)
        assert model._memo_patch.store.step == STEPS
        if rank == 0:
            torch.save(losses / 2, out)
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()


def test_two_fsdp2_ranks_give_the_one_rank_losses(tmp_path, free_port):
    out = str(tmp_path / "losses.pt")
    mp.spawn(_rank, args=(free_port(), out), nprocs=2)
    want = torch.stack(train(llama(), slice(None)))
    torch.testing.assert_close(torch.load(out), want, rtol=1e-5, atol=1e-6)
