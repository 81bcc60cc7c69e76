"""RULER scores of a model by task, length and depth: prompts from `memo.ruler`, greedy decoding with a key/value
cache (`memo.decode`) up to each task's answer length or the tokenizer's end-of-text, RULER's scoring.

A cell is (task, length, depth): the needle tasks at every depth asked, variable tracking and the word-extraction
tasks once per length (no depth). A length a task cannot fill (the byte tokenizer spells its few-shot example and
lists in many tokens) is reported as such, not refused: the other tasks at that length still run. The average row
of the table is the mean over the tasks it names, the offline subset; model cards quote RULER's 13-task average,
which adds two QA tasks this evaluation cannot build offline.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .chat import ChatTemplate
from .decode import generate
from .figures import plot_heatmap
from .ruler import TASKS, Ruler, score

OFFLINE = "the offline subset of RULER's 13 tasks (no QA), not the model-card average"


@dataclass(frozen=True)
class RulerCell:
    """The mean score of one task at one length (and depth, for the needle tasks) over its samples; `skipped` says
    why a cell has none."""

    task: str  # the variant's name, e.g. niah_single_2/noise
    length: int  # the prompt's tokens, as the model saw them
    depth: float | None
    samples: int
    score: float | None
    skipped: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


TRAIN_SUBSET = ("niah_single_1", "niah_multikey_1", "niah_multivalue", "fwe")  # short enough for a run's length


def eval_task_names(chosen: Sequence[str]) -> list[str]:
    """Returns the RULER tasks `memo train --eval-tasks` names: `ruler` for TRAIN_SUBSET, or task names."""
    names = [t for name in chosen for t in (TRAIN_SUBSET if name == "ruler" else (name,))]
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"`--eval-tasks` names {unknown[0]!r}: choose ruler or RULER tasks ({', '.join(TASKS)})")
    return list(dict.fromkeys(names))


def end_of_text(tokenizer) -> tuple[int, ...]:
    """Returns the ids that end a generated answer: the tokenizer's end of text, none for bytes."""
    try:
        return tokenizer.separator("eos").ids
    except ValueError:
        return ()


def task_names(chosen: Sequence[str]) -> list[str]:
    """Returns the RULER tasks `--tasks` names: `ruler` for all of them, or task names; raises for an unknown one."""
    names = []
    for name in chosen:
        if name == "ruler":
            names.extend(TASKS)
        elif name in TASKS:
            names.append(name)
        else:
            raise ValueError(f"`--tasks` names {name!r}: choose passkey, ruler or RULER tasks ({', '.join(TASKS)})")
    return list(dict.fromkeys(names))


@dataclass(frozen=True, kw_only=True)
class RulerGrid:
    """What to score: `tasks` at every length (and depth, the needle tasks), `samples` prompts a cell from `seed`,
    decoded `batch_size` at a time, stopping at the `eos` ids."""

    tasks: Sequence[str]
    lengths: Sequence[int]
    depths: Sequence[float]
    samples: int
    seed: int = 0
    batch_size: int = 1
    eos: Sequence[int] = ()

    def cells(self) -> list[tuple[str, int, float | None]]:
        """Returns (task, length, depth) of every cell, lengths outer."""
        return [
            (task, length, depth)
            for length, task in itertools.product(self.lengths, self.tasks)
            for depth in (self.depths if TASKS[task].has_depth else (None,))
        ]


def ruler_cells(
    model, ruler: Ruler, grid: RulerGrid, progress: Callable[[int], None] = lambda n: None
) -> Iterator[RulerCell]:
    """Yields every cell's score, lengths outer, as it is finished (a caller keeps those finished before a Ctrl-C);
    `progress(n)` as each batch of n prompts is scored."""
    for where in grid.cells():
        yield _cell(model, ruler, grid, where, progress)


