"""The tables `memo estimate` prints, beside the estimates they show: each function returns text, the CLI prints it."""

from __future__ import annotations

from ..device import HOST_USABLE
from ..job import Job
from ..policy import plan_runs
from ..units import format_bytes, format_count
from .efficiency import LENGTHS
from .estimate import CONVENTIONS, MAX_SEQ_RANGE, PACKED_CONVENTIONS, Estimate
from .flops import LORA_FLOPS, MFU_EXPERTS, MFU_WINDOWED
from .hardware import GPUSpec, pinning


def estimate_table(job: Job, spec: GPUSpec, results: list[Estimate], whole: list[Estimate]) -> str:
    """Returns each system's row at `job`'s length, the conventions of its columns and what binds it; `whole`:
    the same systems on whole sequences when `job.documents` packs them."""
    documents = job.documents
    packing = f", {documents}" if documents else ""
    lines = [
        f"{job.model.name}, {format_count(job.seq)} tokens, {job.gpus}x {spec.name}, {job.states}{packing}; "
        f"{host_memory(job, spec)}",
        "| system | fits | layout | plan (alpha) | device GiB/GPU | host GiB/GPU | tokens/step | step s | tokens/s | "
        f"MFU | MFU full {'Σd²' if documents else 's²'} | HFU | dominant | why not |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    node_gpus = min(job.gpus, spec.gpus_per_node)
    for e in results:
        if not e.layout:  # the system has no layout here
            lines.append(f"| {e.system} | no | - | - | - | - | - | - | - | - | - | - | - | {e.why} |")
            continue
        step, mfu = e.ranges["step_seconds"], e.ranges["mfu"]
        lines.append(
            f"| {e.system} | {'yes' if e.fits else 'no'} | {e.layout} | {plan_runs(e.plan, e.alphas)} | "
            f"{e.device_bytes['total'] / 2**30:.1f} | {e.host_bytes_per_node / node_gpus / 2**30:.1f} | "
            f"{format_count(e.tokens_per_step)} | {e.step_seconds:.1f} ({step[0]:.1f}-{step[1]:.1f}) | "
            f"{e.tokens_per_s:.0f} | {100 * e.mfu:.1f}% ({100 * mfu[0]:.1f}-{100 * mfu[1]:.1f}) | "
            f"{100 * e.mfu_full:.1f}% | {100 * e.hfu:.1f}% | {e.dominant} | {e.why} |"
        )
    if documents:
        lines.append(packed_table(job, results, whole))
    else:
        names = ("MFU", "MFU full s²", "HFU")
        lines.append("\n" + "\n".join(f"{name}: {text}" for name, text in zip(names, CONVENTIONS.values())))
    if job.lora:
        lines.append(f"LoRA: {LORA_FLOPS}")
    lines.append(
        "tokens/step: one optimizer step's tokens on all GPUs (compare tokens/s across rows, not step seconds)"
    )
    lines += [f"{e.system}: nearest its limit: {e.binds}; memory served by {e.allocator}" for e in results if e.layout]
    lines += [host_line(e) for e in results if e.layout]
    timed = next((e.attention_kernel for e in results if e.attention_kernel), "-")
    source = results[0].efficiency.get("source", "-")
    lines.append(f"ranges: the efficiency band; attention kernel: {timed}; efficiencies: {source}")
    lines += sorted({f"speeds: {e.speeds_note}" for e in results if e.speeds_note})
    if job.model.sliding_window is not None:
        lines.append(MFU_WINDOWED)
    if job.model.moe:
        lines.append(MFU_EXPERTS)
    return "\n".join(lines)


def host_memory(job: Job, spec: GPUSpec) -> str:
    """Returns whose host memory the estimate assumes and how much of it may be pinned."""
    size = job.host_memory or spec.host_memory_per_node
    whose = "`--host-memory`" if job.host_memory else spec.machine or spec.name
    return f"host {format_bytes(size)} per node ({whose}), {HOST_USABLE:.0%} pinnable"


def one_gpu_lines(spec: GPUSpec, results: list[Estimate]) -> str:
    """Returns each system's answer on a real one-GPU machine's host memory (`GPUSpec.one_gpu_machine`)."""
    return "\n".join(
        f"{e.system} {_on_one_gpu_machine(spec)}: "
        + (f"fits, {e.tokens_per_s:.0f} tokens/s, {e.device_bytes['total'] / 2**30:.1f} GiB" if e.fits else e.why)
        + (f"; pinned host {format_bytes(e.host_bytes_per_node)}" if e.fits and e.host_bytes_per_node else "")
        for e in results
        if e.layout
    )


def _on_one_gpu_machine(spec: GPUSpec) -> str:
    return f"on a one-GPU machine, {spec.one_gpu_machine} ({format_bytes(spec.one_gpu_host_memory)} host)"


def _longest(found: dict) -> str:
    """Returns one `estimate.max_seq_range` answer: the length, its range, and what stops the next one."""
    stop = "longer" if found["mid"] else "shortest tried"
    return (
        f"{format_count(found['mid'])} tokens (range {format_count(found['low'])}-{format_count(found['high'])}); "
        f"{stop}: {found['why_not']}"
    )


def host_line(e: Estimate) -> str:
    """Returns the pinned host a system's plan needs per node, the least any plan at that length needs, and how
    long pinning it takes before the first step."""
    return (
        f"{e.system}: pinned host per node {format_bytes(e.host_bytes_per_node)} for this plan, "
        f"{format_bytes(e.host_least_per_node)} at least for any plan at this length; {pinning(e.pin_seconds)}"
    )


def packed_table(job: Job, packed: list[Estimate], whole: list[Estimate]) -> str:
    """Returns each system's attention, step time and MFU of packed documents beside those of whole sequences, and
    the MFU conventions of both."""
    seq, documents = job.seq, job.documents
    attended = documents.attended(seq)
    shortest = ""
    if attended < LENGTHS[0]:  # no published speed below: the shortest one's, faster than it runs
        shortest = f" (below the shortest published, {LENGTHS[0]}: timed at its speed, an upper bound)"
    lines = [
        f"\n{documents}: attention work left "
        f"E[Σd²]/s² = {attended / seq:.3%} of whole {format_count(seq)}-token sequences; attention timed at the "
        f"published speed of {attended:,.0f}-token sequences{shortest}",
        "| system | attention | attention PFLOP/step | step s | tokens/s | MFU | fits | plan (alpha) |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for p, w in zip(packed, whole):
        for e, label in ((p, "packed documents, Σd²"), (w, "whole sequences, s²")):
            if e.layout:
                lines.append(
                    f"| {e.system} | {label} | {e.attention_flops / 1e15:.4g} | {e.step_seconds:.4g} | "
                    f"{e.tokens_per_s:.0f} | {100 * e.mfu:.1f}% | {'yes' if e.fits else 'no'} | "
                    f"{plan_runs(e.plan, e.alphas)} |"
                )
    lines += [
        f"\nMFU convention: {PACKED_CONVENTIONS['mfu']}",
        f"MFU full Σd²: {PACKED_CONVENTIONS['mfu_full']}\nHFU: {PACKED_CONVENTIONS['hfu']}",
        f"whole-sequence rows: {CONVENTIONS['mfu']}",
        "memory: the same per token packed or not (activations are per token); memo's plan may differ: its copies "
        "hide behind the documents' shorter attention (a smaller alpha, more recomputed)",
    ]
    return "\n".join(lines)


def max_seq_lines(job: Job, spec: GPUSpec, found: dict[str, dict]) -> str:
    """Returns each system's longest sequence (`estimate.max_seq_range`) with its range and what stops it, and
    on a one-GPU machine's host where one was asked too ("one_gpu_machine")."""
    lines = [host_memory(job, spec)]
    for s, n in found.items():
        lines.append(f"{s}: {_longest(n)}")
        if "one_gpu_machine" in n:
            lines.append(f"{s} {_on_one_gpu_machine(spec)}: {_longest(n['one_gpu_machine'])}")
    first = next(iter(found.values()))
    kept = MAX_SEQ_RANGE.format(headroom=format_bytes(first["headroom"]))
    lines.append(f"\nrange: {kept}; attention kernel: {first['attention_kernel']}")
    if job.documents:
        lines.append(
            f"{job.documents}: memory per token as unpacked; memo's plan hides its copies behind less attention"
        )
    return "\n".join(lines)


def sweep_table(job: Job, lengths: list[int], results: dict[str, list[Estimate]]) -> str:
    """Returns each system's MFU at each length (of packed documents when the job packs them, with the attention
    work they leave); OOM where it does not fit."""
    documents, systems = job.documents, list(results)
    lines = [
        f"| seq | {'E[Σd²]/s² | ' if documents else ''}" + " | ".join(f"{s} MFU" for s in systems) + " |",
        "|---" * (len(systems) + 1 + bool(documents)) + "|",
    ]
    for i, n in enumerate(lengths):
        cells = [f"{100 * results[s][i].mfu:.1f}%" if results[s][i].fits else "OOM" for s in systems]
        work = f"{documents.attended(n) / n:.3%} | " if documents else ""
        lines.append(f"| {format_count(n)} | {work}" + " | ".join(cells) + " |")
    timed = next((e.attention_kernel for es in results.values() for e in es if e.attention_kernel), "-")
    conventions = PACKED_CONVENTIONS if documents else CONVENTIONS
    lines.append(f"\n{f'{documents}; ' if documents else ''}MFU: {conventions['mfu']}; attention kernel: {timed}")
    return "\n".join(lines)
