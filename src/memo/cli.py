"""`memo` command line: thin wrappers over the library. Results go to stdout, progress to stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .config import PRESETS, ModelConfig
from .cost.calibrate import calibrate
from .cost.estimate import SYSTEMS, estimate, max_seq
from .cost.hardware import GPUS, Efficiency, efficiency_from_calibration, gpu, load_gpus
from .cost.sweep import default_lengths, plot_sweep, sweep
from .plan.bilevel import plan
from .plan.dsa import solve
from .plan.plot import plot_plan
from .plan.problem import read_csv, write_csv
from .policy import STRATEGIES, ActivationPolicy
from .train.loop import DTYPES, TrainConfig, train
from .units import format_bytes, format_count, parse_size


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


def _estimate_parser(sub) -> None:
    p = sub.add_parser(
        "estimate",
        help="predict memory, alpha, step time and MFU before renting GPUs",
        description="Predict per-GPU device and host memory, alpha, step time, tokens/s and MFU of "
        "MEMO and the baselines (megatron, deepspeed, offload-all). MFU counts the full attention "
        "matrix (memo-method.md section 7).",
    )
    p.add_argument("--model", required=True, choices=list(PRESETS), help="model preset")
    p.add_argument("--seq", type=parse_size, default=None, help="tokens per sequence, e.g. 512K or 1M")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu", required=True, help="GPU name: " + ", ".join(GPUS))
    p.add_argument("--gpu-file", default=None, help="JSON file with more GPU specs (fields as in cost/hardware.py)")
    p.add_argument("--system", action="append", choices=SYSTEMS, help="system(s) to estimate (default: all)")
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel GPUs per sequence (default: all GPUs)")
    p.add_argument("--calibration", default=None, help="JSON written by `memo calibrate` on this GPU type")
    p.add_argument("--max-seq", action="store_true", help="search the longest sequence that fits, per system")
    p.add_argument("--sweep", action="store_true", help="MFU against sequence length (32K..4M) for all systems")
    p.add_argument("--plot", default=None, help="with --sweep: write the MFU plot to this PNG")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_run_estimate)


def _run_estimate(args) -> int:
    gpus = load_gpus(args.gpu_file) if args.gpu_file else GPUS
    spec = gpu(args.gpu, gpus)
    eff = efficiency_from_calibration(_read_json(args.calibration), spec) if args.calibration else Efficiency()
    cfg = ModelConfig.preset(args.model)
    systems = args.system or list(SYSTEMS)
    if args.sweep:
        results = sweep(cfg, default_lengths(), args.gpus, spec, systems, args.sp, eff)
        if args.plot:
            plot_sweep(results, args.plot, f"{cfg.name} on {args.gpus}x {spec.name}")
            print(f"wrote {args.plot}", file=sys.stderr)
        if args.json:
            print(json.dumps({s: [e.as_dict() for e in es] for s, es in results.items()}))
            return 0
        lengths = [e.seq for e in results[systems[0]]]
        print("| seq | " + " | ".join(f"{s} MFU" for s in systems) + " |")
        print("|---" * (len(systems) + 1) + "|")
        for i, n in enumerate(lengths):
            cells = [f"{100 * results[s][i].mfu:.1f}%" if results[s][i].fits else "OOM" for s in systems]
            print(f"| {format_count(n)} | " + " | ".join(cells) + " |")
        return 0
    if args.max_seq:
        found = {s: max_seq(cfg, args.gpus, spec, s, args.sp, eff) for s in systems}
        print(json.dumps(found) if args.json else "\n".join(f"{s}: {format_count(n)} tokens" for s, n in found.items()))
        return 0
    if args.seq is None:
        raise ValueError("give `--seq` (or `--max-seq` / `--sweep`)")
    results = [estimate(cfg, args.seq, args.gpus, spec, s, args.sp, eff) for s in systems]
    if args.json:
        print(json.dumps([e.as_dict() for e in results]))
        return 0
    print(f"{cfg.name}, {format_count(args.seq)} tokens, {args.gpus}x {spec.name}")
    print("| system | fits | alpha per layer | device GiB/GPU | host GiB/GPU | step s | tokens/s | MFU | why not |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    node_gpus = min(args.gpus, spec.gpus_per_node)
    for e in results:
        print(
            f"| {e.system} | {'yes' if e.fits else 'no'} | {_runs(e.alphas)} | {e.device_bytes['total'] / 2**30:.1f} | "
            f"{e.host_bytes_per_node / node_gpus / 2**30:.1f} | {e.step_seconds:.1f} | {e.tokens_per_s:.0f} | "
            f"{100 * e.mfu:.1f}% | {e.why} |"
        )
    return 0


def _runs(alphas: list[float] | None) -> str:
    """Returns α per layer as runs, e.g. '0.40x30 1.00x2' ('-' when nothing is offloaded)."""
    if not alphas:
        return "-"
    runs: list[list] = []
    for a in alphas:
        if runs and abs(runs[-1][0] - a) < 1e-9:
            runs[-1][1] += 1
        else:
            runs.append([a, 1])
    return " ".join(f"{a:.2f}x{k}" for a, k in runs)


def _calibrate_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure matmul, attention and host-copy throughput of this device",
        description="Measure this device's matmul and causal-attention FLOP/s and device->host copy "
        "bandwidth (pinned on CUDA); pass the JSON to `memo estimate --calibration`.",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: %(default)s)")
    p.add_argument("--out", default=None, help="write the measurements to this JSON file")
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")
    p.set_defaults(run=_run_calibrate)


def _run_calibrate(args) -> int:
    result = calibrate(torch.device(args.device))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"device {result['device']} ({result['dtype']})")
        print(f"matmul     {result['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s")
        print(f"attention  {result['attention_flops_per_s'] / 1e12:.2f} TFLOP/s (causal work, fwd+bwd)")
        print(f"host copy  {result['host_copy_bytes_per_s'] / 1e9:.2f} GB/s")
    return 0


def _dsa_parser(sub) -> None:
    p = sub.add_parser(
        "dsa",
        help="solve a DSA instance (MiniMalloc CSV: id,lower,upper,size)",
        description="Place buffers with half-open lifetimes at offsets so that buffers live at the "
        "same time never overlap, minimising the peak; prints peak, LOAD lower bound, gap and proof.",
    )
    p.add_argument("file", help="CSV with header id,lower,upper,size")
    p.add_argument("--time-limit", type=float, default=30.0, help="seconds (default: %(default)s)")
    p.add_argument("--out", default=None, help="write the placement as CSV with an offset column")
    p.add_argument("--json", action="store_true", help="print JSON: peak, lower_bound, gap, optimal, seconds, method")
    p.set_defaults(run=_run_dsa)


def _run_dsa(args) -> int:
    if not args.time_limit > 0:
        raise ValueError(f"`--time-limit` must be positive, got {args.time_limit}")
    problem = read_csv(args.file)
    solution = solve(problem, args.time_limit)
    if args.out:
        write_csv(problem, args.out, solution.offsets)
    if args.json:
        print(json.dumps(solution.summary()))
    else:
        proof = "optimal" if solution.optimal else f"{100 * solution.gap:.2f}% above the lower bound"
        print(
            f"{len(problem)} buffers: peak {solution.peak}, LOAD {solution.lower_bound}, {proof} "
            f"({solution.method}, {solution.seconds:.1f}s)"
        )
    return 0


def _plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="static memory plan of one training step (bi-level DSA), vs the caching allocator",
        description="Trace one training step on the meta device, pack each layer's forward and "
        "backward transients (level 1), then the whole step with layers as blocks (level 2); compare "
        "with PyTorch's caching allocator replaying the same trace.",
    )
    p.add_argument("--model", required=True, choices=list(PRESETS), help="model preset")
    p.add_argument("--seq", type=parse_size, required=True, help="tokens per sequence, e.g. 512K")
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="sequence/tensor-parallel GPUs: each traces seq/tp tokens")
    p.add_argument("--policy", default="memo", choices=STRATEGIES, help="activation strategy (default: %(default)s)")
    p.add_argument("--alpha", type=float, default=0.5, help="memo alpha (default: %(default)s)")
    p.add_argument("--time-limit", type=float, default=20.0, help="solver seconds (default: %(default)s)")
    p.add_argument("--plot", default=None, help="write the plan and allocator curves to this PNG")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_run_plan)


def _run_plan(args) -> int:
    if args.tp <= 0 or args.seq % args.tp:
        raise ValueError(f"`--tp` ({args.tp}) must be positive and divide `--seq` ({args.seq})")
    if args.batch <= 0:
        raise ValueError(f"`--batch` must be positive, got {args.batch}")
    cfg = ModelConfig.preset(args.model)
    policy = ActivationPolicy(args.policy, alpha=args.alpha if args.policy == "memo" else None)
    result = plan(cfg, policy, args.seq // args.tp, args.batch, args.time_limit)
    report = {
        "load": result.load,
        "arena_peak": result.iteration.peak,
        "gap": result.iteration.peak / result.load - 1,
        "caching_peak_allocated": result.caching.peak_allocated,
        "caching_peak_reserved": result.caching.peak_reserved,
        "saved_vs_caching": result.caching.peak_reserved - result.iteration.peak,
        "layer_forward_peak": result.forward.peak,
        "layer_backward_peak": result.backward.peak,
        "store_bytes": result.store_bytes,
        "solve_seconds": result.forward.seconds + result.backward.seconds + result.iteration.seconds,
    }
    if args.plot:
        plot_plan(result, args.plot, f"{cfg.name}, {format_count(args.seq)} tokens / {args.tp} GPUs, {args.policy}")
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
        return 0
    gib = 2**30
    print(f"{cfg.name}, {format_count(args.seq)} tokens over {args.tp} GPU(s), strategy {args.policy}")
    print(f"LOAD (bytes live at once)      {report['load'] / gib:8.2f} GiB")
    print(
        f"planned arena peak             {report['arena_peak'] / gib:8.2f} GiB  ({100 * report['gap']:+.2f}% vs LOAD)"
    )
    print(f"caching allocator: allocated   {report['caching_peak_allocated'] / gib:8.2f} GiB")
    print(f"caching allocator: reserved    {report['caching_peak_reserved'] / gib:8.2f} GiB")
    print(f"saved by planning              {report['saved_vs_caching'] / gib:8.2f} GiB")
    print(
        f"per layer: forward {report['layer_forward_peak'] / gib:.2f} GiB, backward "
        f"{report['layer_backward_peak'] / gib:.2f} GiB; store buffers {report['store_bytes'] / gib:.2f} GiB "
        f"(allocated once); solved in {report['solve_seconds']:.1f}s"
    )
    return 0


def _read_json(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memo", description="MEMO: fine-grained activation memory management for long-context training"
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    _train_parser(sub)
    _estimate_parser(sub)
    _calibrate_parser(sub)
    _dsa_parser(sub)
    _plan_parser(sub)
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
