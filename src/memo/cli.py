"""`memo` command line: thin wrappers over the library. Results go to stdout, progress to stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import sys
import traceback
from pathlib import Path

import torch
from safetensors import SafetensorError
from tqdm import tqdm

from . import eval as evaluation
from .config import PRESETS, ModelConfig
from .cost.calibrate import Shape, calibrate, is_calibration
from .cost.efficiency import LENGTHS as ATTENTION_LENGTHS
from .cost.efficiency import check_calibration_device, efficiency_from_calibration
from .cost.estimate import (
    ATTENTION_CHOICES,
    CONVENTIONS,
    MAX_SEQ_RANGE,
    PACKED_CONVENTIONS,
    SYSTEMS,
    estimate,
    max_seq_range,
)
from .cost.flops import LORA_FLOPS, DocumentLengths
from .cost.hardware import GPUS, gpu, load_gpus
from .cost.memory import training_lower_bound
from .cost.states import States
from .cost.sweep import default_lengths, plot_sweep, sweep
from .device import check_device
from .eval import DTYPES as EVAL_DTYPES
from .eval import PasskeyTask, held_out_sequences, load, passkey_accuracy, perplexity_by_position, plot_passkey
from .figures import drawn_by_memo
from .files import claim_file, read_json_object, write_text
from .lora import ALL_TARGETS, LoraConfig, targets_value
from .parallel import faults
from .policy import STRATEGIES, ActivationPolicy
from .train import checkpoint
from .train.config import (
    TrainConfig,
    alpha_value,
    named_model_config,
    plan_value,
    read_config_file,
    replaced_rope,
    with_model_tokenizer,
)
from .train.data import PACKINGS
from .train.launch import launch
from .train.loop import Trainer, resume_config
from .train.report import plot_report
from .train.signals import Interrupted, Stopping, StopRequest, Terminated
from .units import format_bytes, format_count, parse_length, parse_size

MODEL_HELP = f"a preset ({', '.join(PRESETS)}), a model config file (.yaml/.toml/.json) or a Hugging Face folder"
PLAN_MAX_TOKENS = 4 << 20  # tokens per GPU `memo plan` traces (a trace takes seconds per million)


def _train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        allow_abbrev=False,  # whole flags only: a shortened flag in a run script must not change meaning later
        help="train a model (default: `tiny` on the generated long-range retrieval task)",
        description=(
            "Train with MEMO's activation memory management. Every field can come from --config FILE "
            "(YAML, TOML or JSON) and be overridden by its flag; --resume RUN_DIR continues a run exactly, on "
            "any number of ranks. Distributed: `--nproc N` ranks on this machine (and `--nnodes`, `--node-rank`, "
            "`--master-addr` on each of several), or `torchrun ... -m memo train`; ranks form a dp x sp mesh with "
            "`--sp` ranks per sequence."
        ),
    )
    p.add_argument("--config", help="YAML/TOML/JSON file of the fields below")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its latest checkpoint")
    for f in dataclasses.fields(TrainConfig):
        _add_field(p, f)
    p.set_defaults(run=_run_train)


def _add_field(p, f) -> None:
    """Adds the flag of one TrainConfig field; defaults are suppressed so that only given flags override."""
    flag = "--" + f.name.replace("_", "-")
    help_text = f.metadata["help"]
    if "(default:" not in help_text:  # a help that words its default itself keeps it alone
        help_text += f" (default: {f.default})"
    if isinstance(f.default, bool):
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        return
    kinds = {
        "alpha": _cli_type(alpha_value, "alpha"),
        "plan": plan_value,
        "seq_len": _cli_type(parse_size, "size"),
        "tile_tokens": _cli_type(parse_size, "size"),
        "lora_targets": targets_value,
    }
    kind = kinds.get(f.name)
    kind = kind or f.metadata.get("kind")
    kind = kind or (type(f.default) if f.default is not None else str)
    kind = NUMBER if kind is float else kind
    p.add_argument(flag, type=kind, choices=f.metadata.get("choices"), default=argparse.SUPPRESS, help=help_text)


def _cli_type(parse, name: str):
    """Returns `parse` for argparse: its ValueError becomes the usage error, and messages name `name`, not the
    function (argparse would say "invalid parse_size value")."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = name
    return convert


def _finite(text: str) -> float:
    """Returns a float flag's value: nan and inf are not settings."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


NUMBER = _cli_type(_finite, "number")


def _path(text: str) -> str:
    """Returns a path flag's value: an empty one would silently mean the current folder."""
    if not text.strip():
        raise ValueError("an empty path")
    return text


PATH = _cli_type(_path, "path")


def _claim_output(path: str | None, flag: str, args, inputs: dict | None = None, ours=drawn_by_memo) -> None:
    """Checks, before any work, that the verb may write its output file `path` (`memo.files.claim_file`): an
    existing one only when `ours(path)` recognises memo's own, or with `--overwrite`."""
    if path:
        claim_file(path, flag, inputs, args.overwrite, ours=Path(path).is_file() and ours(path))


def _run_train(args) -> int:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    flags = {k: v for k, v in vars(args).items() if k in fields}
    if args.resume:
        if args.config:
            raise ValueError("`--resume` takes the run's own config; give changes as flags, not `--config`")
        cfg, resume = resume_config(args.resume, flags), True
    else:
        values = {**(read_config_file(args.config) if args.config else {}), **flags}
        if values.get("alpha") is not None and values.get("strategy", TrainConfig.strategy) != "memo":
            ActivationPolicy(values.get("strategy"), alpha=values["alpha"])  # raises the clear error
        cfg, resume = TrainConfig.from_dict(values, args.config or "flags"), False
    if (cfg.nproc > 1 or cfg.nnodes > 1) and "LOCAL_RANK" not in os.environ:
        return launch(cfg, args.argv)
    cfg = cfg if resume else with_model_tokenizer(cfg)  # a resumed run keeps the tokenizer it trained with
    replaced = None if resume else replaced_rope(named_model_config(cfg.model), cfg)
    if replaced and os.environ.get("RANK", "0") == "0":
        print(f"memo train: warning: {replaced}", file=sys.stderr)
    trainer = None
    try:
        trainer = Trainer(cfg, resume=resume)
        code = _train(trainer)
    except BaseException:
        if trainer is not None:
            trainer.abandon()
        elif torch.distributed.is_initialized():  # a rank that failed to start
            torch.distributed.destroy_process_group()
        raise
    trainer.close()
    return code


