import dataclasses
import json
import re

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from memo import ActivationPolicy, ModelConfig, Transformer, to_hf
from memo import policy as planning
from memo.cli import main
from memo.cost import memory
from memo.cost.efficiency import (
    SPEEDS,
    Efficiency,
    attention_kernel,
    check_calibration_device,
    efficiency_from_calibration,
    published_band,
)
from memo.cost.estimate import (
    HEADROOM,
    SYSTEMS,
    Layout,
    Pricing,
    _compute_seconds,
    _loss_peak,
    _step_seconds,
    _traced,
    device_bytes,
    estimate,
    layouts,
    max_seq,
    max_seq_range,
    recipe,
)
from memo.cost.flops import MFU_PACKED, model_flops_per_token
from memo.cost.hardware import GPUS, PIN_BYTES_PER_S, gpu, load_gpus
from memo.cost.memory import (
    Traced,
    fragmentation_bytes,
    skeletal_bytes,
    store_bytes,
    traced_transient_peak,
    traffic_bytes,
)
from memo.cost.states import CPU_ADAM_SECONDS_PER_PARAM, root_parameters, trained
from memo.cost.states import device_bytes as state_device_bytes
from memo.cost.states import host_bytes as state_host_bytes
from memo.device import HOST_USABLE, meta_kernels
from memo.documents import DocumentLengths
from memo.job import Job
from memo.lora import LoraConfig, apply_lora, module_shapes
from memo.plan.caching_sim import replay
from memo.plan.trace import SCRATCH, Tracer, trace, trace_iteration
from memo.train.data import write_token_file
from memo.units import format_bytes, format_count, format_seconds

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
    held = model.store.layout.kept_input_bytes  # the store's (full recompute keeps every layer's input)
    # exact up to the CUDA flash kernel's RNG state (seed and offset, 24 bytes) that each layer keeps until its
    # backward: the 4-layer trace holds four of them, the 8-layer step eight
    assert 0 <= direct.peak - held - traced_transient_peak(cfg, 4096, Traced(strategy)) <= 24 * (cfg.n_layers - 4)


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
    n = cfg.n_layers
    modes, alphas = policy.least_host_plan(n) if strategy == "full" else (["memo"] * n, [0.5] * n)
    predicted = (
        store_bytes(cfg, tokens, modes, alphas, tokens).device_bytes
        + traced_transient_peak(cfg, tokens, Traced(strategy))
        + model.swap_stats().host_pool_bytes
    )
    # the first step creates the gradients as it goes: all of them exist at its peak only if that is late
    assert predicted <= first.peak <= predicted + grads


# the layout memo's search picks for gpt-7b at 1M on 8 A800 (the search itself: test_longest_sequence_...)
ULYSSES8 = Layout(ulysses=8, recompute="memo")
GPT7B_1M = Job(model=GPT7B, seq=1 << 20, gpus=8)


def test_memo_fits_one_million_tokens_of_gpt7b_on_8_a800_where_full_recompute_does_not():
    memo_est = estimate(GPT7B_1M, A800, "memo", layout=ULYSSES8)
    assert memo_est.fits and min(memo_est.alphas) < 1
    for system in ("megatron", "megatron-deepspeed"):
        est = estimate(GPT7B_1M, A800, system)
        assert not est.fits and est.why.startswith("device memory")
    offload_all = estimate(GPT7B_1M, A800, "offload-all")
    assert not offload_all.fits and offload_all.why.startswith("host memory")


def test_alpha_meets_the_host_budget_when_it_binds(monkeypatch):
    monkeypatch.setattr(planning, "HOST_SLACK", 0.0)  # the fastest plan: it spends the host up to the budget
    est = estimate(GPT7B_1M, A800, "memo", layout=ULYSSES8)
    # within the room the solver leaves for each host slot's alignment
    assert est.host_bytes_per_node <= est.host_capacity_per_node
    assert est.host_bytes_per_node == pytest.approx(est.host_capacity_per_node, rel=1e-4)


def test_the_plan_pins_the_least_host_within_the_slack(monkeypatch):
    frugal = estimate(GPT7B_1M, A800, "memo", layout=ULYSSES8)
    monkeypatch.setattr(planning, "HOST_SLACK", 0.0)
    fastest = estimate(GPT7B_1M, A800, "memo", layout=ULYSSES8)
    assert frugal.host_least_per_node <= frugal.host_bytes_per_node < 0.5 * fastest.host_bytes_per_node
    assert fastest.step_seconds <= frugal.step_seconds <= 1.01 * fastest.step_seconds
    assert frugal.pin_seconds == pytest.approx(frugal.host_bytes_per_node / 8 / PIN_BYTES_PER_S)


def test_alpha_meets_copy_time_exactly_when_bandwidth_binds(monkeypatch):
    monkeypatch.setattr(planning, "HOST_SLACK", 0.0)
    slow = dataclasses.replace(A800, host_link_bytes_per_s=8e9)
    est = estimate(Job(model=GPT7B, seq=256 * 1024, gpus=8), slow, "memo", layout=ULYSSES8)
    assert 0 < est.alphas[0] < 1 and est.seconds["exposed_copy"] == pytest.approx(0, abs=1e-6)
    tokens = est.seq // est.sp
    b = skeletal_bytes(GPT7B, tokens)
    eff = Efficiency(**{k: v for k, v in est.efficiency.items() if k != "source"})
    copy = (b["input"] + b["attention"] + est.alphas[0] * b["other"]) / (8e9 * eff.host_link / slow.host_link_shared_by)
    job = Job(model=GPT7B, seq=est.seq, gpus=8)
    assert copy == pytest.approx(_compute_seconds(job, tokens, slow, eff)["forward"], rel=1e-6)


# a small GPU and host keep the longest lengths short, so the traces are quick; the search is the same at any size
SMALL = dataclasses.replace(A800, name="A800-small", hbm_bytes=13 << 30, host_memory_per_node=64 << 30)
LLAMA1B = ModelConfig.preset("llama3.2-1b")


def test_longest_sequence_ranks_memo_above_the_baselines():
    small, job = SMALL, Job(model=LLAMA1B, seq=8 * 1024, gpus=8, sp=8)  # max_seq reads no `seq`
    found = {s: max_seq(job, small, s) for s in ("memo", "megatron", "offload-all")}
    assert found["memo"].tokens > found["megatron"].tokens > found["offload-all"].tokens > 0
    assert estimate(job.at(found["memo"].tokens), small, "memo").fits
    longer = estimate(job.at(found["memo"].tokens + 8 * 1024), small, "memo")
    assert not longer.fits and longer.why == found["memo"].why_not
    assert found["offload-all"].why_not.startswith("host memory")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sp": 3}, "must divide `--gpus`"),
        ({"seq": 1001, "sp": 8}, "multiple of `--sp`"),
        ({"system": "alpa"}, "unknown system"),
    ],
)
def test_impossible_settings_are_clear_errors(kwargs, message):
    args = {"seq": 1 << 20, "gpus": 8, "system": "memo", "sp": None, **kwargs}
    with pytest.raises(ValueError, match=message):
        estimate(Job(model=GPT7B, seq=args["seq"], gpus=args["gpus"], sp=args["sp"]), A800, args["system"])


