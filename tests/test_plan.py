import json

import numpy as np
import pytest
import torch
from test_dsa import INSTANCES, busy_cpus

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.cli import main
from memo.cost import memory
from memo.cost.memory import Traced
from memo.device import meta_kernels
from memo.plan.bilevel import plan
from memo.plan.problem import Problem, check_placement, max_load, read_csv, write_csv
from memo.plan.scratch import cudnn_backward_bytes, efficient_backward_bytes, fa4_backward_bytes, flash_backward_bytes
from memo.plan.trace import SCRATCH, Tracer

WORK = 1_000_000_000  # DSA budgets in search work, not seconds: the same plans at any machine load


def test_bilevel_plan_of_a_tiny_model_is_valid_and_layer_blocks_never_overlap():
    policy = ActivationPolicy("memo", alpha=0.5)
    result = plan(ModelConfig.preset("tiny-gpt"), policy, 256, time_limit=None, work_limit=WORK)
    p = result.problem
    assert check_placement(p, result.iteration.offsets) == []
    blocks = np.flatnonzero([str(i).startswith(("fwd", "bwd")) for i in p.ids])
    assert len(blocks) == 2 * 4
    lower, upper = p.lower[blocks], p.upper[blocks]
    order = np.argsort(lower)
    assert (upper[order][:-1] <= lower[order][1:]).all()  # one layer phase at a time
    assert result.iteration.peak >= result.load >= max(result.forward.peak, result.backward.peak)
    assert result.caching.peak_reserved >= result.caching.peak_allocated >= result.load


def _overlapping_live_pairs(p: Problem, offsets: np.ndarray) -> int:
    """Counts pairs alive at once whose address ranges overlap (a brute-force check, independent of dsa)."""
    bad = 0
    for i in range(len(p)):
        for j in range(i + 1, len(p)):
            live = p.lower[i] < p.upper[j] and p.lower[j] < p.upper[i]
            placed = offsets[i] < offsets[j] + p.size[j] and offsets[j] < offsets[i] + p.size[i]
            bad += bool(live and placed)
    return bad


def test_flat_plan_covers_the_whole_step_with_the_update_and_reaches_load():
    policy = ActivationPolicy("memo", alpha=0.5)
    result = plan(ModelConfig.preset("tiny"), policy, 512, time_limit=None, work_limit=WORK)
    flat = result.trace.to_problem()
    assert _overlapping_live_pairs(flat, result.flat.offsets) == 0
    assert result.flat.peak <= 1.01 * result.load
    ops = {str(e.op) for e in result.trace.events}
    assert "aten.lerp_.Scalar" in ops or any("sqrt" in op for op in ops)  # AdamW's update is in the window
    scratch = [e for e in result.trace.events if e.op == SCRATCH and e.kind == "alloc"]
    assert len(scratch) == 4 and result.load >= result.dispatch_load  # one flash backward per layer


def test_flash_backward_scratch_follows_the_shipped_kernel_sizes():
    # b=1, s=1000 (rounded to 1024), 32 heads of 128, 8 kv heads, bf16: softmax_d + dq_accum + dk/dv_expanded
    want = 32 * 1024 * 4 + 1024 * 32 * 128 * 4 + 2 * 1000 * 32 * 128 * 2
    assert flash_backward_bytes(1, 1000, 1000, 32, 8, 128, 2) == want
    assert flash_backward_bytes(1, 1024, 1024, 8, 8, 72, 2) == 8 * 1024 * 4 + 1024 * 8 * 96 * 4  # d 72 -> 96


def test_efficient_backward_scratch_follows_the_shipped_kernel_sizes():
    # b=1, 32 heads, 8192 tokens, worked by hand from kernel_backward.h's workspace_size() and the kernel
    # cutlassB.h picks on sm80/sm90: 16-bit 128x128 tiles (64x64 at head dim 64), fp32 128x64; plus delta
    assert efficient_backward_bytes(1, 8192, 32, 128, 128, 2) == 135_299_072
    assert efficient_backward_bytes(1, 8192, 32, 64, 64, 2) == 68_222_976
    assert efficient_backward_bytes(1, 8192, 32, 128, 128, 4) == 136_314_880  # delta's fp32 product is the peak
    assert efficient_backward_bytes(1, 8192, 32, 64, 64, 4) == 69_206_016