def _train(trainer: Trainer) -> int:
    """Trains; rank 0 prints (the records of every rank are the same), as JSON lines with `--json`."""
    cfg, quiet = trainer.cfg, trainer.rank != 0
    as_json = cfg.json
    if trainer.step >= cfg.steps:  # a finished run resumed again (a requeued job): nothing to do, and no error
        if not quiet:
            done = f"{trainer.run_dir} is already complete at step {trainer.step}"
            print(f"memo train: {done}: nothing to train (give a larger `--steps` to go on)", file=sys.stderr)
        return 0
    if not quiet:  # before the first step, what the cost model expects of this run
        print(
            json.dumps({"step": trainer.step, "predicted": trainer.prediction})
            if as_json
            else _prediction_line(trainer.prediction),
            flush=True,
        )
    bar = tqdm(total=cfg.steps, initial=trainer.step, desc="train", file=sys.stderr, disable=as_json or quiet)
    history, evals = [], []
    try:
        with StopRequest() as stop:
            for record in trainer.records(stop):
                _show(record, quiet, as_json, bar, history, evals)
    except Interrupted as stopped:
        bar.close()
        if not quiet:
            print(str(stopped), file=sys.stderr)
        return stopped.exit_code
    except (ValueError, Terminated, KeyboardInterrupt):  # a run stopped before its first step leaves no folder
        bar.close()
        if not history and not checkpoint.list_checkpoints(trainer.run_dir):
            trainer.discard()
        raise
    bar.close()
    if as_json and trainer.comparison and not quiet:
        print(json.dumps({"step": trainer.step, "measured_vs_predicted": trainer.comparison}))
    if not as_json and history:
        _print_summary(cfg, trainer, history, evals)
    return 0


def _show(record: dict, quiet: bool, as_json: bool, bar, history: list, evals: list) -> None:
    """Prints a step's record (JSON) or moves the progress bar; keeps it for the summary (rank 0 only)."""
    if quiet:
        return
    if as_json:
        print(json.dumps(record), flush=True)
    if "eval_loss" in record:
        evals.append(record)
        return
    if "skipped" in record:  # its warning is printed; the bar moves on
        bar.update()
        return
    history.append(record)
    bar.set_postfix(
        loss=f"{record['loss']:.3f}",
        tok_s=f"{record['tokens_per_s']:.0f}",
        mem=_memory_label(record),
        refresh=False,
    )
    bar.update()


def _memory_label(record: dict) -> str:
    if "device_peak_reserved" in record:
        return format_bytes(record["device_peak_reserved"])
    if "arena_bytes" in record:
        return f"arena {format_bytes(record['arena_bytes'])} + {format_bytes(record['arena_pass_peak_bytes'])}"
    return f"host {format_bytes(record['host_pool_bytes'])}"


def _print_summary(cfg, trainer, history: list[dict], evals: list[dict]) -> None:
    timed = history[1:] or history  # the first step includes one-off sizing, planning and warm-up
    tokens_per_s = sum(r["tokens_per_s"] for r in timed) / len(timed)
    last = history[-1]
    ranks = f"  ranks {trainer.mesh.size()} (dp {trainer.mesh['dp'].size()} x sp {cfg.sp})" if trainer.mesh else ""
    plan = _plan_runs(last["modes"], last["alphas"]) if cfg.strategy == "memo" else f"every layer {last['modes'][0]}"
    tiles = f", tiles of {format_count(last['tile_tokens'])}" if last["tile_tokens"] < cfg.seq_len // cfg.sp else ""
    print(f"model {cfg.model}  strategy {cfg.strategy}  plan {plan}{tiles}{ranks}  run {trainer.run_dir}")
    print(f"loss {history[0]['loss']:.4f} -> {last['loss']:.4f} over steps {history[0]['step']}-{last['step']}")
    if evals:
        e = evals[-1]
        accuracy = f"  accuracy {e['eval_accuracy']:.1%}" if "eval_accuracy" in e else ""
        print(f"held-out loss {e['eval_loss']:.4f}{accuracy}  (step {e['step']})")
    print(
        f"throughput {tokens_per_s:.0f} tokens/s  offloaded {format_bytes(last['bytes_offloaded'])}/step  "
        f"recomputed {format_bytes(last['bytes_recomputed'])}/step  host pool {format_bytes(last['host_pool_bytes'])}"
    )
    if trainer.arena is not None and trainer.arena.plan is not None:
        print(_arena_line(trainer.arena.plan, history))
    if trainer.comparison:
        print(_comparison_line(trainer.comparison))
    print(f"metrics {trainer.run_dir / 'metrics.jsonl'}  picture: memo report {trainer.run_dir}")


def _prediction_line(predicted: dict) -> str:
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


def _comparison_line(comparison: dict) -> str:
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


def _arena_line(plan, history: list[dict]) -> str:
    """Returns the planned allocator's summary: the arena against the planned step's LOAD, and how the last step
    was served."""
    last = history[-1]
    return (
        f"arena {format_bytes(plan.arena_bytes)} = {plan.arena_bytes / max(plan.load_bytes, 1):.3f} x the step's LOAD "
        f"{format_bytes(plan.load_bytes)}; last step: {last['arena_served']} of {plan.planned} planned allocations "
        f"served, {last['arena_misses']} misses, {last['arena_collisions']} collisions, "
        f"{format_bytes(last['arena_pass_peak_bytes'])} outside the arena"
    )


def _export_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's latest weights as one safetensors file, or as a Hugging Face checkpoint (--hf)",
        description="Gather the latest checkpoint of RUN_DIR, one-process or sharded by a distributed run, into "
        "one model.safetensors of whole tensors (fp32 masters when the run trained in bf16); load it with "
        "Transformer.load_state_dict(safetensors.torch.load_file(PATH)). With --hf DIR, write a folder that "
        "transformers' AutoModelForCausalLM.from_pretrained(DIR) loads: config.json (Llama, Mistral, Qwen2 or "
        "Qwen3, with the RoPE and length trained at), generation_config.json, weights and the run's tokenizer. A LoRA "
        "run's adapters are merged into the weights of either; --adapter DIR writes them alone, for PEFT.",
    )
    p.add_argument("run_dir", type=PATH, help="a run directory written by `memo train`")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", type=PATH, help="safetensors path (default: RUN_DIR/export/model.safetensors)")
    where.add_argument("--hf", type=PATH, metavar="DIR", help="write a Hugging Face checkpoint folder to DIR instead")
    where.add_argument(
        "--adapter",
        type=PATH,
        metavar="DIR",
        help="a LoRA run: write its adapters alone as a PEFT adapter folder (PeftModel.from_pretrained(base, DIR))",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a file or folder memo did not write (a folder whole, never mixed with its old files); without "
        "it only a new path, an empty folder or an earlier export is written. Never the run or its checkpoints",
    )
    p.set_defaults(run=_run_export)


