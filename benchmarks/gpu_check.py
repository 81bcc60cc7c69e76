"""One-GPU check of MEMO's CUDA paths in time-boxed sections, so that a failing part costs only its own numbers.

Sections, in order of value, with their time boxes in seconds:

  environment      30  python, torch, CUDA, device and its memory, host CPUs and memory, numpy / numba /
                       highspy, git commit, nvidia-smi's PCIe link
  bandwidth        60  pinned device->host and host->device GB/s (memo.device.HostBuffer), alone and while bf16
                       matmuls run on the default stream (copies on a side stream), and the matmuls' slowdown
  alpha            90  α the solver picks for a gpt-7b layer (4 layers, bf16) at 32K and 128K tokens, with the
                       solver's log line (bandwidth, layer seconds, host budget); OOM is recorded
  strategies      200  benchmarks/strategies.py on a 4-layer gpt-7b, bf16, 32K and 128K tokens: none, full,
                       memo (α solved), memo + arena, offload-all, autograd, torch.utils.checkpoint, save_on_cpu;
                       step time, peak allocated / reserved, tokens/s, MFU (convention stated in the JSON), OOM
                       rows; `offload_hiding` per length: memo's step time over `none`'s where `none` fits
  sanitizer        60  two memo steps (tiny-gpt, α=0.5, every layer offloaded) in a subprocess with
                       TORCH_CUDA_SANITIZER=1: passed, and the sanitizer's report when it is not
  gradient_tests  150  pytest tests/test_layer_gradients.py tests/test_arena.py, MEMO_TEST_DEVICE=cuda
  arena            90  peak reserved / allocated of the same memo step (4-layer gpt-7b, 32K) with the caching
                       allocator, then with model.plan_memory(); cache emptied and peaks reset before each
  planned         150  `memo train` of that model at 32K, 7 steps, in two processes: the caching allocator (its
                       peak reserved), then `--arena`, the planned allocator (arena + what passed it by, served,
                       misses, collisions, its LOAD); the ratios of memory and of step time
  prediction       90  `memo calibrate` (calibrate(device)), then measured step seconds and activation bytes of
                       that memo step against estimate() with efficiency_from_calibration (ratios)

Each section runs in its own subprocess of this script (`--section NAME`), killed with its children when its
box (or what is left of `--budget`, default 520 s) runs out; a section that would start with under 10 s of
budget left is skipped. Sections write their numbers as they get them, so a timeout or a crash keeps what
was measured. After each section the results file is rewritten: `--out`, else $OUT/gpu_check.json when OUT
is set, else ./gpu_check.json; next to it, gpu_check_logs/ (named after the results file) keeps each
section's output (NAME.log) and numbers (NAME.json). The exit status is 1 only if a correctness section
(gradient_tests, sanitizer) failed, errored or timed out.

`--quick` runs every section at toy sizes (tiny-gpt, 4 layers, 128 and 256 tokens, a few gradient tests);
with `--device cpu` it runs end to end without a GPU: the parts that need CUDA (copies under concurrent
compute, the sanitizer, memory peaks) say "skipped: needs CUDA" in the JSON.

    PYTHONPATH=src python benchmarks/gpu_check.py                      # on the GPU machine, from the repo root
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --quick --out /tmp/check.json
    PYTHONPATH=src python benchmarks/gpu_check.py --only sanitizer,gradient_tests   # rerun some sections

memo is imported inside the sections, not here, so that a broken `import memo` fails those sections and not
the run (the environment section still reports).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
NEEDS_CUDA = "skipped: needs CUDA"
CORRECTNESS = ("sanitizer", "gradient_tests")
MIN_START_S = 10  # a section with less budget than this left is skipped, not started


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of a full GPU run or a `--quick` one."""

    model: str
    layers: int
    seqs: tuple[int, ...]  # short, long
    repeats: tuple[int, ...]  # timed strategy steps per length
    copy_bytes: int
    matmul_n: int
    sanitizer_seq: int
    pytest_args: tuple[str, ...]


