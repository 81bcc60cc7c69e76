"""Bad or absurd input fails at once with one line on stderr (exit 2), before any run folder, model or trace."""

import functools

import pytest
import torch

from memo.cli import main
from memo.config import ModelConfig
from memo.cost import memory
from memo.cost.memory import Traced, training_lower_bound, transient_peak
from memo.job import Job
from memo.policy import ActivationPolicy
from memo.train import loop

ESTIMATE_7B = ["estimate", "--model", "gpt-7b", "--gpus", "8", "--gpu", "H200"]


def run(argv: list[str]) -> int:
    """Returns `memo argv`'s exit code, whether argparse or the verb refused the input."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def assert_one_line_error(capsys, argv: list[str], message: str) -> str:
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert message in err, err
    return err


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "tpu9"], "`--device` 'tpu9' is not a torch device"),
        (["--device", "cuda"], "`--device cuda`: this machine has no cuda device"),
        (["--device", "mps"], "`--device mps`: this machine has no mps device"),
        (["--seq-len", "1T"], "`--seq-len` 1T with `--batch-size` 8 (model tiny) needs at least"),
        (["--seq-len", "0"], "`--seq-len` must be positive"),
        (["--seq-len", "-4"], "argument --seq-len"),
        (["--seq-len", "lots"], "argument --seq-len"),
        (["--seq-len", "16K", "--host-budget", "1M"], "memo's host pool needs at least"),
        (["--nnodes", "2", "--node-rank", "2"], "`--node-rank` must be in [0, --nnodes 2), got 2"),
        (["--master-port", "70000"], "`--master-port` must be in [1, 65535], got 70000"),
        (["--nproc", "2", "--model", "nosuch"], "`--model` 'nosuch' is neither a preset"),  # before any rank starts
    ],
)
def test_bad_train_start_is_one_line_and_leaves_no_run_folder(capsys, empty_cwd, monkeypatch, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert_one_line_error(capsys, ["train", "--steps", "1", *argv], message)
    assert list(empty_cwd.iterdir()) == []


def test_debug_adds_the_traceback_to_the_line(capsys):
    assert run([*ESTIMATE_7B[:-1], "nosuch", "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("memo estimate: error: ") and "Traceback (most recent call last)" in err


def test_a_gpu_index_past_the_machines_gpus_names_device(capsys, empty_cwd, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert_one_line_error(capsys, ["train", "--device", "cuda:7"], "`--device cuda:7`: this machine has 1 cuda")
    assert list(empty_cwd.iterdir()) == []


def test_memory_error_names_the_numbers_and_the_device(capsys, empty_cwd):
    err = assert_one_line_error(capsys, ["train", "--model", "gpt-7b", "--seq-len", "1M"], "needs at least")
    assert "on cpu (states " in err and "available; lower `--seq-len` or `--batch-size`" in err


def test_an_error_in_the_first_step_closes_the_bar_and_removes_the_run_folder(capsys, empty_cwd, monkeypatch):
    def fail(self):
        raise ValueError("first step failed")

    monkeypatch.setattr(loop.Trainer, "_train_step", fail)
    assert run(["train", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("\nmemo train: error: first step failed\n")  # a line of its own, after the closed bar
    assert "Traceback" not in err
    assert list(empty_cwd.iterdir()) == []


def test_an_existing_out_folder_is_kept_when_the_start_fails(capsys, empty_cwd, monkeypatch):
    monkeypatch.setattr(loop.Trainer, "_train_step", lambda self: (_ for _ in ()).throw(ValueError("no")))
    (empty_cwd / "mine").mkdir()
    (empty_cwd / "mine" / "notes.txt").write_text("keep")
    assert run(["train", "--out", "mine"]) == 2
    assert (empty_cwd / "mine" / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("value", ["0", "-1", "many"])
@pytest.mark.parametrize(
    "argv",
    [
        ["estimate", "--model", "tiny", "--gpus", "1", "--gpu", "H200", "--seq"],
        ["plan", "--model", "tiny", "--seq"],
        ["eval", "some_run", "--lengths"],
    ],
)
def test_non_positive_or_unreadable_lengths_are_one_line_errors(capsys, argv, value):
    assert_one_line_error(capsys, [*argv, value], "error: argument --")


def test_plan_refuses_a_length_no_gpu_holds_before_tracing(capsys, monkeypatch):
    monkeypatch.setattr("memo.plan.bilevel.plan", lambda *a, **k: pytest.fail("traced"))
    assert_one_line_error(capsys, ["plan", "--model", "tiny", "--seq", "1T"], "the plan traces each of them")
    assert_one_line_error(capsys, ["plan", "--model", "gpt-7b", "--seq", "4M"], "more than the largest listed GPU")


def test_estimate_plot_without_sweep_is_an_error(capsys, tmp_path):
    argv = ["estimate", "--model", "tiny", "--seq", "4K", "--gpus", "1", "--gpu", "H200", "--plot", "x.png"]
    assert_one_line_error(capsys, argv, "`--plot` draws the `--sweep`")


@pytest.mark.parametrize("seq", ["128M", "1T"])
def test_estimate_at_absurd_lengths_traces_at_most_the_capped_length(capsys, monkeypatch, seq):
    traced = []
    real = memory._traced_step.__wrapped__

    def spy(c, tokens, *args, **kwargs):
        traced.append(tokens)
        return real(c, tokens, *args, **kwargs)

    monkeypatch.setattr(memory, "_traced_step", functools.lru_cache(spy))
    monkeypatch.setattr(memory, "TRACE_TOKENS", 1 << 16)  # a lower cap, as binding as the real one, traces faster
    assert main([*ESTIMATE_7B, "--seq", seq, "--system", "memo", "--system", "megatron"]) == 0
    out = capsys.readouterr().out
    assert "| memo | no |" in out and "bytes" not in out  # the why-not column is in human units
    assert max(traced, default=0) <= memory.TRACE_TOKENS  # none at all when an earlier case's traces serve


@pytest.mark.parametrize(
    "traced", [Traced("memo"), Traced("full"), Traced("none"), Traced("memo", checkpoint=True, tile=4096, heads=2)]
)
def test_transient_peak_extrapolated_in_tokens_equals_the_traced_one(monkeypatch, traced):
    cfg = ModelConfig.preset("tiny-gpt")
    monkeypatch.setattr(memory, "TRACE_TOKENS", 32 * 1024)  # tiny-gpt's phases are linear in tokens from 16K on
    monkeypatch.setattr(memory, "TRACE_TILES", 8)  # tiled: traced at 16K and 32K
    for tokens in (48 * 1024, 100 * 1024):
        assert transient_peak(cfg, tokens, traced) == memory.traced_transient_peak(cfg, tokens, traced)


@pytest.mark.parametrize("traced", [Traced("memo"), Traced("memo", checkpoint=True, tile=4096, heads=2)])
def test_the_floor_a_search_refuses_with_never_exceeds_the_transient_peak(monkeypatch, traced):
    cfg = ModelConfig.preset("tiny-gpt")
    monkeypatch.setattr(memory, "TRACE_TOKENS", 32 * 1024)
    monkeypatch.setattr(memory, "TRACE_TILES", 8)
    for tokens in (3000, 16 * 1024, 48 * 1024):
        floor = memory.transient_floor(cfg, tokens, traced)
        assert 0 < floor <= transient_peak(cfg, tokens, traced)


def test_training_lower_bound_counts_states_and_the_stores_buffers():
    cfg = ModelConfig.preset("gpt-7b")
    tokens, n = 1 << 16, cfg.n_layers
    specs = memory.layer_specs(cfg, tokens)
    align = 512 * len(specs)  # each tensor of a slot starts on 512 bytes

    def total(group=None, role=None, rows=None):
        return sum(
            (sp if rows is None else sp.rows(rows)).nbytes
            for sp in specs.values()
            if (group is None or sp.group == group) and (role is None or sp.role == role)
        )

    def bound(policy: ActivationPolicy, grad_accum: int = 1) -> dict[str, int]:
        return training_lower_bound(Job(model=cfg, seq=tokens, policy=policy, grad_accum=grad_accum))

    none = bound(ActivationPolicy("none"))
    assert none["states"] == cfg.num_parameters() * (2 + 2 + 8 + 4)  # bf16 weights, grads; m, v, fp32 masters
    accumulating = bound(ActivationPolicy("none"), grad_accum=2)
    assert accumulating["states"] == none["states"] + cfg.num_parameters() * 4  # + the masters' fp32 gradients
    assert 0 <= none["activations"] - n * total() < n * align and none["host_pool"] == 0
    memo = bound(ActivationPolicy("memo", alpha=0.0))
    tile = 8192  # two rounding buffers: the whole-length tensors and two tile slots of the larger group
    buffers = 2 * (total("whole") + 2 * total("mlp", rows=tile))
    assert 0 <= memo["activations"] - buffers < 2 * align
    host = (n - 2) * (total(role="input") + total(role="attention"))  # α = 0: inputs and attention outputs
    assert 0 <= memo["host_pool"] - host < n * align
    solved = bound(ActivationPolicy("memo"))
    assert 0 <= solved["host_pool"] - (n - 2) * total(role="input") < n * align  # the least: layer inputs alone
