"""The benchmark scripts run end to end at toy sizes (their numbers live in docs/benchmarks.md, not here)."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import strategies  # noqa: E402

ROWS = (
    "memo none",
    "memo full",
    "memo alpha=0.5",
    "memo alpha=0.5 + phase planner",
    "memo offload-all",
    "autograd (reference)",
    "torch.utils.checkpoint",
    "save_on_cpu",
)


@pytest.mark.slow
def test_strategies_benchmark_prints_a_row_per_alternative(capsys):
    assert strategies.main(["--layers", "4", "--seq", "128", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for row in ROWS:
        assert f"| {row} |" in out


def test_strategies_json_gives_every_row_with_throughput_and_ratios(capsys):
    argv = ["--layers", "2", "--seq", "64", "--repeats", "1", "--device", "cpu", "--json"]
    with pytest.MonkeyPatch.context() as m:  # the CPU memory subprocesses are the table test's business
        m.setattr(strategies, "_memory_in_subprocess", lambda argv, row: (1 << 20, 0))
        assert strategies.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in result["rows"]] == list(ROWS)
    for row in result["rows"]:
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["mfu"] is None  # no GPU peak on CPU
        assert row["activation_over_none"] == 1.0
    assert result["rows"][4]["alphas"] == [1.0, 1.0]  # offload-all: every layer, whole
    assert result["peak_flops"] is None and "causal attention counted as the half" in result["mfu_convention"]["mfu"]


def test_a_row_that_runs_out_of_device_memory_is_recorded_not_raised(capsys):
    def build():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    ids = torch.zeros(1, 8, dtype=torch.long)
    row = strategies.measure_row("memo none", build, ids, repeats=1)
    assert row == {"name": "memo none", "oom": True, "error": "CUDA out of memory. Tried to allocate 20.00 GiB"}
    strategies.print_table([row])
    assert "| memo none | OOM |" in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
def test_reference_rows_take_memos_chunked_loss_with_the_gradients_of_full_logits(preset):
    cfg = strategies.ModelConfig.preset(preset)
    ids = torch.randint(0, cfg.vocab_size, (2, 23))
    losses, grads = [], []
    for loss_of in (strategies.reference_loss, lambda ref, ids: ref(ids, labels=ids)):
        torch.manual_seed(0)
        ref = strategies.ReferenceTransformer(cfg)
        losses.append(loss_of(ref, ids))
        losses[-1].backward()
        grads.append({name: p.grad for name, p in ref.named_parameters()})
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(grads[0], grads[1])


def test_mfu_counts_causal_attention_as_half_the_matrix_and_the_full_variant_all_of_it():
    cfg = strategies.ModelConfig.preset("tiny-gpt")
    full, causal = (strategies.model_flops_per_token(cfg, 1024, causal=c) for c in (False, True))
    attention = 3 * cfg.n_layers * 4 * 1024 * cfg.n_heads * cfg.head_dim
    assert full - causal == pytest.approx(attention / 2)


@pytest.mark.slow
def test_context_extension_demo_runs_every_verb_end_to_end(tmp_path, capsys):
    import context_extension

    assert context_extension.main(["--quick", "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row in ("trained at short length", "fine-tuned at 4x, plain RoPE", "fine-tuned at 4x, YaRN x4"):
        assert out.count(f"| {row} |") == 2  # the pass-key table and the loss-by-position table
    assert json.loads((tmp_path / "yarn-hf" / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"


@pytest.mark.slow
def test_hf_parity_table_has_a_row_per_family_and_rope_type(capsys):
    pytest.importorskip("transformers")
    import hf_parity

    assert hf_parity.main(["--strategy", "full", "--seq", "80"]) == 0
    rows = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.split(" ")[1:2] and line.split(" ")[1] in hf_parity.FAMILIES
    ]
    assert len(rows) == len(hf_parity.FAMILIES) * len(hf_parity.ROPES)
    assert all(float(cell) < 1e-3 for row in rows for cell in row.strip("| ").split(" | ")[2:])


def test_default_run_script_prints_the_readme_summary(tmp_path, capsys):
    import default_run

    assert default_run.main(["--out", str(tmp_path / "run"), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "model tiny  strategy memo" in out and "held-out loss" in out and "Held-out accuracy by step:" in out


def test_backtest_table_at_toy_scale():
    import backtest

    from memo.config import ModelConfig
    from memo.cost.estimate import Layout

    toy = [
        backtest.Run(
            "toy source",
            ModelConfig.preset("tiny-gpt"),
            "A100-80GB",
            2,
            1024,
            backtest.DATA_PARALLEL,
            0.4,
            "6N",
            "a note",
            micro_batch=2,
        ),
        backtest.Run(
            "toy source",
            ModelConfig.preset("tiny"),
            "H100-SXM",
            4,
            4096,
            Layout(system="megatron", tp=2, cp=2, recompute="selective"),
            0.3,
            "megatron-eq3",
            attention="flash2",
        ),
    ]
    rows = [backtest.predict(run) for run in toy]
    for row in rows:
        low, high = row["range"]
        assert 0 < low < row["predicted"] < high and row["error_points"] == pytest.approx(
            100 * (row["predicted"] - row["published"])
        )
    unpublished = dataclasses.replace(toy[0], convention="causal", readings=("causal", "full"))
    shown = backtest.predict(unpublished)  # a convention the source did not publish: both readings, not scored
    assert not shown["scored"] and shown["readings"]["full"] > shown["readings"]["causal"]
    text = backtest.table([*rows, shown])
    assert "| toy source; a note | tiny-gpt" in text and "megatron: tp=2 cp=2, selective recompute" in text
    assert "median absolute error" in text and "of 2 scored rows within 5 points" in text
    assert "causal or full" in text and "not scored" in text and "(1 shown in every reading" in text
    assert len({run.source for run in backtest.RUNS}) >= 3 and len(backtest.RUNS) >= 8


def test_tiling_benchmark_prints_measured_and_predicted_memory_per_tile(capsys):
    import tiling

    assert tiling.main(["--presets", "tiny", "--seqs", "640", "--tiles", "256", "--steps", "3"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny |")]
    assert [row[2] for row in rows] == ["untiled", "256"]
    assert all(0.9 < float(row[5]) < 1.2 and float(row[7]) > 0 for row in rows)  # measured / predicted, step s


def test_lora_benchmark_prints_full_and_lora_steps_with_fewer_flops_for_lora(capsys):
    import lora

    assert lora.main(["--seqs", "64", "--hidden", "128", "--layers", "2", "--rank", "4", "--steps", "3"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1].split("|")
    flop_ratio = float(row[-2])
    assert 0 < flop_ratio < 1  # frozen weights compute no gradient products


def test_cpu_adam_benchmark_times_every_implementation(capsys):
    import cpu_adam

    assert cpu_adam.main(["--params", "1M", "--steps", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["kinds"]) == set(cpu_adam.KINDS)
    assert all(row["seconds_per_billion"] > 0 for row in result["kinds"].values())


def test_window_benchmark_times_windowed_against_full_causal_attention(capsys):
    import window

    assert window.main(["--seq", "2048", "--window", "256"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 2048 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "256" and float(cells[2]) > 0 and float(cells[3]) > 0
    assert "no s² buffer" in out


def test_packing_benchmark_prints_one_document_and_packed_step_times(capsys):
    import packing
    import torch

    threads = torch.get_num_threads()
    assert packing.main(["--presets", "tiny", "--seq", "256", "--doc", "64", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("tiny "))
    assert row.split()[1:3] == ["256", "64"] and float(row.split()[5]) > 0
    assert torch.get_num_threads() == threads  # the benchmark's one thread does not outlive it


def test_hf_patch_benchmark_trains_memo_and_checkpointing_under_sfttrainer_to_the_same_loss(capsys):
    pytest.importorskip("trl")
    import hf_patch

    cpu = torch.device("cpu")
    with pytest.MonkeyPatch.context() as m:  # two rows, in this process: fresh processes are for the real numbers
        m.setattr(hf_patch, "ROWS", ("HF + checkpointing", "memo.patch"))
        m.setattr(hf_patch, "_row_in_subprocess", lambda argv, i: hf_patch.measured_row(i, hf_patch.TINY, 1, cpu))
        assert hf_patch.main(["--tiny", "--steps", "1", "--json"]) == 0
    hf, memo = json.loads(capsys.readouterr().out)["rows"]
    assert memo["loss"] == pytest.approx(hf["loss"], rel=1e-5)  # same weights, same batch
    assert hf["mlp_calls"] == 2  # checkpointing recomputed layer 0
    assert "memo plan" in memo["ran"] and "HF checkpointing False" in memo["ran"]
    assert memo["step_s"] > 0 and memo["step_s_ratio"] is not None
    # in this process the heap may serve a tiny row from freed pages, so the resident set need not grow: the ratio
    # of activation bytes is None then, as the table prints it (a fresh process per row measures the real ones)
    assert hf["activation_bytes"] >= 0 and (memo["activation_bytes_ratio"] is None) == (hf["activation_bytes"] == 0)


def test_hf_patch_repeats_give_each_number_as_the_median_of_fresh_processes(capsys):
    import hf_patch

    runs = [
        {"activation_bytes": a, "host_bytes": 0, "step_s": s, "loss": 7.5, "ran": "HF"}
        for a, s in ((1700, 3.0), (1550, 9.0), (1780, 4.0))
    ]
    row = hf_patch.repeated(runs)
    assert (row["activation_bytes"], row["step_s"], row["activation_range"]) == (1700, 4.0, [1550, 1780])
    assert hf_patch.repeated([runs[0], {"error": "killed"}]) == {"error": "killed"}  # a failed run fails the row
    assert hf_patch.repeated(runs[:1]) is runs[0]
    with pytest.raises(SystemExit):
        hf_patch.main(["--tiny", "--repeats", "0"])
    assert "`--repeats` must be at least 1, got 0" in capsys.readouterr().err
