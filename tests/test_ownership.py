"""Outputs have owners (memo.files): a command writes only a new or empty folder, one memo wrote for the same
purpose, or with `--overwrite` any other, replaced whole; never what it reads, a run or a run's checkpoints. A full
disk (a real one: a small tmpfs) fails in one line and leaves no temporary file and the previous checkpoint whole."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from memo.cli import main
from memo.files import MARK, claim_folder
from memo.train import checkpoint

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
TINY = ["--seq-len", "64", "--batch-size", "2", "--eval-every", "1000"]
HF_CONFIG = {  # a tiny Llama, as transformers' LlamaConfig(...).save_pretrained writes it
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
EXPORTED_HF = [MARK, "config.json", "generation_config.json", "model.safetensors"]


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    """A finished one-step run."""
    run = tmp_path_factory.mktemp("done") / "run"
    assert main(["train", *TINY, "--steps", "1", "--out", str(run), "--json"]) == 0
    return run


@pytest.fixture
def hf_model(tmp_path):
    """A Hugging Face model folder memo did not write: config, two shards with their index, a tokenizer."""
    folder = tmp_path / "hf-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIG, indent=2))
    shards = {f"model-0000{i}-of-00002.safetensors": f"w{i}" for i in (1, 2)}
    for file, name in shards.items():
        save_file({name: torch.zeros(2)}, str(folder / file))
    index = {"metadata": {}, "weight_map": {name: file for file, name in shards.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture
def small_disk(tmp_path):
    """Returns run(size, *memo_args): `memo` in a subprocess whose working folder is a fresh tmpfs of `size`, and
    (its result, a folder holding what the tmpfs holds after it). As root the tmpfs is mounted here and unmounted
    after the test; otherwise inside `unshare --user --map-root-user --mount`, which copies the tmpfs out before
    it ends; the test is skipped when neither can mount."""
    disk, mounted = tmp_path / "disk", []
    disk.mkdir()

    def run(size: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
        memo = [sys.executable, "-m", "memo", *args]
        mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]
        if os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0:
            mounted.append(disk)
            return subprocess.run(memo, capture_output=True, text=True, env=ENV, cwd=disk, timeout=300), disk
        after = tmp_path / "after"
        after.mkdir()
        inside = 'mount -t tmpfs -o size="$1" tmpfs "$2" || exit 99; cd "$2"; d=$2 a=$3; shift 3; "$@"; rc=$?; '
        inside += 'cp -a "$d"/. "$a"/; exit $rc'
        command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", inside, "sh", size, str(disk)]
        if shutil.which("unshare") is None:
            pytest.skip("no tmpfs: not root, and no `unshare` to mount one in a user namespace")
        result = subprocess.run([*command, str(after), *memo], capture_output=True, text=True, env=ENV, timeout=300)
        if result.returncode == 99 or "unshare:" in result.stderr:
            pytest.skip(f"no tmpfs: not root, and unshare cannot mount one ({result.stderr.strip()})")
        return result, after

    yield run
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=True)


def _tree(folder: Path) -> dict[str, str]:
    """Returns every file under `folder` (links not followed) with the SHA-256 of its bytes."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _error(capsys, verb: str) -> str:
    """Returns the one error line a failed command printed."""
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if "warning:" not in line]
    assert len(lines) == 1 and lines[0].startswith(f"memo {verb}: error: "), captured.err
    return lines[0]


def test_train_refuses_its_own_model_folder_as_out_before_building_anything(hf_model, capsys):
    before = _tree(hf_model)
    assert main(["train", "--model", str(hf_model), *TINY, "--steps", "1", "--out", str(hf_model)]) == 2
    line = _error(capsys, "train")
    assert f"`--out` {hf_model}" in line and "is also `--model`, which this command reads" in line
    assert _tree(hf_model) == before and not (hf_model / ".lock").exists()


def test_train_refuses_a_symlink_to_a_folder_of_user_files(tmp_path, capsys):
    folder, link = tmp_path / "notes", tmp_path / "link"
    folder.mkdir()
    (folder / "todo.txt").write_text("mine")
    link.symlink_to(folder)
    assert main(["train", *TINY, "--steps", "1", "--out", str(link)]) == 2
    line = _error(capsys, "train")
    assert f"`--out` {link} (-> {folder}) holds files memo did not write (todo.txt)" in line
    assert "`--overwrite`" not in line  # a run never replaces a folder: the user moves it
    assert sorted(p.name for p in folder.iterdir()) == ["todo.txt"]


