"""The cost model of a mixture of experts: FLOPs from the active weights, states from all of them, the published
presets' parameter counts, the memory model against a traced step, and `memo estimate` end to end."""

import dataclasses
import json

import pytest
import torch

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.cli import main
from memo.cost.efficiency import SPEEDS, _interpolate, published_band
from memo.cost.estimate import _compute_seconds
from memo.cost.flops import (
    MFU_EXPERTS,
    counted_flops_per_token,
    experts_backward_flops,
    linear_params_per_layer,
    model_flops_per_token,
    token_local_flops,
)
from memo.cost.hardware import GPUS
from memo.cost.memory import Traced, store_bytes, traced_transient_peak
from memo.cost.states import BYTES_PER_PARAM, FSDP_BYTES_PER_PARAM, device_terms, root_parameters, trained
from memo.device import meta_kernels
from memo.hf import config_from_hf
from memo.job import Job
from memo.plan.trace import trace

H100 = GPUS["H100-SXM"]
# 4 layers, h = 64, 8 experts of width 32, 2 per token
MOE = ModelConfig(
    arch="llama",
    n_layers=4,
    hidden_size=64,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden_size=176,
    vocab_size=256,
    n_experts=8,
    experts_per_token=2,
    expert_ffn_size=32,
    name="tiny-moe",
)


def test_moe_flops_are_those_of_a_dense_model_of_the_active_width_plus_the_router():
    # a token multiplies by k experts of width f: a dense SwiGLU of width k·f, and the router (E × h)
    dense = dataclasses.replace(MOE, n_experts=0, experts_per_token=0, expert_ffn_size=None, ffn_hidden_size=2 * 32)
    router = 6.0 * MOE.n_layers * MOE.hidden_size * MOE.n_experts  # forward + backward of E·h per token and layer
    for seq in (1, 4096):
        for causal in (True, False):
            moe, same = (model_flops_per_token(c, seq, causal) for c in (MOE, dense))
            assert moe == same + router
    assert counted_flops_per_token(MOE, 4096, "6N") == 6.0 * MOE.active_parameters() + (
        counted_flops_per_token(dense, 4096, "6N") - 6.0 * dense.num_parameters()
    )
    # the recompute reruns the k experts' gate and up, not the router (its routing is kept); the backward reruns
    # each routed expert's down projection and the router's logits
    assert token_local_flops(MOE, 10)[1] == token_local_flops(dense, 10)[1]
    assert experts_backward_flops(MOE, 10) == 2.0 * 10 * 64 * (2 * 32 + 8) and experts_backward_flops(dense, 10) == 0


def test_a_dense_layer_among_experts_counts_its_own_mlp():
    mixed = dataclasses.replace(MOE, dense_layers=(0,))  # layer 0 a SwiGLU of width 176, as Qwen3-MoE's mlp_only_layers
    sparse_layer = MOE.n_experts * 64 + 2 * 3 * 64 * 32  # the router and two experts, per token
    more = 3.0 * 2 * (3 * 64 * 176 - sparse_layer)  # forward + backward, one layer
    assert model_flops_per_token(mixed, 4096) == pytest.approx(model_flops_per_token(MOE, 4096) + more)
    assert mixed.num_parameters() == mixed.n_layers * (linear_params_per_layer(mixed) + 2 * 64) + root_parameters(mixed)
    assert experts_backward_flops(mixed, 8) == 3 / 4 * experts_backward_flops(MOE, 8)


def test_moe_states_count_every_expert():
    c = MOE
    layer_norms = 2 * c.hidden_size
    assert c.num_parameters() == c.n_layers * (linear_params_per_layer(c) + layer_norms) + root_parameters(c)
    assert linear_params_per_layer(c) - linear_params_per_layer(c, active=True) == 6 * 3 * 64 * 32  # E - k idle
    one, eight = Job(model=c, seq=4096, gpus=1), Job(model=c, seq=4096, gpus=8)
    assert trained(one) == (c.num_parameters(), 0) and c.num_parameters() > c.active_parameters()
    assert device_terms(one)["states"] == c.num_parameters() * BYTES_PER_PARAM
    assert device_terms(eight)["states"] == int(c.num_parameters() * FSDP_BYTES_PER_PARAM / 8)
    layer = (c.num_parameters() - root_parameters(c)) // c.n_layers  # FSDP2 gathers a layer with all its experts
    assert device_terms(eight)["gathered"] == 2 * 2 * layer + 2 * root_parameters(c)


# the published config.json of each (the fields transformers reads; tokenizer ids and dtype left out)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}


@pytest.mark.parametrize("name, published", [("qwen3-30b-a3b", QWEN3_30B_A3B), ("mixtral-8x7b", MIXTRAL_8X7B)])
def test_moe_presets_are_their_published_configs_as_memo_imports_them(name, published):
    assert ModelConfig.preset(name) == config_from_hf(published, name)


