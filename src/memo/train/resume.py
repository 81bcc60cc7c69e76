"""Starting a `memo train` run, or resuming one: which of a run's settings may change when it resumes.

A checkpoint records the run's config. Its fields are of two kinds. **What trains** (`TRAINS`: the model and its
context extension, the adapters, the data and how it is packed, the batch, the optimizer and its schedule, the
seed) decides the gradients and the updates: a resume that changes one would silently train something else from
then on, so it is refused in one line naming the flag (`--steps` alone may grow: the run goes on). **How it
runs** (`RUNS`: the memory strategy, plan and tiles, offloaded states, sequence parallelism, the attention
kernel, the device and dtype (fp32 master weights either way), evaluation and checkpointing) leaves the
gradients as they are up to rounding, and is how a run moves to another machine: it may change, and the resume
says what changed. Every field is one or the other (tests/test_resume.py).
"""

from __future__ import annotations

import logging
from pathlib import Path

from .. import parallel
from ..config import PRESETS, ModelConfig
from ..files import read_config_file
from ..job import named_model
from ..policy import ActivationPolicy
from . import checkpoint
from .config import (
    BEFORE_PACKING,
    INPUTS,
    LAUNCH,
    TrainConfig,
    check_inputs,
    check_same_input,
    check_same_model,
    check_same_packing,
    check_token_files,
    flag_name,
    input_fingerprint,
)
from .lock import check_free

log = logging.getLogger(__name__)

LORA = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")  # compared as the adapters they make
TRAINS = ("model", "rope_theta", "rope_scaling", "rope_factor", "original_max_positions") + LORA
TRAINS += ("data", "tokenizer", "text_field", "long_conversations")
TRAINS += ("pack_documents", "document_separator", "max_documents_per_sequence")
TRAINS += ("eval_split", "seq_len", "batch_size", "grad_accum", "seed")
TRAINS += ("lr", "min_lr", "warmup_steps", "schedule", "weight_decay", "beta1", "beta2", "grad_clip")
GROWS = ("steps",)  # what trains, but may grow: the run goes on (a cosine or linear schedule is stretched)
RUNS = ("strategy", "alpha", "plan", "tile_tokens", "attention", "host_budget", "arena", "offload_states", "sp")
RUNS += ("dtype", "device", "nproc", "nnodes", "node_rank", "master_addr", "master_port", "out", "skip_nonfinite")
RUNS += ("save_every", "save_final", "keep_checkpoints", "eval_every", "eval_batches", "eval_data", "eval_tasks")
RUNS += ("tensorboard", "json")
CHECKED = ("model", "data", "tokenizer", "eval_data")  # files: compared by what they hold, not by their path


def start_config(flags: dict, config: str | None, resume: str | None) -> tuple[TrainConfig, bool]:
    """Returns the config a `memo train` start runs and whether it resumes: `--resume RUN`'s saved config with the
    `flags` given, else `--config FILE`'s fields with the flags over them."""
    if resume:
        if config:
            raise ValueError("`--resume` takes the run's own config; give changes as flags, not `--config`")
        return resume_config(resume, flags), True
    values = {**(read_config_file(config) if config else {}), **flags}
    cfg = TrainConfig.from_dict(values, config or "flags")
    check_given(values, cfg)
    return cfg, False


def check_given(given: dict, cfg: TrainConfig) -> None:
    """Raises ValueError naming the flag when one of `given` (flags and config-file fields, by name) cannot take
    effect in `cfg`: it would be dropped without a word. (Flags whose default is "not given" are checked by
    their own validators: `--plan`, `--host-budget`, LoRA's.)"""
    names = {str(key).replace("-", "_") for key in given}
    if "alpha" in names and cfg.strategy != "memo":
        ActivationPolicy(cfg.strategy, alpha=cfg.alpha)  # raises the policy's own error
    if "host_budget" in names and cfg.strategy != "memo" and not cfg.offload_states:
        raise ValueError(
            "`--host-budget` bounds the host memory of memo's offload and of `--offload-states`: give one of them"
        )
    if "max_documents_per_sequence" in names and cfg.packing() != "mask":
        raise ValueError(
            "`--max-documents-per-sequence` bounds the documents that mask packing keeps apart: it applies only "
            "with `--pack-documents mask`"
        )


def resume_config(run_dir: str | Path, overrides: dict) -> TrainConfig:
    """Returns the config saved in `run_dir` with `overrides` (flags given with --resume) applied; an error when
    one of them changes what the run trains (`TRAINS`), when its `--steps` is behind the checkpoint (equal is a
    finished run, which resumes to nothing), or when a file it recorded (at an absolute path) and is not given
    again changed (a `--model` folder that is gone is no error: the checkpoint holds the model). Says what changes
    of how it runs (`RUNS`)."""
    if parallel.rank() == 0:  # rank 0 alone locks, so alone probes
        check_free(Path(run_dir))  # a run still in progress is the error, not its missing checkpoint
    saved = checkpoint.load_latest(Path(run_dir))
    recorded = recorded_fields(saved.state["config"])
    run = f"run {run_dir}"
    unchecked = set(overrides) | ({"model"} if _base_gone(recorded) else set())
    check_inputs(recorded, [name for name in INPUTS if name not in unchecked], run)
    overrides = check_same_packing(overrides, recorded, run)
    check_token_files(overrides, recorded)  # a token file of another tokenizer: the more telling refusal
    for name in ("tokenizer", "data"):
        if name in overrides:
            check_same_input(name, overrides[name], recorded, run)
    if "model" in overrides:
        check_same_model(overrides["model"], checkpoint.saved_model_config(saved.state, Path(run_dir)), run)
    kept = {k: v for k, v in recorded.items() if k not in LAUNCH}  # a 2-node run resumes on one
    try:
        cfg = TrainConfig.from_dict({**_unset_by(overrides, kept), **overrides, "out": str(run_dir)}, f"{run_dir}")
    except ValueError:  # a flag that would change what trains is the error to name, not its consequence
        check_same_values(overrides, kept, run)
        raise
    check_given(overrides, cfg)
    was = TrainConfig.from_dict({**kept, "out": str(run_dir)}, f"{run_dir}")
    check_same_training(was, cfg, run)
    if cfg.steps < saved.step:  # a target behind the checkpoint: most likely meant as steps to add
        raise ValueError(
            f"`--steps {cfg.steps}` is not past the checkpoint's step {saved.step}: nothing to train; "
            "give a larger `--steps`"
        )
    for line in run_changes(was, cfg, run):
        log.warning("%s", line)
    return cfg


