"""What the cost model predicts for one `memo train` run, and how the run's measurements compare: every run
tests the model (memory terms everywhere; step time and MFU on a GPU the model knows)."""

from __future__ import annotations

import dataclasses

from ..job import Job
from ..units import format_bytes
from .estimate import Layout, estimate
from .hardware import GPUSpec, pin_seconds, pinning
from .memory import Traced, store_bytes, training_lower_bound, transient_peak
from .states import device_bytes, host_bytes, trained

OFF_BY = 0.15  # a measured peak further than this from its prediction is a warning


def predict_run(job: Job, kernels: str, spec: GPUSpec | None = None, loss_chunk_tokens: int = 4096) -> dict:
    """Returns one rank's predicted memory (model states, the activation store's buffers for the policy's plan,
    the step's transient peak traced at the run's dtype, `kernels` (a device type), attention kernel
    (`job.attention`), tiles and modes, with the gradients a one-process step makes anew, their sum, and memo's
    host pool when the plan and α are known) and,
    on a known GPU (`spec`), the step time and MFU with their ranges, attention timed as `job.attention`'s.
    Offloaded states (`job.offload_states`) leave on the device only what FSDP gathers (`states.device_bytes`);
    packed `job.documents` are timed and counted as E[Σ d_i²] (memory is the same)."""
    c, policy, dtype, sp = job.model, job.policy, job.torch_dtype, job.sp or 1
    tokens = job.tokens(sp)
    n = c.n_layers
    model_states = training_lower_bound(dataclasses.replace(job, grad_accum=1))["states"]
    modes, alphas = policy.least_host_plan(n)  # the device buffers are the same for every solved plan
    tile = policy.tile_for(tokens)
    store = store_bytes(c, tokens, modes, alphas, tile, policy.offload_last_layers, dtype, policy.empty_buffers)
    cut = tile if tile < tokens else None
    traced = Traced.of(
        c, tokens, policy.strategy, "checkpoint" in modes, cut, sp, kernels, job.lora, dtype, job.attention
    )
    transient = transient_peak(c, tokens, traced, loss_chunk_tokens)
    if job.offload_states:
        model_states = device_bytes(job)
    elif job.gpus == 1:  # `memo train` drops the gradients after every update: each step makes them anew
        grads = trained(job)[0] * dtype.itemsize
        model_states, transient = model_states - grads, transient + grads
    predicted = {
        "device_peak_bytes": model_states + store.device_bytes + transient,
        "model_state_bytes": model_states,
        "skeletal_buffer_bytes": store.device_bytes,
        "step_transient_bytes": transient,
    }
    if policy.strategy == "memo" and policy.layer_modes(n) and policy.layer_alphas(n):
        predicted["host_pool_bytes"] = store.host_total
    if job.offload_states:
        predicted["host_state_bytes"] = host_bytes(job)
    if spec is not None:
        layout = Layout(ulysses=sp, recompute=policy.strategy, tile=cut)
        e = estimate(job, spec, "memo", layout=layout)
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


def host_pool_bytes(job: Job, modes: list[str], alphas: list[float]) -> int:
    """Returns the host pool a plan (mode and α per layer) fills (§3) for one rank of `job`."""
    tokens, policy = job.tokens(job.sp or 1), job.policy
    layout = store_bytes(
        job.model,
        tokens,
        modes,
        alphas,
        policy.tile_for(tokens),
        policy.offload_last_layers,
        job.torch_dtype,
        policy.empty_buffers,
    )
    return layout.host_total


def pinned_host_line(job: Job, ranks: int, budget: int) -> str | None:
    """Returns the pinned host a run's node needs before anything is pinned (its `ranks` ranks, each with
    `budget` bytes of host): this plan's (a solved plan: at most the budget), the least any plan at this length
    needs, and how long pinning takes (`hardware.pinning`); None when nothing is pinned."""
    policy, n = job.policy, job.model.n_layers
    states = host_bytes(job)
    least = training_lower_bound(job)["host_pool"] + states  # the least-host plan where it is solved
    if not least:
        return None
    fixed = policy.strategy != "memo" or (policy.layer_modes(n) and policy.layer_alphas(n))
    plan = least if fixed else max(least, budget)
    pinned = f"{format_bytes(plan * ranks)} for this plan" if fixed else f"up to {format_bytes(plan * ranks)} (solved)"
    return (
        f"pinned host per node: {pinned}, {format_bytes(least * ranks)} at least for any plan at this length; "
        f"{pinning(pin_seconds(plan))}"
    )


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


def prediction_line(predicted: dict) -> str:
    """Returns what the cost model predicts for this run, in one line."""
    parts = [
        f"device peak {format_bytes(predicted['device_peak_bytes'])} (states "
        f"{format_bytes(predicted['model_state_bytes'])}, skeletal buffers "
        f"{format_bytes(predicted['skeletal_buffer_bytes'])}, step transients "
        f"{format_bytes(predicted['step_transient_bytes'])})"
    ]
    if "host_pool_bytes" in predicted:
        parts.append(f"host pool {format_bytes(predicted['host_pool_bytes'])}")
    if "step_seconds" in predicted:
        low, high = predicted["step_seconds_range"]
        parts.append(
            f"step {predicted['step_seconds']:.3g} s ({low:.3g}-{high:.3g}) and MFU {100 * predicted['mfu']:.1f}% "
            f"on {predicted['gpu']} ({predicted['dominant']})"
        )
    return "predicted per rank: " + ", ".join(parts)


def comparison_line(comparison: dict) -> str:
    """Returns the run's measurements beside the cost model's predictions."""

    def shown(key: str, value: float) -> str:
        if key.endswith("_bytes"):
            return format_bytes(value)
        return f"{100 * value:.1f}%" if key == "mfu" else f"{value:.3g} s"

    cells = [
        f"{key.removesuffix('_bytes').replace('_', ' ')} {shown(key, row['measured'])} vs "
        f"{shown(key, row['predicted'])} predicted (x{row['ratio']:.2f})"
        for key, row in comparison["rows"].items()
    ]
    return "measured: " + ("; ".join(cells) or "nothing the cost model predicts (on CPU: run with --arena)")
