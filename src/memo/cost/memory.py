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
from ..plan.trace import trace
from ..policy import ActivationPolicy

# bf16 weights + fp32 gradient + fp32 Adam master weights, m and v (mixed-precision training)
BYTES_PER_PARAM = 2 + 4 + 12
TRACE_LAYERS = 4  # a steady-state step of 4 layers shows every phase; deeper models add only kept inputs
# past this many tokens the transient peak is extrapolated: it is linear in tokens (every phase's tensors are
# token rows, the loss chunk is fixed), and a trace's cost grows with the length (token-wise chunks)
TRACE_TOKENS = 1 << 18


def skeletal_bytes(c: ModelConfig, tokens: int, dtype=torch.bfloat16) -> dict[str, int]:
    """Returns one layer's skeletal bytes by role ("input", "attention", "other") for `tokens` tokens."""
    specs = _specs(c, tokens, dtype)
    return bytes_by_role(specs)


def _specs(c: ModelConfig, tokens: int, dtype):
    with torch.device("meta"):
        layer = DecoderLayer(c, 0)
    return layer.skeletal_specs(1, tokens, dtype, "meta")


def transient_peak(c: ModelConfig, tokens: int, strategy: str, loss_chunk_tokens: int = 4096) -> int:
    """Returns the peak bytes allocated during a steady-state step: traced up to `TRACE_TOKENS` tokens, past
    it the line through the traces at `TRACE_TOKENS / 2` and `TRACE_TOKENS` (seconds at any length)."""
    if tokens <= TRACE_TOKENS:
        return traced_transient_peak(c, tokens, strategy, loss_chunk_tokens)
    lo, hi = TRACE_TOKENS // 2, TRACE_TOKENS
    at_lo = traced_transient_peak(c, lo, strategy, loss_chunk_tokens)
    at_hi = traced_transient_peak(c, hi, strategy, loss_chunk_tokens)
    return at_hi + (at_hi - at_lo) * (tokens - hi) // (hi - lo)


@lru_cache(maxsize=64)
def traced_transient_peak(c: ModelConfig, tokens: int, strategy: str, loss_chunk_tokens: int = 4096) -> int:
    """Returns the peak bytes allocated during a steady-state step (after buffers are sized), on `meta`.

    The step is traced with `TRACE_LAYERS` layers; `full` keeps one input per layer, so the inputs of the
    remaining layers are added. Parameter gradients already exist (accumulated), as in training.
    """
    layers = min(c.n_layers, TRACE_LAYERS)
    small = dataclasses.replace(c, n_layers=layers)
    policy = ActivationPolicy(strategy, alpha=0.5 if strategy == "memo" else None, host_budget_bytes=1 << 60)
    with torch.device("meta"):
        model = Transformer(small, policy, loss_chunk_tokens=loss_chunk_tokens).to(torch.bfloat16)
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with meta_kernels("cuda"):  # a GPU step allocates what the CUDA attention kernels allocate
        model(ids, labels=ids).backward()  # sizes the store and creates .grad
        step, _ = trace(lambda: model(ids, labels=ids).backward())
    extra_inputs = (c.n_layers - layers) * tokens * c.hidden_size * 2 if strategy == "full" else 0
    return step.peak + extra_inputs


def persistent_activation_bytes(c: ModelConfig, tokens: int, strategy: str) -> int:
    """Returns device bytes a strategy allocates once for skeletal tensors (rounding buffers or scratch)."""
    per_layer = sum(skeletal_bytes(c, tokens).values())
    if strategy == "memo":
        return 2 * per_layer  # two rounding buffers (§4)
    if strategy == "full":
        return per_layer - skeletal_bytes(c, tokens)["input"]  # one shared recompute scratch layer
    return 0


def host_bytes_per_gpu(c: ModelConfig, tokens: int, alphas: list[float], offloaded: list[int]) -> int:
    """Returns the host bytes one GPU's offload needs: input, attention and α of the rest per layer (§3)."""
    b = skeletal_bytes(c, tokens)
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