def recorded_fields(config: dict) -> dict:
    """Returns a run's saved config as a resume reads it: packing fields of runs saved before them
    (`BEFORE_PACKING`), and the defaults that runs saved before LoRA's flags could be left unset dropped when no
    adapters trained (they could not take effect, and given again now they would be refused)."""
    values = {**BEFORE_PACKING, **{str(k).replace("-", "_"): v for k, v in config.items()}}
    if not values.get("lora_rank"):
        values = {k: v for k, v in values.items() if k not in LORA[1:]}
    return values


def _unset_by(overrides: dict, recorded: dict) -> dict:
    """Returns `recorded` less the fields that `overrides` leave without effect, so that the flag given is the one
    a refusal names: LoRA's settings when `--lora-rank 0` drops the adapters, memo's plan under another
    `--strategy`."""
    dropped = set()
    if overrides.get("lora_rank") == 0:
        dropped |= set(LORA[1:])
    if overrides.get("strategy", "memo") != "memo":
        dropped.add("plan")
    return {k: v for k, v in recorded.items() if k not in dropped}


def check_same_training(was: TrainConfig, now: TrainConfig, run: str) -> None:
    """Raises ValueError, one line naming the flag, when `now` trains something other than `was` (`TRAINS`,
    files by content, the adapters as they are built)."""
    if was.lora() != now.lora():
        name = next(n for n in LORA if getattr(was, n) != getattr(now, n))
        raise ValueError(
            f"`--{flag_name(name)} {_shown(getattr(now, name))}` changes the adapters {run} trains "
            f"({_adapters(was)} -> {_adapters(now)}): resume without it, or start a new run from its export "
            "(`memo export`)"
        )
    for name in TRAINS:
        before, after = getattr(was, name), getattr(now, name)
        if name in LORA or before == after or (name in CHECKED and None not in (before, after)):
            continue  # files given again are compared by content (`check_same_input`, `check_same_model`)
        raise _changes(name, after, before, run)


def check_same_values(overrides: dict, recorded: dict, run: str) -> None:
    """Raises `check_same_training`'s error for the first flag of `overrides` that differs from the run's
    `recorded` value of a setting of what trains (before they are checked together: `--lr` below the run's
    `--min-lr` is a change of the learning rate, not a bad minimum)."""
    for name, value in overrides.items():
        if name in TRAINS and name not in LORA + CHECKED and not _same(value, recorded.get(name)):
            raise _changes(name, value, recorded.get(name), run)


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


def _changes(name: str, value, was, run: str) -> ValueError:
    before = "the generated task" if name == "data" and was is None else _shown(was)
    return ValueError(
        f"`--{flag_name(name)} {_shown(value)}` changes what {run} trains ({before}): resume without it, or start a "
        "new run"
    )


def run_changes(was: TrainConfig, now: TrainConfig, run: str) -> list[str]:
    """Returns a line per setting of how the run runs (`RUNS`) or of its length (`GROWS`) that the resume
    changes."""
    lines = []
    for name in RUNS + GROWS:
        if name in ("out",) + LAUNCH or getattr(was, name) == getattr(now, name):
            continue
        what = "the schedule is stretched to it" if name == "steps" else "how it runs, not what it trains"
        given, before = _shown(getattr(now, name)), _shown(getattr(was, name))
        lines.append(f"resuming {run} with `--{flag_name(name)} {given}` (was {before}: {what})")
    return lines


def resumed_base(run_dir: str | Path, cfg: TrainConfig) -> ModelConfig:
    """Returns the model a resumed run trains: its `--model` read again, or, when that folder is gone, as its
    checkpoint recorded it (the checkpoint holds every weight, frozen ones included)."""
    if not _base_gone({"model": cfg.model}):
        return named_model(cfg.model)
    saved = checkpoint.load_latest(Path(run_dir))
    log.warning("`--model` %s is gone: resuming with the model its checkpoint recorded", cfg.model)
    return checkpoint.saved_model_config(saved.state, Path(run_dir))


def _base_gone(config: dict) -> bool:
    """Returns whether a run's `--model` named a folder or file that is no longer there (a preset never is)."""
    model = config.get("model")
    return bool(model) and model not in PRESETS and input_fingerprint("model", model) is None


def _adapters(cfg: TrainConfig) -> str:
    lora = cfg.lora()
    if lora is None:
        return "none: every weight trains"
    return f"r={lora.rank} alpha={lora.alpha:g} on {','.join(lora.targets)}, dropout {lora.dropout:g}"


def _shown(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return "not given" if value is None else str(value)
