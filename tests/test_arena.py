"""The planned run-time arena: bit-identical gradients, a valid layout, and run-time checks that can fire."""

import copy
import dataclasses
import os

import pytest
import torch

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.layer import FreshTiles, forward_phase
from memo.plan.arena import ALIGN, Arena, _PlannedMode
from memo.plan.problem import check_placement

DEVICE = torch.device(os.environ.get("MEMO_TEST_DEVICE", "cpu"))
POLICIES = {
    "none": ActivationPolicy("none"),
    "full": ActivationPolicy("full"),
    "memo-a0.37": ActivationPolicy("memo", alpha=0.37),
    "memo-per-layer": ActivationPolicy("memo", alpha=[0.0, 0.55, 1.0, 0.3], offload_last_layers=True),
    "memo-tiled": ActivationPolicy("memo", alpha=0.37, tile_tokens=8),
    "plan-tiled": ActivationPolicy("memo", alpha=0.5, plan=("checkpoint", "memo", "keep", "memo"), tile_tokens=7),
}


def _models(preset: str, policy: ActivationPolicy, dtype=torch.float32):
    torch.manual_seed(0)
    plain = Transformer(ModelConfig.preset(preset), policy).to(DEVICE, dtype)
    planned = copy.deepcopy(plain)
    return plain, planned, planned.plan_memory(debug=True, time_limit=0.2)


