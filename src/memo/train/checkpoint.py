"""Checkpoints: weights and optimizer state in safetensors, the rest in JSON, written atomically.

A checkpoint is a folder `RUN_DIR/checkpoints/step-NNNNNNN/` holding `state.json` (step, config, solved α,
RNG states) and the tensors, in one of two layouts:

- one process: `model.safetensors` and `optimizer.safetensors` (AdamW moments, fp32 master weights);
- distributed: `model/` and `optimizer/`, written by torch.distributed.checkpoint (DCP) with its Hugging
  Face storage writer, one `shard-RRRRR-model-00001-of-00001.safetensors` per rank holding that rank's
  slices of the sharded tensors, each slice's offset in the file's safetensors metadata.

Tensors carry the same names in both (optimizer state as `<parameter>.exp_avg`, `.exp_avg_sq`, `.step`,
`.master`), so either layout resumes on any number of ranks: DCP reads the slices each rank needs for its
own shards, or whole tensors for one process. It is written into a temporary folder, flushed to disk, and
renamed into place (by rank 0, after every rank has written), so a crash mid-save leaves the previous
checkpoint untouched and no half checkpoint visible. Nothing is loaded through pickle: DCP's default
format keeps its `.metadata` as a pickle, the Hugging Face reader rebuilds it from the safetensors headers.

`state.json` also lists every file of the checkpoint with its size and SHA-256 (`files`). Loading verifies the
newest checkpoint (safetensors headers that describe the file, sizes, checksums; only the first two for checkpoints
saved before checksums) and falls back to the newest intact one with a warning: a file damaged on disk or in a copy
costs the steps since the previous checkpoint, never the run. SHA-256 rather than BLAKE2: CPUs with SHA extensions
(x86 since about 2019, ARMv8) hash it as fast or faster through OpenSSL, and `sha256sum` checks a file by hand.

`export` writes the newest checkpoint's weights as one `model.safetensors` of whole tensors (for inference), or as
a Hugging Face checkpoint folder that transformers loads (`memo.hf.save_hf`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..adapter import save_adapter
from ..config import ModelConfig
from ..files import EXPORT, atomic_output, claim_file, claim_folder, disk_errors, fsync, read_json_object
from ..hf import config_token_ids, save_hf
from ..lora import LoraConfig, merge_adapters
from ..parallel import faults
from .config import TrainConfig, check_inputs, model_config
from .signals import Terminated

PREFIX = "step-"
PARTS = ("model", "optimizer")
CHECKSUM = "sha256"

log = logging.getLogger(__name__)


def _dcp():
    """Returns torch.distributed.checkpoint, imported on first use: a seventh of a second of every command's
    start, needed only by sharded checkpoints and loading."""
    import torch.distributed.checkpoint

    return torch.distributed.checkpoint


@dataclass
class Checkpoint:
    """A checkpoint on disk; its tensors are read when asked for (whole, or into a rank's shards)."""

    step: int
    state: dict
    path: Path

    @property
    def sharded(self) -> bool:
        """Whether a distributed run wrote it (DCP layout) rather than one process."""
        return (self.path / "model").is_dir()

    @cached_property
    def model(self) -> dict[str, torch.Tensor]:
        return self._whole("model")

    @cached_property
    def optimizer(self) -> dict[str, torch.Tensor]:
        return self._whole("optimizer")

    def shapes(self, part: str) -> dict[str, torch.Size]:
        """Returns the shape of every saved tensor by name: of `part` ("model" or "optimizer"), or of both
        for a one-process checkpoint (whose two files share a folder)."""
        try:
            metadata = self._reader(part).read_metadata().state_dict_metadata
        except (OSError, ValueError, RuntimeError) as err:
            raise ValueError(f"checkpoint {self.path} cannot be read: {err}") from None
        return {name: meta.size for name, meta in metadata.items()}

    def load_into(self, part: str, targets: dict[str, torch.Tensor]) -> None:
        """Fills `targets` (plain tensors, or this rank's DTensor shards) with the saved values of their names,
        cast to their dtypes; collective under a process group: every rank reads only the slices it holds."""
        with warnings.catch_warnings():  # one process: DCP notes that it runs without a process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _dcp().load(targets, storage_reader=self._reader(part))

    def _reader(self, part: str):
        return _dcp().HuggingFaceStorageReader(str(self.path / part if self.sharded else self.path))

    def _whole(self, part: str) -> dict[str, torch.Tensor]:
        try:
            if not self.sharded:
                return load_file(str(self.path / f"{part}.safetensors"))
            metadata = self._reader(part).read_metadata().state_dict_metadata
            tensors = {name: torch.empty(m.size, dtype=m.properties.dtype) for name, m in metadata.items()}
            self.load_into(part, tensors)
            return tensors
        except (OSError, ValueError, RuntimeError) as err:
            raise ValueError(f"checkpoint {self.path} cannot be read: {err}") from None


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: Path, step: int, model: dict, optimizer: dict, state: dict, keep: int) -> Path:
    """Writes the checkpoint of `step` atomically and deletes all but the newest `keep`; returns its folder. A
    failed save (a full disk, Ctrl-C, a signal) leaves no partial folder and the previous checkpoint as it was."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}"
    _remove_leftovers(root)
    try:
        tmp.mkdir()
        for part, tensors in zip(PARTS, (model, optimizer)):
            _save_tensors(tensors, tmp / f"{part}.safetensors")
        _write_state(tmp, state, step)
        _publish(tmp, final)
    except OSError as err:
        raise _save_failed(run_dir, final, err) from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once published
    _prune(run_dir, keep)
    return final


def _save_tensors(tensors: dict, path: Path) -> None:
    """Writes `tensors` to `path`; a failed write is an OSError naming it (safetensors' error names no file)."""
    with disk_errors(path, path):
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def _write_state(tmp: Path, state: dict, step: int) -> None:
    """Writes state.json, with the size and checksum of every file written before it, and flushes the folder."""
    files = _manifest(tmp)
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "files": files}, indent=1))
    _fsync_tree(tmp)