FULL = Sizes("gpt-7b", 4, (32768, 131072), (3, 1), 1 << 30, 8192, 512, ())
QUICK = Sizes("tiny-gpt", 4, (128, 256), (1, 1), 16 << 20, 256, 64, ("-k", "memo-a0.37 and tiny-gpt"))


class Context:
    """What a section gets: device, sizes, and `put`, which saves a result at once (a later kill keeps it)."""

    def __init__(self, device: torch.device, sizes: Sizes, quick: bool, path: Path):
        self.device, self.sizes, self.quick, self.path = device, sizes, quick, path
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.data: dict = {}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        write_json(self.path, self.data)


def write_json(path: Path, data: dict) -> None:
    """Replaces `path` atomically, so a reader (or a kill) never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _strategies():
    if str(BENCHMARKS) not in sys.path:  # absent when run through runpy or imported by a test
        sys.path.insert(0, str(BENCHMARKS))
    import strategies

    return strategies


def _label(seq: int) -> str:
    from memo.units import format_count

    return format_count(seq)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _memo_model(ctx: Context, policy, seq: int, preset: str | None = None):
    """Returns (a memo Transformer of the section's shape on the device, token ids of length `seq`)."""
    from memo import ModelConfig, Transformer

    cfg = ModelConfig.preset(preset or ctx.sizes.model, n_layers=ctx.sizes.layers)
    torch.manual_seed(0)
    with ctx.device:
        net = Transformer(cfg, policy)
    net.to(dtype=ctx.dtype)
    return net, torch.randint(0, cfg.vocab_size, (1, seq), device=ctx.device)


# ---- sections ---------------------------------------------------------------------------------------------
def _package(name: str) -> str | None:
    """Returns the installed version of an importable package, None when it cannot be imported."""
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "importable"


def _command(*cmd: str) -> str | None:
    """Returns a command's stripped stdout, None when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
    return done.stdout.strip() if done.returncode == 0 else None


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def environment(ctx: Context) -> None:
    ctx.put("python", platform.python_version())
    ctx.put("torch", torch.__version__)
    ctx.put("cuda", torch.version.cuda)
    ctx.put("device", ctx.device.type)
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        ctx.put("device_name", props.name)
        ctx.put("device_memory_bytes", props.total_memory)
        ctx.put("capability", f"{props.major}.{props.minor}")
    ctx.put("cpu_count", os.cpu_count())
    ctx.put("host_memory_bytes", _host_memory_bytes())
    ctx.put("packages", {name: _package(name) for name in ("numpy", "numba", "highspy", "pytest", "transformers")})
    commit = _command("git", "rev-parse", "HEAD")
    ctx.put("git_commit", commit)
    if commit:
        ctx.put("git_dirty", bool(_command("git", "status", "--porcelain", "--untracked-files=no")))
    fields = "name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current"
    ctx.put("nvidia_smi", _command("nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def bandwidth(ctx: Context) -> None:
    from memo.device import HostBuffer, timed
    from memo.swap import measure_copy_bandwidth

    nbytes = ctx.sizes.copy_bytes
    src = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    ctx.put("bytes", nbytes)
    ctx.put("pinned", ctx.device.type == "cuda")
    ctx.put("d2h_GBps", measure_copy_bandwidth(src) / 1e9)
    host = HostBuffer(nbytes, ctx.device)  # memo's pinned buffer: held (and pinned) until released below
    h2d = functools.partial(src.copy_, host.data, non_blocking=True)
    ctx.put("h2d_GBps", _gbps(nbytes, timed(h2d, ctx.device, repeats=3)))
    if ctx.device.type != "cuda":
        ctx.put("with_compute", f"{NEEDS_CUDA} (no second stream on CPU)")
    else:
        d2h = functools.partial(host.data.copy_, src, non_blocking=True)
        ctx.put("with_compute", _copies_under_compute(ctx, {"d2h": d2h, "h2d": h2d}, nbytes))
    host.release()


def _event_seconds(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    return start.elapsed_time(end) / 1e3


def _copies_under_compute(ctx: Context, copies: dict, nbytes: int) -> dict:
    """Returns copy GB/s on a side stream while bf16 matmuls fill the default stream, and the matmuls' TFLOP/s.

    That is the overlap memo relies on: a layer's offload (or prefetch) runs while the next layer computes.
    """
    from memo.device import timed

    n = ctx.sizes.matmul_n
    a, b, out = (torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16) for _ in range(3))
    matmul = functools.partial(torch.matmul, a, b, out=out)
    matmul_s = timed(matmul, ctx.device, repeats=10)
    result = {"matmul_n": n, "matmul_alone_TFLOPs": 2 * n**3 / matmul_s / 1e12}
    side = torch.cuda.Stream()
    for direction, copy in copies.items():
        copy_s, repeats = timed(copy, ctx.device, repeats=3), 8
        matmuls = math.ceil(1.5 * repeats * copy_s / matmul_s)  # compute outlasts the copies
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            events[0].record()
            for _ in range(repeats):
                copy()
            events[1].record()
        events[2].record()
        for _ in range(matmuls):
            matmul()
        events[3].record()
        torch.cuda.synchronize()
        result[direction] = {
            "copy_alone_GBps": _gbps(nbytes, copy_s),
            "copy_GBps": _gbps(repeats * nbytes, _event_seconds(events[0], events[1])),
            "matmul_TFLOPs": 2 * n**3 * matmuls / _event_seconds(events[2], events[3]) / 1e12,
        }
        ctx.put("with_compute", result)
    return result


class _Messages(logging.Handler):
    """Keeps the messages of a logger (the α solver logs what it measured)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _solved_alpha(ctx: Context, seq: int) -> dict:
    from memo import ActivationPolicy

    messages = _Messages()
    logging.getLogger("memo.swap").addHandler(messages)
    try:
        model, ids = _memo_model(ctx, ActivationPolicy("memo"), seq)
        start = time.perf_counter()
        model(ids, labels=ids).backward()
        _synchronize(ctx.device)
        stats = model.swap_stats()
        return {
            "alpha": stats.alphas[0],
            "alphas": stats.alphas,
            "host_pool_bytes": stats.host_pool_bytes,
            "device_skeletal_bytes": stats.device_skeletal_bytes,
            "first_step_s": time.perf_counter() - start,
            "solver_log": messages.lines,
        }
    finally:
        logging.getLogger("memo.swap").removeHandler(messages)


def alpha(ctx: Context) -> None:
    strategies = _strategies()
    ctx.put("model", f"{ctx.sizes.model}, {ctx.sizes.layers} layers, {str(ctx.dtype).removeprefix('torch.')}")
    for seq in ctx.sizes.seqs:
        ctx.put(_label(seq), strategies.guarded(functools.partial(_solved_alpha, ctx, seq), ctx.device))


def _offload_hiding(rows: list[dict]) -> dict:
    """Returns the memo rows' step time over `none`'s: near 1 means the host copies hide behind compute."""
    if rows[0].get("step_s") is None:
        return {"skipped": "memo none did not run (" + rows[0].get("error", "") + ")"}
    return {row["name"]: row["step_over_none"] for row in rows[1:] if row["name"].startswith("memo ")}


def strategies_section(ctx: Context) -> None:
    strategies = _strategies()
    from memo import ModelConfig

    cfg = ModelConfig.preset(ctx.sizes.model, n_layers=ctx.sizes.layers)
    spec = strategies.gpu_spec(ctx.device)
    ctx.put("model", f"{cfg.name}, {cfg.n_layers} layers, {str(ctx.dtype).removeprefix('torch.')}, batch 1")
    ctx.put("peak_flops", {"gpu": spec[0], "flops_per_s": spec[1].peak_flops} if spec else "n/a")
    ctx.put("mfu_convention", strategies.MFU_CONVENTION)
    if ctx.device.type != "cuda":
        ctx.put("memory", f"{NEEDS_CUDA} (benchmarks/strategies.py measures CPU memory in subprocesses)")
    torch.manual_seed(0)
    setup = strategies.Setup(cfg, ctx.device, ctx.dtype, strategies.shared_weights(cfg, ctx.device, ctx.dtype))
    for seq, repeats in zip(ctx.sizes.seqs, ctx.sizes.repeats):
        key = _label(seq)
        ids = torch.randint(0, cfg.vocab_size, (1, seq), device=ctx.device)
        rows = strategies.measure(setup, ids, "auto", repeats, on_row=lambda rows: ctx.put(key, {"rows": rows}))
        ctx.put(key, {"rows": rows, "offload_hiding": _offload_hiding(rows)})


def sanitized_step(ctx: Context) -> None:
    """Two memo steps with every layer offloaded; run by the sanitizer section under TORCH_CUDA_SANITIZER=1."""
    from memo import ActivationPolicy

    policy = ActivationPolicy("memo", alpha=0.5, offload_last_layers=True)
    model, ids = _memo_model(ctx, policy, ctx.sizes.sanitizer_seq, preset="tiny-gpt")
    for _ in range(2):  # the second step reuses the rounding buffers and host pool of the first
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids)
        loss.backward()
    _synchronize(ctx.device)
    ctx.put("loss", loss.item())
    ctx.put("finite_gradients", all(bool(p.grad.isfinite().all()) for p in model.parameters()))
    ctx.put("bytes_offloaded", model.swap_stats().bytes_offloaded)
    ctx.put("sanitizer_enabled", _sanitizer_enabled())


