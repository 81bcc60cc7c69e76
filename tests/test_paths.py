"""Paths a run names are stored absolute with a fingerprint of their content; a run resumed, evaluated or exported
from another folder reads the same files, or refuses in one line when they changed."""

import dataclasses
import json
import os
import re

import pytest

from memo import ModelConfig
from memo.cli import main
from memo.train.config import (
    END_BYTES,
    SMALL_FILE,
    TrainConfig,
    absolute_paths,
    check_inputs,
    file_fingerprint,
    input_fingerprint,
)
from memo.train.data import tokenizer_identity, write_token_file

TINY = ["--seq-len", "64", "--batch-size", "2", "--eval-batches", "1", "--json"]


def _tokenizer(path, words):
    """Writes a word-level tokenizer.json over `words` (ids 0.. in order) and returns its path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def _one_line(capsys, pattern: str) -> str:
    err = capsys.readouterr().err.strip()
    assert re.search(pattern, err), err
    assert len(err.splitlines()) == 1, err
    return err


def _folders(root, run: str = "run"):
    """Returns (A, B) under `root`: a one-step run trained in A on A's data.txt and tokenizer.json, all given
    relative; B holds another data.txt and tokenizer.json."""
    a, b = root / "A", root / "B"
    for folder, text in ((a, "the cat sat on the mat "), (b, "dog dog dog ")):
        folder.mkdir()
        (folder / "data.txt").write_text(text * 40)
        _tokenizer(folder / "tokenizer.json", text.split())
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(a)
        argv = ["train", *TINY, "--steps", "1", "--data", "data.txt", "--tokenizer", "tokenizer.json", "--out", run]
        assert main(argv) == 0
    return a, b


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A run that the tests using it do not change (they read it, or are refused)."""
    return _folders(tmp_path_factory.mktemp("shared"))


@pytest.fixture
def two_folders(shared, monkeypatch):
    monkeypatch.chdir(shared[1])
    return shared


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """A run of its own, for a test that changes it or its files; the current folder is B."""
    a, b = _folders(tmp_path)
    monkeypatch.chdir(b)
    return a, b


def _config(run) -> dict:
    return json.loads((run / "config.json").read_text())


def test_a_run_stores_its_paths_absolute_with_fingerprints(two_folders):
    a, _ = two_folders
    config = _config(a / "run")
    assert config["data"] == str(a / "data.txt") and config["tokenizer"] == str(a / "tokenizer.json")
    assert config["out"] == str(a / "run") and config["model"] == "tiny"
    size = (a / "data.txt").stat().st_size
    assert config["inputs"]["data"]["size"] == size and set(config["inputs"]) == {"data", "tokenizer", "tokens"}
    assert config["inputs"]["tokens"] == {"tokenizer": tokenizer_identity(a / "tokenizer.json")}


def test_a_resume_from_another_folder_reads_the_runs_own_files_or_those_given_again(fresh):
    a, b = fresh
    assert main(["train", "--resume", str(a / "run"), "--steps", "2"]) == 0
    config = _config(a / "run")
    assert config["data"] == str(a / "data.txt") and config["tokenizer"] == str(a / "tokenizer.json")
    assert not (b / "run").exists()
    (b / "moved.json").write_bytes((a / "tokenizer.json").read_bytes())  # the same tokenizer, elsewhere
    (b / "moved.txt").write_bytes((a / "data.txt").read_bytes())  # the same data
    assert main(["train", "--resume", str(a / "run"), "--steps", "3", "--data", "data.txt"]) == 2  # B's own: other
    assert (
        main(["train", "--resume", str(a / "run"), "--steps", "3", "--data", "moved.txt", "--tokenizer", "moved.json"])
        == 0
    )
    config = _config(a / "run")
    assert config["data"] == str(b / "moved.txt") and config["tokenizer"] == str(b / "moved.json")