def test_a_layout_one_system_cannot_run_is_reported_not_raised():
    gpt13b = ModelConfig.preset("gpt-13b")  # 40 heads: Ulysses cannot split them over 16 GPUs, Megatron (tp=8) can
    split16 = Job(model=gpt13b, seq=1 << 20, gpus=16, sp=16)
    ulysses = estimate(split16, A800, "memo")
    assert not ulysses.fits and "40 attention heads cannot be split over 16 GPUs" in ulysses.why
    assert estimate(split16, A800, "megatron").why != ulysses.why
    # without --sp: Ulysses over 8, two sequences at once
    searched = estimate(Job(model=gpt13b, seq=1 << 18, gpus=16), A800, "memo")
    assert searched.sp == 8 and searched.layout.startswith("ulysses=8")


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown GPU 'V100'.*H200"):
        gpu("V100")


@pytest.mark.parametrize(
    "name, spec",
    [("h100-80gb", "H100-SXM"), ("H100-80GB", "H100-SXM"), ("h100-sxm", "H100-SXM"), ("H100 SXM5", "H100-SXM"),
     ("h100", "H100-SXM"), ("a100", "A100-80GB"), ("A100_80GB", "A100-80GB"), ("a800", "A800-80GB"),
     ("h200", "H200"), ("A800-80GB", "A800-80GB")],
)  # fmt: skip
def test_gpu_names_take_any_case_and_the_usual_aliases(name, spec):
    assert gpu(name).name == spec


@pytest.mark.parametrize("name", ["h100-pcie", "a100-40gb", "h100-sxm6"])
def test_another_gpu_of_the_same_family_is_refused_not_taken_for_a_listed_one(name):
    with pytest.raises(ValueError, match=f"unknown GPU '{name}'; choose one of A800-80GB, A100-80GB, H100-SXM, H200"):
        gpu(name)


def test_a_user_gpu_is_found_in_any_case_and_keeps_its_name_over_an_alias(tmp_path):
    spec = {k: v for k, v in A800.__dict__.items() if k not in ("name", "source")}
    (tmp_path / "gpus.json").write_text(json.dumps({"L40S": spec, "h100": {**spec, "hbm_bytes": 1}}))
    gpus = load_gpus(tmp_path / "gpus.json")
    assert gpu("l40s", gpus).name == "L40S" and gpu("H100", gpus).hbm_bytes == 1


def test_user_gpu_file_extends_the_table_and_rejects_unknown_fields(tmp_path):
    spec = {k: v for k, v in A800.__dict__.items() if k not in ("name", "source")}
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"MyGPU": {**spec, "hbm_bytes": 2 * A800.hbm_bytes}}))
    assert load_gpus(path)["MyGPU"].hbm_bytes == 2 * A800.hbm_bytes
    path.write_text(json.dumps({"Bad": {**spec, "tflops": 1}}))
    with pytest.raises(ValueError, match="unknown fields"):
        load_gpus(path)


def test_calibration_turns_measurements_into_efficiencies():
    measured = {
        "device": "NVIDIA A800-SXM4-80GB",
        "matmul_flops_per_s": 156e12,
        "attention_forward_flops_per_s": 93.6e12,
        "attention_backward_flops_per_s": 62.4e12,
        "hbm_bytes_per_s": 1.6e12,
        "host_copy_bytes_per_s": 16e9,
    }
    band = efficiency_from_calibration(measured, A800)
    mid = band.mid
    assert (mid.matmul, mid.attention_forward, mid.attention_backward, mid.host_link) == pytest.approx(
        (0.5, 0.3, 0.2, 0.5)
    )
    assert band.low.matmul < mid.matmul < band.high.matmul and "A800" in band.source
    with pytest.raises(ValueError, match="rerun `memo calibrate`"):  # a calibration from before per-phase speeds
        efficiency_from_calibration({"matmul_flops_per_s": 1e12, "attention_flops_per_s": 1e12}, A800)


@pytest.mark.parametrize("device", ["cpu", "NVIDIA H200"])
def test_a_calibration_from_another_device_is_refused_naming_both(tmp_path, capsys, device):
    measured = {"device": device, "matmul_flops_per_s": 1e12, "attention_forward_flops_per_s": 1e12}
    (tmp_path / "c.json").write_text(json.dumps({**measured, "host_copy_bytes_per_s": 1e9}))
    argv = ["estimate", "--model", "gpt-7b", "--seq", "1M", "--gpus", "8", "--gpu", "A800-80GB"]
    assert main([*argv, "--calibration", str(tmp_path / "c.json")]) == 2
    assert f"measured on {device}, not on a A800-80GB" in capsys.readouterr().err
    check_calibration_device({**measured, "device": "NVIDIA A800-SXM4-80GB"}, A800)  # the same GPU type: taken


def test_estimate_cli_table_and_json(capsys):
    assert main(["estimate", "--model", "llama3.2-1b", "--seq", "256K", "--gpus", "8", "--gpu", "A800-80GB"]) == 0
    out = capsys.readouterr().out
    assert "| memo | yes |" in out and "| megatron |" in out
    assert (
        main(
            [
                "estimate",
                "--model",
                "llama3.2-1b",
                "--seq",
                "512K",
                "--gpus",
                "8",
                "--gpu",
                "A800-80GB",
                "--system",
                "memo",
                "--sp",
                "8",
                "--json",
            ]
        )
        == 0
    )
    (record,) = json.loads(capsys.readouterr().out)
    assert record["fits"] and record["alphas"] and 0 < record["mfu"] < 1