def _sanitizer_enabled() -> bool:
    if "TORCH_CUDA_SANITIZER" not in os.environ:
        return False
    import torch.cuda._sanitizer as csan  # private: PyTorch documents only the environment variable

    return bool(csan.cuda_sanitizer.enabled)


def _child_command(name: str, out: Path, device: torch.device, quick: bool) -> list[str]:
    script, flags = str(Path(__file__).resolve()), ["--quick"] if quick else []
    return [sys.executable, script, "--section", name, "--section-out", str(out), "--device", device.type, *flags]


def sanitizer(ctx: Context) -> None:
    cuda = ctx.device.type == "cuda"
    env = {**os.environ, **({"TORCH_CUDA_SANITIZER": "1"} if cuda else {})}  # on CPU it would fail every op
    out = ctx.path.with_name(ctx.path.stem + "_step.json")
    done = subprocess.run(
        _child_command("sanitized_step", out, ctx.device, ctx.quick), env=env, capture_output=True, text=True
    )
    out.with_suffix(".log").write_text(done.stdout + done.stderr)
    step = json.loads(out.read_text()) if out.exists() else {}
    if not cuda:
        ctx.put("sanitizer", f"{NEEDS_CUDA} (the step ran without it)")
    else:
        ctx.put("sanitizer", "enabled" if step.get("sanitizer_enabled") else "not confirmed enabled (see report)")
    ctx.put("step", step)
    ctx.put("returncode", done.returncode)
    checked = step.get("sanitizer_enabled") is True or not cuda  # on CUDA, a step the sanitizer missed proves nothing
    ctx.put("passed", done.returncode == 0 and step.get("finite_gradients") is True and checked)
    if done.returncode != 0:
        ctx.put("report", done.stderr[-20000:])  # the sanitizer prints each race with both stacks


