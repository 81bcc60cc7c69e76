"""What a run trains and an estimate prices: one typed record, read by the trainer and the cost model alike.

A `Job` is a resolved model (a preset, a file or a Hugging Face folder, RoPE flags applied), the sequences it
trains on and how they split over GPUs, the dtype, where activations live (`ActivationPolicy`), what trains
(every weight, or LoRA's adapters), where the model states live, packed documents, the attention kernel and the
node's host memory. It validates itself once, with the user's flag names; `memo train` builds it from its flags
(`TrainConfig.job`), `memo estimate` from its own (`EstimateRequest.job`), and `Job.of_model` from a live model.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention import CHOICES
from .config import PRESETS, ModelConfig, check_int, model_config_from
from .device import DTYPES
from .documents import DocumentLengths
from .files import read_config_file, read_json_object
from .lora import LoraConfig, check_targets
from .policy import ActivationPolicy

MODEL_HELP = f"a preset ({', '.join(PRESETS)}), a model config file (.yaml/.toml/.json) or a Hugging Face folder"
MAX_GPUS = 1 << 20  # ten times the largest published training clusters (~100K GPUs); layouts search its divisors


@dataclass(frozen=True, kw_only=True)
class Job:
    """One training job: `micro_batch` sequences of `seq` tokens per sequence-parallel group of `sp` GPUs (None:
    the estimator searches the degree) out of `gpus`, in `dtype`, activations kept as `policy` says."""

    model: ModelConfig
    seq: int
    micro_batch: int = 1
    grad_accum: int = 1  # micro-batches per optimizer step: their gradients are summed in fp32 masters
    gpus: int = 1
    sp: int | None = None
    dtype: str = "bfloat16"
    policy: ActivationPolicy = ActivationPolicy("memo")
    lora: LoraConfig | None = None  # adapters on a frozen base; None: every weight trains
    offload_states: bool = False  # weights, gradients and AdamW state in pinned host memory (FSDP2's CPU offload)
    documents: DocumentLengths | None = None  # packed documents attending only to themselves; None: whole sequences
    attention: str = "auto"
    host_memory: int | None = None  # each node's host memory in bytes (None: the GPU's spec says)
    arena: bool = False  # device memory served by memo's planned allocator, not PyTorch's caching allocator

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise ValueError(f"a Job's model is a ModelConfig, got {type(self.model).__name__}")
        if self.micro_batch < 1:
            raise ValueError(f"the micro-batch must be at least one sequence, got {self.micro_batch}")
        check_int("--grad-accum", self.grad_accum)
        if self.host_memory is not None and self.host_memory <= 0:
            raise ValueError(f"`--host-memory` must be positive, got {self.host_memory} bytes")
        if self.attention not in CHOICES:
            raise ValueError(f"`--attention` must be one of {', '.join(CHOICES)}, got {self.attention!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"`--dtype` must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_int("--gpus", self.gpus, most=MAX_GPUS)
        if self.sp is not None and (check_int("--sp", self.sp) > self.gpus or self.gpus % self.sp):
            raise ValueError(f"`--sp` ({self.sp}) must divide `--gpus` ({self.gpus})")
        if check_int("--seq", self.seq) % (self.sp or 1):
            raise ValueError(f"`--seq` ({self.seq}) must be a positive multiple of `--sp` ({self.sp})")
        width = min(self.model.hidden_size, self.model.ffn_hidden_size)
        if self.lora and self.lora.rank > width:
            raise ValueError(
                f"`--lora-rank` ({self.lora.rank}) must be at most {width}, {self.model.name}'s narrowest projection"
            )
        if self.lora:
            check_targets(self.lora, self.model)

    @classmethod
    def of_model(cls, model: torch.nn.Module, seq: int, lora: LoraConfig | None = None) -> "Job":
        """Returns the job of a live memo model (no flags, no folder) training one sequence of `seq` tokens: its
        config, activation policy and dtype; `lora` when adapters were applied to it (`lora.apply_lora`). Other
        fields (GPUs, micro-batch) by `dataclasses.replace`."""
        held = next(model.parameters()).dtype
        names = [name for name, d in DTYPES.items() if d == held]
        if not names:
            raise ValueError(f"a Job trains in {', '.join(DTYPES)}, not the model's {held}")
        return cls(model=model.config, seq=seq, policy=model.policy, dtype=names[0], lora=lora)

    def at(self, seq: int) -> "Job":
        """Returns the same job at another sequence length (a length search, a sweep)."""
        return dataclasses.replace(self, seq=seq)

    def tokens(self, sp: int) -> int:
        """Returns the tokens one GPU holds when `sp` GPUs share each sequence: its rows of the micro-batch."""
        return self.micro_batch * self.seq // sp

    @functools.cached_property
    def attended(self) -> float:
        """Returns the tokens a token attends to: the sequence length, or packed documents' E[Σ d_i²] / s, less
        what sliding windows leave out (`ModelConfig.attended`)."""
        return self.model.attended(self.seq, self.documents.attended(self.seq) if self.documents else self.seq)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def states(self) -> str:
        """Returns what trains and where its states live, as the estimate's table says it."""
        what = f"LoRA r={self.lora.rank} on {','.join(self.lora.targets)}" if self.lora else "full fine-tuning"
        return what + (", states in host memory" if self.offload_states else "")

    @property
    def full_states(self) -> bool:
        """Returns whether every weight trains with its states on the GPUs (what every system supports)."""
        return self.lora is None and not self.offload_states


def named_model(model: str) -> ModelConfig:
    """Returns the ModelConfig `--model` names: a preset, a ModelConfig file or a Hugging Face checkpoint folder."""
    from .hf import CONFIG_NAME, config_from_hf  # the HF reader is only needed for folders

    path = Path(model)
    if model in PRESETS:
        return ModelConfig.preset(model)
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise ValueError(f"`--model` folder {model!r} has no {CONFIG_NAME} (a Hugging Face checkpoint folder)")
        return config_from_hf(read_json_object(path / CONFIG_NAME), name=path.name, source=path / CONFIG_NAME)
    if path.is_file():
        return model_config_from(read_config_file(path), str(path))
    raise ValueError(f"`--model` {model!r} is neither a preset ({', '.join(PRESETS)}) nor a file or folder")