def test_a_cudnn_step_traces_the_frontends_backward_workspace_per_head_chunk():
    # cudnn-frontend's CompositeSDPABackwardNode: dQ_accum fp32 (b, h, s, d) + softmax_sum fp32 (b, h, s), unrounded,
    # none for the grouped-query expansion of dense tensors; one call per query head here (heads=1)
    assert cudnn_backward_bytes(1, 1000, 32, 128) == 32 * 1000 * 128 * 4 + 32 * 1000 * 4
    c, s = ModelConfig.preset("tiny"), 400
    traced = Traced(checkpoint=True, tile=128, heads=1, attention="cudnn")
    events = memory._traced_step(c, s, traced, 64).trace.events
    sizes = [e.nbytes for e in events if e.op == SCRATCH and e.kind == "alloc"]
    assert sizes == [s * (c.head_dim + 1) * 4] * (c.n_heads * c.n_layers)


def test_fa4_backward_scratch_follows_the_cute_interface_sizes():
    # b=1, s=1000 (128-row tiles: 1024; keys to 256-row clusters: 1024), 32 heads of 128, 8 kv heads:
    # dq_accum + dpsum + lse_log2, then dk_accum and dv_accum for the grouped heads; d 72 rounds to 96
    want = 32 * 1024 * (128 + 2) * 4 + 2 * 8 * 1024 * 128 * 4
    assert fa4_backward_bytes(1, 1000, 1000, 32, 8, 128) == want
    assert fa4_backward_bytes(1, 1024, 1024, 8, 8, 72) == 8 * 1024 * (96 + 2) * 4
    c, s = ModelConfig.preset("tiny"), 400  # two query heads a call: one key/value head, grouped
    traced = Traced(checkpoint=True, tile=128, heads=2, attention="fa4")
    events = memory._traced_step(c, s, traced, 64).trace.events
    sizes = [e.nbytes for e in events if e.op == SCRATCH and e.kind == "alloc"]
    calls = c.n_heads // 2 * c.n_layers
    assert sizes == [2 * 512 * (32 + 2) * 4 + 2 * 512 * 32 * 4] * calls


def test_a_float32_gpu_step_traces_the_efficient_kernels_scratch():
    cfg, tokens = ModelConfig.preset("tiny"), 512
    with torch.device("meta"):
        model = Transformer(cfg, ActivationPolicy("none"))
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    tracer = Tracer(scratch=True)
    with meta_kernels("cuda"), tracer:  # float32 on CUDA takes the memory-efficient kernel
        model(ids, labels=ids).backward()
    sizes = [e.nbytes for e in tracer.trace.events if e.op == SCRATCH and e.kind == "alloc"]
    want = efficient_backward_bytes(1, tokens, cfg.n_heads, cfg.head_dim, cfg.head_dim, 4)
    assert sizes == [want] * cfg.n_layers


