"""A checkpoint folder through the CLI as a user takes it: `memo train` a few steps on byte tokens, `memo export --hf`,
`memo eval`; the family tests check what transformers reads back."""

from __future__ import annotations

import json
from pathlib import Path

from memo.cli import main

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def train_and_export(folder: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """Trains `folder` (a 256-token vocabulary: byte tokens) for 2 steps at α 0.5 and exports it; returns (the run,
    the exported folder, the text it trained on)."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    run, out = tmp_path / "run", tmp_path / "hf"
    train = ["train", "--model", str(folder), "--data", str(text), "--seq-len", "48", "--batch-size", "2"]
    assert main([*train, "--steps", "2", "--alpha", "0.5", "--eval-every", "1000", "--out", str(run)]) == 0
    assert main(["export", str(run), "--hf", str(out)]) == 0
    return run, out, text


def evaluates(run: Path, text: Path, capsys) -> None:
    """Raises unless `memo eval` of the run measures perplexity by length."""
    capsys.readouterr()
    assert main(["eval", str(run), "--trials", "0", "--ppl-file", str(text), "--lengths", "48", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"]["buckets"]
