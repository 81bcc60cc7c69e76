import dataclasses
import json

import pytest
import torch

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.cli import main
from memo.cost.estimate import _compute_seconds, estimate, max_seq
from memo.cost.hardware import GPUS, Efficiency, check_calibration_device, efficiency_from_calibration, gpu, load_gpus
from memo.cost.memory import persistent_activation_bytes, skeletal_bytes, traced_transient_peak
from memo.device import meta_kernels
from memo.plan.trace import trace

A800 = GPUS["A800-80GB"]
GPT7B = ModelConfig.preset("gpt-7b")


def test_gpt_skeletal_bytes_are_16bsh_plus_lse_and_norm_statistics():
    s, h, a = 1 << 20, 4096, 32
    b = skeletal_bytes(GPT7B, s)
    assert sum(b.values()) == 16 * s * h * 2 + a * s * 4 + 2 * 2 * s * 4  # two norms' fp32 (mean, rstd)
    assert b["input"] == s * h * 2 and b["attention"] == s * h * 2 + a * s * 4


@pytest.mark.parametrize("strategy", ["memo", "full"])
def test_four_layer_trace_extrapolates_exactly_to_a_deeper_model(strategy):
    cfg = ModelConfig.preset("tiny-gpt", n_layers=8)
    policy = ActivationPolicy(strategy, alpha=0.5 if strategy == "memo" else None, host_budget_bytes=1 << 60)
    with torch.device("meta"):
        model = Transformer(cfg, policy).to(torch.bfloat16)
    ids = torch.zeros(1, 4096, dtype=torch.long, device="meta")
    with meta_kernels("cuda"):  # the cost model traces a GPU step
        model(ids, labels=ids).backward()
        direct, _ = trace(lambda: model(ids, labels=ids).backward())
    # exact up to the CUDA flash kernel's RNG state (seed and offset, 24 bytes) that each layer keeps until its
    # backward: the 4-layer trace holds four of them, the 8-layer step eight
    assert 0 <= direct.peak - traced_transient_peak(cfg, 4096, strategy) <= 24 * (cfg.n_layers - 4)


@pytest.mark.parametrize("strategy", ["memo", "full"])
def test_memory_model_matches_a_traced_first_step_on_meta(strategy):
    cfg, tokens = ModelConfig.preset("tiny-gpt", n_layers=6), 4096
    policy = ActivationPolicy(strategy, alpha=0.5 if strategy == "memo" else None, host_budget_bytes=1 << 60)
    with torch.device("meta"):
        model = Transformer(cfg, policy).to(torch.bfloat16)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with meta_kernels("cuda"):
        first, _ = trace(lambda: model(ids, labels=ids).backward())  # sizes buffers, host pool (meta), grads
    grads = sum(p.numel() * 2 for p in model.parameters())
    predicted = (
        persistent_activation_bytes(cfg, tokens, strategy)
        + traced_transient_peak(cfg, tokens, strategy)
        + grads
        + model.swap_stats().host_pool_bytes
    )
    assert predicted == pytest.approx(first.peak, rel=0.03)


def test_memo_fits_one_million_tokens_of_gpt7b_on_8_a800_where_full_recompute_does_not():
    memo_est = estimate(GPT7B, 1 << 20, 8, A800, "memo")
    assert memo_est.fits and 0 < memo_est.alphas[0] < 1
    for system in ("megatron", "deepspeed"):
        est = estimate(GPT7B, 1 << 20, 8, A800, system)
        assert not est.fits and est.why.startswith("device memory")
    offload_all = estimate(GPT7B, 1 << 20, 8, A800, "offload-all")
    assert not offload_all.fits and offload_all.why.startswith("host memory")


def test_alpha_meets_the_host_budget_exactly_when_it_binds():
    est = estimate(GPT7B, 1 << 20, 8, A800, "memo")
    assert est.host_bytes_per_node == pytest.approx(est.host_capacity_per_node, rel=1e-6)


def test_alpha_meets_copy_time_exactly_when_bandwidth_binds():
    slow = dataclasses.replace(A800, host_link_bytes_per_s=8e9)
    est = estimate(GPT7B, 256 * 1024, 8, slow, "memo")
    assert 0 < est.alphas[0] < 1 and est.seconds["exposed_copy"] == pytest.approx(0, abs=1e-6)
    tokens = est.seq // est.sp
    b = skeletal_bytes(GPT7B, tokens)
    copy = (b["input"] + b["attention"] + est.alphas[0] * b["other"]) / (8e9 * 0.8 / slow.host_link_shared_by)
    assert copy == pytest.approx(_compute_seconds(GPT7B, est.seq, tokens, slow, Efficiency())["forward"], rel=1e-6)


