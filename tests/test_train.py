"""`memo train` as a user runs it: config files and flags, run directories, checkpoints, exact resume, reports."""

import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import HANG

from memo import ModelConfig, Transformer, to_hf
from memo.cli import main
from memo.loss import IGNORE_INDEX
from memo.train import checkpoint, report
from memo.train.config import TrainConfig
from memo.train.loop import Trainer
from memo.train.metrics import read_metrics
from memo.train.optim import MasterAdamW, learning_rate

SMALL = ["--seq-len", "64", "--batch-size", "2", "--eval-batches", "1", "--warmup-steps", "2"]


def _records(capsys) -> list[dict]:
    """Returns the step and evaluation records a `--json` run printed (not the cost model's, first and last)."""
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return [r for r in records if not {"predicted", "measured_vs_predicted"} & r.keys()]


def _losses(records) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs without --out go to ./runs: keep them out of the work tree


def test_config_file_sets_fields_and_flags_override_them(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("steps: 3\nlr: 0.01\nseq-len: 64\nbatch_size: 2\nalpha: 0.25\n")
    out = tmp_path / "run"
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--steps", "2", "--out", str(out), "--json"]) == 0
    assert sorted(_losses(_records(capsys))) == [1, 2]
    saved = json.loads((out / "config.json").read_text())
    assert (saved["steps"], saved["lr"], saved["seq_len"], saved["alpha"]) == (2, 0.01, 64, 0.25)
    (tmp_path / "run.toml").write_text('strategy = "full"\nsteps = 1\nseq_len = 64\nbatch_size = 1\n')
    assert main(["train", "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "t"), "--json"]) == 0
    assert json.loads((tmp_path / "t" / "config.json").read_text())["strategy"] == "full"


def test_config_files_take_sizes_and_numbers_written_as_yaml_text():
    values = {"seq_len": "1K", "lr": "3e-4", "steps": "20", "alpha": "auto"}  # YAML reads 3e-4 as a string
    cfg = TrainConfig.from_dict(values)
    assert (cfg.seq_len, cfg.lr, cfg.steps, cfg.alpha) == (1024, 3e-4, 20, None)


@pytest.mark.parametrize(
    "text, message",
    [
        ("stepz: 3\n", "unknown field 'stepz'"),
        ("steps: three\n", "`steps` must be int"),
        ("steps: 0\n", "`--steps` must be positive"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("steps: [\n", "is not valid"),
        ("batch_size: 3\ngrad_accum: 2\n", "not a multiple of `--grad-accum`"),
    ],
)
def test_bad_config_files_exit_2_with_one_clear_line(tmp_path, capsys, text, message):
    (tmp_path / "bad.yaml").write_text(text)
    assert main(["train", "--config", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_missing_config_file_and_existing_run_are_clear_errors(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert "cannot read config" in capsys.readouterr().err
    out = str(tmp_path / "run")
    assert main(["train", *SMALL, "--steps", "1", "--out", out, "--json"]) == 0
    capsys.readouterr()
    assert main(["train", *SMALL, "--steps", "1", "--out", out]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def _interrupted(cfg: TrainConfig, stop_at: int) -> None:
    """Runs `cfg` and stops the process's work at step `stop_at` (as a crash would)."""
    for record in Trainer(cfg).records():
        if record["step"] == stop_at:
            break


@pytest.mark.parametrize("strategy", ["memo", "none"])
def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path, capsys, strategy):
    common = [*SMALL, "--steps", "6", "--save-every", "3", "--eval-every", "2", "--strategy", strategy, "--json"]
    assert main(["train", *common, "--out", str(tmp_path / "a")]) == 0
    straight = _losses(_records(capsys))
    cfg = TrainConfig.from_dict(
        {"seq_len": 64, "batch_size": 2, "eval_batches": 1, "warmup_steps": 2, "steps": 6, "save_every": 3,
         "eval_every": 2, "strategy": strategy, "out": str(tmp_path / "b")}
    )  # fmt: skip
    _interrupted(cfg, stop_at=5)  # the checkpoint of step 3 is the latest one written
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "b")] == ["step-0000003"]
    assert main(["train", "--resume", str(tmp_path / "b"), "--json"]) == 0
    resumed = _losses(_records(capsys))
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == straight[s] for s in resumed), (resumed, straight)
    logged = [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if "loss" in r]
    assert logged == [1, 2, 3, 4, 5, 6]  # records of the lost steps 4-5 were replaced, not duplicated


def test_a_crash_during_save_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    cfg = TrainConfig.from_dict({"seq_len": 64, "batch_size": 1, "steps": 4, "save_every": 2, "out": str(tmp_path)})
    real = checkpoint.save_file
    calls = []

    def dies_on_the_second_file_of_step_4(tensors, path):
        calls.append(path)
        if "step-0000004" in path and path.endswith("optimizer.safetensors"):
            raise KeyboardInterrupt("killed mid-save")
        real(tensors, path)

    monkeypatch.setattr(checkpoint, "save_file", dies_on_the_second_file_of_step_4)
    with pytest.raises(KeyboardInterrupt):
        for _ in Trainer(cfg).records():
            pass
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the partial folder went with the interruption
    latest = checkpoint.load_latest(tmp_path)
    assert latest.step == 2 and set(latest.model) == set(Transformer(ModelConfig.preset("tiny")).state_dict())
    monkeypatch.setattr(checkpoint, "save_file", real)
    resumed = Trainer(cfg, resume=True)
    assert resumed.step == 2
    assert [r["step"] for r in resumed.records() if "loss" in r] == [3, 4]
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-0000002", "step-0000004"]


def test_gradient_accumulation_takes_one_token_mean_over_the_step(tmp_path):
    docs = [{"text": "xy"}] * 64 + [{"text": "one long document " * 20}]  # sequences of many or few targets
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    losses = {}
    for accum in (1, 2, 4):
        cfg = TrainConfig.from_dict(
            {"data": str(tmp_path / "d.jsonl"), "seq_len": 64, "batch_size": 4, "grad_accum": accum, "steps": 2,
             "warmup_steps": 0, "out": str(tmp_path / f"r{accum}")}
        )  # fmt: skip
        losses[accum] = [r["loss"] for r in Trainer(cfg).records() if "loss" in r]
    for accum in (2, 4):  # micro-batches hold different numbers of targets; the step must not care
        assert losses[accum] == pytest.approx(losses[1], rel=1e-5)


def test_resume_may_switch_between_float32_and_bf16_with_master_weights(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", *SMALL, "--steps", "1", "--out", out, "--json"]) == 0
    assert main(["train", "--resume", out, "--steps", "2", "--dtype", "bfloat16", "--json"]) == 0
    assert main(["train", "--resume", out, "--steps", "3", "--dtype", "float32", "--json"]) == 0
    assert sorted(_losses(_records(capsys))) == [1, 2, 3]
    assert checkpoint.load_latest(out).state["config"]["dtype"] == "float32"


def test_learning_rate_warms_up_linearly_then_decays_to_min_lr():
    cfg = TrainConfig(steps=110, warmup_steps=10, lr=1e-3, min_lr=1e-4).optimizer()
    assert learning_rate(cfg, 5) == pytest.approx(5e-4)
    assert learning_rate(cfg, 10) == pytest.approx(1e-3)
    assert learning_rate(cfg, 60) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert learning_rate(cfg, 110) == pytest.approx(1e-4)
    linear = TrainConfig(steps=110, warmup_steps=10, lr=1e-3, min_lr=0.0, schedule="linear").optimizer()
    assert learning_rate(linear, 60) == pytest.approx(5e-4)


def test_bf16_training_keeps_fp32_master_weights_that_the_model_copies():
    cfg = TrainConfig(dtype="bfloat16", lr=1e-2, warmup_steps=0)
    model = Transformer(ModelConfig.preset("tiny")).to(torch.bfloat16)
    opt = MasterAdamW(model, cfg.optimizer())
    ids = torch.randint(0, 256, (1, 16))
    model(ids, labels=ids).backward()
    opt.step(1e-2, 1.0, torch.tensor(1.0))
    assert all(m.dtype == torch.float32 for m in opt.master)
    for m, p in zip(opt.master, model.parameters()):
        assert torch.equal(p, m.to(torch.bfloat16)) and p.grad is None
    state = opt.state_tensors()
    assert any(k.endswith(".master") for k in state) and any(k.endswith(".exp_avg") for k in state)


def test_bf16_micro_batches_accumulate_their_gradients_in_fp32():
    model = Transformer(ModelConfig.preset("tiny")).to(torch.bfloat16)
    opt = MasterAdamW(model, TrainConfig(dtype="bfloat16").optimizer())
    parts = []
    for seed in (1, 2, 3):  # three micro-batches' bf16 gradients, summed exactly in fp32
        torch.manual_seed(seed)
        ids = torch.randint(0, 256, (1, 16))
        model(ids, labels=ids).backward()
        parts.append({n: p.grad.float() for n, p in model.named_parameters()})
        opt.accumulate()
        assert all(p.grad is None for p in model.parameters())
    rounded = 0
    for name, m in zip(opt.names, opt.master):
        exact = sum(part[name] for part in parts)
        assert torch.equal(m.grad, exact), name
        rounded += not torch.equal(exact.to(torch.bfloat16).float(), exact)  # what a bf16 sum would have lost
    assert rounded > 0


def test_a_run_reports_its_attention_kernel_and_may_keep_no_final_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--steps", "2", "--out", str(out), "--no-save-final", "--json"]) == 0
    steps = [r for r in _records(capsys) if "loss" in r]
    assert [r["attention"] for r in steps] == ["flash", "flash"]  # the CPU's flash kernel
    assert checkpoint.list_checkpoints(out) == [] and (out / "config.json").exists()


def test_an_attention_kernel_this_machine_lacks_is_refused_before_any_work(tmp_path, capsys):
    assert main(["train", *SMALL, "--attention", "cudnn", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "`--attention cudnn` cannot run on cpu float32 here" in err
    assert not (tmp_path / "run").exists()


def test_a_hugging_face_folder_is_a_model(tmp_path, capsys):
    to_hf(Transformer(ModelConfig.preset("tiny")), tmp_path / "hf")
    argv = ["train", "--model", str(tmp_path / "hf"), *SMALL, "--steps", "1", "--out", str(tmp_path / "r"), "--json"]
    assert main(argv) == 0
    assert _losses(_records(capsys))[1] > 0


def test_metrics_and_report(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--steps", "2", "--eval-every", "1", "--out", str(out), "--json"]) == 0
    records = read_metrics(out / "metrics.jsonl")
    step = next(r for r in records if "loss" in r)
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "host_pool_bytes",
                "bytes_offloaded", "bytes_recomputed"):  # fmt: skip
        assert key in step
    assert step["bytes_offloaded"] > 0 and step["mfu"] is None  # no known peak FLOP/s on a CPU
    assert any("eval_loss" in r for r in records)
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    png = out / "report.png"
    assert capsys.readouterr().out.strip() == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    drawn = {}
    monkeypatch.setattr(report, "save", lambda fig, path: drawn.update(fig=fig))
    report.plot_report(out)
    memory = next(ax for ax in drawn["fig"].axes if ax.get_title() == "memory")
    assert memory.get_ylim()[0] == 0  # amounts start at zero
    report.pyplot().close(drawn["fig"])


# ------------------------------------------------------------------------------------------- held-out data


def _documents(tmp_path):
    """Writes a Parquet training corpus and a JSONL held-out file, both with the text in a `body` field."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = [f"training document {i}: " + "abc " * (i % 7) for i in range(40)]
    pq.write_table(pa.table({"body": train, "id": list(range(40))}), tmp_path / "train.parquet")
    held_out = ["held-out " + "xyz " * n for n in (1, 9, 3, 16)]  # 152 bytes: 5 rows of 32, the 6th is padding
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in held_out))
    return tmp_path / "train.parquet", tmp_path / "eval.jsonl", held_out


def test_file_run_with_eval_data_writes_eval_loss_and_prints_it_in_the_summary(tmp_path, capsys):
    train, held_out, _ = _documents(tmp_path)
    out = tmp_path / "run"
    files = ["--data", str(train), "--eval-data", str(held_out), "--text-field", "body"]
    assert main(["train", *SMALL, *files, "--steps", "2", "--eval-every", "1", "--out", str(out)]) == 0
    evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2] and all("eval_accuracy" not in r for r in evals)
    summary = capsys.readouterr().out
    assert f"held-out loss {evals[-1]['eval_loss']:.4f}  (step 2)" in summary


@pytest.mark.parametrize("packing", ["concat", "mask"])
def test_eval_loss_is_the_token_mean_over_the_held_out_batches(tmp_path, packing):
    train, held_out, texts = _documents(tmp_path)
    cfg = TrainConfig.from_dict(
        {"data": str(train), "eval_data": str(held_out), "text_field": "body", "seq_len": 32, "batch_size": 2,
         "eval_batches": 3, "steps": 1, "pack_documents": packing, "out": str(tmp_path / "r")}
    )  # fmt: skip
    trainer = Trainer(cfg)
    evaluated = [r for r in trainer.records() if "eval_loss" in r][0]["eval_loss"]
    # independent reference: the held-out bytes in 32-byte rows, no target at a document's first byte
    stream = b"".join(t.encode() for t in texts)
    starts = {sum(len(t.encode()) for t in texts[:i]) for i in range(len(texts))}
    rows = -(-len(stream) // 32)
    assert rows == 5
    if packing == "concat":  # a row attends across documents
        ids = torch.zeros(rows, 32, dtype=torch.long)
        ids.view(-1)[: len(stream)] = torch.tensor(list(stream))
        targets = torch.full((rows, 32), IGNORE_INDEX)
        for p in range(1, len(stream)):
            if p not in starts:
                targets.view(-1)[p - 1] = stream[p]
        targets[:, -1] = IGNORE_INDEX  # a row's last position predicts nothing
        with torch.no_grad():
            logits = trainer.model(ids).float()
        expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).item()
    else:  # each piece of a document within a row, run alone: what it may see
        cuts = sorted(starts | set(range(0, len(stream), 32)) | {len(stream)})
        pieces = [torch.tensor(list(stream[a:b])) for a, b in zip(cuts, cuts[1:])]
        with torch.no_grad():
            losses = [F.cross_entropy(trainer.model(x[None])[0, :-1].float(), x[1:], reduction="sum") for x in pieces]
        expected = sum(loss.item() for loss in losses) / sum(len(x) - 1 for x in pieces)
    assert evaluated == pytest.approx(expected, rel=1e-5)


def test_eval_split_holds_out_whole_documents_and_the_same_ones_when_a_run_resumes(tmp_path, capsys):
    train, _, _ = _documents(tmp_path)
    out = str(tmp_path / "run")
    argv = ["--data", str(train), "--text-field", "body", "--eval-split", "0.25", "--eval-every", "2", "--out", out]
    assert main(["train", *SMALL, *argv, "--steps", "2", "--json"]) == 0
    assert main(["train", "--resume", out, "--steps", "3", "--json"]) == 0
    assert [r["step"] for r in _records(capsys) if "eval_loss" in r] == [2, 3]
    saved = checkpoint.load_latest(out).state["config"]
    first, again = (Trainer(TrainConfig.from_dict({**saved, "out": str(tmp_path / name)})) for name in "ab")
    assert len(first.held_out.spans) == 10  # a quarter of 40 documents, one span each
    assert first.held_out.num_tokens + first.source.num_tokens == len(first.source.tokens)
    assert again.held_out.spans.tolist() == first.held_out.spans.tolist()


def test_eval_every_on_file_data_without_held_out_data_warns_and_skips_evaluation(tmp_path, caplog):
    train, _, _ = _documents(tmp_path)
    cfg = TrainConfig.from_dict(
        {"data": str(train), "text_field": "body", "seq_len": 32, "batch_size": 2, "steps": 2, "eval_every": 1,
         "out": str(tmp_path / "r")}
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="memo.train.loop"):
        records = list(Trainer(cfg).records())
    assert "no held-out evaluation: give `--eval-data` or `--eval-split` with `--data`" in caplog.text
    assert [r["step"] for r in records] == [1, 2] and all("eval_loss" not in r for r in records)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eval-split", "1.5"], "`--eval-split` must be in [0, 1), got 1.5"),
        (["--eval-data", "eval.jsonl", "--eval-split", "0.1"], "give `--eval-data` or `--eval-split`, not both"),
        (["--eval-data", "none.jsonl"], "`--eval-data` file 'none.jsonl' does not exist"),
        (["--eval-data", "./train.parquet"], "`--eval-data` './train.parquet' overlaps `--data` 'train.parquet'"),
        (["--eval-data", "."], "`--eval-data` '.' overlaps `--data` 'train.parquet'"),
        (["--eval-data", "other.jsonl"], "other.jsonl:1: expected an object with a 'body' field"),
        (["--eval-split", "0.99"], "`--eval-split` 0.99 of 40 document(s) leaves none to train on"),
    ],
)
def test_bad_held_out_data_exits_2_with_one_clear_line(tmp_path, capsys, flags, message):
    _documents(tmp_path)
    (tmp_path / "other.jsonl").write_text('{"content": "a field the run does not read"}\n')
    data = ["--data", "train.parquet", "--text-field", "body"]
    assert main(["train", *SMALL, *data, *flags, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("flag, value", [("--eval-data", "eval.jsonl"), ("--eval-split", "0.1")])
def test_held_out_flags_without_data_exit_2(tmp_path, capsys, flag, value):
    _documents(tmp_path)
    assert main(["train", *SMALL, flag, value, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"`{flag}` applies only with `--data`" in err and len(err.strip().splitlines()) == 1


def test_a_resumed_run_keeps_printing_json_unless_told_no_json(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *SMALL, "--steps", "1", "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--steps", "2"]) == 0
    assert [r["step"] for r in map(json.loads, capsys.readouterr().out.splitlines()) if "loss" in r] == [2]
    assert main(["train", "--resume", str(out), "--steps", "3", "--no-json"]) == 0
    assert "loss " in capsys.readouterr().out  # the summary, not JSON


def test_configs_saved_before_text_key_became_text_field_still_load():
    assert TrainConfig.from_dict({"text_key": "body"}).text_field == "body"


def _small_hf_checkpoint(path, max_positions: int = 64, **rope):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=max_positions, tie_word_embeddings=True, **rope,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return transformers


def test_context_extension_flags_stretch_a_loaded_checkpoint_and_its_export_says_so(tmp_path, capsys):
    """--rope-scaling yarn on a 64-position checkpoint trained at 256 tokens: the run, its resume and its
    Hugging Face export all use YaRN over the original 64 positions, and transformers reads the same logits."""
    transformers = _small_hf_checkpoint(tmp_path / "base")
    out, flags = tmp_path / "run", ["--rope-scaling", "yarn", "--rope-factor", "4", "--rope-theta", "20000"]
    argv = ["train", "--model", str(tmp_path / "base"), *flags, *SMALL, "--seq-len", "256", "--steps", "2"]
    assert main([*argv, "--out", str(out), "--json"]) == 0
    assert main(["export", str(out), "--hf", str(tmp_path / "hf")]) == 0
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    rope = exported["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 64)
    assert rope["rope_theta"] == 20000 and exported["max_position_embeddings"] >= 256
    ours = checkpoint.saved_model_config(checkpoint.load_latest(out).state, out)
    assert ours.rope_scaling.type == "yarn" and ours.rope_theta == 20000
    from memo import from_hf

    model, hf = from_hf(tmp_path / "hf"), transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 256, (1, 200))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_rope_scaling_on_a_scaled_checkpoint_replaces_it_from_its_pretrained_length_and_says_so(tmp_path, capsys):
    """A checkpoint stretched by llama3 x8 from 32 positions to 256, given `--rope-scaling yarn --rope-factor 4`: the
    run says what it replaces, YaRN counts from the 32 positions the unscaled RoPE was trained at (not the 256 the
    old scaling reached), and the export keeps the checkpoint's bos/eos ids (a bytes run has no tokenizer to say
    otherwise); transformers reads the export with the same logits."""
    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32}
    llama3 |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    transformers = _small_hf_checkpoint(tmp_path / "base", 256, rope_parameters=llama3, bos_token_id=1, eos_token_id=2)
    out = tmp_path / "run"
    argv = ["train", "--model", str(tmp_path / "base"), "--rope-scaling", "yarn", "--rope-factor", "4", *SMALL]
    capsys.readouterr()
    assert main([*argv, "--seq-len", "128", "--steps", "1", "--out", str(out), "--json"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "memo train: warning: `--rope-scaling yarn` replaces the RoPE scaling of model 'base', llama3 (factor 8, "
        "original 32), with yarn (factor 4, original 32)"
    ]
    ours = checkpoint.saved_model_config(checkpoint.load_latest(out).state, out).rope_scaling
    assert (ours.type, ours.factor, ours.original_max_positions) == ("yarn", 4.0, 32)
    assert main(["export", str(out), "--hf", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    rope = hf.config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 32)
    assert (hf.config.bos_token_id, hf.config.eos_token_id) == (1, 2)
    from memo import from_hf

    ids = torch.randint(0, 256, (1, 100))
    with torch.no_grad():
        torch.testing.assert_close(from_hf(tmp_path / "hf")(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rope-factor", "4"], "`--rope-factor` needs `--rope-scaling`"),
        (["--rope-scaling", "yarn"], "needs `--rope-factor`"),
        (["--rope-scaling", "yarn", "--rope-factor", "0.5"], "`--rope-factor` must be a finite number >= 1"),
        (["--rope-scaling", "llama3", "--rope-factor", "4"], "needs `--original-max-positions`"),
        (["--rope-theta", "-1"], "`--rope-theta` must be a finite number > 0"),
    ],
)
def test_bad_context_extension_flags_exit_2_with_one_line(tmp_path, capsys, flags, message):
    assert main(["train", *flags, *SMALL, "--steps", "1", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err.splitlines()[-1]
    assert not (tmp_path / "r").exists()


def test_rope_theta_on_a_preset_changes_only_the_base_frequency():
    from memo.train.config import model_config

    extended = model_config(TrainConfig(model="tiny", rope_theta=1e6))
    assert extended == ModelConfig.preset("tiny", rope_theta=1e6)
    dynamic = model_config(TrainConfig(model="tiny", rope_scaling="dynamic", rope_factor=2.0, seq_len=64))
    assert dynamic.rope_scaling.type == "dynamic" and dynamic.max_position_embeddings == 64


def test_alpha_per_layer_from_the_command_line_and_a_config_file(tmp_path, capsys):
    assert main(["train", "--alpha", "0.1,0.5,0.9,0.3", "--strategy", "memo", *SMALL, "--steps", "1",
                 "--out", str(tmp_path / "a"), "--json"]) == 0  # fmt: skip
    assert json.loads((tmp_path / "a" / "config.json").read_text())["alpha"] == [0.1, 0.5, 0.9, 0.3]
    # the last two layers' buffers (and, untiled, their tile slots) still hold all their rows at their backward
    assert _records(capsys)[0]["alphas"] == [0.1, 0.5, 1.0, 1.0]
    assert TrainConfig.from_dict({"alpha": [0.2, 0.4, 0.6, 0.8]}).alpha == (0.2, 0.4, 0.6, 0.8)
    with pytest.raises(SystemExit):  # an argparse usage error, in the user's words
        main(["train", "--alpha", "0.1,x", "--steps", "1"])
    err = capsys.readouterr().err
    assert "`--alpha` must be a number in [0, 1], one per layer" in err and "_alpha" not in err


def test_a_per_layer_plan_and_tiles_from_the_command_line_and_a_config_file(tmp_path, capsys):
    argv = ["train", "--plan", "checkpoint,memo,keep,memo", "--tile-tokens", "24", "--alpha", "0.4", *SMALL]
    assert main([*argv, "--steps", "1", "--out", str(tmp_path / "a"), "--json"]) == 0
    record = _records(capsys)[0]
    assert record["modes"] == ["checkpoint", "memo", "keep", "memo"] and record["tile_tokens"] == 24
    assert record["alphas"] == [0.0, 0.4, 1.0, 0.4]
    config = TrainConfig.from_dict({"plan": "memo,memo,checkpoint,keep", "tile_tokens": 512})
    assert config.policy().plan == ("memo", "memo", "checkpoint", "keep") and config.policy().tile_for(8192) == 512
    assert main(["train", "--plan", "memo,swap", "--steps", "1"]) == 2
    assert "`--plan` modes must be keep, memo, checkpoint, got 'swap'" in capsys.readouterr().err
    assert main(["train", "--plan", "memo,memo", "--steps", "1", "--out", str(tmp_path / "b")]) == 2
    assert "`--plan` lists 2 modes for a model of 4 layers" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()  # refused before any work


def test_every_run_records_the_cost_models_prediction_and_the_measurements_beside_it(tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--strategy", "memo", "--seq-len", "128", "--batch-size", "2", "--steps", "3", "--out", str(run)]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "predicted per rank: device peak" in out.out and "host pool" in out.out.splitlines()[0]
    assert "measured: host pool" in out.out and "(x1.00)" in out.out
    records = read_metrics(run / "metrics.jsonl")
    predicted = records[0]["predicted"]
    assert predicted["device_peak_bytes"] == sum(
        predicted[k] for k in ("model_state_bytes", "skeletal_buffer_bytes", "step_transient_bytes")
    )
    compared = records[-1]["measured_vs_predicted"]
    assert compared["rows"]["host_pool_bytes"]["ratio"] == 1.0  # the host pool of the α it ran with, exactly


# ---------------------------------------------------------------------------------------------- packed documents


def _short_documents(tmp_path):
    """Writes a JSONL corpus of documents shorter than a 64-token sequence, several to a sequence."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}: " + "ab " * (i % 9)}) + "\n" for i in range(80)))
    return path


def _gpt_style_tokenizer(path):
    """Writes a word-level tokenizer.json that declares <|endoftext|> (GPT-2 and Qwen style) and adds nothing."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<|endoftext|>", "the", "cat", "dog", "sat", "on", "a", "mat"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<unk>", "<|endoftext|>"])
    tokenizer.save(str(path))
    return path


def test_mask_packing_trains_from_the_command_line_on_a_token_file_with_its_separator(tmp_path, capsys):
    from memo.train.data import write_token_file

    tokenizer = _gpt_style_tokenizer(tmp_path / "tokenizer.json")
    text = ["the cat sat on a mat " * (1 + i % 5) for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in text))
    write_token_file(tmp_path / "d.jsonl", tmp_path / "d.bin", tokenizer)  # auto: <|endoftext|> after each
    write_token_file(tmp_path / "d.jsonl", tmp_path / "plain.bin", tokenizer, separator="none")
    out = tmp_path / "run"
    argv = ["train", *SMALL, "--data", str(tmp_path / "d.bin"), "--pack-documents", "mask", "--steps", "3"]
    assert main([*argv, "--max-documents-per-sequence", "2", "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines() if '"loss"' in line]
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)
    assert all(0 < r["attended_tokens"] < 64 for r in records)  # the MFU counts the documents' Σ dᵢ², not s²
    assert "document(s) in" in captured.err and "`--max-documents-per-sequence` 2 keeps" in captured.err
    saved = json.loads((out / "config.json").read_text())
    assert (saved["pack_documents"], saved["document_separator"], saved["max_documents_per_sequence"]) == (
        "mask", "eos", 2
    )  # fmt: skip
    mixed = ["--eval-data", str(tmp_path / "plain.bin"), "--out", str(tmp_path / "mixed")]
    assert main([*argv, *mixed]) == 2  # its documents have no separator: one run does not mix them
    err = capsys.readouterr().err
    assert "was written with document separator none, not the run's `--document-separator` eos" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "mixed").exists()


def test_concat_packing_trains_exactly_as_without_positions_and_mask_differs(tmp_path, monkeypatch):
    from memo.train.data import TokenDataset

    def losses(packing: str, name: str) -> list[float]:
        cfg = TrainConfig.from_dict(
            {"data": str(_short_documents(tmp_path)), "seq_len": 64, "batch_size": 2, "steps": 3,
             "pack_documents": packing, "save_final": False, "out": str(tmp_path / name)}
        )  # fmt: skip
        return [r["loss"] for r in Trainer(cfg).records() if "loss" in r]

    concat, mask = losses("concat", "concat"), losses("mask", "mask")
    sequence = TokenDataset.sequence
    monkeypatch.setattr(TokenDataset, "sequence", lambda data, i: (*sequence(data, i)[:2], None))
    assert concat == losses("mask", "forced")  # the batches of before: positions None, bit for bit
    assert mask != concat


def test_mask_packing_resumes_to_the_losses_of_an_uninterrupted_run(tmp_path, capsys):
    data = str(_short_documents(tmp_path))
    fields = {"data": data, "eval_split": 0.1, "seq_len": 64, "batch_size": 2, "eval_batches": 1, "steps": 5,
              "save_every": 2, "eval_every": 2, "max_documents_per_sequence": 3}  # fmt: skip
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in fields.items()]
    assert main(["train", *flags, "--out", str(tmp_path / "a"), "--json"]) == 0
    straight = _records(capsys)
    _interrupted(TrainConfig.from_dict({**fields, "out": str(tmp_path / "b")}), stop_at=3)
    assert main(["train", "--resume", str(tmp_path / "b"), "--json"]) == 0
    resumed = _records(capsys)
    assert [r["step"] for r in resumed if "loss" in r] == [3, 4, 5]
    assert {s: v for s, v in _losses(straight).items() if s >= 3} == _losses(resumed)
    evals = [(r["step"], r["eval_loss"]) for r in straight if "eval_loss" in r]
    assert [(r["step"], r["eval_loss"]) for r in resumed if "eval_loss" in r] == evals[1:]


def test_a_resume_keeps_how_the_run_packs_its_documents(tmp_path, capsys):
    from memo.train.resume import resume_config

    out = str(tmp_path / "run")
    data = ["--data", str(_short_documents(tmp_path))]
    assert main(["train", *SMALL, *data, "--steps", "1", "--out", out, "--json"]) == 0
    capsys.readouterr()
    for flags in (["--pack-documents", "concat"], ["--max-documents-per-sequence", "5"]):
        assert main(["train", "--resume", out, "--steps", "2", *flags]) == 2
        err = capsys.readouterr().err
        assert f"`{flags[0]} {flags[1]}` changes how run {out} packs its documents" in err
        assert len(err.strip().splitlines()) == 1
    same = ["--pack-documents", "mask", "--document-separator", "auto", "--max-documents-per-sequence", "1024"]
    assert main(["train", "--resume", out, "--steps", "2", *same, "--json"]) == 0
    assert checkpoint.load_latest(out).state["config"]["document_separator"] == "none"  # bytes: resolved, kept
    state = next((tmp_path / "run" / "checkpoints").glob("step-0000002")) / "state.json"
    saved = json.loads(state.read_text())
    for name in ("pack_documents", "document_separator", "max_documents_per_sequence"):
        del saved["config"][name]  # a run saved before packing documents: it trained on concat
    state.write_text(json.dumps(saved))
    cfg = resume_config(out, {"steps": 3})
    assert (cfg.packing(), cfg.document_separator) == ("concat", "none")
    for documents in (1024, 5):  # concat has no document bounds: the flag could not take effect
        with pytest.raises(ValueError, match="applies only with `--pack-documents mask`"):
            resume_config(out, {"steps": 3, "max_documents_per_sequence": documents})


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pack-documents", "mask"], "`--pack-documents mask` applies only with `--data`"),
        (["--document-separator", "bos"], "`--document-separator bos` applies only with `--data`"),
        (["--max-documents-per-sequence", "0"], "`--max-documents-per-sequence` must be a positive integer, got 0"),
    ],
)
def test_bad_packing_flags_exit_2_with_one_line(tmp_path, capsys, flags, message):
    assert main(["train", *SMALL, "--steps", "1", *flags, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("layout", [["--sp", "2"], []], ids=["sp2", "dp2"])
def test_mask_packing_on_two_ranks_gives_the_losses_of_one_process(tmp_path, layout):
    def run(*flags: str) -> list[tuple[float, ...]]:
        fields = ["--data", str(_short_documents(tmp_path)), "--eval-split", "0.1", "--eval-every", "3"]
        argv = [*fields, "--seq-len", "64", "--batch-size", "4", "--eval-batches", "1", "--steps", "3"]
        argv += ["--max-documents-per-sequence", "3", "--no-save-final", "--json", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # gloo on CPU
        command = [sys.executable, "-m", "memo", "train", *argv]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=HANG)
        assert result.returncode == 0, result.stderr[-3000:]
        records = [json.loads(line) for line in result.stdout.splitlines()]
        scored = [r for r in records if "loss" in r or "eval_loss" in r]
        return [(r["loss"], r["grad_norm"]) if "loss" in r else (r["eval_loss"],) for r in scored]

    # sp: every rank holds the whole sequence's positions; dp: each its rows' (a document spans both sp ranks)
    one, two = run("--out", str(tmp_path / "one")), run("--nproc", "2", *layout, "--out", str(tmp_path / "two"))
    assert len(one) == 4
    torch.testing.assert_close(two, one, rtol=1e-5, atol=0)