def _run_export(args) -> int:
    print(checkpoint.export(Path(args.run_dir), args.out, args.hf, args.adapter, args.overwrite))
    return 0


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="plot a run's loss, throughput and memory to PNG")
    p.add_argument("run_dir", type=PATH, help="a run directory written by `memo train`")
    p.add_argument("--out", type=PATH, help="PNG path (default: RUN_DIR/report.png; missing folders are made)")
    p.set_defaults(run=_run_report)


def _run_report(args) -> int:
    print(plot_report(args.run_dir, args.out, args.overwrite))
    return 0


def _estimate_parser(sub) -> None:
    p = sub.add_parser(
        "estimate",
        help="predict memory, alpha, step time and MFU before renting GPUs",
        description="Predict per-GPU device and host memory, alpha, step time, tokens/s and MFU of "
        "MEMO and the baselines (megatron, deepspeed, offload-all). MFU counts causal attention as the half of "
        "the s x s matrix a causal kernel computes; the full-matrix MFU and HFU (recomputation included) are "
        "shown beside it, each named under the table and in the JSON.",
    )
    p.add_argument("--model", type=PATH, required=True, help=MODEL_HELP)
    p.add_argument(
        "--seq", type=_cli_type(parse_length, "length"), default=None, help="tokens per sequence, e.g. 512K or 1M"
    )
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu", required=True, help=f"GPU name, any case: {', '.join(GPUS)} (or a usual alias: h100, ...)")
    p.add_argument(
        "--gpu-file", type=PATH, default=None, help="JSON file with more GPU specs (fields as in cost/hardware.py)"
    )
    p.add_argument("--system", action="append", choices=SYSTEMS, help="system(s) to estimate (default: all)")
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel GPUs per sequence (default: all GPUs)")
    p.add_argument(
        "--host-memory",
        type=_cli_type(parse_size, "size"),
        default=None,
        help="host memory per node, e.g. 1.5T or 512G (default: the GPU spec's); 90%% of it may hold offloads",
    )
    p.add_argument("--calibration", type=PATH, default=None, help="JSON written by `memo calibrate` on this GPU type")
    p.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default="auto",
        help="attention kernel whose published speeds time attention: flash (PyTorch's, FlashAttention-2), cudnn "
        "(cuDNN's fused attention), fa4 (flash-attn-4; on Hopper timed at FlashAttention-3's published speeds); "
        "auto (default): what memo's run-time choice takes on that GPU without optional packages, cudnn on Hopper "
        "(H100, H200) and flash elsewhere",
    )
    p.add_argument(
        "--arena", action="store_true", help="memo runs with its planned allocator (memo train --arena), not PyTorch's"
    )
    p.add_argument(
        "--offload-states",
        action="store_true",
        help="memo keeps parameters, gradients and AdamW state in host memory and steps the optimizer on the CPU "
        "(memo train --offload-states); they share the host memory with the activations' offload",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="memo trains LoRA adapters of this rank on a frozen bf16 base (0: none)",
    )
    p.add_argument(
        "--lora-targets",
        type=targets_value,
        default=None,
        help=f"with --lora-rank: projections that get adapters (default: {','.join(ALL_TARGETS)})",
    )
    packed = p.add_mutually_exclusive_group()
    packed.add_argument(
        "--mean-document-tokens",
        default=None,
        help="sequences are packed documents of this many tokens (e.g. 1K), each attending only within itself: "
        "attention does q*N^2 + r^2 of work for s = q*N + r, not s^2; memory is the same",
    )
    packed.add_argument(
        "--document-lengths",
        type=PATH,
        default=None,
        help="sequences are cut from the documents of this memo token file (.bin with its .json sidecar, or .npy "
        "with its .docs.npy), each attending only within itself: attention does their expected sum of d^2, not s^2",
    )
    p.add_argument("--max-seq", action="store_true", help="search the longest sequence that fits, per system")
    p.add_argument("--sweep", action="store_true", help="MFU against sequence length (32K..4M) for all systems")
    p.add_argument("--plot", type=PATH, default=None, help="with --sweep: write the MFU plot to this PNG")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_run_estimate)


