"""Distributed training on CPU with gloo: every dp × sp layout gives the loss and parameter gradients of one
process running the same global batch (torchtitan's loss-parity rule), for every strategy and both archs.

Each world size is one group of spawned processes that runs all of its checks (process start-up costs
seconds on two cores); a failing check raises in its rank and fails the test with that rank's traceback.
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import ranks
import torch
import torch.multiprocessing as mp

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.loss import IGNORE_INDEX
from memo.parallel import (
    check_host_budget,
    clip_grad_norm,
    full_gradients,
    host_budget_per_rank,
    init_mesh,
    mesh,
    offload_bytes,
    parallelize,
    shard_batch,
)
from memo.parallel.mesh import Shard
from memo.parallel.ulysses import Ulysses
from memo.plan.phases import attach

POLICIES = {
    "none": ActivationPolicy("none"),
    "full": ActivationPolicy("full"),
    "memo": ActivationPolicy("memo", alpha=0.5),
    "memo-all-layers": ActivationPolicy("memo", alpha=0.5, offload_last_layers=True),
    "memo-solved": ActivationPolicy("memo", host_budget_bytes=1 << 30),  # α from layer 0's timed forward
    # tiles of 5 tokens (not dividing any shard), one layer of each mode, attention one head per call
    "tiled-plan": ActivationPolicy(
        "memo", alpha=0.4, plan=("checkpoint", "memo", "keep", "memo"), tile_tokens=5, attention_heads=1
    ),
}
# Sharded runs sum weight gradients over ranks in another order than one process sums over tokens, and
# row-sliced matmuls may block differently: float32 rounding, nothing more.
TOL = dict(rtol=1e-5, atol=1e-6)
BATCH, SEQ = 2, 32


def _models(preset: str, policy: ActivationPolicy) -> tuple[Transformer, Transformer]:
    torch.manual_seed(0)
    single = Transformer(ModelConfig.preset(preset), policy)
    for p in single.parameters():  # non-trivial norms and biases so that their gradients are exercised
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.1)
    return single, copy.deepcopy(single)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = IGNORE_INDEX  # uneven ignored tokens: ranks hold different target counts
    labels[1, 17:19] = IGNORE_INDEX
    return ids, labels


def _check_layout(dp: int, sp: int) -> None:
    mesh = init_mesh(sp, timeout=timedelta(seconds=60))
    assert mesh.shape == (dp, sp)
    ids, labels = _batch()
    local_ids, targets = shard_batch(ids, labels, mesh)
    assert local_ids.shape == (BATCH // dp, SEQ // sp)
    if sp > 1:
        with pytest.raises(ValueError, match="must divide the number of attention heads"):
            Ulysses.over(mesh["sp"].get_group(), 3, 1)
    for preset in ("tiny", "tiny-gpt"):
        for name, policy in POLICIES.items():
            where = f"dp={dp} sp={sp} {preset} {name}"
            single, model = _models(preset, policy)
            parallelize(model, mesh)
            for _ in range(2):  # the second step reuses the stores' buffers and FSDP's state
                single.zero_grad()
                model.zero_grad()
                ref_loss = single(ids, labels=labels)
                ref_loss.backward()
                loss = model(local_ids, targets=targets)
                loss.backward()
            torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{where} loss: {m}")
            grads = full_gradients(model)
            for pname, p in single.named_parameters():
                torch.testing.assert_close(grads[pname], p.grad, **TOL, msg=lambda m: f"{where} {pname}: {m}")
            if name == "memo-all-layers":
                assert model.swap_stats().tokens_recomputed > 0, where
                _check_clip_and_step(single, model, where)
            if sp > 1 and name == "none":
                with pytest.raises(ValueError, match="sequence parallelism"):
                    attach(model)


def _check_clip_and_step(single: Transformer, model: Transformer, where: str) -> None:
    """Clipping over DTensor gradients and an optimizer step over sharded parameters match one process."""
    ref_norm = torch.nn.utils.clip_grad_norm_(single.parameters(), 0.1)
    torch.testing.assert_close(clip_grad_norm(model, 0.1), ref_norm, **TOL, msg=lambda m: f"{where} norm: {m}")
    for m in (single, model):  # SGD: Adam's first step g/(|g|+eps) would amplify rounding of tiny gradients
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9).step()
    state = {n: p.full_tensor() for n, p in model.named_parameters()}
    for name, p in single.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), **TOL, msg=lambda m: f"{where} step {name}: {m}")


def _check_phase_planner_under_fsdp() -> None:
    """The planned arena (docs/method.md §5) runs inside FSDP's unsharded layers as in one process."""
    mesh = init_mesh(1)
    ids, labels = _batch()
    single, model = _models("tiny", POLICIES["memo"])
    attach(model, time_limit=0.2)
    parallelize(model, mesh)
    local_ids, targets = shard_batch(ids, labels, mesh)
    single(ids, labels=labels).backward()
    model(local_ids, targets=targets).backward()
    grads = full_gradients(model)
    for name, p in single.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **TOL, msg=lambda m: f"arena {name}: {m}")


