"""The training configuration: one typed dataclass, settable from a YAML/TOML/JSON file and overridden by flags.

Every field is a `memo train` flag of the same name (underscores become dashes) and a key of the config file;
its help text lives here, next to the field, so `memo train --help` documents every field.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..config import PRESETS
from ..policy import STRATEGIES, ActivationPolicy
from ..units import parse_size

DTYPES = ("float32", "bfloat16")
SCHEDULES = ("cosine", "linear", "constant")


def _f(default, help: str, **kwargs):
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass(frozen=True)
class TrainConfig:
    """What `memo train` runs. The defaults train `tiny` on the generated key-value retrieval task on a CPU."""

    # model and memory
    model: str = _f("tiny", f"preset ({', '.join(PRESETS)}), a model config file, or a Hugging Face checkpoint dir")
    strategy: str = _f("memo", "none (keep all), full (recompute layers), memo (token-wise swap)", choices=STRATEGIES)
    alpha: float | None = _f(0.5, "memo: fraction of tokens offloaded in [0, 1]; 'auto' solves it (§3)")
    host_budget: str | None = _f(
        None,
        "memo: pinned host memory for the offload on this node, e.g. 64G, shared by its ranks (default: 80%% of free)",
    )
    arena: bool = _f(False, "carve each layer's transient tensors from one statically planned arena (§5)")
    # data
    data: str | None = _f(None, "text/JSONL file, folder of them, or pre-tokenised .bin; none: generated retrieval")
    tokenizer: str | None = _f(None, "Hugging Face tokenizer.json (default: bytes, ids 0-255)")
    text_key: str = _f("text", "JSONL field holding each document's text")
    seq_len: int = _f(1024, "tokens per sequence")
    batch_size: int = _f(8, "sequences per optimizer step (split into --grad-accum micro-batches)")
    grad_accum: int = _f(1, "micro-batches per optimizer step (gradient accumulation)")
    # optimisation
    steps: int = _f(500, "optimizer steps")
    lr: float = _f(3e-3, "peak AdamW learning rate")
    min_lr: float = _f(3e-4, "learning rate at the end of the schedule")
    warmup_steps: int = _f(20, "linear warm-up steps from 0 to --lr")
    schedule: str = _f("cosine", "decay after warm-up", choices=SCHEDULES)
    weight_decay: float = _f(0.0, "AdamW weight decay (matrices only)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "max global gradient norm")
    seed: int = _f(0, "seed for weights and data")
    device: str = _f("cpu", "torch device, e.g. cpu or cuda (distributed: cuda:LOCAL_RANK on CUDA machines)")
    dtype: str = _f("float32", "bfloat16: bf16 compute with fp32 master weights and optimizer state", choices=DTYPES)
    # distributed (torchrun: WORLD_SIZE ranks = dp x sp)
    sp: int = _f(1, "sequence-parallel ranks per sequence (Ulysses); data-parallel ranks dp = world size / sp")
    nproc: int = _f(1, "processes on this machine: `memo train` relaunches itself under torchrun (one per GPU)")
    # run directory
    out: str | None = _f(None, "run directory (default: runs/<date-time>)")
    save_every: int = _f(0, "checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = _f(2, "checkpoints kept (oldest deleted)")
    eval_every: int = _f(100, "held-out evaluation every N steps (and at the end)")
    eval_batches: int = _f(4, "held-out batches per evaluation")
    tensorboard: bool = _f(False, "also write TensorBoard events (needs the `tensorboard` package)")

    def __post_init__(self) -> None:
        positive = ("seq_len", "batch_size", "grad_accum", "steps", "keep_checkpoints", "eval_every", "eval_batches")
        positive += ("sp", "nproc")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"`--{_flag(name)}` must be positive, got {getattr(self, name)}")
        for name in ("warmup_steps", "save_every", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"`--{_flag(name)}` must not be negative, got {getattr(self, name)}")
        for name in ("lr", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`--{_flag(name)}` must be positive, got {getattr(self, name)}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"`--min-lr` must be in [0, --lr], got {self.min_lr}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"`--{name}` must be in [0, 1), got {getattr(self, name)}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"`--batch-size` {self.batch_size} is not a multiple of `--grad-accum` {self.grad_accum}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"`--{_flag(f.name)}` must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}"
                )
        if self.seq_len % self.sp:
            raise ValueError(f"`--seq-len` {self.seq_len} is not a multiple of `--sp` {self.sp}")
        if self.arena and self.sp > 1:
            raise ValueError("`--arena` does not support sequence parallelism: use `--sp 1` or leave out `--arena`")
        if self.host_budget is not None:
            parse_size(self.host_budget)
        self.policy()

    def check_world(self, world: int) -> None:
        """Raises ValueError unless `world` ranks split into dp × sp and the batch into dp × grad-accum parts."""
        if world % self.sp:
            hint = ": launch more ranks (`--nproc`, torchrun) or lower `--sp`" if world < self.sp else ""
            raise ValueError(f"`--sp` {self.sp} does not divide the number of ranks ({world}){hint}")
        dp = world // self.sp
        if self.batch_size % (dp * self.grad_accum):
            raise ValueError(
                f"`--batch-size` {self.batch_size} is not a multiple of the data-parallel ranks x `--grad-accum` "
                f"({dp} x {self.grad_accum})"
            )

    def policy(self, alphas: list[float] | None = None, host_budget_bytes: int | None = None) -> ActivationPolicy:
        """Returns the activation policy; `alphas` (per layer, e.g. from a checkpoint) pins a solved α, and
        `host_budget_bytes` (one rank's share of the node) replaces `--host-budget`."""
        alpha = alphas if alphas is not None else self.alpha
        budget = host_budget_bytes or (parse_size(self.host_budget) if self.host_budget else None)
        return ActivationPolicy(
            self.strategy, alpha=alpha if self.strategy == "memo" else None, host_budget_bytes=budget
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, origin: str = "config") -> "TrainConfig":
        """Returns the config of `values` (keys with - or _); unknown keys and wrong types are errors."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        clean = {}
        for key, value in values.items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise ValueError(f"{origin}: unknown field {key!r} (fields: {', '.join(known)})")
            clean[name] = _coerce(name, value, known[name].default, origin)
        return cls(**clean)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _coerce(name: str, value, default, origin: str):
    """Returns `value` as the type of the field: ints for floats are fine, 'auto' is α=None, `seq_len` takes
    sizes such as 128K, and a number written as text (YAML reads 3e-4 as text) is read as a number."""
    if name == "alpha" and value in (None, "auto"):
        return None
    if value is None:
        return None
    expected = type(default) if default is not None else (float if name == "alpha" else str)
    if name == "seq_len" and isinstance(value, str):
        return parse_size(value)
    if expected in (int, float) and isinstance(value, str):
        try:
            value = expected(value)
        except ValueError:
            raise ValueError(f"{origin}: `{name}` must be {expected.__name__}, got {value!r}") from None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is str and isinstance(value, (int, float)) and name == "host_budget":
        return str(value)
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise ValueError(f"{origin}: `{name}` must be {expected.__name__}, got {value!r}")
    return value


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
