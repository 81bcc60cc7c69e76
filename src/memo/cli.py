"""`memo` command line: thin wrappers over the library. Results go to stdout, progress to stderr."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import re
import sys
import traceback
from pathlib import Path

import torch
from safetensors import SafetensorError
from tqdm import tqdm

from . import eval as evaluation
from .cost.calibrate import CalibrateRequest, Shape, calibrate, calibration_lines, is_calibration
from .cost.estimate import Pricing, estimate, max_seq_range
from .cost.memory import check_plan_length
from .cost.predict import prediction_line
from .cost.request import EstimateRequest
from .cost.sweep import default_lengths, plot_sweep, sweep
from .cost.tables import estimate_table, max_seq_lines, one_gpu_lines, sweep_table
from .device import DTYPES, check_device
from .eval import (
    EvalRequest,
    PasskeyTask,
    held_out_sequences,
    load,
    passkey_accuracy,
    perplexity_by_position,
    plot_passkey,
    report_lines,
)
from .figures import drawn_by_memo
from .files import claim_file, write_text
from .job import MODEL_HELP, Job, named_model
from .lora import targets_value
from .parallel import faults
from .parallel.mesh import launched, rank
from .plan.request import DsaRequest, PlanRequest, plan_lines, plan_report, plan_title
from .policy import STRATEGIES
from .ruler import Ruler
from .ruler_eval import RulerCell, RulerGrid, chat_hook, end_of_text, plot_cells, plot_paths, ruler_cells
from .train import checkpoint
from .train.config import (
    TrainConfig,
    alpha_value,
    plan_value,
    replaced_rope,
    with_model_tokenizer,
)
from .train.launch import launch
from .train.loop import Trainer
from .train.report import plot_report
from .train.resume import resumed_base, start_config
from .train.signals import Interrupted, Stopping, StopRequest, Terminated
from .train.summary import memory_label, run_summary
from .units import format_bytes, format_count, parse_length, parse_size


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
    cfg, resume = start_config(flags, args.config, args.resume)
    if (cfg.nproc > 1 or cfg.nnodes > 1) and not launched():
        return launch(cfg, args.argv)
    cfg = cfg if resume else with_model_tokenizer(cfg)  # a resumed run keeps the tokenizer it trained with
    base = resumed_base(cfg.out, cfg) if resume else named_model(cfg.model)  # read once: the trainer extends it
    replaced = None if resume else replaced_rope(base, cfg)
    if replaced and rank() == 0:
        print(f"memo train: warning: {replaced}", file=sys.stderr)
    trainer = None
    try:
        trainer = Trainer(cfg, resume=resume, base=base, say=lambda line: print(line, file=sys.stderr, flush=True))
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
            else prediction_line(trainer.prediction),
            flush=True,
        )
    bar = tqdm(total=cfg.steps, initial=trainer.step, desc="train", file=sys.stderr, disable=as_json or quiet)
    history, evals = [], []
    try:
        say = None if quiet else lambda line: bar.write(f"memo train: {line}", file=sys.stderr)  # above the bar
        with StopRequest(say, lambda: trainer.step) as stop:
            for record in trainer.records(stop):
                _show(record, quiet, as_json, bar, history, evals)
    except Interrupted as stopped:
        bar.close()
        if not quiet:
            print(str(stopped), file=sys.stderr)
        return stopped.exit_code
    except (ValueError, OSError, Terminated, KeyboardInterrupt):  # a run stopped before its first step: no folder
        bar.close()
        if not history and not checkpoint.list_checkpoints(trainer.run_dir):
            trainer.discard()
        raise
    bar.close()
    if as_json and trainer.comparison and not quiet:
        print(json.dumps({"step": trainer.step, "measured_vs_predicted": trainer.comparison}))
    if not as_json and history:
        print(run_summary(cfg, trainer, history, evals))
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
        mem=memory_label(record),
        refresh=False,
    )
    bar.update()


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
        "MEMO and the systems people run instead (alst, megatron, megatron-deepspeed, offload-all). MFU counts "
        "causal attention as the half of the s x s matrix a causal kernel computes; the full-matrix MFU and HFU "
        "(recomputation included) are shown beside it, each named under the table and in the JSON.",
    )
    _add_flags(p, EstimateRequest)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_run_estimate)


def _add_flags(p, record: type) -> None:
    """Adds a flag for each field of `record` (a verb's typed flags, `memo.flags.flag`): its help, how its text is
    read, its choices; fields of one `exclusive` group are mutually exclusive."""
    groups = {}
    for f in dataclasses.fields(record):
        meta = f.metadata
        name = f.name if meta.get("positional") else "--" + f.name.replace("_", "-")
        where = p
        if meta.get("exclusive"):
            if meta["exclusive"] not in groups:
                groups[meta["exclusive"]] = p.add_mutually_exclusive_group()
            where = groups[meta["exclusive"]]
        if isinstance(f.default, bool):
            where.add_argument(name, action="store_true", help=meta["help"])
            continue
        kind = meta["parse"]
        if kind and kind is not int:  # int's own "invalid int value" is the message argparse gives
            kind = _cli_type(kind, meta.get("name") or f.name.split("_")[-1])
        kind = PATH if meta.get("path") else NUMBER if meta.get("number") else kind
        given = {"required": True} if f.default is dataclasses.MISSING and not meta.get("positional") else {}
        if f.default is not dataclasses.MISSING:
            given["default"] = f.default
        if meta.get("append"):
            given["action"] = "append"
        where.add_argument(name, type=kind, choices=meta["choices"], help=meta["help"], **given)


def _flags(record: type, args):
    """Returns the typed record (`record`, a dataclass of a verb's flags, checked in it) of the parsed `args`."""
    fields = {f.name for f in dataclasses.fields(record)}
    return record(**{k: v for k, v in vars(args).items() if k in fields})


def _run_estimate(args) -> int:
    request = _flags(EstimateRequest, args)
    spec = request.spec()
    band = request.band(spec)  # None: the published band for the GPU, each layout's shape and attention kernel
    inputs = {"`--model`": args.model, "`--gpu-file`": args.gpu_file, "`--calibration`": args.calibration}
    _claim_output(args.plot, "--plot", args, {**inputs, "`--document-lengths`": args.document_lengths})
    job = request.job()
    request.check_host(job, spec)
    systems = request.systems(job)
    if args.sweep:
        lengths = default_lengths()
        results = sweep(job, lengths, spec, systems, band)
        if args.plot:
            packing = f", {job.documents}" if job.documents else ""
            plot_sweep(results, args.plot, f"{job.model.name} on {args.gpus}x {spec.name}{packing}")
            print(f"wrote {args.plot}", file=sys.stderr)
        shown = json.dumps({s: [e.as_dict() for e in es] for s, es in results.items()})
        print(shown if args.json else sweep_table(job, lengths, results))
        return 0
    # one GPU on its default host: answered on a real one-GPU machine's host too
    one_gpu = job.gpus == 1 and job.host_memory is None and spec.one_gpu_host_memory
    alone = dataclasses.replace(job, host_memory=spec.one_gpu_host_memory) if one_gpu else job
    if args.max_seq:
        found = {s: max_seq_range(job, spec, s, band, request.kept_free()) for s in systems}
        if one_gpu:
            for s in systems:
                found[s]["one_gpu_machine"] = max_seq_range(alone, spec, s, band, request.kept_free())
        print(json.dumps(found) if args.json else max_seq_lines(job, spec, found))
        return 0
    pricing = Pricing(band=band)
    results = [estimate(job, spec, s, pricing) for s in systems]
    unpacked = dataclasses.replace(job, documents=None)
    whole = [estimate(unpacked, spec, s, pricing) for s in systems] if job.documents else []
    machine = [estimate(alone, spec, s, pricing) for s in systems] if one_gpu else []
    if not args.json:
        print(estimate_table(job, spec, results, whole))
        if machine:
            print(one_gpu_lines(spec, machine))
        return 0
    rows = [e.as_dict() for e in results]
    for row, w in zip(rows, whole):
        row["unpacked"] = w.as_dict()
    for row, m in zip(rows, machine):
        row["one_gpu_machine"] = m.as_dict()
    print(json.dumps(rows))
    return 0


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
    _flags(CalibrateRequest, args)
    device = check_device(args.device)
    _claim_output(args.out, "--out", args, {"`--model`": args.model}, ours=is_calibration)
    sp = 1 if args.sp is None else args.sp
    shape = Shape.of(named_model(args.model), args.seq, sp) if args.model else None
    result = calibrate(device, shape)
    if args.out:
        write_text(args.out, json.dumps(result, indent=2))
    print(json.dumps(result) if args.json else calibration_lines(result))
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


def _run_dsa(args) -> int:
    _flags(DsaRequest, args)
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
    request = _flags(PlanRequest, args)
    from .plan.bilevel import plan  # the planner (numba, HiGHS) loads with the verbs that plan
    from .plan.plot import plot_plan

    cfg = named_model(args.model)
    _claim_output(args.plot, "--plot", args, {"`--model`": args.model})
    request.check_model(cfg)  # each GPU holds 1/tp of the tokens as train's `--sp` ranks do
    policy = request.activation_policy()
    check_plan_length(Job(model=cfg, seq=request.tokens, micro_batch=args.batch, policy=policy))
    result = plan(cfg, policy, request.tokens, args.batch, args.time_limit, args.work)
    report = plan_report(result, args.work)
    if args.plot:
        plot_plan(result, args.plot, f"{cfg.name}, {format_count(args.seq)} tokens / {args.tp} GPUs, {args.policy}")
        print(f"wrote {args.plot}", file=sys.stderr)
    print(json.dumps(report) if args.json else plan_lines(report, plan_title(cfg.name, request)))
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
    _add_flags(p, EvalRequest)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(run=_run_eval)


def _run_eval(args) -> int:
    device = check_device(args.device)
    request = _flags(EvalRequest, args).with_defaults(device)
    inputs = {"PATH": args.path, "`--ppl-file`": args.ppl_file}
    plots = plot_paths(args.plot, request.ruler_tasks) if args.plot else {}
    for path in [*([args.plot] if request.passkey else []), *plots.values()]:
        _claim_output(str(path), "--plot", args, inputs)
    loaded = load(args.path, device, DTYPES[args.dtype], args.tokenizer)
    model, tokenizer = loaded.model, loaded.tokenizer
    batch, pack = (args.batch_size, args.passkey_pack) if request.trials else (1, 1)
    ruler = None
    if request.ruler_tasks:  # the haystack read before any decoding
        haystack = Path(args.haystack).read_text() if args.haystack else None
        lengths = _ruler_lengths(request.lengths, args.lengths is not None, loaded.trained_length)
        grid = RulerGrid(
            tasks=request.ruler_tasks, lengths=lengths, depths=request.depths, samples=request.trials,
            seed=request.seed, batch_size=request.batch_size, eos=end_of_text(tokenizer),
        )  # fmt: skip
        chat = chat_hook(args.chat, loaded.tokenizer_path)
        ruler = (Ruler(tokenizer, haystack, chat), grid)
    evaluation.check_lengths(loaded, request.lengths, batch, pack)  # before any work
    limit = model.config.max_position_embeddings
    if limit and max(request.lengths) > limit:
        print(
            f"note: lengths past the model's max_position_embeddings ({format_count(limit)}) run as asked",
            file=sys.stderr,
        )
    if request.passkey:  # bad arguments fail at once, before any progress bar or long run
        PasskeyTask(tokenizer).check(model, request.lengths, request.depths, request.trials, args.seed)
    data = None
    if args.ppl_file:
        packing = args.pack_documents or loaded.pack_documents
        data = held_out_sequences(
            args.ppl_file, loaded.tokenizer_path, max(request.lengths), model.config.vocab_size, tokenizer.identity,
            packing, loaded.document_separator, loaded.max_documents, request.long_conversations,
        )  # fmt: skip
    report = {"model": loaded.source, "tokenizer": tokenizer.name, "device": args.device, "dtype": args.dtype}
    if ruler is not None:
        report["ruler_chat"] = chat is not None  # RULER's prompts as a user turn of the tokenizer's chat template
    cells = _measure_eval(request, loaded, data, report, args.json, ruler)
    if args.plot and cells:
        plot_passkey(cells, args.plot, f"pass key: {loaded.source}, {request.trials} trials per cell")
        print(f"wrote {args.plot}", file=sys.stderr)
    if plots and report.get("ruler"):
        for path in plot_cells([RulerCell(**c) for c in report["ruler"]], plots, loaded.source):
            print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(report) if args.json else report_lines(report, args.seed))
    if report.get("interrupted"):
        raise KeyboardInterrupt  # `memo eval: interrupted`, exit 130, after what was measured
    return 0


def _measure_eval(request: EvalRequest, loaded, data, report: dict, quiet: bool, ruler=None) -> list:
    """Scores the pass key, RULER (`ruler`: its prompts and grid) and the loss by position into `report`; returns
    the pass-key cells. On Ctrl-C the report keeps what was finished (whole cells, the sequences scored) and says
    `interrupted`."""
    cells, stage = [], "passkey"
    try:
        if ruler is not None:
            stage, (prompts, grid) = "ruler", ruler
            total = len(grid.cells()) * grid.samples
            scored: list = []
            with tqdm(total=total, desc="RULER", unit="prompt", file=sys.stderr, disable=quiet) as bar:
                try:
                    for cell in ruler_cells(loaded.model, prompts, grid, bar.update):
                        scored.append(cell)  # one by one: a Ctrl-C keeps the cells finished before it
                except KeyboardInterrupt:
                    raise evaluation.Interrupted(scored, len(scored)) from None
            report["ruler"] = [c.as_dict() for c in scored]
        stage = "passkey"
        if request.passkey:
            total = len(request.lengths) * len(request.depths) * request.trials
            with tqdm(total=total, desc="pass key", unit="trial", file=sys.stderr, disable=quiet) as bar:
                cells = passkey_accuracy(
                    loaded.model, loaded.tokenizer, request.lengths, request.depths, request.trials, request.seed,
                    request.batch_size, bar.update, request.passkey_pack,
                )  # fmt: skip
            report["passkey"] = [c.as_dict() for c in cells]
        if data is not None:
            picked = evaluation.spread(data.num_sequences, request.max_sequences)
            report["perplexity"] = {"file": request.ppl_file, "sequences": 0, "of": data.num_sequences}
            report["perplexity"].update(length=data.seq_len, pack_documents=data.pack_documents)
            report["perplexity"]["targets"] = "all" if data.trained is None else "assistant"
            with tqdm(total=len(picked), desc="loss", unit="seq", file=sys.stderr, disable=quiet) as bar:
                buckets = perplexity_by_position(loaded.model, data, request.bucket_size, bar.update, picked)
            report["perplexity"].update(sequences=len(picked), buckets=[b.as_dict() for b in buckets])
    except evaluation.Interrupted as stop:
        report["interrupted"] = True
        if "perplexity" in report:
            report["perplexity"].update(sequences=stop.done, buckets=[b.as_dict() for b in stop.results])
        elif stage == "ruler":
            report["ruler"] = [c.as_dict() for c in stop.results]
        else:
            cells = stop.results
            report["passkey"] = [c.as_dict() for c in cells]
    return cells


def _ruler_lengths(lengths: tuple[int, ...], given: bool, trained: int | None) -> tuple[int, ...]:
    """Returns RULER's lengths: those `given`, or the device's default ones capped at the length a run trained at
    (what model cards report; `--lengths` goes past it)."""
    if given or trained is None:
        return lengths
    kept = tuple(n for n in lengths if n <= trained) or (trained,)
    if kept != lengths:
        print(f"note: RULER at {', '.join(map(format_count, kept))}: the run trained at {format_count(trained)} "
              "tokens (`--lengths` to go past it)", file=sys.stderr)  # fmt: skip
    return kept


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
    argv_given = argv is not None
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    rank0 = rank() == 0
    warnings = logging.StreamHandler(sys.stderr)  # the library's warnings, one line each (rank 0's only)
    warnings.setFormatter(logging.Formatter(f"memo {args.verb}: warning: %(message)s"))
    warnings.setLevel(logging.WARNING if rank0 else logging.CRITICAL + 1)
    logging.getLogger("memo").addHandler(warnings)
    try:
        with Stopping():
            code = args.run(args)
        if not argv_given:  # a command line: skip the interpreter's last collection over torch's objects at exit
            gc.freeze()
        return code
    except BaseException as err:
        failure = _expected_failure(err)
        if failure is None:
            if not isinstance(err, Exception):  # SystemExit and the like pass through
                raise
            cause = faults.awaited_failure() if launched() else None
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
    if not launched():
        return True
    return faults.report(faults.connect(timeout=2.0), line, code, rank())


if __name__ == "__main__":
    sys.exit(main())
