"""Checkpoints: weights and optimizer state in safetensors, the rest in JSON, written atomically.

A checkpoint is a folder `RUN_DIR/checkpoints/step-NNNNNNN/` holding `model.safetensors`,
`optimizer.safetensors` (AdamW moments and fp32 master weights), and `state.json` (step, config, optimizer
hyper-parameters, solved α, RNG states). It is written into a temporary folder, flushed to disk, and renamed
into place, so a crash mid-save leaves the previous checkpoint untouched and no half checkpoint visible.
Nothing is loaded through pickle.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PREFIX = "step-"


@dataclass
class Checkpoint:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    state: dict
    path: Path


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: Path, step: int, model: dict, optimizer: dict, state: dict, keep: int) -> Path:
    """Writes the checkpoint of `step` atomically and deletes all but the newest `keep`; returns its folder."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in model.items()}, str(tmp / "model.safetensors"))
    save_file({k: v.detach().contiguous().cpu() for k, v in optimizer.items()}, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=1))
    _fsync_tree(tmp)
    if final.exists():  # re-saving a step (e.g. after a resume): the new one replaces it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Returns the complete checkpoints of a run, oldest first (temporary folders are never listed)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").exists()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def load_latest(run_dir: Path) -> Checkpoint:
    """Returns the newest checkpoint of `run_dir`; a clear error when there is none or it cannot be read."""
    found = list_checkpoints(run_dir)
    if not found:
        raise ValueError(f"no checkpoint in {run_dir} to resume from (looked in {checkpoint_dir(run_dir)})")
    path = found[-1]
    try:
        state = json.loads((path / "state.json").read_text())
        return Checkpoint(
            state["step"],
            load_file(str(path / "model.safetensors")),
            load_file(str(path / "optimizer.safetensors")),
            state,
            path,
        )
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"checkpoint {path} cannot be read: {err}") from None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        _fsync(p)
    _fsync(folder)