def _run_estimate(args) -> int:
    gpus = load_gpus(args.gpu_file) if args.gpu_file else GPUS
    spec = gpu(args.gpu, gpus)
    eff = None  # the published band for the GPU, each layout's shape and the attention kernel
    if args.calibration and args.attention != "auto":
        raise ValueError("`--attention` picks published kernel speeds; `--calibration` has measured its own: give one")
    if args.calibration:
        calibration = read_json_object(args.calibration)
        check_calibration_device(calibration, spec)
        eff = efficiency_from_calibration(calibration, spec)
    cfg = named_model_config(args.model)
    inputs = {
        "`--model`": args.model,
        "`--gpu-file`": args.gpu_file,
        "`--calibration`": args.calibration,
        "`--document-lengths`": args.document_lengths,
    }
    _claim_output(args.plot, "--plot", args, inputs)
    states = _estimated_states(args)
    documents = _estimated_documents(args)
    systems = args.system or (["memo"] if states != States() else list(SYSTEMS))
    if args.plot and not args.sweep:
        raise ValueError("`--plot` draws the `--sweep` of MFU against length: give `--sweep` too")
    if args.sweep:
        return _print_sweep(args, cfg, spec, systems, eff, states, documents)
    if args.max_seq:
        run = (cfg, args.gpus, spec)
        every = dict(arena=args.arena, states=states, attention=args.attention, documents=documents)
        found = {s: max_seq_range(*run, s, args.sp, eff, args.host_memory, **every) for s in systems}
        if args.json:
            print(json.dumps(found))
            return 0
        for s, n in found.items():
            print(
                f"{s}: {format_count(n['mid'])} tokens (range {format_count(n['low'])}-{format_count(n['high'])}); "
                f"{'longer' if n['mid'] else 'shortest tried'}: {n['why_not']}"
            )
        print(f"\nrange: {MAX_SEQ_RANGE}; attention kernel: {next(iter(found.values()))['attention_kernel']}")
        if documents:
            print(f"{documents}: memory per token as unpacked; memo's plan hides its copies behind less attention")
        return 0
    if args.seq is None:
        raise ValueError("give `--seq` (or `--max-seq` / `--sweep`)")
    if args.seq < ATTENTION_LENGTHS[0]:  # below them the speeds it would use have no source
        raise ValueError(
            f"`--seq` {args.seq} is shorter than the published attention speeds the estimate cites "
            f"({format_count(ATTENTION_LENGTHS[0])} tokens and up): give a longer `--seq`"
        )
    every = dict(host_memory=args.host_memory, arena=args.arena, states=states, attention=args.attention)
    results = [estimate(cfg, args.seq, args.gpus, spec, s, args.sp, eff, **every, documents=documents) for s in systems]
    whole = [estimate(cfg, args.seq, args.gpus, spec, s, args.sp, eff, **every) for s in systems] if documents else []
    if args.json:
        records = [e.as_dict() for e in results]
        print(json.dumps([{**r, "unpacked": w.as_dict()} for r, w in zip(records, whole)] if documents else records))
        return 0
    packing = f", {documents}" if documents else ""
    print(f"{cfg.name}, {format_count(args.seq)} tokens, {args.gpus}x {spec.name}, {states}{packing}")
    print(
        "| system | fits | layout | plan (alpha) | device GiB/GPU | host GiB/GPU | tokens/step | step s | tokens/s | "
        f"MFU | MFU full {'Σd²' if documents else 's²'} | HFU | dominant | why not |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    node_gpus = min(args.gpus, spec.gpus_per_node)
    for e in results:
        if not e.layout:  # the system has no layout here
            print(f"| {e.system} | no | - | - | - | - | - | - | - | - | - | - | - | {e.why} |")
            continue
        step, mfu = e.ranges["step_seconds"], e.ranges["mfu"]
        print(
            f"| {e.system} | {'yes' if e.fits else 'no'} | {e.layout} | {_plan_runs(e.plan, e.alphas)} | "
            f"{e.device_bytes['total'] / 2**30:.1f} | {e.host_bytes_per_node / node_gpus / 2**30:.1f} | "
            f"{format_count(e.tokens_per_step)} | {e.step_seconds:.1f} ({step[0]:.1f}-{step[1]:.1f}) | "
            f"{e.tokens_per_s:.0f} | {100 * e.mfu:.1f}% ({100 * mfu[0]:.1f}-{100 * mfu[1]:.1f}) | "
            f"{100 * e.mfu_full:.1f}% | {100 * e.hfu:.1f}% | {e.dominant} | {e.why} |"
        )
    if documents:
        _print_packed(args.seq, documents, results, whole)
    else:
        names = ("MFU", "MFU full s²", "HFU")
        print("\n" + "\n".join(f"{name}: {text}" for name, text in zip(names, CONVENTIONS.values())))
    if states.lora:
        print(f"LoRA: {LORA_FLOPS}")
    print("tokens/step: one optimizer step's tokens on all GPUs (compare tokens/s across rows, not step seconds)")
    for e in results:
        if e.layout:
            print(f"{e.system}: nearest its limit: {e.binds}; memory served by {e.allocator}")
    timed = next((e.attention_kernel for e in results if e.attention_kernel), "-")
    source = results[0].efficiency.get("source", "-")
    print(f"ranges: the efficiency band; attention kernel: {timed}; efficiencies: {source}")
    return 0


def _estimated_states(args) -> States:
    """Returns what `memo estimate` is asked to train and where its states live (`--lora-rank`, `--offload-states`)."""
    if args.lora_rank < 0:
        raise ValueError(f"`--lora-rank` must not be negative, got {args.lora_rank}")
    if args.lora_targets and not args.lora_rank:
        raise ValueError("`--lora-targets` names the projections of LoRA's adapters: give `--lora-rank` too")
    lora = LoraConfig(args.lora_rank, targets=args.lora_targets or ALL_TARGETS) if args.lora_rank else None
    return States(lora, args.offload_states)


def _estimated_documents(args) -> DocumentLengths | None:
    """Returns the packed documents `memo estimate` is asked about (`--mean-document-tokens`, `--document-lengths`),
    None for whole sequences."""
    if args.mean_document_tokens is not None:
        try:
            mean = parse_length(args.mean_document_tokens)
        except ValueError as err:
            raise ValueError(f"`--mean-document-tokens` {err}") from None
        return DocumentLengths(mean=mean)
    if args.document_lengths is not None:
        return DocumentLengths.of_file(args.document_lengths)
    return None


def _print_packed(seq: int, documents: DocumentLengths, packed: list, whole: list) -> None:
    """Prints each system's attention, step time and MFU of packed documents beside those of whole sequences, and
    the MFU conventions of both."""
    attended = documents.attended(seq)
    shortest = ""
    if attended < ATTENTION_LENGTHS[0]:  # no published speed below: the shortest one's, faster than it runs
        shortest = f" (below the shortest published, {ATTENTION_LENGTHS[0]}: timed at its speed, an upper bound)"
    print(
        f"\n{documents}: attention work left "
        f"E[Σd²]/s² = {attended / seq:.3%} of whole {format_count(seq)}-token sequences; attention timed at the "
        f"published speed of {attended:,.0f}-token sequences{shortest}"
    )
    print("| system | attention | attention PFLOP/step | step s | tokens/s | MFU | fits | plan (alpha) |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for p, w in zip(packed, whole):
        for e, label in ((p, "packed documents, Σd²"), (w, "whole sequences, s²")):
            if e.layout:
                print(
                    f"| {e.system} | {label} | {e.attention_flops / 1e15:.4g} | {e.step_seconds:.4g} | "
                    f"{e.tokens_per_s:.0f} | {100 * e.mfu:.1f}% | {'yes' if e.fits else 'no'} | "
                    f"{_plan_runs(e.plan, e.alphas)} |"
                )
    print(f"\nMFU convention: {PACKED_CONVENTIONS['mfu']}")
    print(f"MFU full Σd²: {PACKED_CONVENTIONS['mfu_full']}\nHFU: {PACKED_CONVENTIONS['hfu']}")
    print(f"whole-sequence rows: {CONVENTIONS['mfu']}")
    print(
        "memory: the same per token packed or not (activations are per token); memo's plan may differ: its copies "
        "hide behind the documents' shorter attention (a smaller alpha, more recomputed)"
    )


def _print_sweep(args, cfg: ModelConfig, spec, systems: list[str], eff, states: States, documents=None) -> int:
    """Prints (or writes as JSON and a plot) each system's MFU at lengths from 32K to 4M (of packed `documents`
    when given, with the attention work they leave)."""
    lengths = default_lengths()
    if args.sp and lengths[0] % args.sp:
        raise ValueError(f"`--sweep` estimates powers of two from {format_count(lengths[0])}: `--sp` must divide them")
    run = (args.gpus, spec, systems, args.sp, eff, args.host_memory, states, args.attention, documents)
    results = sweep(cfg, lengths, *run)
    packing = f", {documents}" if documents else ""
    if args.plot:
        plot_sweep(results, args.plot, f"{cfg.name} on {args.gpus}x {spec.name}{packing}")
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps({s: [e.as_dict() for e in es] for s, es in results.items()}))
        return 0
    print(f"| seq | {'E[Σd²]/s² | ' if documents else ''}" + " | ".join(f"{s} MFU" for s in systems) + " |")
    print("|---" * (len(systems) + 1 + bool(documents)) + "|")
    for i, n in enumerate(lengths):
        cells = [f"{100 * results[s][i].mfu:.1f}%" if results[s][i].fits else "OOM" for s in systems]
        work = f"{documents.attended(n) / n:.3%} | " if documents else ""
        print(f"| {format_count(n)} | {work}" + " | ".join(cells) + " |")
    timed = next((e.attention_kernel for es in results.values() for e in es if e.attention_kernel), "-")
    conventions = PACKED_CONVENTIONS if documents else CONVENTIONS
    print(f"\n{f'{documents}; ' if documents else ''}MFU: {conventions['mfu']}; attention kernel: {timed}")
    return 0


def _plan_runs(modes: list[str] | None, alphas: list[float] | None) -> str:
    """Returns each layer's mode (and α) as runs, e.g. 'checkpoint x3, memo (0.40) x27, keep x2' ('-' when
    nothing is offloaded)."""
    if not modes:
        return "-"
    runs: list[list] = []
    for mode, a in zip(modes, alphas):
        label = f"memo ({a:.2f})" if mode == "memo" else mode
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    return ", ".join(f"{label} x{k}" for label, k in runs)


def _calibrate_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this device's GEMM, attention and host-copy speeds",
        description="Measure this device's speeds for each phase the cost model times: the layer's GEMMs, "
        "causal attention forward and backward apart, and device->host copy bandwidth (pinned on CUDA), at one "
        "GPU's shape of a run (`--model`, `--seq`, `--sp`; a generic shape without them). Pass the JSON to "
        "`memo estimate --calibration`.",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: %(default)s)")
    p.add_argument("--model", type=PATH, default=None, help=f"the model whose shapes to time: {MODEL_HELP}")
    p.add_argument("--seq", type=_cli_type(parse_length, "length"), default=None, help="tokens per sequence")
    p.add_argument("--sp", type=int, default=None, help="with --model: GPUs per sequence (seq/sp tokens, heads/sp)")
    p.add_argument("--out", type=PATH, default=None, help="write the measurements to this JSON file")
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")
    p.set_defaults(run=_run_calibrate)