def test_a_resume_refuses_data_that_changed_or_is_missing_in_one_line(fresh, capsys):
    a, _ = fresh
    (a / "data.txt").write_text("other text " * 50)
    assert main(["train", "--resume", str(a / "run"), "--steps", "2"]) == 2
    _one_line(capsys, rf"`--data` {re.escape(str(a / 'data.txt'))} changed since run .* \(size \d+ -> \d+\)")
    (a / "data.txt").unlink()
    assert main(["train", "--resume", str(a / "run"), "--steps", "2"]) == 2
    _one_line(capsys, r"`--data` .*data.txt of run .* is missing")


def test_a_tokenizer_changed_in_place_is_refused_by_resume_and_eval(fresh, capsys):
    a, _ = fresh
    _tokenizer(a / "tokenizer.json", "a completely different vocabulary".split())
    assert main(["train", "--resume", str(a / "run"), "--steps", "2"]) == 2
    _one_line(capsys, r"`--tokenizer` .*tokenizer.json changed since run .* \(size")
    assert main(["eval", str(a / "run"), "--lengths", "128", "--trials", "1", "--depths", "0"]) == 2
    _one_line(capsys, r"memo eval: error: `--tokenizer` .*A/tokenizer.json changed since run")


def test_eval_from_another_folder_uses_the_runs_tokenizer(two_folders, capsys):
    a, _ = two_folders
    capsys.readouterr()
    argv = ["eval", str(a / "run"), "--lengths", "128", "--trials", "1", "--depths", "0", "--json"]
    assert main([*argv, "--ppl-file", str(a / "data.txt")]) == 0
    assert json.loads(capsys.readouterr().out)["tokenizer"] == str(a / "tokenizer.json")


def test_a_tokenizer_given_with_resume_must_be_the_same_file(two_folders, capsys):
    a, _ = two_folders
    assert main(["train", "--resume", str(a / "run"), "--steps", "2", "--tokenizer", "tokenizer.json"]) == 2
    pattern = r"`--tokenizer` tokenizer.json is not the tokenizer run .*A/run trained with \(.*A/tokenizer.json\)"
    _one_line(capsys, pattern)


def test_a_model_of_another_shape_given_with_resume_is_one_line(two_folders, capsys):
    a, b = two_folders
    (b / "wide.json").write_text(json.dumps({**dataclasses.asdict(ModelConfig.preset("tiny")), "hidden_size": 96}))
    assert main(["train", "--resume", str(a / "run"), "--steps", "2", "--model", "wide.json"]) == 2
    _one_line(capsys, r"`--model .*wide.json` is not the model run .* trained \(hidden_size 96 vs 64\)")


def test_old_runs_without_fingerprints_resume_unchecked(tmp_path):
    (tmp_path / "data.txt").write_text("changed " * 60)
    config = {"data": str(tmp_path / "data.txt"), "tokenizer": None}  # a config saved before fingerprints
    check_inputs(config)
    with pytest.raises(ValueError, match="changed since the run started"):
        check_inputs({**config, "inputs": {"data": {"size": 1, "sha256": "0"}}})


def test_absolute_paths_leave_presets_and_other_fields_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    values = absolute_paths({"model": "tiny", "data": "d.txt", "eval-data": "e.txt", "seq_len": 64, "out": "r"})
    assert values == {
        "model": "tiny",
        "data": str(tmp_path / "d.txt"),
        "eval-data": str(tmp_path / "e.txt"),
        "seq_len": 64,
        "out": str(tmp_path / "r"),
    }
    assert absolute_paths({"model": "m.yaml"})["model"] == str(tmp_path / "m.yaml")


