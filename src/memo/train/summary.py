"""What `memo train` shows of a run: the memory on its progress bar and the summary it ends with."""

from __future__ import annotations

from ..cost.predict import comparison_line
from ..policy import plan_runs
from ..units import format_bytes, format_count
from .config import TrainConfig


def memory_label(record: dict) -> str:
    """Returns the memory a step's record shows on the progress bar: the device's peak, the arena's or the host's."""
    if "device_peak_reserved" in record:
        return format_bytes(record["device_peak_reserved"])
    if "arena_bytes" in record:
        return f"arena {format_bytes(record['arena_bytes'])} + {format_bytes(record['arena_pass_peak_bytes'])}"
    return f"host {format_bytes(record['host_pool_bytes'])}"


def run_summary(cfg: TrainConfig, trainer, history: list[dict], evals: list[dict]) -> str:
    """Returns the lines `memo train` ends with: the plan, the losses, the held-out evaluation, throughput and
    memory, the planned allocator's arena, measured against predicted, and where the run's files are."""
    lines = []
    timed = history[1:] or history  # the first step includes one-off sizing, planning and warm-up
    tokens_per_s = sum(r["tokens_per_s"] for r in timed) / len(timed)
    last = history[-1]
    ranks = f"  ranks {trainer.mesh.size()} (dp {trainer.mesh['dp'].size()} x sp {cfg.sp})" if trainer.mesh else ""
    plan = plan_runs(last["modes"], last["alphas"]) if cfg.strategy == "memo" else f"every layer {last['modes'][0]}"
    tiles = f", tiles of {format_count(last['tile_tokens'])}" if last["tile_tokens"] < cfg.seq_len // cfg.sp else ""
    lines.append(f"model {cfg.model}  strategy {cfg.strategy}  plan {plan}{tiles}{ranks}  run {trainer.run_dir}")
    lines.append(f"loss {history[0]['loss']:.4f} -> {last['loss']:.4f} over steps {history[0]['step']}-{last['step']}")
    if evals:
        e = evals[-1]
        accuracy = f"  accuracy {e['eval_accuracy']:.1%}" if "eval_accuracy" in e else ""
        ruler = (
            "" if e.get("eval_ruler") is None else f"  RULER {e['eval_ruler']:.1%} ({len(e['eval_ruler_tasks'])} tasks)"
        )
        lines.append(f"held-out loss {e['eval_loss']:.4f}{accuracy}{ruler}  (step {e['step']})")
    lines.append(
        f"throughput {tokens_per_s:.0f} tokens/s  offloaded {format_bytes(last['bytes_offloaded'])}/step  "
        f"recomputed {format_bytes(last['bytes_recomputed'])}/step  host pool {format_bytes(last['host_pool_bytes'])}"
    )
    if trainer.arena is not None and trainer.arena.plan is not None:
        lines.append(arena_line(trainer.arena.plan, history))
    if trainer.comparison:
        lines.append(comparison_line(trainer.comparison))
    lines.append(f"metrics {trainer.run_dir / 'metrics.jsonl'}  picture: memo report {trainer.run_dir}")
    return "\n".join(lines)


def arena_line(plan, history: list[dict]) -> str:
    """Returns the planned allocator's summary: the arena against the planned step's LOAD, and how the last step
    was served."""
    last = history[-1]
    return (
        f"arena {format_bytes(plan.arena_bytes)} = {plan.arena_bytes / max(plan.load_bytes, 1):.3f} x the step's LOAD "
        f"{format_bytes(plan.load_bytes)}; last step: {last['arena_served']} of {plan.planned} planned allocations "
        f"served, {last['arena_misses']} misses, {last['arena_collisions']} collisions, "
        f"{format_bytes(last['arena_pass_peak_bytes'])} outside the arena"
    )
