"""The README's code blocks run as pasted: its two commands are what CI runs, and every other block runs in a fresh
folder (with this checkout's `.venv`) and succeeds; so do the Python examples of docs/."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCED = r"^```(bash|python)\n(.*?)^```"
BLOCKS = re.findall(FENCED, README, flags=re.S | re.M)
DOCS = [
    (page.name, block)
    for page in sorted((ROOT / "docs").glob("*.md"))
    for kind, block in re.findall(FENCED, page.read_text(), flags=re.S | re.M)
    if kind == "python"
]


def _commands(block: str) -> list[str]:
    """Returns the shell commands of a block, comments dropped."""
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def test_the_two_commands_are_setup_then_train_and_setup_then_what_ci_runs():
    kind, first = BLOCKS[0]
    assert kind == "bash"
    train, test = _commands(first)
    assert train == "bash setup.sh && .venv/bin/memo train"
    assert test == "bash setup.sh && .venv/bin/python -m pytest -q"
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert ci[-1] == test


def test_every_block_is_named():
    """A block of another language would escape the test below."""
    openings = re.findall(r"^```(\S*)\n", README, flags=re.M)[::2]  # fences alternate: opening, closing
    assert sorted(openings) == sorted([""] + [kind for kind, _ in BLOCKS])  # the one unnamed: printed output


def _run(args: list[str], cwd: Path) -> None:
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"{shlex.join(args)}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(1, len(BLOCKS)))
def test_a_block_runs_as_pasted(index, tmp_path):
    if not (ROOT / ".venv" / "bin" / "memo").exists():
        pytest.skip("no .venv here: run `bash setup.sh` (CI does)")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    kind, block = BLOCKS[index]
    if kind == "python":
        _run([sys.executable, "-c", block], tmp_path)
    else:
        _run(["bash", "-euo", "pipefail", "-c", block], tmp_path)


@pytest.mark.parametrize("page, block", DOCS, ids=[page for page, _ in DOCS])
def test_a_python_example_of_the_docs_runs(page, block, tmp_path):
    _run([sys.executable, "-c", block], tmp_path)


def test_every_relative_link_of_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [
        f"{page.name}: {target}"
        for page in pages
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not broken
