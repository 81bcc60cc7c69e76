"""What the cost model predicts for one `memo train` run, and how the run's measurements compare: every run
tests the model (memory terms everywhere; step time and MFU on a GPU the model knows)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..policy import ActivationPolicy
from .estimate import Layout, estimate
from .flops import DocumentLengths
from .hardware import GPUSpec
from .memory import Traced, store_bytes, training_lower_bound, transient_peak
from .states import States, device_bytes, host_bytes, trained

OFF_BY = 0.15  # a measured peak further than this from its prediction is a warning


def predict_run(
    c: ModelConfig,
    seq: int,
    micro_batch: int,
    world: int,
    sp: int,
    policy: ActivationPolicy,
    dtype: torch.dtype,
    loss_chunk_tokens: int,
    kernels: str,
    spec: GPUSpec | None = None,
    states: States = States(),
    attention: str = "auto",
    documents: DocumentLengths | None = None,
) -> dict:
    """Returns one rank's predicted memory (model states, the activation store's buffers for the policy's plan,
    the step's transient peak traced at the run's dtype, kernels, tiles and modes, with the gradients a
    one-process step makes anew, their sum, and memo's host pool when the plan and α are known) and, on a known
    GPU, the step time and MFU with their ranges, attention timed as the `attention` kernel's (`--attention`).
    `states`: what trains (LoRA) and whether the model states live in host memory (`--offload-states`: on the
    device only what FSDP gathers, `states.device_bytes`). `documents`: the run's sequences are packed documents
    that attend only within themselves (their attention timed and counted as E[Σ d_i²], `flops.DocumentLengths`;
    memory is the same)."""
    tokens = micro_batch * seq // sp
    n = c.n_layers
    model_states = training_lower_bound(c, tokens, policy, dtype, shards=world, lora=states.lora)["states"]
    modes, alphas = policy.least_host_plan(n)  # the device buffers are the same for every solved plan
    tile = policy.tile_for(tokens)
    store = store_bytes(c, tokens, modes, alphas, tile, policy.offload_last_layers, dtype)
    cut = tile if tile < tokens else None
    traced = Traced.of(c, tokens, policy.strategy, "checkpoint" in modes, cut, sp, kernels, states.lora)
    transient = transient_peak(c, tokens, traced, loss_chunk_tokens, dtype=dtype, kernels=kernels)
    if states.offload:
        model_states = device_bytes(c, world, states)
    elif world == 1:  # `memo train` drops the gradients after every update: each step makes them anew
        grads = trained(c, states)[0] * torch.empty((), dtype=dtype).element_size()
        model_states, transient = model_states - grads, transient + grads
    predicted = {
        "device_peak_bytes": model_states + store.device_bytes + transient,
        "model_state_bytes": model_states,
        "skeletal_buffer_bytes": store.device_bytes,
        "step_transient_bytes": transient,
    }
    if policy.strategy == "memo" and policy.layer_modes(n) and policy.layer_alphas(n):
        predicted["host_pool_bytes"] = store.host_total
    if states.offload:
        predicted["host_state_bytes"] = host_bytes(c, world, states)
    if spec is not None:
        layout = Layout(ulysses=sp, recompute=policy.strategy, tile=tile if tile < tokens else None)
        e = estimate(
            c,
            seq,
            world,
            spec,
            "memo",
            layout=layout,
            micro_batch=micro_batch,
            states=states,
            attention=attention,
            documents=documents,
        )
        predicted.update(
            gpu=spec.name,
            step_seconds=e.step_seconds,
            step_seconds_range=e.ranges["step_seconds"],
            mfu=e.mfu,
            mfu_range=e.ranges["mfu"],
            dominant=e.dominant,
            attention_kernel=e.attention_kernel,
        )
    return predicted


def host_pool_bytes(
    c: ModelConfig, tokens: int, policy: ActivationPolicy, modes: list[str], alphas: list[float], dtype
) -> int:
    """Returns the host pool a plan (mode and α per layer) fills (§3)."""
    return store_bytes(c, tokens, modes, alphas, policy.tile_for(tokens), policy.offload_last_layers, dtype).host_total


def compare(predicted: dict, measured: dict) -> dict:
    """Returns {quantity: {predicted, measured, ratio}} for what both have, and the warnings: a measured
    memory peak more than `OFF_BY` away from its prediction."""
    rows, warnings = {}, []
    for key, value in measured.items():
        if key in predicted and value is not None and predicted[key]:
            rows[key] = {"predicted": predicted[key], "measured": value, "ratio": value / predicted[key]}
    for key in ("device_peak_bytes", "step_transient_bytes"):
        if key in rows and abs(rows[key]["ratio"] - 1) > OFF_BY:
            off = rows[key]["ratio"] - 1
            warnings.append(
                f"measured {key.removesuffix('_bytes').replace('_', ' ')} is {abs(off):.0%} "
                f"{'above' if off > 0 else 'below'} the cost model's prediction"
            )
    return {"rows": rows, "warnings": warnings}
