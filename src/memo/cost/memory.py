"""Per-GPU memory: model states, skeletal activations (device and host), and the traced transient peak.

Activation terms come from the real model: the skeletal tensor list of `DecoderLayer.skeletal_specs`
and an allocation trace of a steady-state training step on the `meta` device (no memory needed).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import torch

from ..config import ModelConfig
from ..device import meta_kernels
from ..layer import DecoderLayer, bytes_by_role
from ..model import Transformer
from ..plan.caching_sim import replay
from ..plan.trace import SCRATCH, trace_iteration, windows
from ..policy import ActivationPolicy

# bf16 weights + fp32 gradient + fp32 Adam master weights, m and v (mixed-precision training)
BYTES_PER_PARAM = 2 + 4 + 12
TRACE_LAYERS = 4  # a steady-state step of 4 layers shows every phase; deeper models add only kept inputs
TRACE_TOKENS = 1 << 18  # longest step traced (a trace's cost grows with the length); past it, extrapolated


def skeletal_bytes(c: ModelConfig, tokens: int, dtype=torch.bfloat16) -> dict[str, int]:
    """Returns one layer's skeletal bytes by role ("input", "attention", "other") for `tokens` tokens."""
    specs = _specs(c, tokens, dtype)
    return bytes_by_role(specs)


def _specs(c: ModelConfig, tokens: int, dtype):
    with torch.device("meta"):
        layer = DecoderLayer(c, 0)
    return layer.skeletal_specs(1, tokens, dtype, "meta")


def transient_peak(c: ModelConfig, tokens: int, strategy: str, loss_chunk_tokens: int = 4096, **step) -> int:
    """Returns the peak bytes allocated during a steady-state step. The step is traced at the powers of two
    around `tokens` (at most `TRACE_TOKENS`) and the line between them read at `tokens`: every phase's
    tensors are token rows, the loss chunk is fixed, so the peak is linear in tokens between two traces and
    past the last one; a few traces then serve any length (a search over lengths and layouts included).
    `step` may name the `dtype` (bf16) and the `kernels` (cuda) of the step traced."""
    return _on_line(c, tokens, strategy, loss_chunk_tokens, 0, **step)


def fragmentation_bytes(c: ModelConfig, tokens: int, strategy: str, loss_chunk_tokens: int = 4096) -> int:
    """Returns the bytes PyTorch's CUDA caching allocator reserves beyond the allocated peak over the
    step: the traced step replayed through `plan.caching_sim`, read on the same line as `transient_peak`."""
    return _on_line(c, tokens, strategy, loss_chunk_tokens, 1)