def _run_calibrate(args) -> int:
    if (args.model is None) != (args.seq is None):
        raise ValueError("give `--model` and `--seq` together (or neither, for a generic shape)")
    if args.sp is not None and args.model is None:
        raise ValueError("`--sp` splits the shape of `--model` and `--seq`: give them too")
    device = check_device(args.device)
    _claim_output(args.out, "--out", args, {"`--model`": args.model}, ours=is_calibration)
    sp = 1 if args.sp is None else args.sp
    shape = Shape.of(named_model_config(args.model), args.seq, sp) if args.model else None
    result = calibrate(device, shape)
    if args.out:
        write_text(args.out, json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result))
    else:
        shape = result["shape"]
        print(
            f"device {result['device']} ({result['dtype']}): GEMMs of {shape['tokens']} tokens, attention over "
            f"{shape['attention_tokens']} tokens x {shape['heads']} heads"
        )
        print(f"matmul              {result['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s")
        print(f"attention forward   {result['attention_forward_flops_per_s'] / 1e12:.2f} TFLOP/s (causal work)")
        print(f"attention backward  {result['attention_backward_flops_per_s'] / 1e12:.2f} TFLOP/s (causal work)")
        print(f"attention kernel    {result['attention_kernel']}")
        print(f"memory              {result['hbm_bytes_per_s'] / 1e9:.2f} GB/s (device copy, read + write)")
        print(f"host copy           {result['host_copy_bytes_per_s'] / 1e9:.2f} GB/s")
    return 0


def _dsa_parser(sub) -> None:
    from .plan.budget import DEFAULT_WORK, SAFETY_SECONDS, TIME_LIMIT_HELP, WORK_HELP, work_value  # no numba

    p = sub.add_parser(
        "dsa",
        help="solve a DSA instance (MiniMalloc CSV: id,lower,upper,size)",
        description="Place buffers with half-open lifetimes at offsets so that buffers live at the "
        "same time never overlap, minimising the peak; prints peak, LOAD lower bound, gap and proof.",
    )
    p.add_argument("file", type=PATH, help="CSV with header id,lower,upper,size")
    p.add_argument("--work", type=_cli_type(work_value, "work"), default=format_count(DEFAULT_WORK), help=WORK_HELP)
    p.add_argument("--time-limit", type=NUMBER, default=SAFETY_SECONDS, help=TIME_LIMIT_HELP)
    p.add_argument("--out", type=PATH, default=None, help="write the placement as CSV with an offset column")
    p.add_argument(
        "--json", action="store_true", help="print JSON: peak, lower_bound, gap, optimal, seconds, method, work"
    )
    p.set_defaults(run=_run_dsa)


def _check_time_limit(seconds: float) -> None:
    if not seconds > 0:
        raise ValueError(f"`--time-limit` must be positive, got {seconds}")


def _run_dsa(args) -> int:
    _check_time_limit(args.time_limit)
    from .plan.budget import describe
    from .plan.dsa import solve  # the planner (numba) loads with the verbs that plan: a fifth of a second
    from .plan.problem import is_placement, read_csv, write_csv

    _claim_output(args.out, "--out", args, {"the buffers' FILE": args.file}, ours=is_placement)
    problem = read_csv(args.file)
    solution = solve(problem, args.time_limit, work_limit=args.work)
    if args.out:
        write_csv(problem, args.out, solution.offsets)
    if args.json:
        print(json.dumps(solution.summary()))
    else:
        proof = "optimal" if solution.optimal else f"{100 * solution.gap:.2f}% above the lower bound"
        spent = describe(solution.work, solution.work_limit, solution.clock_cut)
        print(
            f"{len(problem)} buffers: peak {solution.peak}, LOAD {solution.lower_bound}, {proof} "
            f"({solution.method}, {solution.seconds:.1f}s, {spent})"
        )
    return 0


def _check_plan_length(cfg: ModelConfig, policy: ActivationPolicy, tokens: int, batch: int) -> None:
    """Refuses steps no listed GPU holds, or too long to trace in seconds: the plan traces every token."""
    if tokens * batch > PLAN_MAX_TOKENS:
        raise ValueError(
            f"`--seq` / `--tp` x `--batch` is {format_count(tokens * batch)} tokens per GPU; the plan traces each "
            f"of them, at most {format_count(PLAN_MAX_TOKENS)}: raise `--tp` or lower `--seq`"
        )
    largest = max(GPUS.values(), key=lambda g: g.hbm_bytes)
    need = training_lower_bound(cfg, tokens * batch, policy, torch.bfloat16)["activations"]
    if need > largest.hbm_bytes:
        raise ValueError(
            f"`--seq` {format_count(tokens)} per GPU needs at least {format_bytes(need)} of activations with "
            f"`--policy {policy.strategy}`, more than the largest listed GPU ({largest.name}, "
            f"{format_bytes(largest.hbm_bytes)}): raise `--tp` or lower `--seq`"
        )