def test_plan_cli_reports_load_arena_and_allocator(capsys, tmp_path):
    png = tmp_path / "plan.png"
    argv = ["plan", "--model", "tiny", "--seq", "512", "--tp", "2", "--json", "--plot", str(png), "--work", "256M"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["arena_peak"] >= report["load"] > 0 and report["caching_peak_reserved"] > 0
    assert report["flat_peak"] >= report["load"]
    assert 0 <= report["work"] and report["work_limit"] == 256 << 20 and report["clock_cut"] is False
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plan_cli_json_is_the_same_on_a_busy_machine_but_for_its_seconds(capsys):
    argv = ["plan", "--model", "tiny", "--seq", "4K", "--json", "--work", "1M"]
    assert main(argv) == 0
    idle = json.loads(capsys.readouterr().out)
    assert idle["arena_peak"] > idle["load"]  # the budget ends a search before its optimum: the plan depends on it
    with busy_cpus():
        assert main(argv) == 0
    busy = json.loads(capsys.readouterr().out)
    timeless = [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in (idle, busy)]
    assert timeless[0] == timeless[1] and "work" in timeless[0]


def test_plan_cli_rejects_a_tp_that_does_not_divide(capsys):
    assert main(["plan", "--model", "tiny", "--seq", "100", "--tp", "3"]) == 2
    assert "`--tp` (3)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model", "gpt-7b", "--seq", "96", "--tp", "3"],
            "`--tp` (3) must divide the number of attention heads (32)",
        ),
        (["--model", "tiny", "--seq", "512", "--policy", "none", "--alpha", "0.3"], "`--alpha` applies only to"),
    ],
)
def test_plan_cli_refuses_what_it_would_silently_ignore_in_one_line(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_dsa_cli_solves_the_example_and_writes_offsets(capsys, tmp_path):
    src = tmp_path / "in.csv"
    src.write_text("id,lower,upper,size\n0,0,3,4\n1,3,9,4\n2,0,9,4\n3,9,21,4\n4,0,21,4\n")  # MiniMalloc's example
    out = tmp_path / "out.csv"
    assert main(["dsa", str(src), "--time-limit", "5", "--json", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["peak"] == result["lower_bound"] == max_load(read_csv(src)) and result["optimal"]
    offsets = np.loadtxt(out, delimiter=",", skiprows=1, usecols=4, dtype=np.int64)
    assert check_placement(read_csv(src), offsets) == []


def test_dsa_cli_says_when_the_safety_time_limit_cut_the_solve(capsys):
    src = INSTANCES / "minimalloc" / "challenging" / "J.1048576.csv"
    assert main(["dsa", str(src), "--time-limit", "0.01"]) == 0
    captured = capsys.readouterr()
    assert "cut by --time-limit: not reproducible" in captured.out
    assert "memo dsa: warning:" in captured.err and "depends on the machine's speed and load" in captured.err


@pytest.mark.parametrize("verb", [["dsa", "x.csv"], ["plan", "--model", "tiny", "--seq", "512"]])
def test_a_work_budget_must_be_positive(capsys, verb):
    with pytest.raises(SystemExit):
        main([*verb, "--work", "0"])
    assert "`--work` must be a positive number of work units, got '0'" in capsys.readouterr().err


def test_dsa_cli_bad_file_is_one_line(capsys, tmp_path):
    assert main(["dsa", str(tmp_path / "missing.csv")]) == 2
    assert "no such DSA instance" in capsys.readouterr().err


def test_dsa_cli_size_beyond_int64_is_one_line_naming_file_and_row(capsys, tmp_path):
    src = tmp_path / "overflow.csv"
    src.write_text("id,lower,upper,size\n0,0,2,4\n1,0,2,18446744073709551616\n")
    assert main(["dsa", str(src)]) == 2
    err = capsys.readouterr().err
    assert f"{src}: line 3: size 18446744073709551616 is too large" in err and len(err.strip().splitlines()) == 1


def test_dsa_cli_writes_the_same_placement_on_a_busy_machine_and_reports_its_work(capsys, tmp_path):
    src = INSTANCES / "minimalloc" / "challenging" / "J.1048576.csv"  # never proven: the budget ends the search
    outs = [tmp_path / "idle.csv", tmp_path / "busy.csv"]
    assert main(["dsa", str(src), "--work", "256M", "--out", str(outs[0])]) == 0
    with busy_cpus():
        assert main(["dsa", str(src), "--work", "256M", "--out", str(outs[1])]) == 0
    assert outs[0].read_bytes() == outs[1].read_bytes()
    lines = capsys.readouterr().out.splitlines()
    assert all("of 256M)" in line and "--time-limit" not in line for line in lines) and len(lines) == 2


def test_csv_with_offsets_round_trips(tmp_path):
    p = Problem.from_rows([(0, 0, 2, 3), (1, 1, 3, 3)])
    write_csv(p, tmp_path / "o.csv", np.array([0, 3]))
    assert read_csv(tmp_path / "o.csv").ids == ("0", "1")


def test_plan_picture_puts_its_legends_below_the_plots_inside_the_picture(tmp_path, monkeypatch):
    from memo.plan import plot

    result = plan(
        ModelConfig.preset("tiny-gpt"), ActivationPolicy("memo", alpha=0.5), 256, time_limit=None, work_limit=WORK
    )
    drawn = {}
    monkeypatch.setattr(plot, "save", lambda fig, path: drawn.update(fig=fig))
    plot.plot_plan(result, tmp_path / "plan.png", "tiny-gpt")
    fig = drawn["fig"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent(renderer)
        assert not legend.overlaps(ax.get_window_extent(renderer)), ax.get_title()
        assert fig.bbox.contains(legend.x0, legend.y0) and fig.bbox.contains(legend.x1, legend.y1)
    plot.pyplot().close(fig)
