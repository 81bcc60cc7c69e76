"""What `memo estimate` is asked: its flags as one typed record, checked once before any work (with the flag
names a user typed), and the `Job`, GPU and efficiency band they price."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..device import HOST_USABLE
from ..documents import DocumentLengths
from ..files import read_json_object
from ..flags import flag
from ..job import MODEL_HELP, Job, named_model
from ..lora import ALL_TARGETS, lora_of_flags, targets_value
from ..units import format_bytes, format_count, parse_length, parse_size
from .efficiency import LENGTHS, Band, check_calibration_device, efficiency_from_calibration
from .estimate import ATTENTION_CHOICES, HEADROOM, SYSTEMS
from .hardware import GPUS, GPUSpec, gpu, load_gpus
from .memory import store_bytes
from .sweep import default_lengths


@dataclass(frozen=True, kw_only=True)
class EstimateRequest:
    """`memo estimate`'s flags: the job (`--model`, `--seq`, `--gpus`, `--sp`, LoRA, states, documents, the
    attention kernel, host memory, `--arena`), the GPU, the systems, and what to answer (one length, the longest,
    or a sweep)."""

    model: str = flag(help=MODEL_HELP, path=True)
    seq: int | None = flag(None, "tokens per sequence, e.g. 512K or 1M", parse=parse_length)
    gpus: int = flag(help="number of GPUs", parse=int)
    gpu: str = flag(help=f"GPU name, any case: {', '.join(GPUS)} (or a usual alias: h100, ...)")
    gpu_file: str | None = flag(None, "JSON file with more GPU specs (fields as in cost/hardware.py)", path=True)
    system: tuple[str, ...] | None = flag(None, "system(s) to estimate (default: all)", choices=SYSTEMS, append=True)
    sp: int | None = flag(None, "sequence-parallel GPUs per sequence (default: all GPUs)", parse=int)
    host_memory: int | None = flag(
        None,
        "host memory per node, e.g. 1.5T or 512G (default: the GPU spec's machine); 75%% of it may be pinned",
        parse=parse_size,
    )
    calibration: str | None = flag(None, "JSON written by `memo calibrate` on this GPU type", path=True)
    attention: str = flag(
        "auto",
        "attention kernel whose published speeds time attention: flash (PyTorch's, FlashAttention-2), cudnn "
        "(cuDNN's fused attention), fa4 (flash-attn-4; on Hopper timed at FlashAttention-3's published speeds); "
        "auto (default): what memo's run-time choice takes on that GPU without optional packages, cudnn on Hopper "
        "(H100, H200) and flash elsewhere",
        choices=ATTENTION_CHOICES,
    )
    arena: bool = flag(False, "memo runs with its planned allocator (memo train --arena), not PyTorch's")
    offload_states: bool = flag(
        False,
        "memo keeps parameters, gradients and AdamW state in host memory and steps the optimizer on the CPU "
        "(memo train --offload-states); they share the host memory with the activations' offload",
    )
    lora_rank: int = flag(0, "memo trains LoRA adapters of this rank on a frozen bf16 base (0: none)", parse=int)
    lora_targets: tuple[str, ...] | None = flag(
        None,
        f"with --lora-rank: projections that get adapters (default: {','.join(ALL_TARGETS)})",
        parse=targets_value,
    )
    mean_document_tokens: str | None = flag(
        None,
        "sequences are packed documents of this many tokens (e.g. 1K), each attending only within itself: "
        "attention does q*N^2 + r^2 of work for s = q*N + r, not s^2; memory is the same",
        exclusive="packed",
    )
    document_lengths: str | None = flag(
        None,
        "sequences are cut from the documents of this memo token file (.bin with its .json sidecar, or .npy "
        "with its .docs.npy), each attending only within itself: attention does their expected sum of d^2, not s^2",
        path=True,
        exclusive="packed",
    )
    max_seq: bool = flag(False, "search the longest sequence that fits, per system")
    headroom: int | None = flag(
        None,
        "with --max-seq: device memory kept free beyond the upper end of memory, e.g. 3G or 0 (default: 3G: one "
        "more NCCL communicator with its NVLS buffers, or another library's context)",
        parse=parse_size,
    )
    sweep: bool = flag(False, "MFU against sequence length (32K..4M) for all systems")
    plot: str | None = flag(None, "with --sweep: write the MFU plot to this PNG", path=True)

    def __post_init__(self) -> None:
        if self.calibration and self.attention != "auto":
            raise ValueError(
                "`--attention` picks published kernel speeds; `--calibration` has measured its own: give one"
            )
        lora_of_flags(self.lora_rank, targets=self.lora_targets)
        asked = [name for name, given in (("--seq", self.seq), ("--max-seq", self.max_seq)) if given]
        if self.sweep and asked:
            raise ValueError(f"`--sweep` estimates its own lengths (32K..4M): leave out `{asked[0]}`")
        if self.max_seq and self.seq is not None:
            raise ValueError("`--max-seq` searches the length: leave out `--seq`")
        if self.headroom is not None and not self.max_seq:
            raise ValueError("`--headroom` is what `--max-seq` keeps free: give `--max-seq` too")
        if self.plot and not self.sweep:
            raise ValueError("`--plot` draws the `--sweep` of MFU against length: give `--sweep` too")
        first = default_lengths()[0]
        if self.sweep and self.sp and first % self.sp:
            raise ValueError(f"`--sweep` estimates powers of two from {format_count(first)}: `--sp` must divide them")
        if self.sweep or self.max_seq:
            return
        if self.seq is None:
            raise ValueError("give `--seq` (or `--max-seq` / `--sweep`)")
        if self.seq < LENGTHS[0]:  # below them the speeds it would use have no source
            raise ValueError(
                f"`--seq` {self.seq} is shorter than the published attention speeds the estimate cites "
                f"({format_count(LENGTHS[0])} tokens and up): give a longer `--seq`"
            )

    def spec(self) -> GPUSpec:
        """Returns the GPU `--gpu` names (among `--gpu-file`'s too)."""
        return gpu(self.gpu, load_gpus(self.gpu_file) if self.gpu_file else GPUS)

    def band(self, spec: GPUSpec) -> Band | None:
        """Returns the efficiency band `--calibration` measured on a `spec` GPU; None: the published one."""
        if not self.calibration:
            return None
        calibration = read_json_object(self.calibration)
        check_calibration_device(calibration, spec)
        return efficiency_from_calibration(calibration, spec)

    def documents(self) -> DocumentLengths | None:
        """Returns the packed documents asked about (`--mean-document-tokens`, `--document-lengths`), None for
        whole sequences."""
        if self.mean_document_tokens is not None:
            try:
                mean = parse_length(self.mean_document_tokens)
            except ValueError as err:
                raise ValueError(f"`--mean-document-tokens` {err}") from None
            return DocumentLengths(mean=mean)
        if self.document_lengths is not None:
            return DocumentLengths.of_file(self.document_lengths)
        return None

    def job(self) -> Job:
        """Returns the job to price; `--max-seq` and `--sweep` price it at other lengths (`Job.at`)."""
        return Job(
            model=named_model(self.model),
            seq=1024 * (self.sp or self.gpus) if self.max_seq or self.sweep else self.seq,
            gpus=self.gpus,
            sp=self.sp,
            lora=lora_of_flags(self.lora_rank, targets=self.lora_targets),
            offload_states=self.offload_states,
            documents=self.documents(),
            attention=self.attention,
            host_memory=self.host_memory,
            arena=self.arena,
        )

    def kept_free(self) -> int:
        """Returns the device bytes `--max-seq` keeps free (`--headroom`, default `estimate.HEADROOM`)."""
        return HEADROOM if self.headroom is None else self.headroom

    def check_host(self, job: Job, spec: GPUSpec) -> None:
        """Raises ValueError naming `--host-memory` when the pinnable part of it cannot hold, per GPU, one layer's
        offload at the job's (first) length: the least any of memo's plans pins per layer (its input and attention
        output always go to the host); below that no host figure of the estimate means anything."""
        if self.host_memory is None:
            return
        node_gpus = min(job.gpus, spec.gpus_per_node)
        per_gpu = int(HOST_USABLE * self.host_memory) // node_gpus
        tokens = job.tokens(job.sp or job.gpus)
        one_layer = store_bytes(job.model, tokens, ["memo"], [0.0], tokens, offload_last=True, dtype=job.torch_dtype)
        least = one_layer.host_total  # as the store allocates it
        if per_gpu < least:
            node = math.ceil(least * node_gpus / HOST_USABLE)
            raise ValueError(
                f"`--host-memory` {format_bytes(self.host_memory)} pins {format_bytes(per_gpu)} per GPU "
                f"({HOST_USABLE:.0%}), less than one layer's offload at {format_count(tokens)} tokens "
                f"({format_bytes(least)}): give at least {format_bytes(node)}"
            )

    def systems(self, job: Job) -> list[str]:
        """Returns `--system`, by default every system (memo alone for LoRA or offloaded states)."""
        return list(self.system or (["memo"] if not job.full_states else SYSTEMS))
