"""The optimizer's defaults by what a run starts from: memo's own when it trains from scratch, the ones fine-tuning
recipes publish when `--model` is a Hugging Face checkpoint whose weights it loads, and LoRA's on a checkpoint.

A field that `TrainConfig` leaves None (`--lr`, `--min-lr`, `--warmup-steps`, `--beta2`) means "the default for
this run". `with_defaults` sets it once, when a run starts, and the run saves the values it set: a resume reads
them back and never derives them again (its base folder may be gone, and defaults may change between versions).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class OptimizerDefaults:
    """The settings a run gets for the optimizer fields it leaves out."""

    lr: float
    warmup_steps: int
    beta2: float
    starts_from: str  # as errors name it


# memo's generated retrieval task on `tiny`, from random weights (benchmarks/default_run.py trains with these)
SCRATCH = OptimizerDefaults(lr=3e-3, warmup_steps=20, beta2=0.95, starts_from="a run from scratch")
# full fine-tuning: lr is TRL's `SFTConfig.learning_rate` default (huggingface/trl, trl/trainer/sft_config.py:
# "learning_rate: Defaults to 2e-5 instead of 5e-5"); warm-up and beta2 are transformers' `TrainingArguments`
# defaults (warmup_steps 0, adam_beta2 0.999; transformers 5.25.0, transformers/training_args.py), which
# SFTConfig keeps. Weight decay 0, beta1 0.9 and a gradient clip of 1.0 are already theirs.
FINE_TUNING = OptimizerDefaults(lr=2e-5, warmup_steps=0, beta2=0.999, starts_from="fine-tuning a checkpoint")
# LoRA on a checkpoint: 10x the full fine-tuning rate, TRL's recommended SFT rate with LoRA (huggingface/trl,
# docs/source/peft_integration.md, "Learning Rate Considerations": 2.0e-5 full, 2.0e-4 with LoRA;
# https://huggingface.co/docs/trl/main/en/peft_integration)
LORA = dataclasses.replace(FINE_TUNING, lr=2e-4, starts_from="LoRA on a checkpoint")
# the schedule ends at a tenth of the peak, as Llama 2 (Touvron et al. 2023, §2.2, "decay final learning rate
# down to 10% of the peak") and Chinchilla (Hoffmann et al. 2022) do, and as memo's 3e-3 -> 3e-4 always did;
# relative, so that `--lr 1e-5` alone is a valid schedule (transformers' `cosine_with_min_lr` takes the same ratio)
MIN_LR_DIVISOR = 10


def loads_weights(model: str) -> bool:
    """Returns whether `--model` names a Hugging Face checkpoint folder whose weights the run loads (a preset or a
    ModelConfig file starts from random weights), as `train.loop.build_model` decides."""
    return Path(model).is_dir()


def defaults_for(model: str, lora_rank: int) -> OptimizerDefaults:
    """Returns the optimizer defaults of a run on `--model` with `--lora-rank` (0: every weight trains)."""
    if not loads_weights(model):
        return SCRATCH
    return LORA if lora_rank > 0 else FINE_TUNING


def with_defaults(cfg: TrainConfig) -> TrainConfig:
    """Returns `cfg` with each optimizer field it left None set (`defaults_for`; `--min-lr`: `--lr` /
    MIN_LR_DIVISOR), to be saved with the run; `cfg` itself when it gave them all."""
    chosen = defaults_for(cfg.model, cfg.lora_rank)
    values = {name: getattr(chosen, name) for name in ("lr", "warmup_steps", "beta2") if getattr(cfg, name) is None}
    if cfg.min_lr is None:
        values["min_lr"] = float(f"{values.get('lr', cfg.lr) / MIN_LR_DIVISOR:.12g}")  # 3e-4, not 3.0000000000000003e-4
    elif cfg.min_lr > values.get("lr", cfg.lr):
        raise ValueError(
            f"`--min-lr` {cfg.min_lr:g} is above the default `--lr` {chosen.lr:g} of {chosen.starts_from}: give "
            "`--lr` too, or a smaller `--min-lr`"
        )
    return dataclasses.replace(cfg, **values) if values else cfg
