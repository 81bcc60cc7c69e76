"""The cost model against published training runs: each row a real run (model, GPUs, length, the layout it
used), its published utilisation, and `memo estimate`'s prediction counted in the source's own convention
(`cost.flops.PUBLISHED_CONVENTIONS`). One set of efficiencies per GPU generation (`cost.efficiency.SPEEDS`, the
published kernel speeds, and `IN_TRAINING`, set from a run that is not among these), never fitted to these rows.
A row whose source does not say how it counts is shown in every reading it could be and left out of the median.
Prints a Markdown table and the median absolute error in utilisation points; `--json` for the rows.

    PYTHONPATH=src .venv/bin/python benchmarks/backtest.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass

from memo.config import ModelConfig
from memo.cost.efficiency import published_band
from memo.cost.estimate import Layout, Pricing, estimate
from memo.cost.flops import counted_flops_per_token
from memo.cost.hardware import gpu
from memo.job import Job
from memo.units import format_count

FA2, MEGATRON, KORTHIKANTI, TORCHTITAN, FOUNDRY, IBM, MEMO = (
    "FlashAttention-2",
    "Megatron-LM 2021",
    "Korthikanti 2022",
    "torchtitan",
    "llm-foundry",
    "IBM FSDP",
    "MEMO",
)
SOURCES = {
    FA2: "Dao 2023, FlashAttention-2, arXiv 2307.08691, Table 1",
    MEGATRON: "Narayanan et al. 2021, Efficient large-scale language model training on GPU clusters using "
    "Megatron-LM, arXiv 2104.04473, Table 1",
    KORTHIKANTI: "Korthikanti et al. 2022, Reducing activation recomputation in large transformer models, "
    "arXiv 2205.05198, Table 5",
    TORCHTITAN: "pytorch/torchtitan docs/performance.md, commit 1ea476e9f (April 2024)",
    FOUNDRY: "mosaicml/llm-foundry scripts/train/benchmarking/README.md",
    IBM: "IBM and PyTorch, Maximizing training throughput using PyTorch FSDP, pytorch.org blog, 2024-03-13",
    MEMO: "Zhao et al., MEMO: fine-grained tensor management for ultra-long context LLM training, SIGMOD 2025, "
    "arXiv 2407.12117, abstract",
}


def _gpt(layers: int, hidden: int, heads: int, vocab: int, name: str = "", biases: bool = True) -> ModelConfig:
    """Returns a GPT shape (GeLU MLP of 4h, tied embeddings as GPT-2, Megatron and MPT ship them)."""
    flags = {"qkv_bias": biases, "out_bias": biases, "mlp_bias": biases}
    name = name or f"gpt {layers}x{hidden}"
    return ModelConfig("gpt", layers, hidden, heads, 4 * hidden, vocab, tie_embeddings=True, name=name, **flags)


def _mpt(layers: int, hidden: int, heads: int, name: str) -> ModelConfig:
    return _gpt(layers, hidden, heads, 50368, name, biases=False)


GPT3_1B3, GPT3_2B7 = _gpt(24, 2048, 16, 50257, "gpt3-1.3b"), _gpt(32, 2560, 32, 50257, "gpt3-2.7b")
LLAMA2_7B = ModelConfig("llama", 32, 4096, 32, 11008, 32000, name="llama2-7b")
LLAMA3_8B = ModelConfig("llama", 32, 4096, 32, 14336, 128256, n_kv_heads=8, name="llama3-8b")
SHOWN = {"megatron-deepspeed": "ZeRO-3/FSDP"}  # the estimate's deepspeed system, as data-parallel runs use it
DATA_PARALLEL = Layout(
    system="megatron-deepspeed", recompute="none"
)  # every GPU a whole sequence, states sharded (ZeRO / FSDP)
CHECKPOINTED = Layout(system="megatron-deepspeed", recompute="full")
# Megatron-LM before FlashAttention: its fused softmax over the materialised s x s scores, timed as the
# standard attention of FlashAttention-2's Fig. 4
OLD_MEGATRON = {"note": "fused softmax attention", "attention": "standard"}
EQ3 = "megatron-eq3"


@dataclass(frozen=True)
class Run:
    """One published training run and the figure it reports."""

    source: str
    model: ModelConfig
    gpu: str
    gpus: int
    seq: int
    layout: Layout  # of the estimate's system closest to what the run used
    published: float  # utilisation in the source's convention, a fraction of the GPU's peak
    convention: str  # cost.flops.PUBLISHED_CONVENTIONS
    note: str = ""
    micro_batch: int = 1  # sequences per GPU (per sequence-parallel group) at once, where published
    attention: str = "flash2"  # the attention kernel the run used (cost.hardware.KernelSpeeds.attention)
    readings: tuple[str, ...] = ()  # the conventions an unpublished one could be: shown, not scored


A100, H100, A800 = "A100-80GB", "H100-SXM", "A800-80GB"
MPT_7B, MPT_13B, MPT_1B = _mpt(32, 4096, 32, "mpt-7b"), _mpt(40, 5120, 40, "mpt-13b"), _mpt(24, 2048, 16, "mpt-1b")
TRITON = {"note": "FSDP, Triton attention", "attention": "triton"}  # llm-foundry's attn_impl default then
H100_TRITON = {"note": "FSDP, Triton attention (unpublished on H100: timed as FlashAttention-2)"}
FSDP = {"note": "FSDP, SDPA flash"}
SELECTIVE_OPS = {"note": "FSDP, op-level selective checkpointing: no matmul recomputed"}


def _megatron(tp: int, recompute: str = "full") -> Layout:
    """Returns Megatron-LM's layout of `tp`-way tensor parallelism (no context parallelism)."""
    return Layout(system="megatron", tp=tp, recompute=recompute)