def _pythonpath() -> str:
    """Returns PYTHONPATH with the repo's src first (the project is not installed on the GPU machine)."""
    return os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])


def gradient_tests(ctx: Context) -> None:
    env = {**os.environ, "MEMO_TEST_DEVICE": ctx.device.type, "PYTHONPATH": _pythonpath()}
    files = ["tests/test_layer_gradients.py", "tests/test_arena.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", *files, *ctx.sizes.pytest_args]
    ctx.put("command", shlex.join(cmd[1:]))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    ctx.put("summary", lines[-1] if lines else done.stderr.strip()[-500:])
    ctx.put("returncode", done.returncode)
    ctx.put("passed", done.returncode == 0)
    if done.returncode != 0:
        ctx.put("output_tail", (done.stdout + done.stderr)[-8000:])


def _measured_step(ctx: Context, step) -> dict:
    """Returns step seconds and peaks of one step after a warm-up, with the cache emptied and peaks reset."""
    strategies = _strategies()
    step()  # warm-up: sizes buffers, solves α, plans every phase when planned
    base = strategies.free_device_memory(ctx.device)
    start = time.perf_counter()
    step()
    _synchronize(ctx.device)
    result = {"step_s": time.perf_counter() - start, "allocated_before": base}
    if ctx.device.type == "cuda":
        result.update(peak_allocated=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved())
    else:
        result["peaks"] = NEEDS_CUDA
    return result


