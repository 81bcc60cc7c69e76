"""`memo` command line: thin wrappers over the library. Results go to stdout, progress to stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from tqdm import tqdm

from .config import PRESETS
from .policy import STRATEGIES, ActivationPolicy
from .train.loop import DTYPES, TrainConfig, train
from .units import format_bytes


def _train_parser(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train a model on the embedded generated task",
        description=(
            "Train on a generated long-range copy task (the second half of each sequence repeats the first), "
            "printing loss and throughput."
        ),
    )
    p.add_argument("--model", default=d.model, choices=list(PRESETS), help="model preset (default: %(default)s)")
    p.add_argument(
        "--strategy",
        default=d.strategy,
        choices=STRATEGIES,
        help="none (keep all), full (recompute layers), memo (token-wise swap) (default: %(default)s)",
    )
    p.add_argument(
        "--alpha",
        type=_alpha,
        default=argparse.SUPPRESS,
        help=f"memo: fraction of tokens offloaded in [0, 1], or 'auto' to solve it (default: {d.alpha})",
    )
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (default: %(default)s)")
    p.add_argument(
        "--grad-clip", type=float, default=d.grad_clip, help="max global gradient norm (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed for weights and data (default: %(default)s)")
    p.add_argument("--device", default=d.device, help="torch device, e.g. cpu or cuda (default: %(default)s)")
    p.add_argument(
        "--dtype", default=d.dtype, choices=list(DTYPES), help="parameter/activation dtype (default: %(default)s)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON line per step instead of a progress bar")
    p.set_defaults(run=_run_train)


def _alpha(text: str) -> float | None:
    return None if text == "auto" else float(text)


def _run_train(args) -> int:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields}
    if "alpha" in given and given.get("strategy", TrainConfig.strategy) != "memo":
        ActivationPolicy(given.get("strategy", TrainConfig.strategy), alpha=given["alpha"])  # raises the clear error
    cfg = TrainConfig(**given)
    bar = tqdm(total=cfg.steps, desc="train", file=sys.stderr, disable=args.json)
    history = []
    for metrics in train(cfg):
        history.append(metrics)
        if args.json:
            print(json.dumps(metrics), flush=True)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
        bar.update()
    bar.close()
    timed = history[1:] or history  # the first step includes one-off sizing and warm-up
    tokens_per_s = sum(m["tokens_per_s"] for m in timed) / len(timed)
    last = history[-1]
    if not args.json:
        print(f"model {cfg.model}  strategy {cfg.strategy}  alpha {last['alphas'] or '-'}")
        print(f"loss {history[0]['loss']:.4f} -> {last['loss']:.4f} over {cfg.steps} steps")
        print(
            f"throughput {tokens_per_s:.0f} tokens/s  offloaded {format_bytes(last['bytes_offloaded'])}/step  "
            f"recomputed {format_bytes(last['bytes_recomputed'])}/step  "
            f"host pool peak {format_bytes(last['host_pool_peak'])}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memo", description="MEMO: fine-grained activation memory management for long-context training"
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    _train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs `memo <verb>`; returns the exit code. Bad input exits 2 with one line on stderr."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as err:
        print(f"memo {args.verb}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
