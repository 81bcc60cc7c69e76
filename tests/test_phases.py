"""The phase planner: bit-identical gradients, a valid layout, run-time checks that can fire, and phases that
cannot keep to a plan running unplanned with the same gradients."""

import contextlib
import copy
import dataclasses
import logging
import os

import pytest
import torch

from memo import ActivationPolicy, ModelConfig, Transformer
from memo import layer as layer_module
from memo.layer import FreshTiles, forward_phase
from memo.plan.phases import ALIGN, PhasePlanner, attach
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
    return plain, planned, attach(planned, debug=True, time_limit=0.2)


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
    plain, planned, planner = _models(preset, POLICIES[policy], dtype)
    ids = torch.randint(0, 256, (2, 29), device=DEVICE)
    for _ in range(2):  # the second step replays the plans made in the first
        loss, grads = _step(plain, ids)
        planned_loss, planned_grads = _step(planned, ids)
        assert torch.equal(loss, planned_loss)
        for name, g in grads.items():
            assert torch.equal(g, planned_grads[name]), name
    summary = planner.summary()
    assert summary["phases"] >= 2 and not summary["unplanned_phases"]  # a forward and a backward, both planned
    assert 0 < summary["load_bytes"] <= summary["buffer_bytes"] <= summary["planned_bytes"]