@pytest.mark.parametrize(
    "name, total, active",
    [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9)],  # their model cards' counts
)
def test_moe_presets_have_their_published_parameter_counts(name, total, active):
    c = ModelConfig.preset(name)
    assert abs(c.num_parameters() - total) < 0.05e9
    assert abs(c.active_parameters() - active) < 0.06e9  # Qwen3-30B-A3B: 3.35B, published as "3.3B"


def test_expert_gemms_are_timed_at_their_rows_per_expert():
    c = ModelConfig.preset("qwen3-30b-a3b")
    speeds = SPEEDS["H100"]
    rows = 16384  # tokens of a tile: 16384·8/128 = 1024 rows per expert, against (2048, 768) weights
    dense, grouped = (_interpolate(speeds.matmul, n) for n in (c.hidden_size, 768))
    share = 8 * 3 * 2048 * 768 / linear_params_per_layer(c, active=True)
    expected = 1 / ((1 - share) / dense + share / grouped) / (H100.peak_flops / 1e12)
    band = published_band(H100, c, rows, c.n_heads, "cudnn", rows=rows)
    assert band.high.matmul == pytest.approx(expected) and grouped < dense
    # the layer's seconds price the active matmuls at that speed, and the backward's reruns
    t = _compute_seconds(Job(model=c, seq=rows, gpus=1), rows, H100, band.high)
    gemm = H100.peak_flops * band.high.matmul
    assert t["matmul"] == pytest.approx(2 * linear_params_per_layer(c, active=True) * rows / gemm)
    assert t["matmul_backward"] == pytest.approx(2 * t["matmul"] + experts_backward_flops(c, rows) / gemm)
    autograd = _compute_seconds(Job(model=c, seq=rows, gpus=1), rows, H100, band.high, memo_layer=False)
    assert autograd["matmul_backward"] == pytest.approx(2 * t["matmul"])  # the baselines keep what memo reruns


@pytest.mark.parametrize(
    "config, dtype",
    [
        (MOE, torch.float32),
        (MOE, torch.bfloat16),
        (dataclasses.replace(MOE, dense_layers=(1,)), torch.float32),
    ],
    ids=["fp32", "bf16", "a-dense-layer"],
)
def test_moe_memory_model_matches_a_traced_first_step_on_meta(config, dtype):
    tokens = 2048
    policy = ActivationPolicy("memo", alpha=0.5, host_budget_bytes=1 << 60)
    with torch.device("meta"):
        model = Transformer(config, policy).to(dtype)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with meta_kernels("cuda"):
        first, _ = trace(lambda: model(ids, labels=ids).backward())  # sizes buffers, host pool (meta), grads
    grads = sum(p.numel() * dtype.itemsize for p in model.parameters())
    n = config.n_layers
    stored = store_bytes(config, tokens, ["memo"] * n, [0.5] * n, tokens, dtype=dtype)
    assert stored == model.store.layout  # the store's own layout, dense and sparse layers each with their tensors
    predicted = (
        stored.device_bytes + traced_transient_peak(config, tokens, Traced("memo", dtype=dtype)) + stored.host_total
    )
    # the first step creates the gradients as it goes: all of them exist at its peak only if that is late
    assert predicted <= first.peak <= predicted + grads


def _config_file(tmp_path) -> str:
    path = tmp_path / "tiny-moe.json"
    path.write_text(json.dumps({k: v for k, v in dataclasses.asdict(MOE).items() if v is not None}))
    return str(path)


def test_memo_estimate_prices_a_mixture_of_experts_end_to_end(tmp_path, capsys):
    path = _config_file(tmp_path)
    argv = ["estimate", "--model", path, "--seq", "8K", "--gpus", "2", "--gpu", "h100", "--system", "memo"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| memo |"))
    assert row.split(" | ")[1] == "yes" and MFU_EXPERTS in out
    assert main([*argv, "--json"]) == 0
    (e,) = json.loads(capsys.readouterr().out)
    assert e["fits"] and e["plan"] and e["mfu"] > 0 and e["hfu"] > e["mfu"]


def test_memo_train_measures_an_expert_models_transient_peak_against_the_cost_models(tmp_path, capsys):
    # tests/test_planned_allocator.py's check for tiny-gpt, on a mixture of experts (fp32 on CPU, measured by the arena)
    run = tmp_path / "run"
    argv = [
        "train",
        "--model",
        _config_file(tmp_path),
        "--strategy",
        "memo",
        "--arena",
        "--seq-len",
        "512",
        "--steps",
        "5",
    ]
    assert main([*argv, "--batch-size", "2", "--out", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (compared,) = [r["measured_vs_predicted"] for r in records if "measured_vs_predicted" in r]
    assert abs(compared["rows"]["step_transient_bytes"]["ratio"] - 1) < 0.15 and not compared["warnings"]
    assert compared["rows"]["host_pool_bytes"]["ratio"] == 1.0