# fmt: off
RUNS = [  # source, model, GPU, GPUs, length, layout, published utilisation, convention, extra
    Run(FA2, GPT3_1B3, A100, 8, 2048, DATA_PARALLEL, 196 / 312, "6N"),
    Run(FA2, GPT3_1B3, A100, 8, 8192, DATA_PARALLEL, 220 / 312, "6N"),
    Run(FA2, GPT3_2B7, A100, 8, 2048, DATA_PARALLEL, 205 / 312, "6N", note="heads 32 or 20"),
    Run(FA2, GPT3_2B7, A100, 8, 8192, DATA_PARALLEL, 225 / 312, "6N"),
    Run(MEGATRON, _gpt(24, 2304, 24, 51200), A100, 32, 2048, _megatron(1), 137 / 312, EQ3, **OLD_MEGATRON),
    Run(MEGATRON, _gpt(30, 3072, 32, 51200), A100, 64, 2048, _megatron(2), 138 / 312, EQ3, **OLD_MEGATRON),
    Run(MEGATRON, _gpt(36, 4096, 32, 51200), A100, 128, 2048, _megatron(4), 142 / 312, EQ3, **OLD_MEGATRON),
    Run(MEGATRON, _gpt(40, 6144, 48, 51200), A100, 256, 2048, _megatron(8), 135 / 312, EQ3, **OLD_MEGATRON),
    Run(KORTHIKANTI, _gpt(48, 6144, 64, 51200), A100, 8, 2048, _megatron(8, "selective"), 0.415,
        "full", note="22B, sequence parallel, fused softmax attention", micro_batch=4, attention="standard"),
    Run(TORCHTITAN, LLAMA3_8B, A100, 64, 8192, DATA_PARALLEL, 0.582, "6N", **SELECTIVE_OPS),
    Run(FOUNDRY, MPT_7B, A100, 8, 65536, CHECKPOINTED, 0.4697, "6N", **TRITON),
    Run(FOUNDRY, MPT_7B, A100, 8, 32768, CHECKPOINTED, 0.4946, "6N", micro_batch=2, **TRITON),
    Run(FOUNDRY, MPT_7B, A100, 8, 8192, CHECKPOINTED, 0.5447, "6N", micro_batch=8, **TRITON),
    Run(FOUNDRY, MPT_13B, A100, 8, 32768, CHECKPOINTED, 0.5169, "6N", **TRITON),
    Run(FOUNDRY, MPT_1B, A100, 8, 32768, DATA_PARALLEL, 0.5552, "6N", **TRITON),
    Run(FOUNDRY, MPT_7B, H100, 8, 65536, CHECKPOINTED, 0.2859, "6N", **H100_TRITON),
    Run(FOUNDRY, MPT_7B, H100, 8, 8192, CHECKPOINTED, 0.3714, "6N", micro_batch=8, **H100_TRITON),
    Run(FOUNDRY, MPT_7B, H100, 128, 2048, DATA_PARALLEL, 0.4571, "6N", micro_batch=6, **H100_TRITON),
    Run(IBM, LLAMA2_7B, A100, 128, 4096, DATA_PARALLEL, 0.57, "6N", micro_batch=2, **FSDP),
    Run(IBM, LLAMA2_7B, H100, 96, 4096, DATA_PARALLEL, 0.37, "6N", micro_batch=2, **FSDP),
    Run(MEMO, ModelConfig.preset("gpt-7b"), A800, 8, 1 << 20, Layout(ulysses=8, recompute="memo"), 0.523,
        "causal", note="convention unpublished", readings=("causal", "full")),
]
# fmt: on


