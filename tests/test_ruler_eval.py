"""`memo eval --tasks ruler`: prompts from memo.ruler decoded with memo's cache and scored as RULER scores. The
wiring is checked with the decoder replaced by the reference solver (every cell 100%) and by a wrong answer (0%), so
both ends can fail; then the CLI on a tiny run: cells by task, length and depth, the lengths a task cannot fill
reported, bad flags refused in one line, Ctrl-C keeping the cells finished."""

import json
import re

import numpy as np
import pytest
import torch

import memo.ruler_eval as ruler_eval
from memo.cli import main
from memo.ruler import TASKS, Ruler, solve
from memo.ruler_eval import RulerCell, RulerGrid, chat_hook, ruler_cells, table
from memo.train.data import load_tokenizer

BYTES = load_tokenizer(None)


class _Solver:
    """Stands for `generate`: answers each prompt with the reference solver's reading of its text (`right`), or a
    wrong word."""

    def __init__(self, right: bool):
        self.right, self.calls = right, 0

    def __call__(self, model, ids, n, eos=()):
        self.calls += 1
        texts = [BYTES.decode(row.tolist()) for row in ids]
        answers = [solve(_task_of(text), text) if self.right else " nothing" for text in texts]
        return [BYTES.encode(a)[:n] for a in answers]


def _task_of(text: str) -> str:
    """Returns the RULER family a prompt's text is of (the solver reads the same text either way)."""
    for task in TASKS:
        if TASKS[task].family == "niah" and "special magic" in text:
            return task
    return next(t for t in TASKS if TASKS[t].family != "niah" and _family_words(TASKS[t].family) in text)


def _family_words(family: str) -> str:
    return {"variable_tracking": "VAR", "common_words_extraction": "most often", "freq_words_extraction": "coded"}[
        family
    ]


@pytest.mark.parametrize("right", [True, False], ids=["solver", "wrong"])
def test_every_cell_scores_what_its_answers_deserve(monkeypatch, right):
    model = torch.nn.Linear(1, 1)  # only its device is read: `generate` is replaced
    monkeypatch.setattr(ruler_eval, "generate", _Solver(right))
    tasks = ["niah_single_1", "niah_multikey_2", "niah_multiquery", "fwe"]
    grid = RulerGrid(tasks=tasks, lengths=[1500], depths=[0.0, 1.0], samples=2, batch_size=2)
    cells = list(ruler_cells(model, Ruler(BYTES), grid))
    assert [(c.task.split("/")[0], c.depth) for c in cells] == [
        ("niah_single_1", 0.0), ("niah_single_1", 1.0), ("niah_multikey_2", 0.0), ("niah_multikey_2", 1.0),
        ("niah_multiquery", 0.0), ("niah_multiquery", 1.0), ("fwe", None),
    ]  # fmt: skip
    assert all(c.score == (1.0 if right else 0.0) and c.samples == 2 for c in cells)


def test_a_length_a_task_cannot_fill_is_reported_not_refused(monkeypatch):
    monkeypatch.setattr(ruler_eval, "generate", _Solver(True))
    grid = RulerGrid(tasks=["vt", "niah_single_1"], lengths=[1024], depths=[0.5], samples=1)
    cells = list(ruler_cells(torch.nn.Linear(1, 1), Ruler(BYTES), grid))
    assert cells[0].skipped and "1024 is too short for vt" in cells[0].skipped and cells[1].score == 1.0
    text = table(cells)
    assert "| vt | - |" in text and "| average of 1 | 100.0 |" in text and "average: niah_single_1;" in text
    assert "not the model-card average" in text and "not scored: 1 cells" in text