def _step(model, ids):
    model.zero_grad()
    loss = model(ids, labels=ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


CASES = [(policy, torch.float32) for policy in POLICIES]
CASES += [("none", torch.bfloat16), ("memo-a0.37", torch.bfloat16), ("memo-tiled", torch.bfloat16)]


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
@pytest.mark.parametrize("policy, dtype", CASES)
def test_planned_model_gives_bit_identical_loss_and_gradients(preset, policy, dtype):
    plain, planned, arena = _models(preset, POLICIES[policy], dtype)
    ids = torch.randint(0, 256, (2, 29), device=DEVICE)
    for _ in range(2):  # the second step replays the plans made in the first
        loss, grads = _step(plain, ids)
        planned_loss, planned_grads = _step(planned, ids)
        assert torch.equal(loss, planned_loss)
        for name, g in grads.items():
            assert torch.equal(g, planned_grads[name]), name
    summary = arena.summary()
    assert summary["phases"] >= 2  # a forward and a backward at least
    assert 0 < summary["load_bytes"] <= summary["arena_bytes"] <= summary["planned_bytes"]


def test_plans_are_valid_placements_and_name_what_they_could_not_plan():
    _, planned, arena = _models("tiny-gpt", POLICIES["memo-a0.37"])
    _step(planned, torch.randint(0, 256, (1, 64), device=DEVICE))
    for plan in arena.plans.values():
        offsets = [s.offset // ALIGN for slots in plan.slots.values() for s in slots if s.offset is not None]
        ids = [s.tensor for slots in plan.slots.values() for s in slots if s.offset is not None]
        order = {t: i for i, t in enumerate(plan.problem.ids)}
        by_problem = [offsets[ids.index(t)] for t in sorted(order, key=order.get)]
        assert check_placement(plan.problem, by_problem) == []
        assert all(s.offset % ALIGN == 0 for slots in plan.slots.values() for s in slots if s.offset is not None)
    whys = {(u["op"].split(".")[1], u["why"]) for u in arena.summary()["unplanned"]}
    attention = {op for op, why in whys if why == "no out= overload" and "_scaled_dot_product" in op}
    assert attention  # attention is a fused kernel with no out= overload
    assert ("mm", "outlives the phase") in whys  # weight gradients leave the layer


def _plan_with_overlap(arena: Arena):
    """Returns a forward plan edited so that two tensors that are live together share an address."""
    key, plan = next((k, p) for k, p in arena.plans.items() if k[0] == "forward_phase")
    first, second = (int(a[0]) for a in plan.problem.overlaps())
    slot_of = {s.tensor: (call, j) for call, slots in plan.slots.items() for j, s in enumerate(slots)}
    a, b = plan.problem.ids[first], plan.problem.ids[second]
    call, j = slot_of[b]
    bad = copy.copy(plan)
    bad.slots = dict(plan.slots)
    bad.slots[call] = list(plan.slots[call])
    bad.slots[call][j] = dataclasses.replace(
        plan.slots[call][j], offset=plan.slots[slot_of[a][0]][slot_of[a][1]].offset
    )
    return key, bad


def test_debug_check_catches_a_planted_overlap():
    _, planned, arena = _models("tiny", POLICIES["none"])
    ids = torch.randint(0, 256, (1, 32), device=DEVICE)
    _step(planned, ids)
    key, bad = _plan_with_overlap(arena)
    arena.plans[key] = bad
    with pytest.raises(RuntimeError, match="arena overlap"):
        _step(planned, ids)


def test_debug_check_catches_a_planned_tensor_kept_past_its_phase():
    _, planned, arena = _models("tiny", POLICIES["none"])
    layer, kept = planned.layers[0], []

    def leaky(layer, t, tiles):
        y, aux = forward_phase(layer, t, tiles)
        scratch = t["x"] * 2
        if not y.is_meta:  # the trace (on meta) saw it die; the run keeps this planned temporary alive
            kept.append(scratch)
        return y, aux

    specs = layer.skeletal_specs(1, 16, torch.float32, DEVICE)
    t = {n: torch.randn(sp.shape, dtype=sp.dtype, device=DEVICE) for n, sp in specs.items() if sp.group == "whole"}
    with torch.no_grad(), pytest.raises(RuntimeError, match="outlive their phase"):
        arena.run(layer, leaky, t, FreshTiles.of(specs, 16, 4))


def test_a_phase_that_strays_from_its_plan_is_stopped():
    _, planned, arena = _models("tiny", POLICIES["none"])
    _step(planned, torch.randint(0, 256, (1, 16), device=DEVICE))
    plan = next(p for k, p in arena.plans.items() if k[0] == "forward_phase")
    with pytest.raises(RuntimeError, match="out of step"), _PlannedMode(arena.buffer, plan, debug=False):
        torch.ones(3, device=DEVICE).cumsum(0)


def _fused_rms_norm_cpu(x, normalized_shape, weight, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype), rstd


def _fused_rms_norm_backward_cpu(dy, x, normalized_shape, rstd, weight, output_mask):
    xf, g = x.float(), dy.float() * weight.float()
    dx = rstd * (g - xf * rstd.pow(2) * (g * xf).mean(-1, keepdim=True))
    dw = (dy.float() * xf * rstd).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@pytest.fixture
def cuda_like_rms_norm():
    """Gives CPU fused kernels for `_fused_rms_norm` and its backward, as CUDA has: the CPU suite then sees
    the op sequence of a CUDA step (one op each), where meta and plain CPU see a decomposition."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_fused_rms_norm", _fused_rms_norm_cpu, "CPU")
    lib.impl("_fused_rms_norm_backward", _fused_rms_norm_backward_cpu, "CPU")
    yield
    lib._destroy()


@pytest.mark.skipif(DEVICE.type != "cpu", reason="mimics the CUDA kernels on CPU")
@pytest.mark.parametrize("policy", ["none", "memo-a0.37"])
def test_planned_rms_norm_model_replays_the_cuda_op_sequence(cuda_like_rms_norm, policy):
    plain, planned, arena = _models("tiny", POLICIES[policy])
    ids = torch.randint(0, 256, (1, 29), device=DEVICE)
    for _ in range(2):
        loss, grads = _step(plain, ids)
        planned_loss, planned_grads = _step(planned, ids)
        assert torch.equal(loss, planned_loss)
        for name, g in grads.items():
            assert torch.equal(g, planned_grads[name]), name
    calls = {str(func) for plan in arena.plans.values() for func in plan.calls}
    assert {"aten._fused_rms_norm_backward.default", "memo.rms_norm.default"} <= calls
