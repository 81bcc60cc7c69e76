"""LoRA against full fine-tuning on the CPU: the step time of the same model, length and memory strategy, with
every weight training or with rank-r adapters on the seven projections (base frozen: the backward skips every
frozen weight gradient, the LM head's included, and AdamW updates only the adapters).

Both models are built from the same weights and run the same batch; their steps (forward, backward, AdamW) are
alternated in one process, so that a shared machine's drift in speed falls on both alike; each time is the
median after the warm-up steps. The FLOPs column counts the step's matrix products (torch's FlopCounterMode).

    PYTHONPATH=src .venv/bin/python benchmarks/lora.py
    PYTHONPATH=src .venv/bin/python benchmarks/lora.py --seqs 1024 --hidden 256 --steps 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from memo import ActivationPolicy, ModelConfig, Transformer
from memo.lora import LoraConfig, apply_lora

WARMUP = 2  # the first step sizes the store and makes the optimizer state; the second warms the caches


def _config(hidden: int, layers: int) -> ModelConfig:
    """A Llama-shaped model (SwiGLU at 3.5x, 4 query heads per kv head, 64-wide heads) of `hidden` width."""
    heads = hidden // 64
    return ModelConfig("llama", layers, hidden, heads, 7 * hidden // 2, 8192, n_kv_heads=max(heads // 4, 1))


def _pair(config: ModelConfig, seq: int, rank: int, alpha: float):
    """Returns (full, LoRA) models with the same base weights, each with its AdamW, and one batch."""
    runs = []
    for lora in (None, LoraConfig(rank)):
        torch.manual_seed(0)
        model = Transformer(config, ActivationPolicy("memo", alpha=alpha, host_budget_bytes=1 << 40))
        if lora is not None:
            apply_lora(model, lora)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        runs.append((model, optimizer))
    return runs, torch.randint(0, config.vocab_size, (1, seq))


def _step(model, optimizer, ids) -> None:
    model(ids, labels=ids).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(config: ModelConfig, seq: int, rank: int, alpha: float, steps: int) -> dict:
    """Returns the median step seconds and the matmul FLOPs of a step, full and LoRA."""
    runs, ids = _pair(config, seq, rank, alpha)
    times = [[], []]
    for _ in range(steps):
        for (model, optimizer), spent in zip(runs, times):
            start = time.perf_counter()
            _step(model, optimizer, ids)
            spent.append(time.perf_counter() - start)
    flops = []
    for model, optimizer in runs:
        with FlopCounterMode(display=False) as counter:
            _step(model, optimizer, ids)
        flops.append(counter.get_total_flops())
    trainable = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m, _ in runs]
    return {
        "seconds": [statistics.median(t[WARMUP:]) for t in times],
        "flops": flops,
        "trainable": trainable,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="2048,4096", help="tokens per sequence (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=1024, help="model width (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default: %(default)s)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=0.5, help="memo's offloaded fraction (default: %(default)s)")
    p.add_argument("--steps", type=int, default=7, help="steps of each, the first two not counted")
    args = p.parse_args(argv)
    if args.steps <= WARMUP:
        p.error(f"--steps must exceed the {WARMUP} warm-up steps")
    config = _config(args.hidden, args.layers)
    print(f"model: {config.n_layers} layers x {config.hidden_size} wide, memo alpha={args.alpha}, "
          f"LoRA r={args.rank} on q,k,v,o,gate,up,down; {torch.get_num_threads()} threads", flush=True)  # fmt: skip
    print("| tokens | trainable full | trainable LoRA | step s full | step s LoRA | LoRA / full | "
          "GFLOP full | GFLOP LoRA | FLOP ratio |", flush=True)  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for seq in map(int, args.seqs.split(",")):
        m = measure(config, seq, args.rank, args.alpha, args.steps)
        (full, lora), (f_full, f_lora), (n_full, n_lora) = m["seconds"], m["flops"], m["trainable"]
        print(
            f"| {seq} | {n_full / 1e6:.1f}M | {n_lora / 1e6:.2f}M | {full:.3f} | {lora:.3f} | {lora / full:.3f} | "
            f"{f_full / 1e9:.1f} | {f_lora / 1e9:.1f} | {f_lora / f_full:.3f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
