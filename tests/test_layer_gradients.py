"""Loss and every parameter gradient of memo.Transformer against the independent plain-autograd reference.

MEMO_TEST_DEVICE=cuda runs the same checks on a GPU (benchmarks/gpu_check.py does).
"""

import os

import pytest
import torch

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.config import RopeScaling
from memo.reference import ReferenceTransformer

DEVICE = torch.device(os.environ.get("MEMO_TEST_DEVICE", "cpu"))
# CUDA kernels reduce in other orders (and fp32 attention uses the efficient kernel): looser there.
FP32_TOL = dict(rtol=1e-4, atol=1e-6) if DEVICE.type == "cpu" else dict(rtol=2e-3, atol=2e-5)

POLICIES = {
    "none": ActivationPolicy("none"),
    "full": ActivationPolicy("full"),
    "memo-a0": ActivationPolicy("memo", alpha=0.0),
    "memo-a0.37": ActivationPolicy("memo", alpha=0.37),
    "memo-a1": ActivationPolicy("memo", alpha=1.0),
    "memo-per-layer": ActivationPolicy("memo", alpha=[0.1, 0.55, 0.9, 0.3]),
    "memo-all-layers": ActivationPolicy("memo", alpha=[0.8, 0.25, 0.37, 0.6], offload_last_layers=True),
    "memo-emptied-buffers": ActivationPolicy("memo", alpha=[0.8, 0.25, 0.37, 0.6], empty_buffers=True),
    "memo-gradient-over-input": ActivationPolicy(
        "memo", alpha=[0.8, 0.25, 0.37, 0.6], offload_last_layers=True, gradient_over_input=True
    ),
}
# token tiles that divide no sequence length below, per-layer plans (docs/method.md §3), and attention calls of a
# few heads (one: parts of a key/value group, their dk, dv summed; two: whole groups of tiny's two)
TILED = {
    "none-tile-16": ActivationPolicy("none", tile_tokens=16),
    "full-tile-7-heads-1": ActivationPolicy("full", tile_tokens=7, attention_heads=1),
    "memo-a0.37-tile-8": ActivationPolicy("memo", alpha=0.37, tile_tokens=8),
    "memo-a1-tile-5-heads-2": ActivationPolicy("memo", alpha=1.0, tile_tokens=5, attention_heads=2),
    "plan-tile-6": ActivationPolicy(
        "memo", alpha=0.6, plan=("checkpoint", "memo", "keep", "memo"), tile_tokens=6, attention_heads=1
    ),
    "plan-all-offloaded-tile-4": ActivationPolicy(
        "memo", alpha=[0.1, 0.5, 0.9, 0.3], plan=("memo", "checkpoint", "memo", "checkpoint"), tile_tokens=4,
        offload_last_layers=True,
    ),
    "plan-solved-short-host-tile-9": ActivationPolicy("memo", host_budget_bytes=60_000, tile_tokens=9),
    "plan-emptied-tile-6": ActivationPolicy(
        "memo", alpha=0.6, plan=("memo", "keep", "checkpoint", "memo"), tile_tokens=6, empty_buffers=True
    ),
    "plan-emptied-over-input-tile-6": ActivationPolicy(
        "memo", alpha=0.6, plan=("checkpoint", "keep", "memo", "memo"), tile_tokens=6, empty_buffers=True,
        gradient_over_input=True,
    ),
}


# the features of released checkpoints (Qwen2/Qwen3/Llama 3.x), on the tiny shape
VARIANTS = {
    "qwen2-like": dict(qkv_bias=True, rope_scaling=RopeScaling("llama3", 8.0, original_max_positions=16)),
    "qwen3-like": dict(
        kv_channels=24,
        qk_norm=True,
        tie_embeddings=True,
        rope_scaling=RopeScaling("yarn", 4.0, original_max_positions=16),
    ),
    "dynamic-rope": dict(max_position_embeddings=24, rope_scaling=RopeScaling("dynamic", 2.0)),
}


def _config(preset: str) -> ModelConfig:
    return ModelConfig.preset("tiny", **VARIANTS[preset]) if preset in VARIANTS else ModelConfig.preset(preset)


def _pair(preset: str, policy: str, dtype=torch.float32):
    policy = {**POLICIES, **TILED}[policy]
    ref = ReferenceTransformer(_config(preset)).to(DEVICE, dtype)
    for p in ref.parameters():  # non-trivial norms and biases so their gradients are exercised
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.1)
    model = Transformer(_config(preset), policy).to(DEVICE, dtype)
    model.load_state_dict(ref.state_dict())
    return ref, model


def _batch(batch: int, seq: int):
    ids = torch.randint(0, 256, (batch, seq), device=DEVICE)
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt", *VARIANTS])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("batch, seq", [(1, 37), (2, 29)])
def test_loss_and_gradients_match_autograd_reference_fp32(preset, policy, batch, seq):
    ref, model = _pair(preset, policy)
    ids, labels = _batch(batch, seq)
    ref_loss = ref(ids, labels=labels)
    ref_loss.backward()
    for _ in range(2):  # the second step reuses the sized buffers and host pool
        model.zero_grad()
        loss = model(ids, labels=labels)
        loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5 if DEVICE.type == "cpu" else 1e-4)
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, **FP32_TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt", "qwen3-like"])
@pytest.mark.parametrize("policy", list(TILED))
def test_tiled_layers_and_per_layer_plans_match_autograd_reference_fp32(preset, policy):
    test_loss_and_gradients_match_autograd_reference_fp32(preset, policy, 2, 29)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
@pytest.mark.parametrize("policy", ["none", "full", "memo-a0.37", "memo-a0.37-tile-8", "plan-tile-6"])
def test_bf16_gradients_are_as_close_to_fp32_as_the_bf16_reference(preset, policy):
    # The bf16 reference runs public SDPA under autograd: flash kernels derive dq, dk from the bf16 output
    # (D = dO·O), which costs precision a float32-softmax reference would not lose; compare like with like.
    ref32, model = _pair(preset, policy)
    model.to(torch.bfloat16)
    ref16 = ReferenceTransformer(ModelConfig.preset(preset), attention="sdpa").to(DEVICE, torch.bfloat16)
    ref16.load_state_dict(model.state_dict())
    ref32.load_state_dict(ref16.state_dict())
    ids, labels = _batch(2, 33)
    for m in (ref32, ref16, model):
        m(ids, labels=labels).backward()
    exact = dict(ref32.named_parameters())
    ref16_params = dict(ref16.named_parameters())
    for name, p in model.named_parameters():
        truth = exact[name].grad
        err = (p.grad.float() - truth).norm() / truth.norm()
        ref_err = (ref16_params[name].grad.float() - truth).norm() / truth.norm()
        assert err <= 1.5 * ref_err + 0.005, f"{name}: bf16 memo error {err:.4f}, bf16 reference error {ref_err:.4f}"


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_logits_match_reference_for_short_inputs(preset):
    ref, model = _pair(preset, "memo-a0.37-tile-8")
    ids = torch.randint(0, 256, (2, 11), device=DEVICE)
    torch.testing.assert_close(model(ids), ref(ids), **FP32_TOL)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), **FP32_TOL)