def _on_line(c: ModelConfig, tokens: int, strategy: str, loss_chunk_tokens: int, which: int, **step) -> int:
    lo, hi = _bracket(tokens)
    at_hi = _traced_step(c, hi, strategy, loss_chunk_tokens, **step)[which]
    if hi == tokens:
        return at_hi
    at_lo = _traced_step(c, lo, strategy, loss_chunk_tokens, **step)[which]
    return max(0, at_lo + (at_hi - at_lo) * (tokens - lo) // (hi - lo))


def _bracket(tokens: int) -> tuple[int, int]:
    """Returns the traced lengths whose line gives the peak at `tokens`: (t, t) when `tokens` is traced itself."""
    if tokens >= TRACE_TOKENS:
        return (TRACE_TOKENS, TRACE_TOKENS) if tokens == TRACE_TOKENS else (TRACE_TOKENS // 2, TRACE_TOKENS)
    hi = 1 << max(tokens - 1, 1).bit_length()
    return (hi, hi) if hi == tokens else (hi // 2, hi)


def traced_transient_peak(c: ModelConfig, tokens: int, strategy: str, loss_chunk_tokens: int = 4096) -> int:
    """Returns the peak bytes allocated during a steady-state step (after buffers are sized), on `meta`, kernel
    scratch (`plan.scratch`: the flash backward's fp32 accumulators) included.

    The step is traced with `TRACE_LAYERS` layers; `full` keeps one input per layer and `none` every layer's
    skeletal tensors, so those of the remaining layers are added. Parameter gradients already exist
    (accumulated), as in training.
    """
    return _traced_step(c, tokens, strategy, loss_chunk_tokens)[0]


def traffic_bytes(c: ModelConfig, tokens: int, strategy: str, loss_chunk_tokens: int = 4096) -> tuple[int, int]:
    """Returns (per layer, outside the layers) bytes that the step's memory-bound ops write, from its trace: the
    outputs of every op but matmuls, attention and empty allocations (norms, activations, residual adds, RoPE,
    casts, the loss's softmax...), which run at HBM speed, not at tensor-core speed."""
    return _on_line(c, tokens, strategy, loss_chunk_tokens, 2), _on_line(c, tokens, strategy, loss_chunk_tokens, 3)


COMPUTE_BOUND = ("mm", "attention", "empty")  # op names holding these: timed at FLOP/s, or writing nothing


@lru_cache(maxsize=128)
def _traced_step(
    c: ModelConfig, tokens: int, strategy: str, loss_chunk_tokens: int, dtype=torch.bfloat16, kernels: str = "cuda"
) -> tuple[int, int, int, int]:
    """Returns the traced step's (peak, caching allocator's reserved beyond its peak, memory-bound bytes written
    per layer and outside the layers); see the callers."""
    layers = min(c.n_layers, TRACE_LAYERS)
    small = dataclasses.replace(c, n_layers=layers)
    policy = ActivationPolicy(strategy, alpha=0.5 if strategy == "memo" else None, host_budget_bytes=1 << 60)
    with torch.device("meta"):
        model = Transformer(small, policy, loss_chunk_tokens=loss_chunk_tokens).to(dtype)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with meta_kernels(kernels):  # a GPU step allocates what the CUDA attention kernels allocate
        model(ids, labels=ids).backward()  # sizes the store and creates .grad
        step = trace_iteration(model, ids, scratch=kernels == "cuda")
    b = skeletal_bytes(c, tokens, dtype)
    kept = {"full": b["input"], "none": sum(b.values())}
    extra = (c.n_layers - layers) * kept.get(strategy, 0)
    cached = replay([(e.kind, e.tensor, e.nbytes) for e in step.events if e.kind != "mark"])
    written = [
        e.nbytes if e.kind == "alloc" and e.op != SCRATCH and not any(k in str(e.op) for k in COMPUTE_BOUND) else 0
        for e in step.events
    ]
    in_layers = sum(sum(written[lo:hi]) for lo, hi in windows(step).values())
    return (
        step.peak + extra,
        cached.peak_reserved - cached.peak_allocated,
        in_layers // layers,
        sum(written) - in_layers,
    )


def persistent_activation_bytes(c: ModelConfig, tokens: int, strategy: str, dtype=torch.bfloat16) -> int:
    """Returns device bytes a strategy allocates once for skeletal tensors (rounding buffers or scratch)."""
    b = skeletal_bytes(c, tokens, dtype)
    if strategy == "memo":
        return 2 * sum(b.values())  # two rounding buffers (§4)
    if strategy == "full":
        return sum(b.values()) - b["input"]  # one shared recompute scratch layer
    return 0


def host_bytes_per_gpu(
    c: ModelConfig, tokens: int, alphas: list[float], offloaded: list[int], dtype=torch.bfloat16
) -> int:
    """Returns the host bytes one GPU's offload needs: input, attention and α of the rest per layer (§3)."""
    b = skeletal_bytes(c, tokens, dtype)
    return int(sum(b["input"] + b["attention"] + alphas[i] * b["other"] for i in offloaded))


def training_lower_bound(
    c: ModelConfig, tokens: int, policy: ActivationPolicy, dtype: torch.dtype, shards: int = 1
) -> dict[str, int]:
    """Returns bytes a training run needs at least, without tracing: model states (weights, gradients, AdamW
    m and v, fp32 masters of 16-bit weights; sharded over `shards` ranks), the skeletal tensors the strategy
    keeps on the device for `tokens` tokens (all micro-batch rows), and `memo`'s host pool (α = 0 when it is
    to be solved: the least it can be). Transients and the loss are left out."""
    size = torch.empty((), dtype=dtype).element_size()
    masters = 4 if dtype != torch.float32 else 0
    states = c.num_parameters() * (2 * size + 8 + masters) // shards
    b = skeletal_bytes(c, tokens, dtype)
    per_layer = sum(b.values())
    host = 0
    if policy.strategy == "none":
        device = c.n_layers * per_layer
    elif policy.strategy == "full":
        device = c.n_layers * b["input"] + per_layer - b["input"]  # kept inputs + one recompute scratch layer
    else:  # two rounding buffers (§4); the last two layers keep theirs there
        alphas = policy.layer_alphas(c.n_layers) or [0.0] * c.n_layers
        device = 2 * per_layer
        host = host_bytes_per_gpu(c, tokens, alphas, policy.offloaded_layers(c.n_layers))
    return {"states": states, "activations": device, "host_pool": host}