def _save_failed(run_dir: Path, final: Path, err: OSError) -> OSError:
    """Returns the one-line error of a save that failed (a full disk, say), naming the file it was writing."""
    found = list_checkpoints(run_dir)
    kept = f"{found[-1].name} is intact" if found else "no earlier checkpoint"
    reason = os.strerror(err.errno) if err.errno else str(err)
    file = f"{Path(os.fsdecode(err.filename)).name}: " if err.filename else ""
    return OSError(f"cannot save checkpoint {final.name} in {final.parent}: {file}{reason} ({kept})")


def _remove_leftovers(root: Path) -> None:
    """Deletes the temporary folders of saves that crashed (one writer per run, so none is in use)."""
    for p in root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def _publish(tmp: Path, final: Path) -> None:
    """Renames the written folder into place; a checkpoint of the same step is moved aside first and deleted
    after, so some complete checkpoint of that step exists at every moment."""
    aside = final.with_name(f".tmp-old-{final.name}")
    if final.exists():
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
    except BaseException:
        if aside.exists():
            os.replace(aside, final)
        raise
    fsync(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _prune(run_dir: Path, keep: int) -> None:
    """Deletes all but the newest `keep` checkpoints, state.json first so a half-deleted one is never listed."""
    for old in list_checkpoints(run_dir)[:-keep]:
        (old / "state.json").unlink(missing_ok=True)
        shutil.rmtree(old, ignore_errors=True)


def save_sharded(run_dir: Path, step: int, model: dict, optimizer: dict, state: dict, keep: int) -> Path:
    """Like `save`, from every rank of the process group at once (collective): `model` and `optimizer` hold
    each rank's DTensor shards (and replicated plain tensors), written by DCP; rank 0 writes `state`."""
    root = checkpoint_dir(run_dir)
    final = root / f"{PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}"  # the same on every rank
    rank0 = dist.get_rank() == 0
    try:
        if rank0:
            root.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(root)
            tmp.mkdir()
        dist.barrier()  # the folder exists before any rank writes into it
        for part, tensors in zip(PARTS, (model, optimizer)):
            writer = _dcp().HuggingFaceStorageWriter(str(tmp / part), save_distributed=True)
            _dcp().save({k: v.detach() for k, v in tensors.items()}, storage_writer=writer)
        if rank0:  # DCP's save ends once every rank's files are written
            _write_state(tmp, state, step)
            _publish(tmp, final)
    except BaseException as err:  # a full disk, a second Ctrl-C: each rank deletes the folder once its writes stopped
        shutil.rmtree(tmp, ignore_errors=True)
        cause = _cause(err)
        if isinstance(cause, OSError):
            if cause is not err and not rank0:  # DCP gave every rank the same failure: rank 0 says it, after its bar
                faults.awaited_failure()
            raise _save_failed(run_dir, final, cause) from err
        if cause is not err:  # a signal that stopped a rank's write, unwrapped: the run ends as that signal
            raise cause from None
        raise
    if rank0:
        _prune(run_dir, keep)
    dist.barrier()  # no rank goes on (or resumes) before the checkpoint is in place
    return final


def _cause(err: BaseException) -> BaseException:
    """Returns what stopped a distributed save: DCP reports what any rank raised while writing as one
    CheckpointException holding every rank's exception (a full disk on rank 1, a second Ctrl-C reaching every rank
    mid-write); the first rank's OSError, Ctrl-C or signal of it, else `err` itself."""
    from torch.distributed.checkpoint.api import CheckpointException  # loaded with DCP, which raised `err`

    if not isinstance(err, CheckpointException):
        return err
    causes = [cause for _, (cause, _) in sorted(err.failures.items())]
    return next((c for c in causes if isinstance(c, (OSError, KeyboardInterrupt, Terminated))), err)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Returns the complete checkpoints of a run, oldest first (temporary folders and anything not named
    step-N, such as a user's copy "step-5-backup", are never listed)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit() and (p / "state.json").exists()
    ]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def load_latest(run_dir: Path) -> Checkpoint:
    """Returns the newest intact checkpoint of `run_dir`, warning (once per process) about newer damaged ones; a
    clear error when there is none, or none intact."""
    found = list_checkpoints(run_dir)
    if not found:
        raise ValueError(f"run {run_dir} has no checkpoint yet (looked in {checkpoint_dir(run_dir)})")
    damaged, fresh = [], False
    for path in reversed(found):
        reason, new = _verdict(path)
        fresh |= new
        if reason is None:
            state = json.loads((path / "state.json").read_text())
            if damaged and fresh:
                log.warning("%s; falling back to %s", _damage_line(damaged), path.name)
            return Checkpoint(state["step"], state, path)
        damaged.append(f"{path.name} ({reason})")
    raise ValueError(f"every checkpoint in {checkpoint_dir(run_dir)} is damaged: {', '.join(damaged)}")


def _damage_line(damaged: list[str]) -> str:
    if len(damaged) == 1:
        return f"checkpoint {damaged[0].replace(' (', ' is damaged (', 1)}"
    return f"checkpoints {', '.join(damaged)} are damaged"


_verdicts: dict[tuple, str | None] = {}  # verifying reads every byte: once per process for files unchanged since


def _verdict(path: Path) -> tuple[str | None, bool]:
    """Returns (why the checkpoint at `path` is damaged, None if intact; whether this is the first look at it)."""
    key = (str(path.resolve()), *((str(p), s.st_size, s.st_mtime_ns) for p, s in _stats(path)))
    if key in _verdicts:
        return _verdicts[key], False
    _verdicts[key] = damage(path)
    return _verdicts[key], True


def _stats(folder: Path) -> list[tuple[Path, os.stat_result]]:
    return sorted((p, p.stat()) for p in folder.rglob("*") if p.is_file())


def damage(path: Path) -> str | None:
    """Returns why the checkpoint at `path` cannot be trusted (`FILE: problem`, the first found), or None when it
    is intact: state.json readable, every file it lists present with its size and checksum, every safetensors
    header readable and describing the file's length. Checkpoints saved before checksums list no files: those
    of their layout are checked by headers and sizes."""
    try:
        state = json.loads((path / "state.json").read_text())
        int(state["step"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"state.json: {err}"
    files = state.get("files") or {name: None for name in _expected_files(path)}
    for name, saved in files.items():
        problem = _file_problem(path / name, saved)
        if problem:
            return f"{name}: {problem}"
    listed = [(name, saved[CHECKSUM]) for name, saved in files.items() if saved and CHECKSUM in saved]
    digests = _digests([path / name for name, _ in listed])
    return next((f"{name}: checksum mismatch" for (name, want), got in zip(listed, digests) if got != want), None)


def _expected_files(path: Path) -> list[str]:
    """Returns the tensor files a checkpoint without a file list holds: its two safetensors files, or every
    safetensors file of its DCP folders."""
    if not (path / "model").is_dir():
        return [f"{part}.safetensors" for part in PARTS]
    return sorted(p.relative_to(path).as_posix() for part in PARTS for p in (path / part).rglob("*.safetensors"))


def _file_problem(path: Path, saved: dict | None) -> str | None:
    """Returns what is wrong with one file's presence, size or safetensors header, or None."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if saved and size != saved["bytes"]:
        return f"{size} bytes, saved as {saved['bytes']}"
    if path.suffix != ".safetensors":
        return None
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 <= length <= size - 8:
            return "header cut off"
        try:
            header = json.loads(f.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "header unreadable"
    if 8 + length + end != size:
        return f"{size} bytes, its header describes {8 + length + end}"
    return None


def _manifest(folder: Path) -> dict[str, dict]:
    """Returns the size and checksum of every file under `folder`, by path relative to it."""
    files = [p for p, _ in _stats(folder)]
    digests = _digests(files)
    return {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, CHECKSUM: d} for p, d in zip(files, digests)}


def _digests(files: list[Path]) -> list[str]:
    """Returns the checksums of `files`, hashed in parallel (hashlib lets go of the GIL for large buffers)."""
    if not files:
        return []
    with ThreadPoolExecutor(min(len(files), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(_digest, files))


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, CHECKSUM).hexdigest()


def export(
    run_dir: Path,
    out: Path | None = None,
    hf: Path | None = None,
    adapter: Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes the weights of the newest checkpoint of `run_dir` (fp32 masters replace bf16 weights) and returns
    where: as whole tensors with memo's names in one safetensors file (default `RUN_DIR/export/model.safetensors`),
    or, given `hf`, as a Hugging Face checkpoint folder there (`memo.hf.save_hf`) with the run's model config,
    trained length and tokenizer; a LoRA run's adapters are merged into its weights for either. Given `adapter`,
    a LoRA run's adapters alone as a PEFT adapter folder (`memo.adapter.save_adapter`). Each is written
    atomically, where memo's ownership rule lets it (`memo.files`; `overwrite` replaces what memo did not write)."""
    if not list_checkpoints(run_dir):
        raise ValueError(f"run {run_dir} has no checkpoint to export yet (looked in {checkpoint_dir(run_dir)})")
    run_config = Path(run_dir) / "config.json"  # enough to check where the export may go, before reading weights
    config = read_json_object(run_config) if run_config.is_file() else {}
    out = _claim_export(Path(run_dir), config, out, hf, adapter, overwrite)
    saved = load_latest(run_dir)
    config = saved.state.get("config", {})
    if hf is not None:  # the export copies the run's tokenizer: the file it trained with, or none
        check_inputs(config, ("tokenizer",), f"run {run_dir}", "restore it: the export copies the run's tokenizer")
    weights = saved.model
    masters = {name[: -len(".master")]: t for name, t in saved.optimizer.items() if name.endswith(".master")}
    weights = {name: masters.get(name, t) for name, t in weights.items()}
    lora = saved_lora(saved.state, run_dir)
    if adapter is not None:
        if lora is None:
            raise ValueError(f"run {run_dir} trained every weight (no `--lora-rank`): it has no adapter; use `--hf`")
        model = saved_model_config(saved.state, run_dir)
        return save_adapter(model, weights, lora, Path(adapter), base_of(config), overwrite)
    if lora is not None:
        weights = merge_adapters(weights, lora.scaling)
    if hf is not None:  # a run from a Hugging Face folder keeps its token ids unless its tokenizer names others
        model = saved_model_config(saved.state, run_dir)
        source = config_token_ids(config.get("model", ""))
        return save_hf(model, weights, Path(hf), config.get("seq_len"), run_tokenizer(config), source, overwrite)
    metadata = {"step": str(saved.step), "model": str(config.get("model", ""))}  # `_exported` knows it by these
    with atomic_output(out) as tmp:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp), metadata=metadata)
        _chmod_as_new(tmp)
    return out


def _claim_export(
    run_dir: Path, config: dict, out: Path | None, hf: Path | None, adapter: Path | None, overwrite: bool
) -> Path | None:
    """Checks that the export may write where it is told (`memo.files.claim_folder`, `claim_file`: never the run,
    its checkpoints or what it reads) and returns the file of a one-file export (None for a folder)."""
    inputs = {"RUN_DIR": run_dir, "the run's `--model`": config.get("model")}
    if hf is not None:
        inputs["the run's tokenizer"] = run_tokenizer(config)
        claim_folder(hf, "--hf", EXPORT, inputs, overwrite)
    elif adapter is not None:
        claim_folder(adapter, "--adapter", EXPORT, inputs, overwrite)
    else:
        default = run_dir / "export" / "model.safetensors"
        out = Path(out) if out is not None else default
        claim_file(out, "--out", inputs, overwrite, ours=out.resolve() == default.resolve() or _exported(out))
        return out
    return None


def _exported(path: Path) -> bool:
    """Returns whether `path` is a safetensors file `export` wrote: its metadata names the step and the model."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (OSError, SafetensorError):
        return False
    return {"step", "model"} <= set(metadata)


def saved_lora(state: dict, run_dir: Path) -> LoraConfig | None:
    """Returns the adapters a checkpoint trained (None: every weight trained)."""
    return TrainConfig.from_dict(state.get("config", {}), origin=f"{run_dir} state.json").lora()


def base_of(config: dict) -> str | None:
    """Returns the checkpoint folder a run started from, as an absolute path (None for a preset or config file)."""
    model = Path(config.get("model", ""))
    return str(model.resolve()) if config.get("model") and model.is_dir() else None


def saved_model_config(state: dict, run_dir: Path) -> ModelConfig:
    """Returns the ModelConfig a checkpoint was trained with: as saved, else (older runs) resolved again from
    its `--model` and context-extension flags."""
    if "model_config" in state:
        return ModelConfig(**state["model_config"])
    return model_config(TrainConfig.from_dict(state.get("config", {}), origin=f"{run_dir} state.json"))


def run_tokenizer(config: dict) -> str | None:
    """Returns the HF tokenizer.json a run trained with: its `--tokenizer`, else the one that tokenized its .bin
    data (named in the data's sidecar JSON); None for the bytes tokenizer."""
    if config.get("tokenizer"):
        return config["tokenizer"]
    data = Path(config.get("data") or "")
    if data.suffix != ".bin" or not data.with_suffix(".json").is_file():
        return None
    name = json.loads(data.with_suffix(".json").read_text()).get("tokenizer")
    return None if name in (None, "bytes") else name


def _chmod_as_new(path: Path) -> None:
    """Gives `path` the mode of a newly created file (0644 under the usual umask 022): safetensors writes 0600."""
    probe = path.with_name(f"{path.name}.mode")
    probe.touch()
    try:
        shutil.copymode(probe, path)
    finally:
        probe.unlink()


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        _fsync_tree(p) if p.is_dir() else fsync(p)
    fsync(folder)