def test_memo_eval_scores_ruler_by_task_length_and_depth(run_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Long rivers run to the sea. Mountains stand in the north. " * 10)
    capsys.readouterr()
    argv = ["eval", str(run_dir), "--tasks", "niah_single_2,cwe", "--lengths", "600", "--depths", "0,1"]
    assert main([*argv, "--trials", "1", "--haystack", str(corpus), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cells = [RulerCell(**c) for c in report["ruler"]]
    assert [(c.task, c.length, c.depth) for c in cells] == [
        ("niah_single_2/corpus", 600, 0.0), ("niah_single_2/corpus", 600, 1.0), ("cwe", 600, None),
    ]  # fmt: skip
    assert cells[2].skipped and all(0 <= c.score <= 1 for c in cells[:2]) and "passkey" not in report
    plot = tmp_path / "heat.png"
    assert main([*argv, "--trials", "1", "--plot", str(plot)]) == 0
    out, err = capsys.readouterr()
    assert "| niah_single_2/noise | " in out and not plot.exists()  # no pass key asked: only the task's heatmap
    drawn = tmp_path / "heat-niah_single_2.png"
    assert f"wrote {drawn}" in err and drawn.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tasks", "ruler,bogus"], "`--tasks` names 'bogus': choose passkey, ruler or RULER tasks"),
        (["--tasks", "ruler", "--trials", "0"], "`--tasks` names RULER tasks: they need `--trials` > 0"),
        (["--haystack", "corpus.txt"], "`--haystack` replaces RULER's essay haystack: give `--tasks ruler`"),
        (["--tasks", "vt,cwe", "--plot", "p.png"], "`--plot` draws needle heatmaps: it needs the pass key or a RULER"),
    ],
)
def test_bad_ruler_flags_are_one_line_before_any_work(run_dir, tmp_path, capsys, flags, message):
    (tmp_path / "corpus.txt").write_text("A sentence. ")
    flags = [str(tmp_path / f) if f.endswith((".txt", ".png")) else f for f in flags]
    assert main(["eval", str(run_dir), "--lengths", "600", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_ctrl_c_keeps_the_ruler_cells_finished(run_dir, monkeypatch, capsys):
    solver = _Solver(True)

    def interrupted(*args, **kwargs):
        if solver.calls == 2:
            raise KeyboardInterrupt
        return solver(*args, **kwargs)

    monkeypatch.setattr(ruler_eval, "generate", interrupted)
    capsys.readouterr()
    argv = ["eval", str(run_dir), "--tasks", "niah_single_1", "--lengths", "600", "--depths", "0,0.5,1"]
    assert main([*argv, "--trials", "1", "--json"]) == 130
    report = json.loads(capsys.readouterr().out)
    assert report["interrupted"] and [(c["depth"], c["score"]) for c in report["ruler"]] == [(0.0, 1.0), (0.5, 1.0)]
    assert np.isclose(sum(c["score"] for c in report["ruler"]), 2.0)


def test_default_lengths_stop_at_the_length_the_run_trained_at(run_dir, capsys):
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--tasks", "niah_single_1", "--trials", "1", "--depths", "0", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "note: RULER at 64: the run trained at 64 tokens (`--lengths` to go past it)" in err
    assert [(c["length"], bool(c["skipped"])) for c in json.loads(out)["ruler"]] == [(64, True)]  # too short to hold


def test_the_chat_template_wraps_the_prompt_when_the_tokenizer_has_one(tmp_path):
    from test_chat import char_tokenizer

    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    path = char_tokenizer(tmp_path / "chat", template)
    tokenizer = load_tokenizer(path)
    hook = chat_hook("auto", path)
    prompt = Ruler(tokenizer, chat=hook).prompt("niah_single_1", 1500, 0.5, 0, 0)
    text = tokenizer.decode(prompt.ids.tolist())
    assert len(prompt.ids) == 1500 and text.startswith("<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n" + prompt.answer_prefix)
    assert solve("niah_single_1", text) and chat_hook("auto", None) is None and chat_hook("off", path) is None
    char_tokenizer(tmp_path / "plain", "")  # a folder whose config has no template
    assert chat_hook("auto", tmp_path / "plain" / "tokenizer.json") is None
    with pytest.raises(ValueError, match="`--chat on`: the tokenizer .* has no chat template; give `--chat off`"):
        chat_hook("on", tmp_path / "plain" / "tokenizer.json")


def test_memo_train_scores_ruler_at_each_evaluation(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--seq-len", "1024", "--batch-size", "2", "--steps", "2", "--eval-every", "1"]
    assert main([*argv, "--eval-batches", "1", "--eval-tasks", "niah_single_1,fwe", "--out", str(out)]) == 0
    printed = "".join(capsys.readouterr())
    assert re.search(r"held-out loss \S+  accuracy \S+  RULER \d+\.\d% \(2 tasks\)  \(step 2\)", printed)
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert [e["step"] for e in evals] == [1, 2]
    assert all(set(e["eval_ruler_tasks"]) == {"niah_single_1", "fwe"} and 0 <= e["eval_ruler"] <= 1 for e in evals)
    assert main(["report", str(out)]) == 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--eval-tasks", "ruler,bogus"], "`--eval-tasks` names 'bogus': choose ruler or RULER tasks"),
        (["--eval-tasks", "ruler", "--nproc", "2"], "`--eval-tasks` decodes in one process"),
    ],
)
def test_bad_eval_tasks_are_one_line(tmp_path, capsys, flags, message):
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "run"), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