def test_longest_sequence_ranks_memo_above_the_baselines():
    found = {s: max_seq(GPT7B, 8, A800, s) for s in ("memo", "megatron", "offload-all")}
    assert found["memo"] > found["megatron"] > found["offload-all"] > 0
    assert estimate(GPT7B, found["memo"], 8, A800, "memo").fits
    assert not estimate(GPT7B, found["memo"] + 8 * 1024, 8, A800, "memo").fits


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sp": 3}, "must divide `--gpus`"),
        ({"seq": 1001}, "multiple of `--sp`"),
        ({"system": "alpa"}, "unknown system"),
    ],
)
def test_impossible_settings_are_clear_errors(kwargs, message):
    args = {"seq": 1 << 20, "gpus": 8, "system": "memo", "sp": None, **kwargs}
    with pytest.raises(ValueError, match=message):
        estimate(GPT7B, args["seq"], args["gpus"], A800, args["system"], args["sp"])


def test_a_layout_one_system_cannot_run_is_reported_not_raised():
    gpt13b = ModelConfig.preset("gpt-13b")  # 40 heads: Ulysses cannot split them over 16 GPUs, Megatron (tp=8) can
    ulysses = estimate(gpt13b, 1 << 20, 16, A800, "memo")
    assert not ulysses.fits and "40 attention heads cannot be split over 16 GPUs" in ulysses.why
    assert estimate(gpt13b, 1 << 20, 16, A800, "megatron").why != ulysses.why


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown GPU 'V100'.*H200"):
        gpu("V100")


def test_user_gpu_file_extends_the_table_and_rejects_unknown_fields(tmp_path):
    spec = {k: v for k, v in A800.__dict__.items() if k not in ("name", "source")}
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"MyGPU": {**spec, "hbm_bytes": 2 * A800.hbm_bytes}}))
    assert load_gpus(path)["MyGPU"].hbm_bytes == 2 * A800.hbm_bytes
    path.write_text(json.dumps({"Bad": {**spec, "tflops": 1}}))
    with pytest.raises(ValueError, match="unknown fields"):
        load_gpus(path)


def test_calibration_turns_measurements_into_efficiencies():
    eff = efficiency_from_calibration(
        {"matmul_flops_per_s": 156e12, "attention_flops_per_s": 93.6e12, "host_copy_bytes_per_s": 16e9}, A800
    )
    assert (eff.matmul, eff.attention, eff.host_link) == pytest.approx((0.5, 0.3, 0.5))


@pytest.mark.parametrize("device", ["cpu", "NVIDIA H200"])
def test_a_calibration_from_another_device_is_refused_naming_both(tmp_path, capsys, device):
    measured = {"device": device, "matmul_flops_per_s": 1e12, "attention_flops_per_s": 1e12}
    (tmp_path / "c.json").write_text(json.dumps({**measured, "host_copy_bytes_per_s": 1e9}))
    argv = ["estimate", "--model", "gpt-7b", "--seq", "1M", "--gpus", "8", "--gpu", "A800-80GB"]
    assert main([*argv, "--calibration", str(tmp_path / "c.json")]) == 2
    assert f"measured on {device}, not on a A800-80GB" in capsys.readouterr().err
    check_calibration_device({**measured, "device": "NVIDIA A800-SXM4-80GB"}, A800)  # the same GPU type: taken


def test_estimate_cli_table_and_json(capsys):
    assert main(["estimate", "--model", "gpt-7b", "--seq", "512K", "--gpus", "8", "--gpu", "A800-80GB"]) == 0
    out = capsys.readouterr().out
    assert "| memo | yes |" in out and "| megatron |" in out
    assert (
        main(
            [
                "estimate",
                "--model",
                "gpt-7b",
                "--seq",
                "1M",
                "--gpus",
                "8",
                "--gpu",
                "A800-80GB",
                "--system",
                "memo",
                "--json",
            ]
        )
        == 0
    )
    (record,) = json.loads(capsys.readouterr().out)
    assert record["fits"] and record["alphas"] and 0 < record["mfu"] < 1


def test_estimate_cli_sweep_writes_a_plot(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert (
        main(
            [
                "estimate",
                "--model",
                "gpt-7b",
                "--gpus",
                "8",
                "--gpu",
                "A800-80GB",
                "--sweep",
                "--system",
                "memo",
                "--system",
                "megatron",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 1M |" in capsys.readouterr().out


def test_estimate_cli_bad_input_is_one_line(capsys):
    assert main(["estimate", "--model", "gpt-7b", "--seq", "1M", "--gpus", "8", "--gpu", "V100"]) == 2
    assert "unknown GPU 'V100'" in capsys.readouterr().err


def test_calibrate_cli_measures_this_cpu(tmp_path, capsys):
    out = tmp_path / "calib.json"
    assert main(["calibrate", "--device", "cpu", "--out", str(out), "--json"]) == 0
    result = json.loads(out.read_text())
    assert result["matmul_flops_per_s"] > 0 and result["host_copy_bytes_per_s"] > 0