def _plan_parser(sub) -> None:
    from .plan.budget import PLAN_WORK, SAFETY_SECONDS, TIME_LIMIT_HELP, WORK_HELP, work_value  # no numba

    p = sub.add_parser(
        "plan",
        help="static memory plan of one training step (flat and bi-level DSA), vs the caching allocator",
        description="Trace one training step (forward, backward, optimizer update, kernel scratch) on the meta "
        "device; pack every tensor of it as one DSA (flat: what `memo train --arena` serves), and as the paper "
        "does, each layer's forward and backward (level 1) then the step with layers as blocks (level 2); "
        "compare with PyTorch's caching allocator replaying the same trace.",
    )
    p.add_argument("--model", type=PATH, required=True, help=MODEL_HELP)
    p.add_argument(
        "--seq", type=_cli_type(parse_length, "length"), required=True, help="tokens per sequence, e.g. 512K"
    )
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="sequence/tensor-parallel GPUs: each traces seq/tp tokens")
    p.add_argument("--policy", default="memo", choices=STRATEGIES, help="activation strategy (default: %(default)s)")
    p.add_argument("--alpha", type=NUMBER, default=None, help="memo alpha, only with `--policy memo` (default: 0.5)")
    p.add_argument("--work", type=_cli_type(work_value, "work"), default=format_count(PLAN_WORK), help=WORK_HELP)
    p.add_argument("--time-limit", type=NUMBER, default=SAFETY_SECONDS, help=TIME_LIMIT_HELP)
    p.add_argument("--plot", type=PATH, default=None, help="write the plan and allocator curves to this PNG")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=_run_plan)