def predict(run: Run) -> dict:
    """Returns the run's row: what was published and what the cost model predicts, in the source's convention."""
    spec, lay = gpu(run.gpu), run.layout
    heads = run.micro_batch * run.model.n_heads // (lay.tp * lay.ulysses)
    band = published_band(spec, run.model, run.seq // lay.cp, heads, run.attention)
    job = Job(model=run.model, seq=run.seq, micro_batch=run.micro_batch, gpus=run.gpus)
    e = estimate(job, spec, lay.system, Pricing(band=band), layout=lay)
    per_gpu = e.tokens_per_s / run.gpus
    counted = counted_flops_per_token(run.model, run.seq, run.convention)
    predicted = counted * per_gpu / spec.peak_flops
    low, high = (counted * t / run.gpus / spec.peak_flops for t in e.ranges["tokens_per_s"])
    readings = {c: counted_flops_per_token(run.model, run.seq, c) * per_gpu / spec.peak_flops for c in run.readings}
    return {
        "source": run.source,
        "model": f"{run.model.name} ({run.model.num_parameters() / 1e9:.1f}B)",
        "gpus": f"{run.gpus}x {run.gpu}",
        "seq": run.seq,
        "layout": f"{SHOWN.get(lay.system, lay.system)}: {lay}",
        "convention": run.convention,
        "published": run.published,
        "predicted": predicted,
        "range": (low, high),
        "error_points": 100 * (predicted - run.published),
        "dominant": e.dominant,
        "note": run.note,
        "readings": readings,  # unscored: the prediction in each convention the source could have used
        "scored": not readings,
    }


def table(rows: list[dict]) -> str:
    """Returns the rows as Markdown, with the median absolute error."""
    lines = [
        "| source | model | GPUs | seq | layout | convention | published | predicted (range) | error (points) |",
        "|---|---|---|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        low, high = r["range"]
        convention, predicted, error = (
            r["convention"],
            f"{100 * r['predicted']:.1f}% ({100 * low:.1f}-{100 * high:.1f})",
            f"{r['error_points']:+.1f}",
        )
        if not r["scored"]:
            convention = " or ".join(r["readings"])
            predicted = " / ".join(f"{100 * v:.1f}% ({c})" for c, v in r["readings"].items())
            error = "not scored"
        lines.append(
            f"| {r['source']}{'; ' + r['note'] if r['note'] else ''} | {r['model']} | {r['gpus']} | "
            f"{format_count(r['seq'])} | {r['layout']} | {convention} | {100 * r['published']:.1f}% | "
            f"{predicted} | {error} |"
        )
    errors = [abs(r["error_points"]) for r in rows if r["scored"]]
    lines.append(
        f"\nmedian absolute error {statistics.median(errors):.1f} points, largest {max(errors):.1f}, "
        f"{sum(e <= 5 for e in errors)} of {len(errors)} scored rows within 5 points "
        f"({len(rows) - len(errors)} shown in every reading of an unpublished convention, not scored)"
    )
    cited = dict.fromkeys(r["source"] for r in rows)
    lines += ["", "Sources:"] + [f"- {name}: {SOURCES.get(name, name)}" for name in cited]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    rows = [predict(run) for run in RUNS]
    print(json.dumps(rows) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
