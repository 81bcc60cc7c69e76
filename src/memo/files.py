"""Files a user hands memo, and files memo hands back: JSON is read with the file named in every error, and every
output is written atomically (a temporary file beside the target, renamed over it once whole), so a failure or
a full disk never leaves half a file or a temporary one behind.

Outputs have owners. A command writes a folder only when it is new or empty, or memo wrote it for the same purpose
(its `.memo` mark says which: "run", "export"), or the user gave `--overwrite`: then it is replaced whole. It writes
a file only when it is new, memo wrote it, or with `--overwrite`. Never an input of the command, a run's
checkpoints or a run's own files (`claim_folder`, `claim_file`, called before any work starts). A run killed before
its first checkpoint (its trainer's lock file left behind) is not started afresh over: its config and metrics may
say why it died, and it has nothing to resume."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import tomllib
import uuid
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator

import yaml

MARK = ".memo"  # in a folder memo wrote whole: {"purpose": ...}, so that it may write there again
LOCK = ".lock"  # a trainer's lock on its run folder (train/lock.py): {"pid": ..., "host": ...}, gone when it ends
RUN = "run"
EXPORT = "export"


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


def claim_folder(
    path: str | Path, flag: str, purpose: str, inputs: dict | None = None, overwrite: bool | None = False
) -> None:
    """Checks, before any work, that a command may write its `purpose` folder at `path` (given as `flag`): a new or
    empty folder, one memo wrote for the same purpose, or any other with `overwrite` (to be replaced whole; None:
    the command has no `--overwrite`). Never an input (`inputs`: {what: path}, symlinks resolved), a run folder
    for another purpose, a run's checkpoints or a run killed before its first one. ValueError in one line naming
    `flag` and the folder otherwise."""
    real, shown = _target(path, flag)
    if real.exists() and not real.is_dir():
        raise ValueError(f"{shown} is a file: give a folder path")
    _check_free(real, shown, inputs)
    found = folder_purpose(real)
    if found == RUN and purpose != RUN:
        raise ValueError(f"{shown} is a run folder (`memo train` writes it): give another folder")
    if not real.is_dir() or not any(real.iterdir()):
        return
    run = next(_runs_in(real), None) if found != RUN else None
    if run is not None:  # replacing the folder whole would delete it
        raise ValueError(f"{shown} holds run {run}: give another folder")
    if found == RUN and lock_held(real) is False and not _has_checkpoints(real):
        raise ValueError(
            f"{shown} is a `memo train` run killed before its first checkpoint, so there is nothing to `--resume`: "
            "give another folder, or delete this one to start afresh there"
        )
    if found == purpose or overwrite:
        return
    names = sorted(p.name for p in real.iterdir())
    listed = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    also = ", or `--overwrite` to replace it whole" if overwrite is not None else ""
    raise ValueError(f"{shown} holds files memo did not write ({listed}): give a new or empty folder{also}")


def claim_file(
    path: str | Path, flag: str, inputs: dict | None = None, overwrite: bool = False, ours: bool = False
) -> None:
    """Checks, before any work, that a command may write the file `path` (given as `flag`): a new one (missing
    folders are made as it is written), one memo wrote (`ours`: the caller recognised it), or any other with
    `overwrite`. Never an input (`inputs`: {what: path}, symlinks resolved), a file in a run's checkpoints or one
    of a run's own files. ValueError in one line naming `flag` and the file otherwise."""
    real, shown = _target(path, flag)
    if real.is_dir():
        raise ValueError(f"{shown} is a folder: give a file path")
    _check_free(real, shown, inputs)
    if not real.exists() or ours:
        return
    run = next((p for p in real.parents if folder_purpose(p) == RUN), None)
    if run is not None:
        raise ValueError(f"{shown} is a file of run {run}: give another path")
    if not overwrite:
        raise ValueError(f"{shown} exists and memo did not write it: give a new path, or `--overwrite` to replace it")


def _runs_in(folder: Path) -> Iterator[Path]:
    """Yields the run folders anywhere below `folder` (links not followed; a run's own folders not searched)."""
    for parent, children, _ in os.walk(folder):
        runs = [c for c in children if folder_purpose(Path(parent, c)) == RUN]
        children[:] = [c for c in children if c not in runs]
        yield from (Path(parent, c) for c in runs)


def folder_purpose(folder: str | Path) -> str | None:
    """Returns what memo wrote `folder` for (its mark's purpose; "run" for a run from before marks, known by its
    checkpoints or its config and metrics), None when memo did not write it."""
    folder = Path(folder)
    with suppress(OSError, ValueError, KeyError, TypeError):
        return str(json.loads((folder / MARK).read_text())["purpose"])
    before_marks = (folder / "config.json").is_file() and (folder / "metrics.jsonl").is_file()  # a run saving none
    return RUN if before_marks or _trainer_lock(folder) or _has_checkpoints(folder) else None


def _has_checkpoints(folder: Path) -> bool:
    return any((folder / "checkpoints").glob("step-*/state.json"))


def _trainer_lock(folder: Path) -> bool:
    """Returns whether `folder` holds a trainer's lock file, by what it says (a run killed before its mark)."""
    with suppress(OSError, ValueError):
        holder = json.loads((folder / LOCK).read_text())
        return isinstance(holder, dict) and {"pid", "host"} <= holder.keys()
    return False


