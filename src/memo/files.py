"""Files a user hands memo, and files memo hands back: JSON is read with the file named in every error, and every
output is written atomically (a temporary file beside the target, renamed over it once whole), so a failure or
a full disk never leaves half a file or a temporary one behind."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def read_json(path: str | Path) -> Any:
    """Returns the JSON value in `path`; ValueError naming the file when it cannot be read or parsed."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def read_json_object(path: str | Path) -> dict:
    """Returns the JSON object in `path` (a list or a number where fields are expected is an error)."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object of fields, got a {type(value).__name__}")
    return value


@contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path beside `path` (same suffix, so writers that go by it still do) that replaces
    `path` when the block ends without error, and is removed otherwise."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder: give a file path")
    if not path.parent.is_dir():
        raise ValueError(f"cannot write {path}: folder {path.parent} does not exist")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        yield tmp
        fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Yields a new temporary folder beside `path` whose files, when the block ends without error, appear in
    `path` whole: a new `path` is the renamed folder, an existing one gets each file replaced whole. The folder
    is removed otherwise. Modes are those of new files (not tempfile's 0700)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file: give a folder path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    tmp.mkdir()
    try:
        yield tmp
        if not path.exists():
            tmp.rename(path)
            return
        for file in sorted(tmp.iterdir()):  # each file whole; for an instant new files meet old ones
            os.replace(file, path / file.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fsync(path: str | Path) -> None:
    """Forces a file's (or a folder's: its entries') contents to disk, so a rename after it publishes whole data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str | Path, text: str) -> None:
    """Writes `text` to `path` atomically."""
    with atomic_output(path) as tmp:
        tmp.write_text(text)