def test_train_writes_an_empty_folder_and_marks_it_as_a_run(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert main(["train", *TINY, "--steps", "1", "--no-save-final", "--out", str(out), "--json"]) == 0
    assert json.loads((out / MARK).read_text()) == {"purpose": "run"}
    claim_folder(out, "--out", "run")  # a run without checkpoints may start there again
    with pytest.raises(ValueError, match=r"is a run folder \(`memo train` writes it\)"):
        claim_folder(out, "--hf", "export")


@pytest.mark.parametrize(
    "left", [(MARK, "config.json", "metrics.jsonl"), ("metrics.jsonl",)], ids=["marked", "killed-before-its-mark"]
)
def test_train_refuses_to_start_afresh_over_its_own_run_killed_before_its_first_checkpoint(tmp_path, capsys, left):
    run = tmp_path / "run"
    run.mkdir()
    for name in left:
        (run / name).write_text('{"purpose": "run"}\n' if name == MARK else "{}\n")
    (run / ".lock").write_text(json.dumps({"pid": 1234, "host": "node-7"}) + "\n")  # no process holds it: killed
    before = _tree(run)
    assert main(["train", *TINY, "--steps", "1", "--out", str(run)]) == 2
    assert _error(capsys, "train") == (
        f"memo train: error: `--out` {run} is a `memo train` run killed before its first checkpoint, so there is "
        "nothing to `--resume`: give another folder, or delete this one to start afresh there"
    )
    assert _tree(run) == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "{run}/checkpoints/step-0000001/model.safetensors"], "is inside the checkpoints of run {run}"),
        (["--hf", "{run}/checkpoints"], "is inside the checkpoints of run {run}"),
        (["--hf", "{run}"], "`--hf` {run} is also RUN_DIR, which this command reads"),
        (["--adapter", "{run}/.."], "holds RUN_DIR ({run}), which this command reads"),
        (["--out", "{run}/config.json", "--overwrite"], "is a file of run {run}"),
        (["--hf", "{other}"], "is a run folder (`memo train` writes it)"),
    ],
    ids=["out-in-checkpoints", "hf-checkpoints", "hf-run", "adapter-above-run", "run-file", "hf-other-run"],
)
def test_export_never_writes_into_a_run_or_its_checkpoints(done, tmp_path, capsys, argv, message):
    other = tmp_path / "other"
    shutil.copytree(done, other)
    before = _tree(done.parent)
    argv = [a.format(run=done, other=other) for a in argv]
    assert main(["export", str(done), *argv]) == 2
    assert message.format(run=done) in _error(capsys, "export")
    assert _tree(done.parent) == before


def test_export_hf_into_another_model_needs_overwrite_then_replaces_it_whole(done, hf_model, capsys):
    before = _tree(hf_model)
    assert main(["export", str(done), "--hf", str(hf_model)]) == 2
    line = _error(capsys, "export")
    assert f"`--hf` {hf_model} holds files memo did not write (config.json, model-00001-of-00002.safetensors," in line
    assert line.endswith("give a new or empty folder, or `--overwrite` to replace it whole")
    assert _tree(hf_model) == before
    assert main(["export", str(done), "--hf", str(hf_model), "--overwrite"]) == 0
    assert sorted(p.name for p in hf_model.iterdir()) == EXPORTED_HF  # no stale shard, index or tokenizer
    assert sorted(p.name for p in hf_model.parent.iterdir()) == ["hf-model"]  # no temporary or old folder
    assert main(["export", str(done), "--hf", str(hf_model)]) == 0  # memo's own export: replaced without asking
    assert sorted(p.name for p in hf_model.iterdir()) == EXPORTED_HF


def test_export_out_makes_missing_folders_and_replaces_only_its_own_file(done, tmp_path, capsys):
    out = tmp_path / "new" / "a b" / "ü" / "m.safetensors"
    for _ in range(2):  # the second time, the file is memo's export
        assert main(["export", str(done), "--out", str(out)]) == 0
        assert capsys.readouterr().out.strip() == str(out)
    assert set(load_file(out)) == set(checkpoint.load_latest(done).model)
    mine = tmp_path / "mine.safetensors"
    save_file({"x": torch.zeros(1)}, str(mine))
    assert main(["export", str(done), "--out", str(mine)]) == 2
    assert "exists and memo did not write it: give a new path, or `--overwrite`" in _error(capsys, "export")
    assert set(load_file(mine)) == {"x"}
    assert main(["export", str(done), "--out", str(mine), "--overwrite"]) == 0
    assert set(load_file(mine)) == set(load_file(out))


def test_report_replaces_its_own_picture_and_asks_before_replacing_any_other_file(done, tmp_path, capsys):
    assert main(["report", str(done)]) == 0 and main(["report", str(done)]) == 0  # RUN_DIR/report.png is its own
    picture, foreign = tmp_path / "new" / "r.png", tmp_path / "photo.png"
    assert main(["report", str(done), "--out", str(picture)]) == 0
    assert main(["report", str(done), "--out", str(picture)]) == 0  # a PNG memo drew (its Software field)
    foreign.write_bytes(b"\x89PNG not memo's")
    assert main(["report", str(done), "--out", str(foreign)]) == 2
    assert "photo.png exists and memo did not write it" in _error(capsys, "report")
    assert main(["report", str(done), "--out", str(done / "metrics.jsonl"), "--overwrite"]) == 2
    assert "is also RUN_DIR's metrics.jsonl, which this command reads" in _error(capsys, "report")
    assert main(["report", str(done), "--out", str(foreign), "--overwrite"]) == 0


