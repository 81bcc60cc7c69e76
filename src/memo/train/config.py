"""The training configuration: one typed dataclass, settable from a YAML/TOML/JSON file and overridden by flags.

Every field is a `memo train` flag of the same name (underscores become dashes) and a key of the config file;
its help text lives here, next to the field, so `memo train --help` documents every field.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..attention import CHOICES as ATTENTION_CHOICES
from ..config import PRESETS, ModelConfig, RopeScaling, check_int
from ..flags import flag
from ..job import Job, named_model
from ..lora import ALL_TARGETS, LoraConfig, lora_of_flags, targets_value
from ..policy import DEFAULT_TILE_TOKENS, STRATEGIES, ActivationPolicy
from ..ruler_eval import TRAIN_SUBSET, eval_task_names
from ..token_files import TOKEN_SUFFIXES, check_tokenizer, token_file_tokenizer
from ..units import parse_size
from .data import (
    LONG_CONVERSATIONS,
    MAX_DOCUMENTS,
    PACKINGS,
    SEPARATORS,
    TEXT_SUFFIXES,
    HFTokenizer,
    holds_conversations,
    separator_kind,
    tokenizer_identity,
)
from .defaults import FINE_TUNING, LORA, MIN_LR_DIVISOR, SCRATCH, with_defaults
from .optim import OptimizerConfig

SCHEDULES = ("cosine", "linear", "constant")
ROPE_SCALINGS = ("linear", "yarn", "llama3", "dynamic")
RENAMED = {"text_key": "text_field"}  # old field names, so that runs saved before a rename still resume
PACKING = ("pack_documents", "document_separator", "max_documents_per_sequence")  # shape the batches: kept on resume
# how runs saved before these fields packed (concat: the guard, at its default, never applies)
BEFORE_PACKING = {"pack_documents": "concat", "document_separator": "none", "max_documents_per_sequence": MAX_DOCUMENTS}
LAUNCH = ("nnodes", "node_rank", "master_addr", "master_port")  # where a run ran, not what: not kept on resume
PATHS = ("model", "data", "eval_data", "tokenizer", "out")  # fields that name files: stored absolute
INPUTS = ("model", "data", "eval_data", "tokenizer")  # files a run reads, fingerprinted in its config
TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")  # where transformers reads a chat template
SMALL_FILE = 16 << 20  # bytes up to which a file's fingerprint hashes all of it (a tokenizer.json, a config)
END_BYTES = 1 << 20  # bytes hashed at each end of a larger file: reads two MiB of a corpus of any size
SHAPE = ("arch", "n_layers", "hidden_size", "n_heads", "n_kv_heads", "kv_channels", "ffn_hidden_size", "vocab_size")
SHAPE += ("qkv_bias", "out_bias", "mlp_bias", "qk_norm", "tie_embeddings")  # fields that decide the weights' shapes
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """What `memo train` runs. The defaults train `tiny` on the generated key-value retrieval task on a CPU."""

    # model and memory
    model: str = flag("tiny", f"preset ({', '.join(PRESETS)}), a model config file, or a Hugging Face checkpoint dir")
    strategy: str = flag("memo", "none (keep all), full (recompute layers), memo (token-wise swap)", choices=STRATEGIES)
    alpha: float | tuple[float, ...] | None = flag(
        0.5, "memo: fraction of tokens offloaded in [0, 1], or one per layer (0.2,0.5,...); 'auto' solves it (§3)"
    )
    plan: tuple[str, ...] | None = flag(
        None,
        "memo: where each layer's tensors live, one mode per layer: keep, memo or checkpoint (e.g. "
        "checkpoint,memo,memo,keep); default every layer memo, or solved with the host and device budgets when "
        "--alpha is auto",
    )
    tile_tokens: int | None = flag(
        None, "tokens per tile of the token-local work (default 8K, or the whole sequence shard when shorter)", kind=int
    )
    attention: str = flag(
        "auto",
        "attention kernel: flash (PyTorch's, FlashAttention-2), cudnn, fa4 (the flash-attn-4 package), efficient; "
        "auto: the fastest that runs here (Hopper and later: fa4, cudnn, flash)",
        choices=ATTENTION_CHOICES,
    )
    host_budget: str | None = flag(
        None,
        "memo: pinned host memory for the offload on this node, e.g. 64G, shared by its ranks (default: 75%% of free)",
    )
    arena: bool = flag(
        False, "serve each step's allocations from one arena planned from a recorded step (§5; one CPU process)"
    )
    offload_states: bool = flag(
        False,
        "keep parameters, gradients and AdamW state in pinned host memory and step the optimizer on the CPU "
        "(FSDP2's CPU offload, one rank or many); the device holds a layer's weights only while it runs",
    )
    # LoRA: a frozen base and trainable low-rank adapters (memo.lora)
    lora_rank: int = flag(0, "LoRA rank r of the adapters (0: full fine-tuning, every parameter trains)")
    lora_alpha: float | None = flag(
        None, "LoRA alpha: the adapters' update is scaled by alpha / r (PEFT's lora_alpha) (default: 16)", kind=float
    )
    lora_dropout: float | None = flag(
        None,
        "LoRA dropout on the adapters' input; its mask is a function of step, token and feature, so the "
        "token-wise recompute drops what the forward dropped (default: 0)",
        kind=float,
    )
    lora_targets: tuple[str, ...] | None = flag(
        None, f"projections that get adapters, some of {','.join(ALL_TARGETS)} (default: all the model has)"
    )
    # context extension, applied on top of --model (its own RoPE is kept unless these are given)
    rope_theta: float | None = flag(
        None, "RoPE base frequency replacing the model's (raise it to extend context)", kind=float
    )
    rope_scaling: str | None = flag(None, "stretch RoPE for a longer context", choices=ROPE_SCALINGS)
    rope_factor: float | None = flag(None, "--rope-scaling factor: new context length / original (e.g. 4)", kind=float)
    original_max_positions: int | None = flag(
        None,
        "length the model was pretrained at, for yarn/llama3 (default: the original length of the model's own "
        "yarn/llama3 scaling, which the new one replaces, else its max_position_embeddings)",
        kind=int,
    )
    # data
    data: str | None = flag(
        None, ".txt/.jsonl/.parquet file, folder of them, or pre-tokenised .bin/.npy; none: generated retrieval"
    )
    tokenizer: str | None = flag(None, "Hugging Face tokenizer.json (default: bytes, ids 0-255)")
    text_field: str = flag(
        "text",
        "JSONL field / Parquet column holding each document's text; where it is missing, `messages` holds "
        "conversations, rendered with the tokenizer's chat template and trained on the assistant's tokens only",
    )
    long_conversations: str = flag(
        "refuse",
        "conversations (`messages` --data) longer than --seq-len: refuse (an error naming the row) or truncate "
        "(keep the first --seq-len tokens; a warning counts them)",
        choices=LONG_CONVERSATIONS,
    )
    pack_documents: str | None = flag(
        None,
        "how documents share a sequence: mask (each attends only to itself; RoPE positions restart at its first "
        "token) or concat (GPT-style: attention and positions run across documents) (default: mask with --data; "
        "no effect on the generated task, one document per sequence)",
        choices=PACKINGS,
    )
    document_separator: str = flag(
        "auto",
        "special tokens around each document of text --data: bos (prepended: the BOS the tokenizer's post-processor "
        "adds, Llama), eos (appended: its end-of-text token, GPT-2, Qwen, Mistral) or none; auto: bos if the "
        "tokenizer adds one, else eos if it has one, else none (bytes: none). A token file keeps the separator it "
        "was written with, which must match",
        choices=SEPARATORS,
    )
    max_documents_per_sequence: int = flag(
        MAX_DOCUMENTS,
        "mask packing: documents kept apart in one sequence; later ones join the last kept one (attending to it as "
        "with concat, no token dropped), bounding the attention calls per sequence",
    )
    seq_len: int = flag(1024, "tokens per sequence")
    batch_size: int = flag(8, "sequences per optimizer step (split into --grad-accum micro-batches)")
    grad_accum: int = flag(1, "micro-batches per optimizer step (gradient accumulation)")
    # optimisation
    steps: int = flag(500, "optimizer steps")
    lr: float | None = flag(
        None,
        f"peak AdamW learning rate (default: {SCRATCH.lr:g} from scratch; from a Hugging Face checkpoint "
        f"{FINE_TUNING.lr:g}, TRL's SFT default, or {LORA.lr:g} with --lora-rank, TRL's LoRA rate)",
        kind=float,
    )
    min_lr: float | None = flag(
        None, f"learning rate at the end of the schedule (default: --lr / {MIN_LR_DIVISOR})", kind=float
    )
    warmup_steps: int | None = flag(
        None,
        f"linear warm-up steps from 0 to --lr (default: {SCRATCH.warmup_steps} from scratch, "
        f"{FINE_TUNING.warmup_steps} from a checkpoint: transformers' Trainer)",
        kind=int,
    )
    schedule: str = flag("cosine", "decay after warm-up", choices=SCHEDULES)
    weight_decay: float = flag(0.0, "AdamW weight decay (matrices only)")
    beta1: float = flag(0.9, "AdamW beta1")
    beta2: float | None = flag(
        None,
        f"AdamW beta2 (default: {SCRATCH.beta2} from scratch, {FINE_TUNING.beta2} from a checkpoint: "
        "transformers' Trainer)",
        kind=float,
    )
    grad_clip: float = flag(1.0, "max global gradient norm")
    skip_nonfinite: int = flag(
        0, "steps whose loss or gradient norm is nan/inf that are skipped (no update) before the run stops"
    )
    seed: int = flag(0, "seed for weights and data")
    device: str = flag("cpu", "torch device, e.g. cpu or cuda (distributed: cuda:LOCAL_RANK on CUDA machines)")
    dtype: str = flag(  # of `device.DTYPES`, not float16: training it would need loss scaling
        "float32",
        "bfloat16: bf16 compute with fp32 master weights and optimizer state",
        choices=("float32", "bfloat16"),
    )
    # distributed (torchrun: WORLD_SIZE ranks = dp x sp)
    sp: int = flag(1, "sequence-parallel ranks per sequence (Ulysses); data-parallel ranks dp = world size / sp")
    nproc: int = flag(1, "ranks on this machine (one per GPU): `memo train` starts them itself")
    nnodes: int = flag(1, "machines in the run: start the same `memo train` on each, with its own --node-rank")
    node_rank: int = flag(0, "this machine's place in [0, --nnodes); node 0 serves the rendezvous")
    master_addr: str = flag("127.0.0.1", "address of node 0 that every node reaches (--nnodes > 1)")
    master_port: int | None = flag(
        None, "node 0's rendezvous port (default: 29500 with --nnodes > 1, else any free port)", kind=int
    )
    # run directory
    out: str | None = flag(
        None,
        "run directory: a new or empty folder, or memo's own run folder; never replaced (default: runs/<date-time>)",
    )
    save_every: int = flag(0, "checkpoint every N steps (0: only at the end)")
    save_final: bool = flag(True, "write a checkpoint at the last step (--no-save-final: benchmarks keep no weights)")
    keep_checkpoints: int = flag(2, "checkpoints kept (oldest deleted)")
    eval_every: int = flag(
        100, "held-out evaluation every N steps and at the end (with --data: needs --eval-data or --eval-split)"
    )
    eval_batches: int = flag(4, "held-out batches per evaluation (the same ones each time)")
    eval_tasks: tuple[str, ...] | None = flag(
        None,
        "RULER tasks scored at each evaluation at --seq-len, depth 0.5, 2 prompts each, into the metrics: ruler (a "
        f"fixed subset: {','.join(TRAIN_SUBSET)}) or task names; one process only (default: none)",
    )
    eval_data: str | None = flag(None, "held-out data for --data runs, in any --data format (same tokenizer and field)")
    eval_split: float = flag(0.0, "fraction of --data's documents held out whole for evaluation (seeded); 0: none")
    tensorboard: bool = flag(False, "also write TensorBoard events (needs the `tensorboard` package)")
    json: bool = flag(False, "print one JSON line per record instead of a progress bar (kept by --resume)")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"`--{flag_name(f.name)}` must be a finite number, got {value}")
            if isinstance(value, str) and not value.strip():  # "" would mean the current folder, silently
                raise ValueError(f"`--{flag_name(f.name)}` must not be empty")
        positive = ("seq_len", "batch_size", "grad_accum", "steps", "keep_checkpoints", "eval_every", "eval_batches")
        positive += ("sp", "nproc", "nnodes")
        if self.tile_tokens is not None and self.tile_tokens <= 0:
            raise ValueError(f"`--tile-tokens` must be positive, got {self.tile_tokens}")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"`--{flag_name(name)}` must be positive, got {getattr(self, name)}")
        for name in ("save_every", "weight_decay", "skip_nonfinite"):
            if getattr(self, name) < 0:
                raise ValueError(f"`--{flag_name(name)}` must not be negative, got {getattr(self, name)}")
        self._check_optimizer()
        if self.batch_size % self.grad_accum:
            raise ValueError(f"`--batch-size` {self.batch_size} is not a multiple of `--grad-accum` {self.grad_accum}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) is not None and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"`--{flag_name(f.name)}` must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}"
                )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"`--node-rank` must be in [0, --nnodes {self.nnodes}), got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 1 << 16:
            raise ValueError(f"`--master-port` must be in [1, 65535], got {self.master_port}")
        if self.seq_len % self.sp:
            raise ValueError(f"`--seq-len` {self.seq_len} is not a multiple of `--sp` {self.sp}")
        if self.arena and self.sp > 1:
            raise ValueError("`--arena` does not support sequence parallelism: use `--sp 1` or leave out `--arena`")
        if self.arena and self.offload_states:
            raise ValueError("`--arena` plans one process's own allocations, not FSDP's: leave out `--offload-states`")
        if self.host_budget is not None:
            parse_size(self.host_budget)
        self._check_packing()
        self._check_eval_source()
        self._check_eval_tasks()
        self._check_rope()
        if self.plan is not None and self.strategy != "memo":  # the policy would never see it
            raise ValueError(
                f"`--plan` places memo's layers: it applies only with `--strategy memo`, not {self.strategy}"
            )
        self.policy()
        self.lora()

    def _check_optimizer(self) -> None:
        """Checks the optimizer fields that are given (None: the run's default, `train.defaults`)."""
        if not self.grad_clip > 0:
            raise ValueError(f"`--grad-clip` must be positive, got {self.grad_clip}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"`--lr` must be positive, got {self.lr}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"`--warmup-steps` must not be negative, got {self.warmup_steps}")
        if self.min_lr is not None and not 0 <= self.min_lr <= (math.inf if self.lr is None else self.lr):
            peak = "--lr" if self.lr is None else f"--lr {self.lr:g}"
            raise ValueError(f"`--min-lr` must be in [0, {peak}], got {self.min_lr:g}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ValueError(f"`--{name}` must be in [0, 1), got {value}")

    def _check_rope(self) -> None:
        if self.rope_theta is not None and not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"`--rope-theta` must be a finite number > 0, got {self.rope_theta}")
        if self.rope_scaling is None:
            given = [n for n in ("rope_factor", "original_max_positions") if getattr(self, n) is not None]
            if given:
                raise ValueError(f"`--{flag_name(given[0])}` needs `--rope-scaling` ({', '.join(ROPE_SCALINGS)})")
            return
        if self.rope_factor is None:
            raise ValueError(f"`--rope-scaling {self.rope_scaling}` needs `--rope-factor` (new length / original)")
        if not (math.isfinite(self.rope_factor) and self.rope_factor >= 1):
            raise ValueError(f"`--rope-factor` must be a finite number >= 1, got {self.rope_factor}")
        if self.original_max_positions is not None and self.original_max_positions <= 0:
            raise ValueError(f"`--original-max-positions` must be positive, got {self.original_max_positions}")

    def _check_packing(self) -> None:
        check_int("--max-documents-per-sequence", self.max_documents_per_sequence)
        if self.data is None and self.pack_documents == "mask":
            raise ValueError("`--pack-documents mask` applies only with `--data` (the generated task is one document)")
        if self.data is None and self.document_separator in ("bos", "eos"):
            raise ValueError(f"`--document-separator {self.document_separator}` applies only with `--data`")
        if self.data is None and self.long_conversations != "refuse":
            raise ValueError(f"`--long-conversations {self.long_conversations}` applies only with `--data`")

    def packing(self) -> str:
        """Returns how documents share a sequence: `--pack-documents`, by default mask with `--data`, else concat."""
        return self.pack_documents or ("mask" if self.data is not None else "concat")

    def _check_eval_source(self) -> None:
        if not 0 <= self.eval_split < 1:
            raise ValueError(f"`--eval-split` must be in [0, 1), got {self.eval_split}")
        if self.eval_data is not None and self.eval_split:
            raise ValueError("give `--eval-data` or `--eval-split`, not both")
        if self.data is None and (self.eval_data is not None or self.eval_split):
            which = "--eval-data" if self.eval_data is not None else "--eval-split"
            raise ValueError(f"`{which}` applies only with `--data` (the generated task has its own held-out stream)")
        if self.eval_data is not None:
            data, held_out = Path(self.data).resolve(), Path(self.eval_data).resolve()
            if held_out == data or data in held_out.parents or held_out in data.parents:
                raise ValueError(
                    f"`--eval-data` {self.eval_data!r} overlaps `--data` {self.data!r}: held-out documents must not "
                    "be trained on"
                )

    def _check_eval_tasks(self) -> None:
        """Raises for RULER tasks memo does not know, or asked of several processes (decoding runs in one)."""
        if not self.eval_tasks:
            return
        eval_task_names(self.eval_tasks)
        if self.nproc > 1 or self.nnodes > 1 or self.sp > 1:
            raise ValueError(
                "`--eval-tasks` decodes in one process: leave it out under --nproc, --nnodes or --sp and run "
                "`memo eval RUN --tasks ruler` on the trained run"
            )

    def check_world(self, world: int) -> None:
        """Raises ValueError unless `world` ranks split into dp × sp and the batch into dp × grad-accum parts."""
        if world % self.sp:
            hint = ": launch more ranks (`--nproc`, torchrun) or lower `--sp`" if world < self.sp else ""
            raise ValueError(f"`--sp` {self.sp} does not divide the number of ranks ({world}){hint}")
        if self.eval_tasks and world > 1:
            raise ValueError(
                f"`--eval-tasks` decodes in one process, not {world}: score the run with `memo eval` after"
            )
        dp = world // self.sp
        if self.batch_size % (dp * self.grad_accum):
            raise ValueError(
                f"`--batch-size` {self.batch_size} is not a multiple of the data-parallel ranks x `--grad-accum` "
                f"({dp} x {self.grad_accum})"
            )

    def policy(
        self, alphas: list[float] | None = None, host_budget_bytes: int | None = None, modes: list[str] | None = None
    ) -> ActivationPolicy:
        """Returns the activation policy; `alphas` and `modes` (per layer, e.g. from a checkpoint) pin a solved α
        and plan, and `host_budget_bytes` (one rank's share of the node) replaces `--host-budget`."""
        memo = self.strategy == "memo"
        alpha = alphas if alphas is not None else self.alpha
        plan = modes if modes is not None else self.plan
        budget = host_budget_bytes or (parse_size(self.host_budget) if self.host_budget else None)
        return ActivationPolicy(
            self.strategy,
            alpha=alpha if memo else None,
            host_budget_bytes=budget,
            plan=plan if memo else None,
            tile_tokens=self.tile_tokens or DEFAULT_TILE_TOKENS,
            attention=self.attention,
        )

    def lora(self) -> LoraConfig | None:
        """Returns the adapters to train (None: full fine-tuning)."""
        return lora_of_flags(self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_dropout)

    def sequences_per_rank(self, world: int) -> int:
        """Returns the sequences one rank runs at once: its data-parallel share of a micro-batch, at least one."""
        return max(self.batch_size // self.grad_accum // (world // self.sp), 1)

    def job(self, world: int = 1, base: ModelConfig | None = None) -> Job:
        """Returns what this run trains on `world` ranks: `--model` (`base`, when already read, else read now) with
        the context-extension flags applied, one rank's sequences, its memory policy, adapters and states."""
        return Job(
            model=extend_context(base or named_model(self.model), self),
            seq=self.seq_len,
            micro_batch=self.sequences_per_rank(world),
            grad_accum=self.grad_accum,
            gpus=world,
            sp=self.sp,
            dtype=self.dtype,
            policy=self.policy(),
            lora=self.lora(),
            offload_states=self.offload_states,
            attention=self.attention,
            arena=self.arena,
        )

    def optimizer(self) -> OptimizerConfig:
        """Returns the optimizer's and the learning-rate schedule's settings, the fields left out at their defaults
        for this run (`with_defaults`; a run saves them so resolved)."""
        resolved = with_defaults(self)
        names = [f.name for f in dataclasses.fields(OptimizerConfig)]
        return OptimizerConfig(**{name: getattr(resolved, name) for name in names})

    def to_dict(self) -> dict:
        """Returns the fields, paths absolute (`absolute_paths`: a run's own files wherever it is resumed, evaluated
        or exported from), and under `inputs` the fingerprints of the files they name."""
        return {**absolute_paths(dataclasses.asdict(self)), "inputs": self.inputs}

    @functools.cached_property
    def inputs(self) -> dict[str, dict]:
        """Returns {field: fingerprint} of the input files (`input_fingerprint`), taken once, when the run first
        records its config, after reading them: resume, eval and export check that they are still those files."""
        named = {name: getattr(self, name) for name in INPUTS if getattr(self, name)}
        found = {name: fp for name, value in named.items() if (fp := input_fingerprint(name, value)) is not None}
        return {**found, "tokens": {"tokenizer": run_tokenizer_id(self)}}  # whose ids the checkpoints learned

    @classmethod
    def from_dict(cls, values: dict, origin: str = "config") -> "TrainConfig":
        """Returns the config of `values` (keys with - or _); unknown keys and wrong types are errors."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        clean = {}
        for key, value in values.items():
            if key == "inputs":  # recorded fingerprints, checked by `check_inputs`, taken again by a new config
                continue
            name = str(key).replace("-", "_")
            name = RENAMED.get(name, name)
            if name not in known:
                raise ValueError(f"{origin}: unknown field {key!r} (fields: {', '.join(known)})")
            clean[name] = _coerce(name, value, known[name].default, origin, known[name].metadata.get("kind"))
        return cls(**clean)


def model_config(cfg: TrainConfig) -> ModelConfig:
    """Returns the ModelConfig a run trains: `--model`'s (a preset, a config file or a Hugging Face folder)
    with the context-extension flags applied."""
    return extend_context(named_model(cfg.model), cfg)


def extend_context(base: ModelConfig, cfg: TrainConfig) -> ModelConfig:
    """Returns `base` with `--rope-theta` and `--rope-scaling/--rope-factor/--original-max-positions` applied,
    as long-context recipes do (a raised base frequency, YaRN, Llama 3's scaling); unchanged without them."""
    changes: dict = {}
    if cfg.rope_theta is not None:
        changes["rope_theta"] = cfg.rope_theta
    if cfg.rope_scaling is not None:
        original = cfg.original_max_positions or pretrained_length(base)
        if cfg.rope_scaling in ("yarn", "llama3") and original is None:
            raise ValueError(
                f"`--rope-scaling {cfg.rope_scaling}` needs `--original-max-positions`: model {base.name!r} does "
                "not say the length it was trained at"
            )
        changes["rope_scaling"] = RopeScaling(cfg.rope_scaling, cfg.rope_factor, original_max_positions=original)
        if cfg.rope_scaling == "dynamic":  # NTK stretches from max_position_embeddings on
            changes["max_position_embeddings"] = original or cfg.seq_len
    return dataclasses.replace(base, **changes) if changes else base


def pretrained_length(base: ModelConfig) -> int | None:
    """Returns the length `base`'s RoPE was pretrained at, before any scaling: the original length its yarn or
    llama3 scaling names, else its max_position_embeddings. A model has one scaling, and a new one replaces it and
    stretches the unscaled frequencies again, so its factor counts from that length, not from the extended one."""
    r = base.rope_scaling
    return r.original_max_positions if r is not None and r.original_max_positions else base.max_position_embeddings


def replaced_rope(base: ModelConfig, cfg: TrainConfig) -> str | None:
    """Returns a line naming the RoPE scaling of `base` that `--rope-scaling` replaces, and the new one; None when
    nothing is replaced."""
    if base.rope_scaling is None or cfg.rope_scaling is None:
        return None
    new = extend_context(base, cfg).rope_scaling
    return (
        f"`--rope-scaling {cfg.rope_scaling}` replaces the RoPE scaling of model {base.name!r}, "
        f"{_rope_text(base.rope_scaling)}, with {_rope_text(new)}"
    )


def _rope_text(r: RopeScaling) -> str:
    original = f", original {r.original_max_positions}" if r.original_max_positions else ""
    return f"{r.type} (factor {r.factor:g}{original})"


def absolute_paths(values: dict) -> dict:
    """Returns `values` (fields, keys with - or _) with every path made absolute against the current folder, the
    one the run reads them from (a config file's paths too); a `--model` that names a preset stays a name."""
    return {key: os.path.abspath(value) if _is_path(str(key), value) else value for key, value in values.items()}


def _is_path(key: str, value) -> bool:
    name = key.replace("-", "_")
    preset = name == "model" and value in PRESETS
    return name in PATHS and isinstance(value, str) and bool(value.strip()) and not preset


def with_model_tokenizer(cfg: TrainConfig) -> TrainConfig:
    """Returns `cfg` tokenizing its text `--data` with the tokenizer.json of its `--model` folder when no
    `--tokenizer` is given: a checkpoint's ids are its own tokenizer's, not bytes. Says so on the `memo` log."""
    found = model_tokenizer(cfg.model)
    if cfg.tokenizer or found is None or cfg.data is None or Path(cfg.data).suffix in TOKEN_SUFFIXES:
        return cfg
    HFTokenizer(found, f"`--model` {cfg.model}'s tokenizer (it tokenizes `--data` without `--tokenizer`)")
    log.warning("no `--tokenizer`: tokenizing `--data` with %s, the tokenizer of `--model`", found)
    return dataclasses.replace(cfg, tokenizer=str(found))


def with_packing(cfg: TrainConfig) -> TrainConfig:
    """Returns `cfg` with its packing as the run reads its data, to be saved with it: `--pack-documents` made
    explicit (`packing`), and `--document-separator auto` resolved with `--data`: by the tokenizer for text, none
    for conversations, to a token file's own (a .npy does not say: left auto). A resumed run then keeps them
    whatever the defaults say. Raises ValueError for `--document-separator` bos or eos with conversations, and
    `--long-conversations truncate` without."""
    separator, chat = cfg.document_separator, _holds_conversations(cfg.data, cfg.text_field)
    if chat and separator in ("bos", "eos"):
        raise ValueError(
            f"`--document-separator {separator}`: `--data` {cfg.data} holds conversations (`messages`), whose chat "
            "template writes the special tokens around each; use auto or none"
        )
    if cfg.long_conversations != "refuse" and not chat:
        raise ValueError(
            f"`--long-conversations {cfg.long_conversations}` applies to conversations (`messages`); `--data` "
            f"{cfg.data} holds none"
        )
    if cfg.data is not None and separator == "auto":
        separator = separator_kind(cfg.data, cfg.tokenizer, text_field=cfg.text_field) or separator
    return dataclasses.replace(cfg, pack_documents=cfg.packing(), document_separator=separator)


def _holds_conversations(data: str | None, text_field: str) -> bool:
    return data is not None and Path(data).suffix not in TOKEN_SUFFIXES and holds_conversations(data, text_field)


def check_same_packing(overrides: dict, recorded: dict, run: str) -> dict:
    """Returns the flags given with `--resume` (`overrides`) less `--document-separator auto` (the run keeps the
    separator it resolved); raises ValueError when one of them changes how the run packs its documents (its
    saved config `recorded`; `BEFORE_PACKING` for runs saved before those fields): the batches after the
    checkpoint would not be those of the run."""
    saved = {**BEFORE_PACKING, **recorded}
    for name in PACKING:
        given = overrides.get(name)
        if given is None or given == saved.get(name) or (name == "document_separator" and given == "auto"):
            continue
        if name == "max_documents_per_sequence" and saved["pack_documents"] == "concat":
            continue  # concat packing has no document bounds to count
        raise ValueError(
            f"`--{flag_name(name)} {given}` changes how {run} packs its documents ({saved.get(name)}): resume "
            "without it"
        )
    return {k: v for k, v in overrides.items() if not (k == "document_separator" and v == "auto")}


def model_tokenizer(model: str) -> Path | None:
    """Returns the tokenizer.json of a `--model` Hugging Face folder; None for a preset, a file or a folder
    without one."""
    path = Path(model) / "tokenizer.json"
    return path if model not in PRESETS and path.is_file() else None


def run_tokenizer_id(cfg: TrainConfig) -> str | None:
    """Returns the identity (`tokenizer_identity`) of the tokenizer whose ids the run trains on: its
    `--tokenizer`'s, bytes for text or generated data, else for token files its `--model` folder's tokenizer or
    the one `--data`'s sidecar names (None: not recorded, nothing to check against)."""
    if cfg.tokenizer:
        return tokenizer_identity(cfg.tokenizer)
    if cfg.data is None or Path(cfg.data).suffix not in TOKEN_SUFFIXES:
        return tokenizer_identity(None)
    found = model_tokenizer(cfg.model)
    return tokenizer_identity(found) if found else token_file_tokenizer(cfg.data)


def input_fingerprint(name: str, value: str) -> dict | None:
    """Returns what identifies the content of the file that field `name` names now; None for a preset or a
    path that is not there. A `--model` folder is its config.json (the shapes; weights come from checkpoints);
    a token file adds its sidecar's hash (tokenizer, counts); a tokenizer.json the files of its chat template
    (`template_fingerprint`); a data folder is its listing (`folder_fingerprint`)."""
    from ..hf import CONFIG_NAME

    path = Path(value)
    if name == "model" and value in PRESETS:
        return None
    if name == "model" and path.is_dir():
        path = path / CONFIG_NAME
    if path.is_dir():
        return folder_fingerprint(path)
    if not path.is_file():
        return None
    found = file_fingerprint(path)
    if name == "tokenizer":
        found.update(template_fingerprint(path.parent))
    sidecar = path.with_suffix(".json")
    if path.suffix == ".bin" and sidecar.is_file():
        found["sidecar_sha256"] = _sha256(sidecar, sidecar.stat().st_size)
    return found


def template_fingerprint(folder: Path) -> dict:
    """Returns {template_sha256} of the files beside a tokenizer.json that render conversations with it (its chat
    template and special tokens, TEMPLATE_FILES), {} without them: another template trains other text."""
    present = [folder / name for name in TEMPLATE_FILES if (folder / name).is_file()]
    if not present:
        return {}
    digest = hashlib.sha256()
    for path in present:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return {"template_sha256": digest.hexdigest()}


def file_fingerprint(path: Path) -> dict:
    """Returns {size, sha256} of a file up to SMALL_FILE bytes; of a larger one {size, ends_sha256 (its first and
    last END_BYTES), mtime_ns}: a corpus is not read whole at every start, and an edit that keeps the size and
    both ends shows in its mtime (a warning, not a refusal: a copy changes the mtime alone)."""
    stat = path.stat()
    if stat.st_size <= SMALL_FILE:
        return {"size": stat.st_size, "sha256": _sha256(path, stat.st_size)}
    return {"size": stat.st_size, "ends_sha256": _sha256(path, END_BYTES), "mtime_ns": stat.st_mtime_ns}


def folder_fingerprint(path: Path) -> dict:
    """Returns {files, size, listing_sha256 (each file's relative name and size), mtime_ns (the newest)} of the
    files a data folder trains on (`text_files`: a README beside them is no change): files added, removed or
    resized show; contents are not read (a folder may hold terabytes)."""
    files = [p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()]
    files.sort()
    stats = [p.stat() for p in files]
    listing = "\n".join(f"{p.relative_to(path)}\t{s.st_size}" for p, s in zip(files, stats))
    return {
        "files": len(files),
        "size": sum(s.st_size for s in stats),
        "listing_sha256": hashlib.sha256(listing.encode()).hexdigest(),
        "mtime_ns": max((s.st_mtime_ns for s in stats), default=0),
    }


def _sha256(path: Path, ends: int) -> str:
    """Returns the sha256 of the first and last `ends` bytes of `path` (all of it when it is no longer)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(ends))
        if f.seek(0, os.SEEK_END) > ends:
            f.seek(max(ends, f.tell() - ends))
            digest.update(f.read())
    return digest.hexdigest()


def check_inputs(config: dict, fields: Iterable[str] = INPUTS, run: str = "the run", remedy: str | None = None) -> None:
    """Raises ValueError, one line naming the flag and the file, when an input file that `config` (a run's saved
    config) recorded under `inputs` is missing or changed; a run saved without fingerprints passes unchecked.
    `remedy` says what to do (default: a resume's: restore it, or give its flag again)."""
    recorded = config.get("inputs") or {}
    for name in fields:
        if name not in recorded or not config.get(name):
            continue
        was, now = recorded[name], input_fingerprint(name, config[name])
        where, flag = f"`--{flag_name(name)}` {config[name]}", f"`--{flag_name(name)}`"
        if now is None:
            again = remedy or f"put it back, or give {flag} with its new place"
            raise ValueError(f"{where} of {run} is missing: {again}")
        changed = _changed(was, now)
        if changed:
            again = remedy or f"restore it, or give {flag} to use another"
            raise ValueError(f"{where} changed since {run} started ({_change(changed[0], was, now)}): {again}")
        if was.get("mtime_ns") != now.get("mtime_ns"):
            log.warning("%s was modified since %s started (same size and ends): reading it as it is now", where, run)


def _changed(was: dict, now: dict | None) -> list[str]:
    """Returns the keys of fingerprint `was` that `now` does not match (a mtime alone is not a change)."""
    return [key for key in was if key != "mtime_ns" and was[key] != (now or {}).get(key)]


def check_same_input(name: str, value: str, config: dict, run: str) -> None:
    """Raises ValueError when an input file given with `--resume` (`--tokenizer`, `--data`) is not the one the run
    recorded (moved is fine): the checkpoint learned that tokenizer's ids, from that data."""
    was = (config.get("inputs") or {}).get(name)
    if was and _changed(was, input_fingerprint(name, value)):
        what = "the tokenizer {} trained with" if name == "tokenizer" else "the data {} trained on"
        raise ValueError(
            f"`--{flag_name(name)}` {value} is not {what.format(run)} ({config.get(name)}): resume without "
            f"`--{flag_name(name)}`, or give a copy of it"
        )


def _change(key: str, was: dict, now: dict) -> str:
    if key in ("size", "files"):
        return f"{key} {was[key]} -> {now.get(key)}"
    if key == "template_sha256":
        return "another tokenizer_config.json or chat template beside it"
    return "other content" if key != "sidecar_sha256" else "another sidecar"


def check_token_files(overrides: dict, config: dict) -> None:
    """Raises ValueError when a token file given with `--resume` (`--data`, `--eval-data`) was made by another
    tokenizer than the one whose ids the run (`config`, saved) trained on."""
    expected = ((config.get("inputs") or {}).get("tokens") or {}).get("tokenizer")
    for name in ("data", "eval_data"):
        if overrides.get(name):
            given = token_file_tokenizer(overrides[name])
            check_tokenizer(overrides[name], given, expected, f"--{flag_name(name)}")


def check_same_model(model: str, saved: ModelConfig, run: str) -> None:
    """Raises ValueError when `--model` given with `--resume` is not shaped like the model the checkpoint holds
    (another folder or file of the same model is fine: a moved checkpoint)."""
    given = named_model(model)
    diff = [name for name in SHAPE if getattr(given, name) != getattr(saved, name)]
    if diff:
        name = diff[0]
        raise ValueError(
            f"`--model {model}` is not the model {run} trained ({name} {getattr(given, name)} vs "
            f"{getattr(saved, name)}): resume without `--model`, or give the same model"
        )


def flag_name(name: str) -> str:
    """Returns the flag of field `name`, without its leading dashes: min_lr -> min-lr."""
    return name.replace("_", "-")


def _coerce(name: str, value, default, origin: str, kind: type | None = None):
    """Returns `value` as the type of the field: ints for floats are fine, 'auto' is α=None, token counts take
    sizes such as 128K, and a number written as text (YAML reads 3e-4 as text) is read as a number."""
    if name == "alpha" and value in (None, "auto"):
        return None
    if name == "alpha" and isinstance(value, (list, tuple, str)):  # one α per layer: a list, or "0.2,0.5,..."
        return alpha_value(value) if isinstance(value, str) else _alpha_list(value, origin)
    if name == "plan" and isinstance(value, (list, tuple, str)):  # a list, or "checkpoint,memo,..."
        return plan_value(value) if isinstance(value, str) else tuple(str(v) for v in value)
    if name in ("lora_targets", "eval_tasks") and isinstance(value, (list, tuple, str)):  # a list, or "q,v"
        return targets_value(value) if isinstance(value, str) else tuple(str(v) for v in value)
    if value is None:
        if default is not None:  # a null in a config file where the field needs a value
            raise ValueError(f"{origin}: `{name}` needs a value, got null (leave it out for {default!r})")
        return None
    expected = kind or (type(default) if default is not None else (float if name == "alpha" else str))
    if name in ("seq_len", "tile_tokens") and isinstance(value, str):
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


def alpha_value(text: str) -> float | tuple[float, ...] | None:
    """Returns `--alpha` as written: 'auto' (None: solve it), one number, or one per layer separated by commas."""
    if text == "auto":
        return None
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"`--alpha` must be a number in [0, 1], one per layer (0.2,0.5,...), or auto; got {text!r}")
    return values[0] if len(values) == 1 else values


def plan_value(text: str) -> tuple[str, ...]:
    """Returns `--plan` as written: modes separated by commas (checked by ActivationPolicy)."""
    return tuple(part.strip() for part in text.split(","))


def _alpha_list(values, origin: str) -> tuple[float, ...]:
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{origin}: `alpha` per layer must be numbers, got {list(values)!r}")
    return tuple(float(v) for v in values)
