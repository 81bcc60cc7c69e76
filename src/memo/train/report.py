"""`memo report RUN_DIR`: loss, throughput and memory of a run, from its metrics.jsonl, in one PNG."""

from __future__ import annotations

from pathlib import Path

from ..figures import drawn_by_memo, pyplot, save
from ..files import claim_file
from .metrics import read_metrics

GIB = 1 << 30


SCORES = (("eval_accuracy", "held-out accuracy"), ("eval_ruler", "RULER score"))  # 0..1, beside the loss


def plot_report(run_dir: str | Path, out: str | Path | None = None, overwrite: bool = False) -> Path:
    """Writes the run's report picture (default RUN_DIR/report.png) and returns its path; an existing `out` that
    memo did not draw is replaced only with `overwrite` (`memo.files.claim_file`)."""
    run_dir = Path(run_dir)
    default = run_dir / "report.png"
    out = Path(out) if out else default
    metrics = run_dir / "metrics.jsonl"
    ours = out.resolve() == default.resolve() or drawn_by_memo(out)
    claim_file(out, "--out", {"RUN_DIR's metrics.jsonl": metrics}, overwrite, ours=ours)
    records = read_metrics(metrics)
    steps = [r for r in records if "loss" in r]
    if not steps:
        raise ValueError(f"{run_dir}: no training records in metrics.jsonl")
    evals = [r for r in records if "eval_loss" in r]
    x = [r["step"] for r in steps]
    plt = pyplot()
    fig, (ax_loss, ax_speed, ax_mem) = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss.plot(x, [r["loss"] for r in steps], lw=1, label="train")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out")
        scores = [(k, label) for k, label in SCORES if any(r.get(k) is not None for r in evals)]
        if scores:
            acc = ax_loss.twinx()
            for (key, label), style in zip(scores, ("s--", "d:")):
                kept = [r for r in evals if r.get(key) is not None]
                acc.plot([r["step"] for r in kept], [r[key] for r in kept], style, label=label)
            acc.set_ylabel(" / ".join(label for _, label in scores))
            acc.set_ylim(0, 1)
            acc.legend(loc="center right")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend(loc="upper right")
    ax_speed.plot(x, [r["tokens_per_s"] for r in steps], lw=1)
    ax_speed.set(xlabel="step", ylabel="tokens/s", title="throughput")
    _memory(ax_mem, x, steps)
    fig.suptitle(f"{run_dir.name}")
    fig.tight_layout()
    save(fig, out)
    return out


def _memory(ax, x, steps) -> None:
    """Plots device peak memory where it was measured (CUDA), and the offload's host and traffic bytes."""
    series = {
        "device peak allocated": "device_peak_allocated",
        "device peak reserved": "device_peak_reserved",
        "pinned host pool": "host_pool_bytes",
        "offloaded / step": "bytes_offloaded",
        "recomputed / step": "bytes_recomputed",
    }
    present = {label: [r.get(key) or 0 for r in steps] for label, key in series.items()}
    present = {label: values for label, values in present.items() if any(values)}
    top = max((max(v) for v in present.values()), default=0)
    unit, scale = ("GiB", GIB) if top >= GIB else ("MiB", 1 << 20)
    for (label, values), style in zip(present.items(), ("-", "--", "-.", ":", "-")):
        ax.plot(x, [v / scale for v in values], style, lw=1.5, label=label)
    ax.set(xlabel="step", ylabel=unit, title="memory")
    ax.set_ylim(bottom=0)  # amounts: a zoomed axis would make a flat host pool look like a swing
    if ax.lines:
        ax.legend(fontsize=8)