def _check_mixed_precision() -> None:
    """bf16 parameters with float32 reduction under sp=2 err from float32 no more than one bf16 process does."""
    mesh = init_mesh(2)
    ids, labels = _batch()
    single, model = _models("tiny", POLICIES["memo"])
    single16 = copy.deepcopy(single).to(torch.bfloat16)
    parallelize(model, mesh, mixed_precision=True)
    local_ids, targets = shard_batch(ids, labels, mesh)
    for m in (single, single16):
        m(ids, labels=labels).backward()
    model(local_ids, targets=targets).backward()
    grads, grads16 = full_gradients(model), dict(single16.named_parameters())
    for name, p in single.named_parameters():
        assert grads[name].dtype == torch.float32, name  # reduced and kept in float32
        err = (grads[name] - p.grad).norm() / p.grad.norm()
        err16 = (grads16[name].grad.float() - p.grad).norm() / p.grad.norm()
        assert err <= 1.5 * err16 + 0.005, f"{name}: sp=2 bf16 error {err:.4f}, one bf16 process {err16:.4f}"


def _run(rank: int, world: int, port: int, layouts: list[tuple[int, int]]) -> None:
    ranks.join(rank, world, port)
    import torch.distributed as dist

    try:
        for dp, sp in layouts:
            _check_layout(dp, sp)
        if world == 2:
            _check_phase_planner_under_fsdp()
            _check_mixed_precision()
        with pytest.raises(ValueError, match="`--sp` must be a positive divisor"):
            init_mesh(3)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world, layouts",
    [(2, [(1, 2), (2, 1)]), (4, [(2, 2), (1, 4)])],
    ids=["world2-sp2-dp2", "world4-sp2xdp2-sp4"],
)
def test_parallel_layouts_match_one_process_loss_and_gradients(world, layouts, free_port):
    mp.spawn(_run, args=(world, free_port(), layouts), nprocs=world)


def test_shard_holds_contiguous_tokens_and_rows_and_refuses_uneven_splits():
    shard = Shard(dp_rank=1, dp_size=2, sp_rank=2, sp_size=4)
    assert shard.rows(6) == slice(3, 6)
    assert shard.tokens(32) == slice(16, 24)
    with pytest.raises(ValueError, match="multiple of `--sp`"):
        shard.tokens(30)
    with pytest.raises(ValueError, match="multiple of the data-parallel size"):
        shard.rows(3)


LAUNCH = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _launch_view() -> tuple:
    ranks = mesh.rank(), mesh.local_rank(), mesh.world_size(), mesh.local_world_size()
    return *ranks, mesh.launched(), mesh.rendezvous()


def test_the_launch_environment_reads_as_one_process_alone_outside_a_launch(monkeypatch):
    for name in LAUNCH:
        monkeypatch.delenv(name, raising=False)
    assert _launch_view() == (0, 0, 1, 1, False, None)
    values = ("5", "1", "8", "4", "node0", "29500")
    for name, value in zip(LAUNCH, values):
        monkeypatch.setenv(name, value)
    assert _launch_view() == (5, 1, 8, 4, True, ("node0", 29500))


def test_host_budget_is_split_among_local_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_budget_per_rank(8 << 30) == 2 << 30


def test_offload_that_the_node_cannot_hold_is_refused_before_training(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    model = Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.5))
    need = offload_bytes(model, 1, 64, torch.float32)
    model(torch.zeros(1, 64, dtype=torch.long), labels=torch.ones(1, 64, dtype=torch.long)).backward()
    assert model.swap_stats().host_pool_bytes == need  # what the swap engine really reserves
    model_a0 = Transformer(ModelConfig.preset("tiny"), ActivationPolicy("memo", alpha=0.0))
    assert 0 < offload_bytes(model_a0, 1, 64, torch.float32) < need
    check_host_budget(model, 1, 64, torch.float32, host_budget_per_rank(8 * need))
    with pytest.raises(ValueError, match="8 local rank"):
        check_host_budget(model, 1, 64, torch.float32, host_budget_per_rank(8 * need - 8))