def _cell(model, ruler: Ruler, grid: RulerGrid, where: tuple, progress) -> RulerCell:
    """Returns the cell `where` (task, length, depth) scored over the grid's samples."""
    task, length, depth = where
    try:
        prompts = [ruler.prompt(task, length, depth, grid.seed, index) for index in range(grid.samples)]
    except ValueError as err:  # this task cannot fill this length with this tokenizer
        progress(grid.samples)
        return RulerCell(task, length, depth, 0, None, skipped=str(err))
    device = next(model.parameters()).device
    scores = []
    for first in range(0, grid.samples, grid.batch_size):
        batch = prompts[first : first + grid.batch_size]
        ids = torch.from_numpy(np.stack([p.ids for p in batch])).to(device)
        for prompt, answer in zip(batch, generate(model, ids, batch[0].tokens_to_generate, grid.eos)):
            known = [i for i in answer if i < ruler.tokenizer.vocab_size and i not in grid.eos]
            scores.append(score(prompt, ruler.tokenizer.decode(known)))
        progress(len(batch))
    return RulerCell(prompts[0].name, length, depth, grid.samples, float(np.mean(scores)))


def chat_hook(choice: str, tokenizer_path: str | Path | None) -> Callable[[str], str] | None:
    """Returns what wraps RULER's user message in the tokenizer's chat template with its generation prompt
    (`memo.chat`), or None: `choice` off, or auto and the tokenizer has no template (bytes, or a folder without
    one); on without one raises."""
    has = _has_template(tokenizer_path)
    if choice == "off" or (choice == "auto" and not has):
        return None
    if not has:
        where = "bytes" if tokenizer_path is None else Path(tokenizer_path).parent
        raise ValueError(
            f"`--chat on`: the tokenizer ({where}) has no chat template; give `--chat off` or `--tokenizer`"
        )
    template = ChatTemplate(tokenizer_path, "RULER's prompts")
    return lambda message: template.render([{"role": "user", "content": message}], "a RULER prompt", prompt=True)


def _has_template(tokenizer_path: str | Path | None) -> bool:
    """Returns whether a tokenizer's folder holds a chat template (tokenizer_config.json's, or its own file)."""
    if tokenizer_path is None:
        return False
    folder = Path(tokenizer_path).parent
    config = folder / "tokenizer_config.json"
    has = config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))
    return has or (folder / "chat_template.jinja").is_file()


def plot_paths(plot: str | Path, tasks: Sequence[str]) -> dict[str, Path]:
    """Returns where `--plot PATH` puts each needle task's heatmap: beside PATH, `PATH-<task>.png`."""
    path = Path(plot)
    return {t: path.with_name(f"{path.stem}-{t}{path.suffix}") for t in tasks if TASKS[t].has_depth}


def plot_cells(cells: Sequence[RulerCell], paths: dict[str, Path], source: str) -> list[Path]:
    """Draws each needle task's heatmap (length x depth, its mean score) to `paths`; returns the files written."""
    written = []
    for task, path in paths.items():
        mine = [c for c in cells if c.task.split("/")[0] == task]
        if mine:
            samples = max(c.samples for c in mine)
            values = {(c.length, c.depth): c.score for c in mine}
            plot_heatmap(values, path, f"RULER {mine[0].task}: {source}, {samples} per cell", "score")
            written.append(path)
    return written


def table(cells: Sequence[RulerCell]) -> str:
    """Returns the task × length table (mean over depths, in percent) with the average row over the tasks every
    length scored, named."""
    lengths = sorted({c.length for c in cells})
    tasks = list(dict.fromkeys(c.task for c in cells))
    mean = {(t, n): _mean([c.score for c in cells if (c.task, c.length) == (t, n)]) for t in tasks for n in lengths}
    lines = ["| task | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---:|" * len(lengths)]
    lines += [f"| {t} | " + " | ".join(_percent(mean[t, n]) for n in lengths) + " |" for t in tasks]
    whole = [t for t in tasks if all(mean[t, n] is not None for n in lengths)]
    average = [_mean([mean[t, n] for t in whole]) for n in lengths]
    lines.append(f"| average of {len(whole)} | " + " | ".join(_percent(a) for a in average) + " |")
    lines.append(f"average: {', '.join(whole) or 'no task scored at every length'}; {OFFLINE}")
    skipped = [c for c in cells if c.skipped]
    if skipped:
        lines.append(f"not scored: {len(skipped)} cells, e.g. {skipped[0].skipped}")
    return "\n".join(lines)


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return float(np.mean(kept)) if kept else None


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"