def _placements(tmp_path: Path, buffers: int) -> Path:
    """Writes a DSA instance of `buffers` overlapping buffers; returns its CSV."""
    csv = tmp_path / "buffers.csv"
    csv.write_text("id,lower,upper,size\n" + "".join(f"{i},{i},{i + 3},{64 + i}\n" for i in range(buffers)))
    return csv


def test_single_file_outputs_replace_memos_own_and_ask_before_any_other(tmp_path, capsys):
    csv, placed, plot, mine = _placements(tmp_path, 8), tmp_path / "placed.csv", tmp_path / "plan.png", tmp_path / "m"
    mine.write_text("mine\n")
    for argv in (
        ["dsa", str(csv), "--out", str(placed)],
        ["plan", "--model", "tiny", "--seq", "64", "--plot", str(plot)],
    ):
        assert main(argv) == 0 and main(argv) == 0  # the second replaces what the first wrote
    capsys.readouterr()
    for argv in (["dsa", str(csv), "--out"], ["plan", "--model", "tiny", "--seq", "64", "--plot"]):
        assert main([*argv, str(mine)]) == 2
        assert "exists and memo did not write it: give a new path, or `--overwrite`" in _error(capsys, argv[0])
    assert main(["dsa", str(csv), "--out", str(csv)]) == 2
    assert "is also the buffers' FILE, which this command reads" in _error(capsys, "dsa")
    assert mine.read_text() == "mine\n"
    assert main(["dsa", str(csv), "--out", str(mine), "--overwrite"]) == 0 and mine.read_text().startswith("id,")


def test_a_full_disk_under_any_verbs_output_is_one_line_and_leaves_nothing(tmp_path, small_disk):
    csv = _placements(tmp_path, 3000)  # its placement, ~70 KB, does not fit in 16 KB
    result, after = small_disk("16k", "dsa", str(csv), "--work", "1M", "--out", "out/placed.csv")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1] == "memo dsa: error: out/placed.csv: No space left on device"
    assert not list(after.iterdir())


def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_previous_one(small_disk):
    result, after = small_disk("4m", "train", *TINY, "--steps", "2", "--save-every", "1", "--out", "run")
    lines = re.findall(r"memo train: .*", result.stderr)  # after the progress bar's carriage return
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and "cannot save checkpoint step-0000002" in lines[0], result.stderr
    assert ".safetensors: No space left on device (step-0000001 is intact)" in lines[0]
    assert not [p for p in after.rglob("*") if ".tmp" in p.name]
    assert [p.name for p in checkpoint.list_checkpoints(after / "run")] == ["step-0000001"]
    assert checkpoint.damage(after / "run" / "checkpoints" / "step-0000001") is None


def test_a_full_disk_during_an_export_is_one_line_and_leaves_nothing(done, small_disk):
    result, after = small_disk("256k", "export", str(done), "--out", "a/b/m.safetensors")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines() == ["memo export: error: a/b/m.safetensors: No space left on device"]
    assert not list(after.iterdir())  # no file, no temporary, and the folders it made are gone


def test_overwrite_never_replaces_a_folder_holding_a_run(done, tmp_path, capsys):
    projects = tmp_path / "projects"
    shutil.copytree(done, projects / "team" / "old-run")
    (projects / "notes.txt").write_text("mine\n")
    before = _tree(projects)
    assert main(["export", str(done), "--hf", str(projects), "--overwrite"]) == 2
    assert "holds run " in _error(capsys, "export") and _tree(projects) == before


def test_the_library_replaces_only_folders_it_may(tmp_path):
    from memo.config import ModelConfig
    from memo.hf import to_hf
    from memo.model import Transformer

    model, folder = Transformer(ModelConfig.preset("tiny")), tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    with pytest.raises(ValueError, match="holds files memo did not write"):
        to_hf(model, folder)
    assert (folder / "notes.txt").read_text() == "mine\n"
    to_hf(model, folder, overwrite=True)
    to_hf(model, folder)  # now memo's export: replaced without asking
    assert not (folder / "notes.txt").exists()


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf", ".eps"])
def test_figures_in_every_format_are_memos_own_to_replace(done, tmp_path, suffix):
    from memo.figures import drawn_by_memo

    picture = tmp_path / f"r{suffix}"
    assert main(["report", str(done), "--out", str(picture)]) == 0 and drawn_by_memo(picture)
    assert main(["report", str(done), "--out", str(picture)]) == 0  # its own: replaced without `--overwrite`
    picture.write_bytes(picture.read_bytes().replace(b"memo", b"user"))
    assert not drawn_by_memo(picture) and main(["report", str(done), "--out", str(picture)]) == 2


def test_an_export_never_replaces_a_run_placed_inside_it(done, tmp_path, capsys):
    export = tmp_path / "export"
    assert main(["export", str(done), "--hf", str(export)]) == 0
    shutil.copytree(done, export / "a" / "b" / "c" / "fine-tuned")  # a run trained from the export, deep inside
    before = _tree(export)
    for overwrite in ([], ["--overwrite"]):
        assert main(["export", str(done), "--hf", str(export), *overwrite]) == 2
        assert "holds run " in _error(capsys, "export") and _tree(export) == before