def test_estimate_cli_sweep_writes_a_plot(tmp_path, capsys):
    png, gpus = tmp_path / "sweep.png", tmp_path / "gpus.json"
    fields = {k: v for k, v in dataclasses.asdict(SMALL).items() if k not in ("name", "source")}
    gpus.write_text(json.dumps({"small": fields}))
    assert (
        main(
            [
                "estimate",
                "--model",
                "llama3.2-1b",
                "--gpus",
                "8",
                "--gpu-file",
                str(gpus),
                "--gpu",
                "small",
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


# ---- packed documents: attention over Σ d_i², not s² --------------------------------------------------------

H100 = GPUS["H100-SXM"]


def test_shorter_documents_shorten_attention_not_matmuls_nor_memory():
    tiny, seq, layout = ModelConfig.preset("tiny"), 16384, Layout(system="megatron-deepspeed", recompute="full")
    eff = published_band(H100, tiny, seq, tiny.n_heads)  # one efficiency for all: seconds scale with FLOPs
    runs = [None, 4096, 1024, 256, 1]
    packed = [n and DocumentLengths(n) for n in runs]
    pricing = Pricing(band=eff)
    es = [estimate(Job(model=tiny, seq=seq, documents=d), H100, "megatron-deepspeed", pricing, layout) for d in packed]
    whole = es[0]
    for n, e in zip(runs[1:], es[1:]):
        fraction = DocumentLengths(n).squares(seq) / seq**2
        assert e.attention_fraction == fraction and e.documents == f"packed documents of {format_count(n)} tokens"
        assert e.seconds["attention"] == pytest.approx(fraction * whole.seconds["attention"], rel=1e-12)
        assert e.attention_flops == pytest.approx(fraction * whole.attention_flops, rel=1e-12)
        assert (e.seconds["matmul"], e.device_bytes) == (whole.seconds["matmul"], whole.device_bytes)
    assert [e.step_seconds for e in es] == sorted((e.step_seconds for e in es), reverse=True)
    # model attention FLOPs of a step: 3 passes x layers x 4·heads·head_dim·E[Σd²] / 2 (causal)
    assert es[2].attention_flops == 3 * tiny.n_layers * 4 * tiny.n_heads * tiny.head_dim * (16 * 1024**2) / 2
    assert es[2].mfu * es[2].step_seconds * H100.peak_flops == pytest.approx(
        model_flops_per_token(tiny, 1024) * seq, rel=1e-12
    )


def test_packed_attention_runs_at_the_published_speed_of_the_documents_length():
    tiny, seq = ModelConfig.preset("tiny"), 16384
    layout = Layout(system="megatron-deepspeed", recompute="full")
    for n, length in [(None, seq), (1024, 1024), (2048, 2048), (100, 512)]:  # below 512: the shortest published
        e = estimate(
            Job(model=tiny, seq=seq, documents=n and DocumentLengths(n)), H100, "megatron-deepspeed", layout=layout
        )
        kernel = "flash" if n else "cudnn"  # "auto" on H100: cuDNN, but flash's one call over packed documents
        assert e.attention_kernel == kernel
        band = published_band(H100, tiny, seq, tiny.n_heads, kernel, rows=seq, length=length)
        assert e.efficiency["attention_forward"] == band.mid.attention_forward
        assert e.efficiency["attention_backward"] == band.mid.attention_backward
    short, long = (published_band(H100, tiny, seq, tiny.n_heads, "cudnn", length=n).mid for n in (1024, seq))
    assert short.attention_forward < long.attention_forward and short.matmul == long.matmul


def test_estimate_cli_packs_documents_of_a_mean_length(capsys):
    argv = ["estimate", "--model", "tiny", "--seq", "8K", "--gpus", "1", "--gpu", "h100", "--system", "memo"]
    assert main([*argv, "--mean-document-tokens", "1024"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("tiny, 8K tokens, 1x H100-SXM, full fine-tuning, packed documents of 1K tokens; host 2.00TiB")
    assert "MFU full Σd²" in out and "E[Σd²]/s² = 12.500% of whole 8K-token sequences" in out
    assert "| memo | packed documents, Σd² |" in out and "| memo | whole sequences, s² |" in out
    assert f"MFU convention: {MFU_PACKED}" in out and "memory: the same per token packed or not" in out
    assert "memo on a one-GPU machine, Google Cloud a3-highgpu-1g (217.93GiB host): fits" in out
    assert "memo: pinned host per node " in out and "at least for any plan at this length; pinning takes" in out
    assert main([*argv, "--mean-document-tokens", "1K", "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    assert record["attention_fraction"] == 1 / 8 and record["unpacked"]["attention_fraction"] == 1
    assert record["conventions"]["mfu"] == MFU_PACKED and record["unpacked"]["conventions"]["mfu"] != MFU_PACKED
    assert record["attention_flops"] == pytest.approx(record["unpacked"]["attention_flops"] / 8, rel=1e-12)
    assert record["step_seconds"] < record["unpacked"]["step_seconds"]
    assert record["one_gpu_machine"]["host_capacity_per_node"] < record["host_capacity_per_node"]


def test_estimate_cli_reads_document_lengths_from_a_token_file(tmp_path, capsys):
    texts = ["x" * 1000, "y" * 3000, "z" * 200]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    write_token_file(tmp_path / "d.jsonl", tmp_path / "c.bin")
    argv = ["estimate", "--model", "tiny", "--seq", "8K", "--gpus", "1", "--gpu", "h100", "--system", "memo"]
    assert main([*argv, "--document-lengths", str(tmp_path / "c.bin"), "--json"]) == 0
    (record,) = json.loads(capsys.readouterr().out)
    expected = DocumentLengths.of_lengths([1000, 3000, 200]).squares(8192) / 8192**2
    assert record["attention_fraction"] == pytest.approx(expected, rel=1e-12)
    assert "mean 1,400 tokens" in record["documents"]


def test_estimate_takes_one_way_of_giving_document_lengths(capsys):
    argv = [*EST, "--seq", "1M", "--mean-document-tokens", "1K", "--document-lengths", "c.bin"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert "argument --document-lengths: not allowed with argument --mean-document-tokens" in err


def test_estimate_cli_sweeps_and_searches_lengths_of_packed_documents(capsys, monkeypatch):
    argv = ["estimate", "--model", "tiny", "--gpus", "1", "--gpu", "h100", "--system", "memo"]
    monkeypatch.setattr("memo.cli.default_lengths", lambda: [32 * 1024])
    assert main([*argv, "--sweep", "--mean-document-tokens", "1K"]) == 0
    out = capsys.readouterr().out
    assert "| seq | E[Σd²]/s² | memo MFU |" in out and "| 32K | 3.125% |" in out and f"MFU: {MFU_PACKED}" in out
    asked = {}

    def longest(job, *args, **kwargs):
        asked["job"] = job
        found = {"low": 1024, "mid": 2048, "high": 4096, "why_not": "device memory", "attention_kernel": "cudnn"}
        return {**found, "headroom": 3 << 30}

    monkeypatch.setattr("memo.cli.max_seq_range", longest)
    assert main([*argv, "--max-seq", "--mean-document-tokens", "2K"]) == 0
    assert asked["job"].documents == DocumentLengths(2048)
    assert "packed documents of 2K tokens: memory per token as unpacked" in capsys.readouterr().out


def test_estimate_cli_bad_input_is_one_line(capsys):
    assert main(["estimate", "--model", "gpt-7b", "--seq", "1M", "--gpus", "8", "--gpu", "V100"]) == 2
    assert "unknown GPU 'V100'" in capsys.readouterr().err


def _model_files(tmp_path) -> dict[str, str]:
    """Returns `tiny` as a preset, a ModelConfig YAML file and a Hugging Face folder (what `memo train` reads)."""
    tiny = ModelConfig.preset("tiny")
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(dataclasses.asdict(tiny)))
    to_hf(Transformer(tiny), tmp_path / "hf")
    return {"preset": "tiny", "file": str(tmp_path / "tiny.yaml"), "folder": str(tmp_path / "hf")}


def test_estimate_plan_and_calibrate_take_a_model_file_or_a_hugging_face_folder(tmp_path, capsys):
    models = _model_files(tmp_path)
    answers = {}
    for kind, model in models.items():
        capsys.readouterr()
        assert main(["estimate", "--model", model, "--seq", "4K", "--gpus", "1", "--gpu", "h200", "--json"]) == 0
        estimates = json.loads(capsys.readouterr().out)
        assert main(["plan", "--model", model, "--seq", "512", "--json", "--time-limit", "5"]) == 0
        load = json.loads(capsys.readouterr().out)["load"]
        out = tmp_path / f"calibration-{kind}.json"
        assert main(["calibrate", "--device", "cpu", "--model", model, "--seq", "1K", "--out", str(out)]) == 0
        answers[kind] = ([(e["system"], e["device_bytes"], e["step_seconds"]) for e in estimates], load)
        answers[kind] += (json.loads(out.read_text())["shape"],)
    assert answers["file"] == answers["preset"] == answers["folder"]  # one loader, the same model


@pytest.mark.parametrize("verb", [["estimate", "--seq", "4K", "--gpus", "1", "--gpu", "H200"], ["plan", "--seq", "1K"]])
def test_a_model_that_is_neither_preset_file_nor_folder_is_one_line(tmp_path, capsys, verb):
    assert main([verb[0], "--model", "hf_llama", *verb[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert "`--model` 'hf_llama' is neither a preset (" in err and len(err.splitlines()) == 1


def test_calibrate_cli_measures_this_cpu(tmp_path, capsys):
    out = tmp_path / "calib.json"
    assert main(["calibrate", "--device", "cpu", "--out", str(out), "--json"]) == 0
    result = json.loads(out.read_text())
    assert result["matmul_flops_per_s"] > 0 and result["host_copy_bytes_per_s"] > 0 and result["hbm_bytes_per_s"] > 0
    assert result["attention_forward_flops_per_s"] > 0 and result["attention_backward_flops_per_s"] > 0


def test_calibrate_cli_times_a_runs_shape_per_gpu(tmp_path, capsys):
    out = tmp_path / "calib.json"
    argv = ["calibrate", "--device", "cpu", "--model", "tiny", "--seq", "2K", "--sp", "2", "--out", str(out)]
    assert main(argv) == 0
    tiny = ModelConfig.preset("tiny")
    assert json.loads(out.read_text())["shape"] == {
        "tokens": 1024,
        "attention_tokens": 2048,
        "heads": tiny.n_heads // 2,
        "kv_heads": max(tiny.n_kv_heads // 2, 1),
        "head_dim": tiny.head_dim,
        "hidden": tiny.hidden_size,
        "ffn": tiny.ffn_hidden_size,
    }
    assert "attention backward" in capsys.readouterr().out
    assert main(["calibrate", "--device", "cpu", "--model", "tiny"]) == 2  # --seq goes with --model
    assert main(["calibrate", "--device", "cpu", "--model", "tiny", "--seq", "2K", "--sp", "3"]) == 2


def _traced_loss_peak(loss, tokens: int, c: ModelConfig) -> int:
    """Returns the peak bytes of the output layer's logits and a loss over them, forward and backward, less the
    output layer's own gradients (a few (tokens x h) and (V x h) tensors)."""
    hidden = torch.zeros(tokens, c.hidden_size, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = torch.zeros(c.vocab_size, c.hidden_size, dtype=torch.bfloat16, device="meta", requires_grad=True)
    targets = torch.zeros(tokens, dtype=torch.long, device="meta")
    tracer = Tracer()
    with tracer:
        loss(hidden @ weight.t(), targets).backward()
    return tracer.trace.peak


class _MegatronCrossEntropy(torch.autograd.Function):
    """megatron/core/tensor_parallel/cross_entropy.py at tp = 1: one fp32 copy; max, exp and the division in
    place; the softmax saved; its backward in place in that softmax."""

    @staticmethod
    def forward(ctx, logits, targets):
        x = logits.float()
        x -= x.max(dim=-1, keepdim=True).values
        predicted = x.gather(1, targets[:, None]).squeeze(1)
        torch.exp(x, out=x)
        total = x.sum(dim=-1)
        loss = torch.log(total) - predicted
        x.div_(total[:, None])
        ctx.save_for_backward(x, targets)
        return loss.sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, targets = ctx.saved_tensors
        softmax[torch.arange(len(targets), device=softmax.device), targets] -= 1.0
        softmax.mul_(grad)
        return softmax, None  # fp32: autograd casts it to the logits' bf16


def _megatron_loss(logits, targets):
    return _MegatronCrossEntropy.apply(logits, targets)


class _UlyssesCrossEntropy(torch.autograd.Function):
    """Megatron-DeepSpeed's core/sequence_parallel/cross_entropy.py: a new fp32 softmax and its log; the softmax
    saved, the backward in place in it."""

    @staticmethod
    def forward(ctx, logits, targets):
        softmax = torch.softmax(logits, dim=-1)
        loss = -softmax.log().gather(1, targets[:, None]).sum()
        ctx.save_for_backward(softmax, targets)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, targets = ctx.saved_tensors
        softmax[torch.arange(len(targets), device=softmax.device), targets] -= 1.0
        return softmax.mul_(grad), None


def _ulysses_loss(logits, targets):
    output = logits  # gpt_model.py holds the bf16 output while the loss runs on `output.float()`
    return _UlyssesCrossEntropy.apply(output.float(), targets)


@pytest.mark.parametrize(
    "layout, loss",
    [
        (Layout(system="megatron", tp=8), _megatron_loss),
        (Layout(system="megatron-deepspeed", ulysses=8), _ulysses_loss),
    ],
    ids=["megatron", "megatron-deepspeed"],
)
def test_materialised_loss_term_against_a_traced_loss(layout, loss):
    cfg, tokens = ModelConfig.preset("tiny-gpt"), 2048
    traced = _traced_loss_peak(loss, tokens, cfg)
    hidden = 2 * tokens * cfg.hidden_size * 2  # the final hidden state and its norm
    modelled = _loss_peak(cfg, tokens, layout) - hidden
    assert modelled == pytest.approx(traced, rel=0.05)


def test_fragmentation_is_the_caching_allocators_replay_of_the_traced_step():
    cfg, tokens = ModelConfig.preset("tiny-gpt"), 4096
    policy = ActivationPolicy("full")
    with torch.device("meta"):
        model = Transformer(cfg, policy).to(torch.bfloat16)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with meta_kernels("cuda"):
        model(ids, labels=ids).backward()
        step = trace_iteration(model, ids, scratch=True)
    replayed = replay([(e.kind, e.tensor, e.nbytes) for e in step.events if e.kind != "mark"])
    assert fragmentation_bytes(cfg, tokens, Traced("full")) == replayed.peak_reserved - replayed.peak_allocated > 0


def test_memory_bound_traffic_extrapolates_to_a_deeper_model():
    cfg, tokens = ModelConfig.preset("tiny-gpt", n_layers=8), 4096
    with torch.device("meta"):
        model = Transformer(cfg, ActivationPolicy("none")).to(torch.bfloat16)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with meta_kernels("cuda"):
        model(ids, labels=ids).backward()
        step = trace_iteration(model, ids, scratch=True)
    skip = ("mm", "attention", "empty")
    written = sum(
        e.nbytes for e in step.events if e.kind == "alloc" and e.op != SCRATCH and not any(k in str(e.op) for k in skip)
    )
    per_layer, outside = traffic_bytes(cfg, tokens, Traced("none"))  # traced with 4 layers
    assert cfg.n_layers * per_layer + outside == pytest.approx(written, rel=0.01)


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("preset, gpus", [("gpt-13b", 16), ("llama3-8b", 16), ("gpt-7b", 8)])
def test_layout_search_returns_only_layouts_the_system_supports(system, preset, gpus):
    cfg, seq = ModelConfig.preset(preset), 1 << 20
    found = layouts(Job(model=cfg, seq=seq, gpus=gpus), A800, system)
    assert found and len(set(found)) == len(found)
    for lay in found:
        assert lay.system == system and gpus % lay.sp == 0 and seq % lay.sp == 0
        if system == "megatron":
            assert lay.ulysses == 1 and lay.tp <= A800.gpus_per_node
            assert cfg.n_heads % lay.tp == 0 and cfg.n_kv_heads % lay.tp == 0
            assert lay.cp == 1 or seq % (2 * lay.cp) == 0
            assert lay.recompute in ("selective", "full")
        else:
            assert lay.tp == lay.cp == 1 and cfg.n_heads % lay.ulysses == 0
            if system == "megatron-deepspeed":
                assert cfg.n_kv_heads % lay.ulysses == 0 and lay.recompute in ("none", "full")
    assert all(lay.sp == 4 for lay in layouts(Job(model=cfg, seq=seq, gpus=gpus, sp=4), A800, system))


def test_the_estimate_keeps_the_fastest_layout_that_fits():
    job = Job(model=GPT7B, seq=256 * 1024, gpus=8)
    best = estimate(job, A800, "megatron")
    for lay in layouts(job, A800, "megatron"):
        other = estimate(job, A800, "megatron", layout=lay)
        assert not other.fits or other.tokens_per_s <= best.tokens_per_s
    assert best.fits and best.layout


def test_every_prediction_has_a_range_and_names_its_dominant_term():
    est = estimate(GPT7B_1M, A800, "memo", layout=ULYSSES8)
    for key in ("step_seconds", "tokens_per_s", "mfu"):
        low, high = est.ranges[key]
        assert low < high
    assert est.ranges["mfu"][0] < est.mfu < est.ranges["mfu"][1]
    assert est.dominant.endswith("attention") and int(est.dominant.split("%")[0]) > 90
    assert "FlashAttention-2" in est.efficiency["source"]
    job = Job(model=LLAMA1B, seq=8 * 1024, gpus=8, sp=8)
    found = max_seq_range(job, SMALL, "memo")
    assert 0 < found["low"] <= found["mid"] <= found["high"]
    kept = HEADROOM  # the longest length leaves it free at the upper end of memory; without it, a longer one fits
    at = estimate(job.at(found["mid"]), SMALL, "memo", Pricing(memory="high", headroom=kept))
    assert found["headroom"] == kept and at.fits and at.device_range[1] + kept <= SMALL.hbm_bytes
    assert max_seq_range(job, SMALL, "memo", headroom=0)["mid"] > found["mid"]


def test_published_efficiencies_follow_the_shape():
    h100, a100 = GPUS["H100-SXM"], GPUS["A100-80GB"]
    short, long = (published_band(a100, GPT7B, n, 32).mid for n in (1024, 16384))
    assert short.attention_forward < long.attention_forward  # FlashAttention-2 is slower on short sequences
    assert published_band(h100, GPT7B, 16384, 32).high.attention_backward * h100.peak_flops == pytest.approx(
        SPEEDS["H100"].attention["flash2"][128][1][-1][1] * 1e12
    )
    few = published_band(a100, GPT7B, 1024, 1).mid  # 8 blocks of 128 rows cannot fill 108 SMs
    assert few.attention_forward == pytest.approx(short.attention_forward * 8 / 108)
    small = ModelConfig.preset("llama3.2-1b")
    assert published_band(h100, small, 16384, 32).mid.matmul < published_band(h100, GPT7B, 16384, 32).mid.matmul
    assert "no published speeds" in published_band(dataclasses.replace(a100, name="MI300X"), GPT7B, 1024, 8).source


# H100 SXM5, TFLOP/s at 512 and 16K tokens, head dim 128, as printed in the FlashAttention-3 paper (arXiv 2407.08608):
# Fig. 5 (d) forward with causal mask, Fig. 6 (b) backward without it; FlashAttention-2's causal forward + backward
# from its release's H100 figure (163 and 328)
FA3_FORWARD = {"flash": (191, 335), "cudnn": (315, 539), "fa4": (292, 616)}
FA3_BACKWARD_UNMASKED = {"flash": (214, 322), "cudnn": (305, 516), "fa4": (316, 561)}
FA2_CAUSAL_COMBINED = (163, 328)


@pytest.mark.parametrize("kernel", ["flash", "cudnn", "fa4"])
def test_each_attention_kernel_runs_at_its_published_h100_speed(kernel):
    h100 = GPUS["H100-SXM"]
    peak = h100.peak_flops / 1e12
    # the causal backward: 3.5 units of FlashAttention-2's work take 1 / forward + 2.5 / backward
    fa2 = [2.5 / (3.5 / c - 1 / f) for c, f in zip(FA2_CAUSAL_COMBINED, FA3_FORWARD["flash"])]
    for i, tokens in enumerate((512, 16384)):
        band = published_band(h100, GPT7B, tokens, 512, kernel).high  # head dim 128, every SM busy
        assert band.attention_forward * peak == pytest.approx(FA3_FORWARD[kernel][i])
        # the unmasked backward, slowed as the mask slows FlashAttention-2's (not at 16K: 325 there, 322 unmasked)
        slowdown = min(1.0, fa2[i] / FA3_BACKWARD_UNMASKED["flash"][i])
        expected = fa2[i] if kernel == "flash" else FA3_BACKWARD_UNMASKED[kernel][i] * slowdown
        assert band.attention_backward * peak == pytest.approx(expected)


def test_auto_times_the_kernel_memo_runs_there_without_optional_packages():
    assert [attention_kernel(GPUS[g]) for g in ("H100-SXM", "H200", "A100-80GB", "A800-80GB")] == [
        "cudnn",
        "cudnn",
        "flash",
        "flash",
    ]
    assert attention_kernel(GPUS["H100-SXM"], "fa4") == "fa4"
    assert attention_kernel(dataclasses.replace(A800, name="MI300X")) == "auto"  # generic efficiencies for all


@pytest.mark.parametrize(
    ("gpu_name", "kernel", "published"),
    [("A100-80GB", "fa4", "flash"), ("A800-80GB", "cudnn", "flash"), ("H100-SXM", "efficient", "flash, cudnn, fa4")],
)
def test_a_kernel_without_published_speeds_on_a_gpu_is_refused(gpu_name, kernel, published):
    spec = GPUS[gpu_name]
    message = f"no published speeds of the '{kernel}' attention kernel on {spec.name} (published: {published})"
    with pytest.raises(ValueError, match=re.escape(message)):
        published_band(spec, GPT7B, 16384, 32, kernel)
    with pytest.raises(ValueError, match="`--attention` must be one of auto, flash, cudnn, fa4, efficient"):
        estimate(Job(model=GPT7B, seq=1 << 20, gpus=8, attention="flash3"), spec, "memo")


def test_hopper_kernels_shorten_the_step_at_1m_tokens():
    h100, llama = GPUS["H100-SXM"], ModelConfig.preset("llama3.1-8b")
    seq, layout = 1 << 20, Layout(ulysses=8, recompute="memo", tile=16384)
    steps = {}
    for kernel in ("flash", "cudnn", "fa4"):
        eff = published_band(h100, llama, seq, llama.n_heads // 8, kernel, rows=16384).mid
        steps[kernel] = sum(_step_seconds(Job(model=llama, seq=seq, gpus=8), layout, h100, eff, None).values())
    assert steps["fa4"] < steps["cudnn"] < steps["flash"]


def test_the_step_is_traced_with_the_attention_kernel_that_times_it():
    job, layout = Job(model=ModelConfig.preset("tiny"), seq=4096, gpus=1), Layout(recompute="memo")
    asked = [("H100-SXM", "auto"), ("A100-80GB", "auto"), ("H100-SXM", "fa4"), ("H200", "flash")]
    ran = [_traced(dataclasses.replace(job, attention=a), layout, GPUS[g], None).attention for g, a in asked]
    assert ran == ["cudnn", "flash", "fa4", "flash"]
    alst = Layout(system="alst", recompute="host-checkpoint")
    assert _traced(recipe(job), alst, GPUS["H100-SXM"], None).attention == "flash"  # ALST's recipe: FlashAttention-2
    assert Traced() == Traced(attention="flash") != Traced(attention="cudnn")  # "auto" on meta: one trace, not two


def test_a_cudnn_step_allocates_dense_copies_of_each_head_chunk_beyond_a_flash_step():
    # one query head a call: q, k, v (and in the backward dout and out too) are views of a few heads of token-major
    # buffers, which cuDNN's path copies into dense ones (attention._dense); flash takes them as they are
    c, s, chunk = ModelConfig.preset("tiny"), 400, 64
    flash = Traced(checkpoint=True, tile=128, heads=1, attention="flash")

    def allocated(traced: Traced) -> int:  # by every op but the kernels themselves (outputs, flash's scratch)
        events = memory._traced_step(c, s, traced, chunk).trace.events
        kernel = [e.op == SCRATCH or "_scaled_dot_product" in str(e.op) for e in events]
        return sum(e.nbytes for e, k in zip(events, kernel) if e.kind == "alloc" and not k)

    head = s * c.head_dim * 2  # one head's q, k, v, out or dout, bf16
    forward = c.n_layers + 1  # attention passes: each layer's, and the checkpointed layer's again
    copies = c.n_heads * (3 * forward + 5 * c.n_layers) * head  # a call per query head
    assert allocated(dataclasses.replace(flash, attention="cudnn")) - allocated(flash) == copies


def test_estimate_names_its_attention_kernel_in_the_table_and_the_json(tmp_path, capsys):
    argv = ["estimate", "--model", "tiny", "--seq", "4K", "--gpus", "1", "--gpu", "h100", "--system", "memo"]
    for extra, kernel in [([], "cudnn"), (["--attention", "fa4"], "fa4"), (["--attention", "flash"], "flash")]:
        assert main([*argv, *extra, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)[0]["attention_kernel"] == kernel
    assert main([*argv, "--gpu", "a100"]) == 0
    assert "attention kernel: flash;" in capsys.readouterr().out
    assert main([*argv, "--gpu", "a100", "--attention", "fa4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no published speeds of the 'fa4' attention kernel on A100-80GB" in err and len(err.splitlines()) == 1
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3"}))
    assert main([*argv, "--calibration", str(calibration), "--attention", "cudnn"]) == 2
    assert "`--attention` picks published kernel speeds" in capsys.readouterr().err


def test_device_terms_of_each_system():
    seq = 256 * 1024
    job = Job(model=GPT7B, seq=seq, gpus=8)
    megatron = device_bytes(job, Layout(system="megatron", tp=4, cp=2, recompute="full"), A800)
    assert megatron["gather_buffer"] == (seq // 2) * GPT7B.hidden_size * 2
    ulysses = Layout(system="megatron-deepspeed", ulysses=8, recompute="full")
    deepspeed = device_bytes(job, ulysses, A800)
    assert deepspeed["gather_buffer"] == 0 and deepspeed["runtime"] > 0
    assert deepspeed["total"] == sum(v for k, v in deepspeed.items() if k != "total")
    arena = device_bytes(job, ulysses, A800, fragmentation=None)
    assert arena["fragmentation"] == 0 and arena["total"] < deepspeed["total"]


def test_a_measured_peak_far_from_its_prediction_is_a_warning():
    from memo.cost.predict import compare

    predicted = {"device_peak_bytes": 100, "step_transient_bytes": 100, "host_pool_bytes": 10, "mfu": 0.5}
    close = compare(predicted, {"device_peak_bytes": 110, "host_pool_bytes": 10, "mfu": 0.4, "other": 1})
    assert set(close["rows"]) == {"device_peak_bytes", "host_pool_bytes", "mfu"} and not close["warnings"]
    far = compare(predicted, {"device_peak_bytes": 120, "step_transient_bytes": 80})
    assert far["warnings"] == [
        "measured device peak is 20% above the cost model's prediction",
        "measured step transient is 20% below the cost model's prediction",
    ]


# one GPU: LoRA and model states in host memory (memo.cost.states)
LORA = LoraConfig(8)


def _parameters(c: ModelConfig, lora: LoraConfig | None) -> dict[str, int]:
    """Returns the real model's trained, frozen, root-unit and per-layer parameters (the reference for states)."""
    with torch.device("meta"):
        model = Transformer(c)
    layer = sum(p.numel() for p in model.layers[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - c.n_layers * layer
    if lora is not None:
        apply_lora(model, lora)
    grads = [p.requires_grad for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    trained = sum(n for n, g in zip(sizes, grads) if g)
    return {"trained": trained, "frozen": sum(sizes) - trained, "root": root}


@pytest.mark.parametrize("preset", ["llama3.2-1b", "tiny-gpt"])
@pytest.mark.parametrize("lora", [None, LORA, LoraConfig(4, targets=("q", "v"))], ids=["full", "lora", "lora-qv"])
def test_offloaded_states_are_the_models_own_parameters_in_host_memory(preset, lora):
    cfg = ModelConfig.preset(preset)
    real = _parameters(cfg, lora)
    on_device = Job(model=cfg, seq=1024, lora=lora)
    offloaded = dataclasses.replace(on_device, offload_states=True)
    assert trained(offloaded) == (real["trained"], real["frozen"]) and root_parameters(cfg) == real["root"]
    # fp32 parameter, gradient and two moments per trained weight; a frozen one in bf16
    assert state_host_bytes(dataclasses.replace(offloaded, gpus=4)) == (real["trained"] * 16 + real["frozen"] * 2) // 4
    assert state_host_bytes(dataclasses.replace(on_device, gpus=4)) == 0
    assert state_device_bytes(on_device) >= real["trained"] * 18 + real["frozen"] * 2
    assert state_device_bytes(offloaded) < state_device_bytes(on_device)


def test_offloaded_states_of_an_8b_model_leave_a_few_layers_on_the_device():
    cfg = ModelConfig.preset("llama3.1-8b")
    full, offloaded = (state_device_bytes(Job(model=cfg, seq=1024, offload_states=o)) for o in (False, True))
    assert full > 130 * 2**30 and offloaded < 10 * 2**30  # the root unit (embedding, head) is most of it
    assert offloaded > 2 * root_parameters(cfg) * 2  # the root's bf16 weights and gradients, for the whole step


def test_the_cpu_optimizer_step_and_the_weights_copies_are_in_the_step_time():
    cfg, tokens = ModelConfig.preset("llama3.2-1b"), 8192
    layout = Layout(recompute="memo")
    job = Job(model=cfg, seq=tokens, host_memory=1 << 40)
    on_device = estimate(job, SMALL, "memo", layout=layout)
    offloaded = estimate(dataclasses.replace(job, offload_states=True), SMALL, "memo", layout=layout)
    assert on_device.seconds["optimizer"] == 0 and not on_device.fits  # 22 GB of states on a 12 GiB GPU
    assert offloaded.fits
    assert offloaded.seconds["optimizer"] == pytest.approx(cfg.num_parameters() * CPU_ADAM_SECONDS_PER_PARAM)
    # at 8K tokens a layer's compute is shorter than its weights' copies: the copies show
    assert offloaded.seconds["exposed_copy"] > on_device.seconds["exposed_copy"]
    assert offloaded.host_state_bytes_per_node == state_host_bytes(Job(model=cfg, seq=tokens, offload_states=True))
    assert offloaded.host_bytes_per_node >= offloaded.host_state_bytes_per_node


def test_states_and_the_activation_pool_share_the_host_and_a_refusal_names_both():
    job = Job(model=ModelConfig.preset("llama3.2-1b"), seq=8192, offload_states=True)
    layout = Layout(recompute="memo")
    need = state_host_bytes(job)
    alone = estimate(dataclasses.replace(job, host_memory=need), SMALL, "memo", layout=layout)
    assert not alone.fits and "the model states alone need" in alone.why
    # room for the states and a little more: the plan's pool gets what they leave
    roomier = dataclasses.replace(job, seq=64 * 1024, host_memory=int(need / HOST_USABLE) + (64 << 20))
    tight = estimate(roomier, SMALL, "memo", layout=layout)
    assert not tight.fits and tight.why.startswith("host memory") and "model states take" in tight.why


def test_lora_computes_no_weight_gradients_and_trains_few_states():
    job = Job(model=ModelConfig.preset("llama3.2-1b"), seq=16384)
    layout = Layout(recompute="memo")
    full = estimate(job, A800, "memo", layout=layout)
    lora = estimate(dataclasses.replace(job, lora=LORA), A800, "memo", layout=layout)
    assert lora.device_bytes["model_states"] < full.device_bytes["model_states"] / 5
    # frozen projections and head: forward and input gradient, 2/3 of full fine-tuning's matmuls; plus the
    # adapters' memory-bound rank-8 GEMMs
    assert 2 / 3 < lora.seconds["matmul"] / full.seconds["matmul"] < 0.8
    assert lora.seconds["attention"] == full.seconds["attention"]
    assert "LoRA r=8" in lora.states and full.states == "full fine-tuning"


def _counted_flops(model, ids) -> int:
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_lora_model_flops_against_the_counted_flops_of_both_runs(preset):
    cfg, b, s = ModelConfig.preset(preset), 2, 24
    ids = torch.randint(0, 256, (b, s))
    full = _counted_flops(Transformer(cfg, ActivationPolicy("none")), ids)
    lora = _counted_flops(apply_lora(Transformer(cfg, ActivationPolicy("none")), LORA), ids)
    ins = sum(module_shapes(cfg)[m][0] for m in LORA.modules(cfg))
    again = cfg.n_layers * 2 * LORA.rank * ins * b * s  # the backward recomputes x·Aᵀ rather than keep it
    # what both runs count alike (attention, the forward's linears) cancels: the weight gradients LoRA skips and
    # the adapters it trains remain
    model = model_flops_per_token(cfg, s, lora=LORA) - model_flops_per_token(cfg, s)
    assert lora - full == model * b * s + again


def test_a_lora_steps_memory_is_traced_from_the_lora_model():
    cfg, tokens = ModelConfig.preset("tiny", n_layers=6), 4096
    policy = ActivationPolicy("memo", alpha=0.5, host_budget_bytes=1 << 60)
    with torch.device("meta"):
        model = apply_lora(Transformer(cfg, policy).to(torch.bfloat16), LORA)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with meta_kernels("cuda"):
        first, _ = trace(lambda: model(ids, labels=ids).backward())  # sizes buffers, host pool (meta), grads
    grads = sum(p.numel() * 2 for p in model.parameters() if p.requires_grad)  # the adapters' alone
    n = cfg.n_layers
    predicted = (
        store_bytes(cfg, tokens, ["memo"] * n, [0.5] * n, tokens).device_bytes
        + traced_transient_peak(cfg, tokens, Traced("memo", lora=LORA))
        + model.swap_stats().host_pool_bytes
    )
    assert predicted <= first.peak <= predicted + grads


def test_estimate_cli_takes_lora_and_offloaded_states(capsys):
    argv = ["estimate", "--model", "tiny", "--seq", "4K", "--gpus", "1", "--gpu", "h100"]
    assert main([*argv, "--lora-rank", "8", "--lora-targets", "q,v", "--offload-states"]) == 0
    out = capsys.readouterr().out
    assert "LoRA r=8 on q,v, states in host memory" in out and "| memo | yes |" in out
    assert "| megatron |" not in out and "LoRA: model FLOPs of the work LoRA does" in out
    for bad, message in [
        (["--lora-targets", "q,v"], "give `--lora-rank` too"),
        (["--lora-rank", "8", "--lora-targets", "q,x"], "`--lora-targets` must name distinct projections"),
        (["--offload-states", "--system", "megatron"], "estimated for memo, offload-all and alst, not for megatron"),
    ]:
        assert main([*argv, *bad]) == 2
        assert message in capsys.readouterr().err


# ---- bad input: one line naming the flag or file, before any work -----------------------------------------

EST = ["estimate", "--model", "gpt-7b", "--gpus", "8", "--gpu", "A800-80GB"]


def _one_line_error(capsys, argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("peak_flops", float("inf"), "`peak_flops` must be a finite number > 0, got inf"),
        ("nvlink_bytes_per_s", float("nan"), "`nvlink_bytes_per_s` must be a finite number > 0, got nan"),
        ("gpus_per_node", 7.5, "`gpus_per_node` must be a positive integer, got 7.5"),
        ("hbm_bytes", "80GB", "`hbm_bytes` must be a positive integer, got '80GB'"),
        ("host_link_shared_by", True, "`host_link_shared_by` must be a positive integer, got True"),
    ],
)
def test_a_gpu_file_with_a_value_no_gpu_has_is_one_line_naming_file_gpu_and_field(
    tmp_path, capsys, field, value, message
):
    spec = {k: v for k, v in A800.__dict__.items() if k not in ("name", "source")}
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"X1": {**spec, field: value}}))  # json writes Infinity and NaN, as a user may
    _one_line_error(capsys, [*EST, "--seq", "1M", "--gpu-file", str(path)], f"{path}: GPU 'X1': {message}")


def test_a_gpu_file_may_write_whole_numbers_as_floats(tmp_path):
    spec = {k: v for k, v in A800.__dict__.items() if k not in ("name", "source")}
    (tmp_path / "gpus.json").write_text(json.dumps({"X1": {**spec, "hbm_bytes": 48e9, "gpus_per_node": 4.0}}))
    x1 = load_gpus(tmp_path / "gpus.json")["X1"]
    assert (x1.hbm_bytes, x1.gpus_per_node) == (48 * 10**9, 4) and isinstance(x1.gpus_per_node, int)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gpus", str(1 << 40), "--seq", "1M"], "`--gpus` must be a positive integer up to 1M, got 1099511627776"),
        (["--gpus", str(1 << 40), "--max-seq"], "`--gpus` must be a positive integer up to 1M"),
        (["--gpus", str(1 << 40), "--sweep"], "`--gpus` must be a positive integer up to 1M"),
        (["--gpus", "0", "--seq", "1M"], "`--gpus` must be a positive integer up to 1M, got 0"),
        (["--seq", "100"], "`--seq` 100 is shorter than the published attention speeds the estimate cites (512"),
        (["--seq", "1M", "--sp", "0"], "`--sp` must be a positive integer, got 0"),
        (["--seq", "1M", "--sp", "16"], "`--sp` (16) must divide `--gpus` (8)"),
        (["--gpus", "6", "--sp", "6", "--sweep"], "powers of two from 32K: `--sp` must divide them"),
        (["--seq", "1M", "--lora-rank", "100000"], "`--lora-rank` (100000) must be at most 4096"),
        (["--seq", "1M", "--mean-document-tokens", "0"], "`--mean-document-tokens` must be a positive number of"),
        (["--seq", "1M", "--mean-document-tokens", "1.5"], "`--mean-document-tokens` '1.5' is not a whole number"),
        (["--seq", "1M", "--mean-document-tokens", "x"], "`--mean-document-tokens` cannot read size 'x'"),
        (["--seq", "1M", "--document-lengths", "no.bin"], "`--document-lengths` file 'no.bin' does not exist"),
        (["--seq", "1M", "--document-lengths", "README.md"], "`--document-lengths` takes a memo token file"),
        (["--max-seq", "--document-lengths", "no.npy"], "`--document-lengths` file 'no.npy' does not exist"),
        (["--sweep", "--mean-document-tokens", "-1"], "`--mean-document-tokens` cannot read size '-1'"),
    ],
)
def test_estimate_bounds_are_one_line_before_any_layout_is_searched(capsys, monkeypatch, flags, message):
    monkeypatch.setattr("memo.cost.estimate.layouts", lambda *a, **k: pytest.fail("searched"))
    _one_line_error(capsys, [*EST, *flags], message)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model", "tiny", "--seq", "1K", "--sp", "0"], "`--sp` must be a positive integer, got 0"),
        (["--model", "tiny", "--seq", "1K", "--sp", "-2"], "`--sp` must be a positive integer, got -2"),
        (["--model", "tiny", "--seq", "1K", "--sp", "8"], "heads of tiny must split over `--sp` 8"),
        (["--sp", "2"], "`--sp` splits the shape of `--model` and `--seq`"),
    ],
)
def test_calibrate_flags_are_checked_before_measuring(capsys, monkeypatch, flags, message):
    monkeypatch.setattr("memo.cli.calibrate", lambda *a, **k: pytest.fail("measured"))
    _one_line_error(capsys, ["calibrate", "--device", "cpu", *flags], message)


def test_memo_train_names_the_pinned_host_before_pinning_it():
    from memo.cost.predict import host_pool_bytes, pinned_host_line

    job = Job(model=GPT7B, seq=1 << 20, gpus=8, sp=8, policy=ActivationPolicy("memo", alpha=0.5))
    line = pinned_host_line(job, 8, 1 << 40)
    fixed = host_pool_bytes(job, *job.policy.least_host_plan(GPT7B.n_layers))
    assert line.startswith(f"pinned host per node: {format_bytes(8 * fixed)} for this plan")
    assert f"pinning takes {format_seconds(fixed / PIN_BYTES_PER_S)}" in line
    solved = dataclasses.replace(job, policy=ActivationPolicy("memo"))  # α solved at the first step
    assert pinned_host_line(solved, 8, 1 << 40).startswith(f"pinned host per node: up to {format_bytes(8 << 40)}")
    assert pinned_host_line(dataclasses.replace(job, policy=ActivationPolicy("none")), 8, 1 << 40) is None


def test_a_gpu_without_a_listed_one_gpu_machine_is_answered_on_its_node(capsys):
    assert main(["estimate", "--model", "tiny", "--seq", "4K", "--gpus", "1", "--gpu", "h200", "--system", "memo"]) == 0
    out = capsys.readouterr().out
    assert "host 2.00TiB per node (DGX H200)" in out and "one-GPU machine" not in out