def arena(ctx: Context) -> None:
    from memo import ActivationPolicy

    strategies = _strategies()
    seq = ctx.sizes.seqs[0]
    model, ids = _memo_model(ctx, ActivationPolicy("memo"), seq)
    ctx.put("model", f"{ctx.sizes.model}, {ctx.sizes.layers} layers, {_label(seq)} tokens, memo (alpha solved)")

    def step():
        model(ids, labels=ids).backward()  # gradients accumulate: allocated once, like a training step's

    ctx.put("caching_allocator", strategies.guarded(functools.partial(_measured_step, ctx, step), ctx.device))
    planned = model.plan_memory()
    ctx.put("arena", strategies.guarded(functools.partial(_measured_step, ctx, step), ctx.device))
    ctx.put("arena_summary", planned.summary())
    before, after = ctx.data["caching_allocator"].get("peak_reserved"), ctx.data["arena"].get("peak_reserved")
    ctx.put("reserved_arena_over_caching", after / before if before and after else None)


def planned(ctx: Context) -> None:
    from memo import ModelConfig

    seq = ctx.sizes.seqs[0]
    config = asdict(ModelConfig.preset(ctx.sizes.model, n_layers=ctx.sizes.layers))
    model_file = ctx.path.with_name("planned_model.json")
    model_file.write_text(json.dumps(config))
    ctx.put("model", f"{ctx.sizes.model}, {ctx.sizes.layers} layers, {_label(seq)} tokens, memo α=0.5, 7 steps")
    dtype = "bfloat16" if ctx.device.type == "cuda" else "float32"
    flags = ["--model", str(model_file), "--seq-len", str(seq), "--batch-size", "1", "--steps", "7", "--alpha", "0.5"]
    flags += ["--device", ctx.device.type, "--dtype", dtype, "--eval-every", "1000", "--json"]
    runs = {}
    for name, extra in (("caching_allocator", []), ("planned_allocator", ["--arena"])):
        records = _train_records(flags + extra, ctx.path.with_name(f"planned_{name}"))
        steady = [r for r in records if "loss" in r][3:]  # steps 1-3 make the state and the plan
        runs[name] = {"step_s": statistics.median(r["seconds"] for r in steady), "last": steady[-1] if steady else {}}
        # every memo train run measures the cost model's prediction of it (memory; on a known GPU time and MFU)
        runs[name]["vs_prediction"] = next(
            (r["measured_vs_predicted"] for r in records if "measured_vs_predicted" in r), None
        )
        ctx.put(name, runs[name])
    last = runs["planned_allocator"]["last"]
    held = last.get("arena_bytes", 0) + last.get("arena_pass_peak_bytes", 0)
    reserved = runs["caching_allocator"]["last"].get("device_peak_reserved")
    ctx.put("planned_held_bytes", held)
    ctx.put("planned_over_caching_reserved", held / reserved if reserved else NEEDS_CUDA)
    ctx.put("arena_over_load", last["arena_bytes"] / last["arena_load_bytes"] if last.get("arena_load_bytes") else None)
    ctx.put("step_time_planned_over_caching", runs["planned_allocator"]["step_s"] / runs["caching_allocator"]["step_s"])