def _run_plan(args) -> int:
    if args.tp <= 0 or args.seq % args.tp:
        raise ValueError(f"`--tp` ({args.tp}) must be positive and divide `--seq` ({args.seq})")
    if args.batch <= 0:
        raise ValueError(f"`--batch` must be positive, got {args.batch}")
    _check_time_limit(args.time_limit)
    from .parallel.ulysses import Ulysses
    from .plan.bilevel import plan
    from .plan.budget import describe
    from .plan.plot import plot_plan

    cfg = named_model_config(args.model)
    _claim_output(args.plot, "--plot", args, {"`--model`": args.model})
    try:  # each GPU holds 1/tp of the tokens as train's `--sp` ranks do: the same rule on the heads
        Ulysses.traced(args.tp, cfg.n_heads, cfg.n_kv_heads)
    except ValueError as err:
        raise ValueError(str(err).replace("`--sp`", "`--tp`")) from None
    alpha = 0.5 if args.alpha is None and args.policy == "memo" else args.alpha
    policy = ActivationPolicy(args.policy, alpha=alpha)  # refuses an `--alpha` given with another policy
    _check_plan_length(cfg, policy, args.seq // args.tp, args.batch)
    result = plan(cfg, policy, args.seq // args.tp, args.batch, args.time_limit, args.work)
    report = {
        "load": result.load,
        "dispatch_load": result.dispatch_load,
        "flat_peak": result.flat.peak,
        "flat_gap": result.flat.peak / result.load - 1,
        "flat_seconds": result.flat.seconds,
        "arena_peak": result.iteration.peak,
        "gap": result.iteration.peak / result.load - 1,
        "caching_peak_allocated": result.caching.peak_allocated,
        "caching_peak_reserved": result.caching.peak_reserved,
        "saved_vs_caching": result.caching.peak_reserved - result.iteration.peak,
        "layer_forward_peak": result.forward.peak,
        "layer_backward_peak": result.backward.peak,
        "store_bytes": result.store_bytes,
        "solve_seconds": result.forward.seconds + result.backward.seconds + result.iteration.seconds,
        "trace_seconds": result.trace_seconds,
        "work": result.work,
        "work_limit": args.work,
        "clock_cut": result.clock_cut,
    }
    if args.plot:
        plot_plan(result, args.plot, f"{cfg.name}, {format_count(args.seq)} tokens / {args.tp} GPUs, {args.policy}")
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
        return 0
    gib = 2**30
    print(f"{cfg.name}, {format_count(args.seq)} tokens over {args.tp} GPU(s), strategy {args.policy}")
    print(f"LOAD (bytes live at once)      {report['load'] / gib:8.2f} GiB  (kernel scratch included)")
    print(f"LOAD of the tensors ops return {report['dispatch_load'] / gib:8.2f} GiB  (what a dispatch trace sees)")
    print(
        f"flat plan (--arena)            {report['flat_peak'] / gib:8.2f} GiB  ({100 * report['flat_gap']:+.2f}% vs "
        f"LOAD, solved in {report['flat_seconds']:.1f}s)"
    )
    print(
        f"bi-level plan (the paper's)    {report['arena_peak'] / gib:8.2f} GiB  ({100 * report['gap']:+.2f}% vs LOAD)"
    )
    print(f"caching allocator: allocated   {report['caching_peak_allocated'] / gib:8.2f} GiB")
    print(f"caching allocator: reserved    {report['caching_peak_reserved'] / gib:8.2f} GiB")
    print(f"saved by planning              {report['saved_vs_caching'] / gib:8.2f} GiB")
    print(
        f"per layer: forward {report['layer_forward_peak'] / gib:.2f} GiB, backward "
        f"{report['layer_backward_peak'] / gib:.2f} GiB; store buffers {report['store_bytes'] / gib:.2f} GiB "
        f"(allocated once); bi-level solved in {report['solve_seconds']:.1f}s; traced in "
        f"{report['trace_seconds']:.1f}s"
    )
    print(f"DSA search: {describe(result.work, args.work, result.clock_cut)}")
    return 0


def _eval_parser(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="long-context evaluation: pass-key retrieval by length and depth, loss by position",
        description="Evaluate the newest checkpoint of a `memo train` run, or a Hugging Face folder (Llama, "
        "Mistral, Qwen2, Qwen3): "
        "pass-key (needle-in-a-haystack) accuracy per prompt length and needle depth, by greedy decoding; with "
        "--ppl-file, the loss of a held-out text by token position (within its document when documents are "
        "masked). Prompts are generated from --seed.",
    )
    p.add_argument(
        "path", type=PATH, help="a `memo train` run directory, or a Hugging Face folder (config.json + safetensors)"
    )
    p.add_argument(
        "--tokenizer",
        type=PATH,
        help="Hugging Face tokenizer.json (default: the run's, the folder's tokenizer.json, else bytes)",
    )
    cpu, cuda = evaluation.DEFAULTS["cpu"], evaluation.DEFAULTS["cuda"]
    p.add_argument(
        "--lengths",
        type=_cli_type(_lengths, "lengths"),
        help=f"prompt lengths in tokens (default: {_by_device(cpu.lengths, cuda.lengths, format_count)})",
    )
    p.add_argument(
        "--depths",
        type=_cli_type(_numbers, "depths"),
        help="needle depths in [0, 1]; 0 opens the prompt, 1 ends it before the question "
        f"(default: {_by_device(cpu.depths, cuda.depths, '{:g}'.format)})",
    )
    p.add_argument(
        "--trials",
        type=int,
        help=f"prompts per length and depth; 0: no pass key (default: {_by_device(cpu.trials, cuda.trials)})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of keys and filler (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default: %(default)s)")
    p.add_argument(
        "--passkey-pack",
        type=int,
        default=1,
        help="pass-key prompts of a cell packed in one sequence, each its own document (it attends only to itself, "
        "positions from 0): the same answers as one at a time, most in one forward (default: %(default)s)",
    )
    p.add_argument(
        "--ppl-file",
        type=PATH,
        help="held-out text (as --data takes it): loss by position over sequences of max(--lengths)",
    )
    p.add_argument(
        "--pack-documents",
        choices=PACKINGS,
        help="how --ppl-file's documents share a sequence, as `memo train --pack-documents`: mask (each attends "
        "only to itself; loss by position within its document) or concat (loss by position in the sequence) "
        "(default: the run's; concat for a run from before the option, mask for a Hugging Face folder)",
    )
    p.add_argument(
        "--max-sequences",
        type=int,
        help="score at most this many sequences of --ppl-file, spread evenly over it "
        f"(default: {_by_device(cpu.max_sequences, cuda.max_sequences)})",
    )
    p.add_argument(
        "--bucket-size",
        type=_cli_type(parse_size, "size"),
        help="positions per loss bucket (default: doubling from 128)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=list(EVAL_DTYPES), help="(default: %(default)s)")
    p.add_argument("--plot", type=PATH, help="write the pass-key heatmap (length x depth) to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=_run_eval)


def _by_device(cpu, cuda, show=str) -> str:
    """Returns a default that depends on the device, as help text: "256,1K on CPU; 1K,4K,16K on CUDA"."""
    spell = lambda v: ",".join(map(show, v)) if isinstance(v, tuple) else show(v)
    return f"{spell(cpu)} on CPU; {spell(cuda)} on CUDA"


def _lengths(text: str) -> list[int]:
    return [parse_length(t) for t in text.split(",")]


def _numbers(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"expected numbers separated by commas, got {text!r}") from None


def _run_eval(args) -> int:
    device = check_device(args.device)
    _eval_defaults(args, evaluation.defaults(device))
    if args.trials == 0 and not args.ppl_file:
        raise ValueError("nothing to evaluate: `--trials 0` and no `--ppl-file`")
    if args.plot and args.trials == 0:
        raise ValueError("`--plot` draws the pass-key heatmap: it needs `--trials` > 0")
    if args.max_sequences < 1:
        raise ValueError(f"`--max-sequences` must be positive, got {args.max_sequences}")
    if args.passkey_pack != 1 and args.trials == 0:
        raise ValueError("`--passkey-pack` packs pass-key prompts: it needs `--trials` > 0")
    if args.pack_documents and not args.ppl_file:
        raise ValueError("`--pack-documents` packs the documents of `--ppl-file`: give one")
    evaluation.check_pack(args.passkey_pack, args.batch_size)
    _claim_output(args.plot, "--plot", args, {"PATH": args.path, "`--ppl-file`": args.ppl_file})
    loaded = load(args.path, device, EVAL_DTYPES[args.dtype], args.tokenizer)
    model, tokenizer = loaded.model, loaded.tokenizer
    batch, pack = (args.batch_size, args.passkey_pack) if args.trials else (1, 1)
    evaluation.check_lengths(loaded, args.lengths, batch, pack)  # before any work
    limit = model.config.max_position_embeddings
    if limit and max(args.lengths) > limit:
        print(
            f"note: lengths past the model's max_position_embeddings ({format_count(limit)}) run as asked",
            file=sys.stderr,
        )
    if args.trials:  # bad arguments fail at once, before any progress bar or long run
        PasskeyTask(tokenizer).check(model, args.lengths, args.depths, args.trials, args.seed)
    longest = max(args.lengths)
    data = None
    if args.ppl_file:
        packing = args.pack_documents or loaded.pack_documents
        data = held_out_sequences(
            args.ppl_file, loaded.tokenizer_path, longest, model.config.vocab_size, tokenizer.identity, packing,
            loaded.document_separator, loaded.max_documents,
        )  # fmt: skip
    report = {"model": loaded.source, "tokenizer": tokenizer.name, "device": args.device, "dtype": args.dtype}
    cells = _measure_eval(args, loaded, data, report)
    if args.plot and cells:
        plot_passkey(cells, args.plot, f"pass key: {loaded.source}, {args.trials} trials per cell")
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    else:
        _print_eval(report, args.seed)
    if report.get("interrupted"):
        raise KeyboardInterrupt  # `memo eval: interrupted`, exit 130, after what was measured
    return 0


def _measure_eval(args, loaded, data, report: dict) -> list:
    """Scores the pass key and the loss by position into `report`; returns the pass-key cells. On Ctrl-C the
    report keeps what was finished (whole cells, the sequences scored) and says `interrupted`."""
    cells = []
    try:
        if args.trials:
            total = len(args.lengths) * len(args.depths) * args.trials
            with tqdm(total=total, desc="pass key", unit="trial", file=sys.stderr, disable=args.json) as bar:
                cells = passkey_accuracy(
                    loaded.model, loaded.tokenizer, args.lengths, args.depths, args.trials, args.seed,
                    args.batch_size, bar.update, args.passkey_pack,
                )  # fmt: skip
            report["passkey"] = [c.as_dict() for c in cells]
        if data is not None:
            picked = evaluation.spread(data.num_sequences, args.max_sequences)
            report["perplexity"] = {"file": args.ppl_file, "sequences": 0, "of": data.num_sequences}
            report["perplexity"].update(length=data.seq_len, pack_documents=data.pack_documents)
            with tqdm(total=len(picked), desc="loss", unit="seq", file=sys.stderr, disable=args.json) as bar:
                buckets = perplexity_by_position(loaded.model, data, args.bucket_size, bar.update, picked)
            report["perplexity"].update(sequences=len(picked), buckets=[b.as_dict() for b in buckets])
    except evaluation.Interrupted as stop:
        report["interrupted"] = True
        if "perplexity" in report:
            report["perplexity"].update(sequences=stop.done, buckets=[b.as_dict() for b in stop.results])
        else:
            cells = stop.results
            report["passkey"] = [c.as_dict() for c in cells]
    return cells


def _eval_defaults(args, defaults) -> None:
    """Fills the flags left unset with the device's defaults, once the device is known."""
    for name in ("lengths", "depths", "trials", "max_sequences"):
        if getattr(args, name) is None:
            value = getattr(defaults, name)
            setattr(args, name, list(value) if isinstance(value, tuple) else value)


def _print_eval(report: dict, seed: int) -> None:
    print(f"model {report['model']}  tokenizer {report['tokenizer']}  {report['device']} {report['dtype']}")
    if report.get("interrupted"):
        finished = report.get("passkey") or report.get("perplexity", {}).get("sequences")
        print(f"interrupted: {'the results finished' if finished else 'nothing was finished'} before Ctrl-C")
    if report.get("passkey"):
        cells = report["passkey"]
        lengths = list(dict.fromkeys(c["length"] for c in cells))
        accuracy = {(c["length"], c["depth"]): f"{c['accuracy']:.0%}" for c in cells}
        print(f"\npass key accuracy, {cells[0]['trials']} trials per cell (seed {seed})")
        print("| depth | " + " | ".join(format_count(n) for n in lengths) + " |")
        print("|---:" * (len(lengths) + 1) + "|")
        for depth in dict.fromkeys(c["depth"] for c in cells):
            print(f"| {depth:.2f} | " + " | ".join(accuracy.get((n, depth), "-") for n in lengths) + " |")
    if "perplexity" in report:
        ppl = report["perplexity"]
        of = f" of {ppl['of']}" if ppl["sequences"] < ppl["of"] else ""
        within = ppl["pack_documents"] == "mask"
        print(
            f"\nloss of {ppl['file']} by position{' within document' if within else ''}, {ppl['sequences']}{of} "
            f"sequence(s) of {format_count(ppl['length'])}"
            + (" (--max-sequences)" if of and not report.get("interrupted") else "")
        )
        print(f"| {'position within document' if within else 'positions'} | tokens | loss | perplexity |")
        print("|---|---:|---:|---:|")
        for b in ppl["buckets"]:
            loss, perplexity = (f"{b['loss']:.4f}", f"{b['perplexity']:.2f}") if b["tokens"] else ("-", "-")
            print(f"| [{format_count(b['start'])}, {format_count(b['end'])}) | {b['tokens']} | {loss} | {perplexity} |")


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line on stderr and exit 2, like every other bad input (`--help` shows usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="memo", description="MEMO: fine-grained activation memory management for long-context training"
    )
    sub = parser.add_subparsers(dest="verb", required=True)
    _train_parser(sub)
    _export_parser(sub)
    _report_parser(sub)
    _estimate_parser(sub)
    _calibrate_parser(sub)
    _dsa_parser(sub)
    _plan_parser(sub)
    _eval_parser(sub)
    for name in ("report", "estimate", "calibrate", "dsa", "plan", "eval"):  # export words its own
        sub.choices[name].add_argument(
            "--overwrite", action="store_true", help="replace an existing output file that memo did not write"
        )
    for verb in sub.choices.values():
        verb.add_argument("--debug", action="store_true", help="show the traceback of an error, not just its line")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs `memo <verb>`; returns the exit code. Expected failures (bad input, a file, device or memory that
    cannot be used: 2; a signal: 128 + its number, 130 for Ctrl-C) are one line on stderr, with the traceback only
    under `--debug`, after the verb removed its temporaries; any other exception is a bug: its traceback."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    rank0 = os.environ.get("RANK", "0") == "0"
    warnings = logging.StreamHandler(sys.stderr)  # the library's warnings, one line each (rank 0's only)
    warnings.setFormatter(logging.Formatter(f"memo {args.verb}: warning: %(message)s"))
    warnings.setLevel(logging.WARNING if rank0 else logging.CRITICAL + 1)
    logging.getLogger("memo").addHandler(warnings)
    try:
        with Stopping():
            return args.run(args)
    except BaseException as err:
        failure = _expected_failure(err)
        if failure is None:
            if not isinstance(err, Exception):  # SystemExit and the like pass through
                raise
            cause = faults.awaited_failure() if "LOCAL_RANK" in os.environ else None
            if cause is not None:  # a peer died first (a lost connection here is its echo): end with its code
                return cause["code"]
            _first_to_fail(f"error: {type(err).__name__}: {err}", 1)  # a bug: the other ranks end, this one shows
            raise
        line, code = failure
        if _first_to_fail(line, code):  # under a distributed launch: once, from the rank that failed first
            print(f"memo {args.verb}: {line}", file=sys.stderr)
            if args.debug:
                traceback.print_exc()
        return code
    finally:
        logging.getLogger("memo").removeHandler(warnings)


def _expected_failure(err: BaseException) -> tuple[str, int] | None:
    """Returns the line and exit code of a failure that is not a bug: a signal, bad input, a file that cannot be
    used, memory that runs out, a safetensors file that cannot be read; None for anything else."""
    if isinstance(err, Terminated):
        return str(err), err.exit_code
    if isinstance(err, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(err, (ValueError, OSError)):
        return f"error: {_message(err)}", 2
    if isinstance(err, torch.OutOfMemoryError):
        first = str(err).splitlines()[0] if str(err) else "out of memory"
        return f"error: the device ran out of memory ({first}); lower `--seq-len` or `--batch-size`", 2
    host = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", str(err))
    if isinstance(err, MemoryError) or (isinstance(err, RuntimeError) and host):
        size = f" ({format_bytes(int(host[1]))} at once)" if host else ""
        return f"error: the host ran out of memory{size}; lower `--seq-len` or `--batch-size`", 2
    if isinstance(err, SafetensorError):
        return f"error: a safetensors file cannot be read: {err}", 2
    return None


def _message(err: Exception) -> str:
    """Returns an error's line; an OSError's names the file and the reason without Python's [Errno N]."""
    if isinstance(err, OSError) and err.strerror:
        where = " -> ".join(str(f) for f in (err.filename, err.filename2) if f)
        return f"{where}: {err.strerror}" if where else err.strerror
    return str(err)


def _first_to_fail(line: str, code: int) -> bool:
    """Under a distributed launch, reports this rank's failure to every rank (which then end) and returns whether
    it is the run's first, the one to print; outside one, True."""
    if "LOCAL_RANK" not in os.environ:
        return True
    return faults.report(faults.connect(timeout=2.0), line, code, int(os.environ.get("RANK", "0")))


if __name__ == "__main__":
    sys.exit(main())