def test_plans_are_valid_placements_and_name_what_they_could_not_plan():
    _, planned, planner = _models("tiny-gpt", POLICIES["memo-a0.37"])
    _step(planned, torch.randint(0, 256, (1, 64), device=DEVICE))
    for plan in planner.plans.values():
        offsets = [s.offset // ALIGN for slots in plan.slots.values() for s in slots if s.offset is not None]
        ids = [s.tensor for slots in plan.slots.values() for s in slots if s.offset is not None]
        order = {t: i for i, t in enumerate(plan.problem.ids)}
        by_problem = [offsets[ids.index(t)] for t in sorted(order, key=order.get)]
        assert check_placement(plan.problem, by_problem) == []
        assert all(s.offset % ALIGN == 0 for slots in plan.slots.values() for s in slots if s.offset is not None)
    whys = {(u["op"].split(".")[1], u["why"]) for u in planner.summary()["unplanned"]}
    attention = {op for op, why in whys if why == "no out= overload" and "_scaled_dot_product" in op}
    assert attention  # attention is a fused kernel with no out= overload
    assert ("mm", "outlives the phase") in whys  # weight gradients leave the layer


def _plan_with_overlap(planner: PhasePlanner):
    """Returns a forward plan edited so that two tensors that are live together share an address."""
    key, plan = next((k, p) for k, p in planner.plans.items() if k[0] == "forward_phase")
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
    _, planned, planner = _models("tiny", POLICIES["none"])
    ids = torch.randint(0, 256, (1, 32), device=DEVICE)
    _step(planned, ids)
    key, bad = _plan_with_overlap(planner)
    planner.plans[key] = bad
    with pytest.raises(RuntimeError, match="phase buffer overlap"):
        _step(planned, ids)


def test_debug_check_catches_a_planned_tensor_kept_past_its_phase():
    _, planned, planner = _models("tiny", POLICIES["none"])
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
        planner.run(layer, leaky, t, FreshTiles.of(specs, 16, 4))


def _fused_rms_norm_cpu(x, normalized_shape, weight, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype), rstd


def _fused_rms_norm_backward_cpu(dy, x, normalized_shape, rstd, weight, output_mask):
    xf, g = x.float(), dy.float() * weight.float()
    dx = rstd * (g - xf * rstd.pow(2) * (g * xf).mean(-1, keepdim=True))
    dw = (dy.float() * xf * rstd).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@contextlib.contextmanager
def _cuda_like_rms_norm():
    """Gives CPU fused kernels for `_fused_rms_norm` and its backward, as CUDA has: the CPU suite then sees
    the op sequence of a CUDA step (one op each), where meta and plain CPU see a decomposition."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_fused_rms_norm", _fused_rms_norm_cpu, "CPU")
    lib.impl("_fused_rms_norm_backward", _fused_rms_norm_backward_cpu, "CPU")
    try:
        yield
    finally:
        lib._destroy()


@pytest.fixture
def cuda_like_rms_norm():
    with _cuda_like_rms_norm():
        yield


@pytest.mark.skipif(DEVICE.type != "cpu", reason="mimics the CUDA kernels on CPU")
@pytest.mark.parametrize("policy", ["none", "memo-a0.37"])
def test_planned_rms_norm_model_replays_the_cuda_op_sequence(cuda_like_rms_norm, policy):
    plain, planned, planner = _models("tiny", POLICIES[policy])
    ids = torch.randint(0, 256, (1, 29), device=DEVICE)
    for _ in range(2):
        loss, grads = _step(plain, ids)
        planned_loss, planned_grads = _step(planned, ids)
        assert torch.equal(loss, planned_loss)
        for name, g in grads.items():
            assert torch.equal(g, planned_grads[name]), name
    calls = {str(func) for plan in planner.plans.values() for func in plan.calls}
    assert {"aten._fused_rms_norm_backward.default", "memo.rms_norm.default"} <= calls and not planner.unplanned


# ---- phases that cannot keep to a plan run unplanned: the step goes on, with the unplanned model's gradients ----


def _same_steps(plain, planned, ids, steps: int = 2) -> None:
    for _ in range(steps):
        loss, grads = _step(plain, ids)
        planned_loss, planned_grads = _step(planned, ids)
        assert torch.equal(loss, planned_loss)
        for name, g in grads.items():
            assert torch.equal(g, planned_grads[name]), name


def _unplanned_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "memo.plan.phases" and r.levelno == logging.WARNING]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="registers CPU kernels")
def test_a_phase_whose_ops_change_after_planning_runs_unplanned_and_says_why_once(caplog):
    plain, planned, planner = _models("tiny", POLICIES["memo-a0.37"])
    ids = torch.randint(0, 256, (1, 29), device=DEVICE)
    _step(planned, ids)  # every phase planned from a trace of the decomposed RMSNorm backward
    assert not planner.unplanned
    with caplog.at_level(logging.WARNING), _cuda_like_rms_norm():  # now the backward runs one fused kernel
        _same_steps(plain, planned, ids, steps=3)
    phases = planner.summary()["unplanned_phases"]
    assert phases and {p["phase"] for p in phases} == {"backward_phase"}
    assert all("aten._fused_rms_norm_backward.default" in p["why"] for p in phases)
    assert len(_unplanned_warnings(caplog)) == len(phases)  # once per phase and reason, not per step or layer
    assert any(key[0] == "forward_phase" for key in planner.plans)  # the forward keeps its plan


@torch.library.custom_op("memo_test::copy_without_meta", mutates_args=())
def _copy_without_meta(x: torch.Tensor) -> torch.Tensor:
    """An op with a kernel for real tensors only: a trace on `meta` fails at it."""
    return x.clone()


def test_a_phase_that_cannot_be_traced_on_meta_runs_unplanned(monkeypatch, caplog):
    def forward_then_copy(layer, t, tiles):
        y, aux = forward_phase(layer, t, tiles)
        return _copy_without_meta(y), aux

    monkeypatch.setattr(layer_module, "forward_phase", forward_then_copy)
    plain, planned, planner = _models("tiny", POLICIES["memo-a0.37"])
    with caplog.at_level(logging.WARNING):
        _same_steps(plain, planned, torch.randint(0, 256, (2, 29), device=DEVICE))
    (phase,) = planner.summary()["unplanned_phases"]
    assert phase["phase"] == "forward_then_copy" and "its trace on meta failed" in phase["why"]
    assert len(_unplanned_warnings(caplog)) == 1
    assert any(key[0] == "backward_phase" for key in planner.plans)  # the backward keeps its plan


def test_a_tensor_placed_before_its_phase_strayed_keeps_its_memory_from_the_next_phase():
    _, planned, planner = _models("tiny", POLICIES["none"])
    layer, kept = planned.layers[0], []

    def keeps_and_strays(layer, t, tiles):
        y, aux = forward_phase(layer, t, tiles)
        scratch = t["x"] * 2  # planned: the trace sees it die
        if not y.is_meta:  # the run keeps it, then runs an op the trace does not have
            kept.append(scratch)
            y = y.clone()
        return y, aux

    specs = layer.skeletal_specs(1, 16, torch.float32, DEVICE)
    t = {n: torch.randn(sp.shape, dtype=sp.dtype, device=DEVICE) for n, sp in specs.items() if sp.group == "whole"}
    with torch.no_grad():
        planner.run(layer, keeps_and_strays, t, FreshTiles.of(specs, 16, 4))
        held = kept[0].untyped_storage().data_ptr()
        planner.run(layer, forward_phase, t, FreshTiles.of(specs, 16, 4))  # planned: it writes its buffer
    assert [p["phase"] for p in planner.summary()["unplanned_phases"]] == ["keeps_and_strays"]
    assert planner.buffer.untyped_storage().data_ptr() != held  # the strayed phase's buffer went with its tensor
    assert torch.equal(kept[0], t["x"] * 2)