def test_a_big_file_is_fingerprinted_by_size_both_ends_and_mtime(tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * (SMALL_FILE + 3 * END_BYTES))
    before = file_fingerprint(big)
    assert set(before) == {"size", "ends_sha256", "mtime_ns"}
    with open(big, "r+b") as f:  # the middle: same size, same ends, only mtime tells
        f.seek(SMALL_FILE // 2)
        f.write(b"b")
    os.utime(big, ns=(before["mtime_ns"] + 10**9, before["mtime_ns"] + 10**9))
    after = file_fingerprint(big)
    assert after["ends_sha256"] == before["ends_sha256"] and after["mtime_ns"] != before["mtime_ns"]
    with open(big, "r+b") as f:  # the last byte: its end changes
        f.seek(-1, os.SEEK_END)
        f.write(b"c")
    assert file_fingerprint(big)["ends_sha256"] != before["ends_sha256"]


def test_a_token_file_is_fingerprinted_with_its_sidecar(tmp_path):
    (tmp_path / "d.txt").write_text("hello " * 20)
    write_token_file(tmp_path / "d.txt", tmp_path / "d.bin")
    found = input_fingerprint("data", str(tmp_path / "d.bin"))
    assert set(found) == {"size", "sha256", "sidecar_sha256"}
    assert input_fingerprint("model", "tiny") is None and input_fingerprint("data", str(tmp_path / "no")) is None


def test_a_hugging_face_model_folder_trains_on_its_own_tokenizer_and_says_so(tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    _tokenizer(tmp_path / "hf" / "tokenizer.json", "the cat sat on mat".split())
    (tmp_path / "data.txt").write_text("the cat sat on the mat " * 40)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["train", *TINY, "--steps", "1", "--model", "hf", "--data", "data.txt", "--out", "run"]) == 0
    err = capsys.readouterr().err
    assert "no `--tokenizer`: tokenizing `--data` with hf/tokenizer.json, the tokenizer of `--model`" in err
    saved = _config(tmp_path / "run")
    assert saved["tokenizer"] == str(tmp_path / "hf" / "tokenizer.json") and saved["model"] == str(tmp_path / "hf")
    assert set(saved["inputs"]) == {"model", "data", "tokenizer", "tokens"}


def test_eval_data_of_another_tokenizer_is_refused_in_one_line(two_folders, monkeypatch, capsys):
    a, b = two_folders
    capsys.readouterr()
    write_token_file(b / "data.txt", b / "held.bin", b / "tokenizer.json")
    monkeypatch.chdir(a)
    argv = ["train", *TINY, "--steps", "1", "--data", "data.txt", "--tokenizer", "tokenizer.json", "--out", "run2"]
    assert main([*argv, "--eval-data", str(b / "held.bin")]) == 2
    _one_line(capsys, r"`--eval-data` '.*held.bin' is tokenized by sha256:\w{12}\.\.\., not by the run's tokenizer")
    assert main(["eval", str(a / "run"), "--lengths", "128", "--trials", "0", "--ppl-file", str(b / "held.bin")]) == 2
    _one_line(capsys, r"`--ppl-file` '.*held.bin' is tokenized by sha256")


def test_a_named_pipe_as_data_is_refused_not_read(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "pipe.txt")
    assert main(["train", *TINY, "--steps", "1", "--data", "pipe.txt"]) == 2
    _one_line(capsys, r"`--data` '.*pipe.txt' is not a regular file")
    (tmp_path / "d.txt").write_text("hello " * 40)
    os.mkfifo(tmp_path / "held.bin")
    assert main(["train", *TINY, "--steps", "1", "--data", "d.txt", "--eval-data", "held.bin"]) == 2
    _one_line(capsys, r"`--eval-data` '.*held.bin' is not a regular file")
    assert TrainConfig.from_dict({"inputs": {"data": {}}}).data is None  # a saved config's fingerprints are no field


def test_a_token_file_given_with_resume_must_come_from_the_runs_tokenizer(two_folders, capsys):
    a, b = two_folders  # the run trained on A's tokenizer; B's tokenizer made this token file
    write_token_file(b / "data.txt", b / "other.bin", b / "tokenizer.json")
    capsys.readouterr()
    assert main(["train", "--resume", str(a / "run"), "--steps", "2", "--data", str(b / "other.bin")]) == 2
    _one_line(capsys, r"`--data` '.*other.bin' is tokenized by sha256:\w{12}\.\.\., not by the run's tokenizer")
