"""FSDP2's model states counted, not guessed: `memo.parallel.fsdp.apply_fsdp` at world size 8 in one CPU process
(torch's `fake` process group: real sharding, collectives that move nothing), against what the cost model says
each GPU holds (`cost.states.device_terms`)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.cost.states import FSDP_BYTES_PER_PARAM, device_terms, root_parameters
from memo.job import Job
from memo.parallel.fsdp import apply_fsdp

WORLD = 8


@pytest.fixture
def sharded():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        config = ModelConfig.preset("tiny")
        model = Transformer(config, ActivationPolicy("none"))
        apply_fsdp(model, init_device_mesh("cpu", (WORLD,)), mixed_precision=True)
        yield config, model
    finally:
        dist.destroy_process_group()


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def test_a_rank_holds_sixteen_bytes_per_weight_in_shards(sharded):
    config, model = sharded
    ids = torch.zeros(1, 64, dtype=torch.long)
    model(ids, labels=ids).backward()
    optimizer = torch.optim.AdamW(model.parameters())  # what MasterAdamW steps when the parameters are fp32 masters
    optimizer.step()
    moments = [t for state in optimizer.state.values() for t in state.values() if t.dim() > 0]
    params = list(model.parameters())
    held = _local_bytes(params) + _local_bytes(p.grad for p in params) + _local_bytes(moments)
    assert {p.to_local().dtype for p in params} == {torch.float32}  # the shards are their own fp32 masters
    predicted = device_terms(Job(model=config, seq=64, gpus=WORLD))["states"]
    assert predicted == config.num_parameters() * FSDP_BYTES_PER_PARAM // WORLD
    assert predicted <= held <= predicted * 1.01  # FSDP pads each parameter's rows to a multiple of the ranks


def test_the_root_unit_stays_gathered_from_its_forward_to_its_backward(sharded):
    config, model = sharded
    ids = torch.zeros(1, 64, dtype=torch.long)
    loss = model(ids, labels=ids)
    units = {
        name: m._get_fsdp_state()._fsdp_param_group for name, m in model.named_modules() if isinstance(m, FSDPModule)
    }
    assert units.pop("").is_unsharded and not any(group.is_unsharded for group in units.values())
    root = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("layers."))
    assert root == root_parameters(config)  # what device_terms counts gathered for the whole step
    loss.backward()