def _train_records(flags: list[str], out: Path) -> list[dict]:
    """Runs `memo train` in a process of its own (the planned allocator owns a process's CUDA memory)."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "memo", "train", *flags, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} exited {done.returncode}: {done.stderr[-1500:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def prediction(ctx: Context) -> None:
    from memo import ActivationPolicy
    from memo.cost.calibrate import calibrate
    from memo.cost.efficiency import efficiency_from_calibration
    from memo.cost.estimate import estimate
    from memo.cost.hardware import GPUS

    strategies = _strategies()
    calibration = calibrate(ctx.device)
    ctx.put("calibration", calibration)
    found = strategies.gpu_spec(ctx.device)
    name, spec = found or ("H200", GPUS["H200"])
    ctx.put("spec", name if found else f"{name} (assumed: this device is not in memo.cost.hardware.GPUS)")
    eff = efficiency_from_calibration(calibration, spec)
    ctx.put("efficiency", asdict(eff))
    seq = ctx.sizes.seqs[0]
    model, ids = _memo_model(ctx, ActivationPolicy("memo"), seq)
    predicted = estimate(model.config, seq, 1, spec, "memo", eff=eff)
    ctx.put("predicted", predicted.as_dict())
    measured = _measured_step(ctx, lambda: model(ids, labels=ids).backward())
    stats = model.swap_stats()
    ctx.put("measured", {**measured, "alphas": stats.alphas, "device_skeletal_bytes": stats.device_skeletal_bytes})
    ctx.put("step_measured_over_predicted", measured["step_s"] / predicted.step_seconds)
    # The estimate's total adds fp32 master weights, Adam states and a 2 GiB reserve that a bare step lacks:
    # compare the activations (persistent skeletal buffers + the step's transient peak) instead.
    predicted_activation = predicted.device_bytes["skeletal_buffers"] + predicted.device_bytes["transient_peak"]
    ctx.put("predicted_activation_bytes", predicted_activation)
    if "peak_allocated" not in measured:
        ctx.put("activation_measured_over_predicted", NEEDS_CUDA)
        return
    activation = measured["peak_allocated"] - measured["allocated_before"] + stats.device_skeletal_bytes
    ctx.put("measured_activation_bytes", activation)
    ctx.put("activation_measured_over_predicted", activation / predicted_activation)


SECTIONS = {  # name: (time box in seconds, function), in order of value
    "environment": (30, environment),
    "bandwidth": (60, bandwidth),
    "alpha": (90, alpha),
    "strategies": (200, strategies_section),
    "sanitizer": (60, sanitizer),
    "gradient_tests": (150, gradient_tests),
    "arena": (90, arena),
    "planned": (150, planned),
    "prediction": (90, prediction),
}
HELPERS = {"sanitized_step": sanitized_step}  # run only as another section's subprocess


# ---- the parent: one subprocess per section ---------------------------------------------------------------
def run_child(cmd: list[str], timeout: float, log_path: Path, env: dict | None = None) -> str:
    """Runs `cmd` in its own process group with output to `log_path`; returns "ok", "error" or "timeout".

    The whole group is killed at the end, so a hung grandchild (pytest, the sanitized step) cannot outlive it.
    """
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status = "ok" if proc.wait(timeout=timeout) == 0 else "error"
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return status


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_section(name: str, args, timeout: float, logs: Path) -> tuple[dict, dict | None]:
    """Returns (the section's status record, whatever numbers it wrote before it ended)."""
    out, log_path = logs / f"{name}.json", logs / f"{name}.log"
    out.unlink(missing_ok=True)
    start = time.monotonic()
    status = run_child(_child_command(name, out, torch.device(args.device), args.quick), timeout, log_path)
    record = {"status": status, "seconds": round(time.monotonic() - start, 1), "error": None, "log": str(log_path)}
    if status == "timeout":
        record["error"] = f"killed after its {timeout:.0f} s box\n{_tail(log_path)}"
    elif status == "error":
        record["error"] = _tail(log_path)
    return record, json.loads(out.read_text()) if out.exists() else None


def correctness_failed(results: dict) -> list[str]:
    """Returns the correctness sections that failed, errored or timed out (a skipped one has not failed)."""
    failed = []
    for name in CORRECTNESS:
        status = results["sections"].get(name, {}).get("status")
        if status in ("error", "timeout") or (status == "ok" and results.get(name, {}).get("passed") is not True):
            failed.append(name)
    return failed


def _fmt(value, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def _step_cell(row: dict) -> str:
    return "OOM" if row.get("oom") else _fmt(row.get("step_s", "error"), ".3f")


def summary(results: dict) -> list[str]:
    """Returns a few human lines: each section's status and its headline numbers."""
    lines = [f"{name}: {r['status']} ({r['seconds']} s)" for name, r in results["sections"].items()]
    bw = results.get("bandwidth", {})
    if "d2h_GBps" in bw:
        lines.append(f"pinned copies GB/s: d2h {_fmt(bw['d2h_GBps'], '.1f')}, h2d {_fmt(bw.get('h2d_GBps'), '.1f')}")
    for seq, solved in results.get("alpha", {}).items():
        if isinstance(solved, dict):
            lines.append(f"alpha at {seq}: {_fmt(solved.get('alpha', solved.get('error')))}")
    for seq, table in results.get("strategies", {}).items():
        if isinstance(table, dict) and "rows" in table:
            cells = [f"{r['name']} {_step_cell(r)}" for r in table["rows"]]
            lines.append(f"strategies at {seq} (step s): " + ", ".join(cells))
            lines.append(f"offload hiding at {seq} (x none): {table.get('offload_hiding')}")
    for name in CORRECTNESS:
        if name in results:
            lines.append(f"{name}: passed={results[name].get('passed')} {results[name].get('summary', '')}")
    if "arena" in results:
        lines.append(f"arena reserved / caching reserved: {_fmt(results['arena'].get('reserved_arena_over_caching'))}")
    if "prediction" in results:
        p = results["prediction"]
        lines.append(
            f"measured / predicted: step {_fmt(p.get('step_measured_over_predicted'))}, "
            f"activation {_fmt(p.get('activation_measured_over_predicted'))}"
        )
    return lines


def _default_out() -> Path:
    return Path(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else Path("gpu_check.json")


def run_all(args) -> int:
    """Runs the chosen sections one subprocess each, rewriting the results file after every one."""
    out = Path(args.out) if args.out else _default_out()
    logs = out.parent / f"{out.stem}_logs"
    logs.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    if only - set(SECTIONS):
        raise SystemExit(f"unknown section(s) {sorted(only - set(SECTIONS))}; choose from {', '.join(SECTIONS)}")
    names = [name for name in SECTIONS if name in only]
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    run = {"device": args.device, "quick": args.quick, "budget_s": args.budget, "out": str(out), "started": started}
    results = {"run": {**run, "seconds": 0.0}, "sections": {}}
    start = time.monotonic()
    for name in names:
        left = args.budget - (time.monotonic() - start)
        if left < MIN_START_S:
            record = {"status": "skipped", "seconds": 0.0, "error": f"global budget of {args.budget} s spent"}
        else:
            log(f"gpu_check: {name} (box {min(SECTIONS[name][0], left):.0f} s)")
            record, data = run_section(name, args, min(SECTIONS[name][0], left), logs)
            if data is not None:
                results[name] = data
        results["sections"][name] = record
        results["run"]["seconds"] = round(time.monotonic() - start, 1)
        write_json(out, results)
        log(f"gpu_check: {name} {record['status']} after {record['seconds']} s")
    print("\n".join(summary(results)))
    failed = correctness_failed(results)
    print(f"results: {out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def run_one(args) -> int:
    """Runs one section in this process (the parent started it); its numbers go to --section-out."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    ctx = Context(torch.device(args.device), QUICK if args.quick else FULL, args.quick, Path(args.section_out))
    fn = {**{name: fn for name, (_, fn) in SECTIONS.items()}, **HELPERS}[args.section]
    fn(ctx)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="toy sizes: every section in about a minute")
    p.add_argument("--out", default=None, help="results JSON (default $OUT/gpu_check.json, else ./gpu_check.json)")
    p.add_argument("--budget", type=float, default=520.0, help="seconds for all sections together")
    p.add_argument("--only", default=None, help="comma-separated sections to run, in the usual order")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)
    p.add_argument("--section-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return run_one(args) if args.section else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