def lock_held(folder: Path) -> bool | None:
    """Returns whether a trainer holds `folder`'s lock file (True), or one is left with no holder, its trainer killed
    (False: one that ends removes it); None without a lock file. Changes nothing on disk."""
    try:
        file = open(folder / LOCK)
    except OSError:
        return None
    with file:
        try:
            fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released as the file closes
        except BlockingIOError:
            return True
    return False


def mark(folder: str | Path, purpose: str) -> None:
    """Marks `folder` as memo's, written for `purpose` (`claim_folder` lets the same purpose write there again)."""
    write_text(Path(folder) / MARK, json.dumps({"purpose": purpose}) + "\n")


def _target(path: str | Path, flag: str) -> tuple[Path, str]:
    """Returns the real path (symlinks resolved) and how errors name it; an error when a folder above is a file."""
    path = Path(path)
    real = path.resolve()
    _check_above(real, path)
    return real, f"`{flag}` {path}" + (f" (-> {real})" if real != path.absolute() else "")


def _check_above(real: Path, path: Path) -> None:
    """Raises the error of a path that cannot be made: the nearest existing folder above it is a file."""
    if not next(p for p in real.absolute().parents if p.exists()).is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))


def _check_free(real: Path, shown: str, inputs: dict | None) -> None:
    """Raises when `real` is an input, holds one, or lies in a run's checkpoints."""
    for what, given in (inputs or {}).items():
        if given is None or not Path(given).exists():
            continue
        source = Path(given).resolve()
        if source == real:
            raise ValueError(f"{shown} is also {what}, which this command reads: give another path")
        if real in source.parents:
            raise ValueError(f"{shown} holds {what} ({given}), which this command reads: give another path")
    for p in (real, *real.parents):
        if p.name == "checkpoints" and folder_purpose(p.parent) == RUN:
            raise ValueError(f"{shown} is inside the checkpoints of run {p.parent}: give a path outside it")


@contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path beside `path` (same suffix, so writers that go by it still do) that replaces
    `path` when the block ends without error; removed otherwise (Ctrl-C and signals too), with the folders
    made for it. A failed write is an OSError naming `path`."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder: give a file path")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    with _parents_of(path), disk_errors(path, tmp):
        try:
            yield tmp
            fsync(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


@contextmanager
def atomic_folder(path: str | Path, purpose: str = EXPORT, overwrite: bool = False) -> Iterator[Path]:
    """Yields a new temporary folder beside `path` that, marked as memo's `purpose` folder, becomes `path` when
    the block ends without error: an existing folder (new, empty, memo's for `purpose`, or any with `overwrite`:
    `claim_folder`) is replaced whole, never mixed with the new files. It is removed otherwise (Ctrl-C and
    signals too), with the folders made for it. Modes are those of new files (not tempfile's 0700); symlinks are
    followed (the folder a link names is replaced, the link kept)."""
    claim_folder(path, "folder", purpose, overwrite=overwrite)
    path = Path(path).resolve()
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    with _parents_of(path), disk_errors(path, tmp):
        tmp.mkdir()
        try:
            yield tmp
            mark(tmp, purpose)
            _replace_folder(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _replace_folder(new: Path, path: Path) -> None:
    """Renames folder `new` to `path`; an existing `path` is moved aside first (back if the rename fails) and
    deleted after."""
    if not path.exists():
        new.rename(path)
        return
    old = path.with_name(f".{path.name}.{uuid.uuid4().hex}.old")
    path.rename(old)
    try:
        new.rename(path)
    except BaseException:
        old.rename(path)
        raise
    try:
        shutil.rmtree(old, ignore_errors=True)
    finally:  # a signal in the middle: the new folder is in place, the old one still goes
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _parents_of(path: Path) -> Iterator[None]:
    """Makes the missing folders above `path`; removes them again when the block fails."""
    _check_above(path, path)
    missing = [p for p in path.absolute().parents if not p.exists()]  # deepest first
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for folder in missing:
            with suppress(OSError):
                folder.rmdir()
        raise


@contextmanager
def disk_errors(path: str | Path, tmp: str | Path) -> Iterator[None]:
    """Re-raises a failed write into `tmp` (a temporary file or folder; a full disk, say) as an OSError naming
    `path`, what `tmp` was to become. Safetensors gives the OS error in its message only ("os error 28")."""
    try:
        yield
    except Exception as err:
        code = _write_errno(err, Path(tmp))
        if not code:
            raise
        raise OSError(code, os.strerror(code), str(path)) from err


def _write_errno(err: Exception, tmp: Path) -> int | None:
    """Returns the OS error number of a failed write into `tmp`, None for any other failure (reading an input)."""
    if isinstance(err, OSError):
        name = Path(os.fsdecode(err.filename)) if err.filename is not None else tmp
        return err.errno if name == tmp or tmp in name.parents else None
    found = re.search(r"\(os error (\d+)\)", str(err))
    return int(found.group(1)) if found else None


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


def read_config_file(path: str | Path) -> dict:
    """Returns the mapping in a YAML (.yaml/.yml), TOML (.toml) or JSON (.json) config file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"cannot read config {path}: {err.strerror}") from None
    try:
        if path.suffix == ".toml":
            values = tomllib.loads(text)
        elif path.suffix == ".json":
            values = json.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            values = yaml.safe_load(text)
        else:
            raise ValueError(f"config {path}: use a .yaml, .yml, .toml or .json file")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"config {path} is not valid: {' '.join(str(err).split())}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config {path}: expected a mapping of field: value")
    return values
