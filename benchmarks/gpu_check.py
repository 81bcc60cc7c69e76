"""One-GPU check of MEMO's CUDA paths in time-boxed sections, so that a failing part costs only its own numbers.

Sections, in order of value, with their time boxes in seconds (450 in all, the default `--budget`):

  preflight    40  python, torch, CUDA, cuDNN, the device, nvidia-smi's PCIe link, host CPUs and memory, the cgroup's
                   memory limit, free disk, packages, ninja and a C++ compiler, git commit; then an op smoke test of
                   the private ops memo calls, none of which had run on a GPU: every attention kernel memo offers
                   here (forward and backward), the fused RMSNorm forward and backward, mm(out_dtype=float32), once
                   at toy size against the meta kernel's shapes and dtypes and a float64 CPU reference; then a
                   forward and backward of the `tiny` and `tiny-gpt` presets (memo, every layer offloaded) in bf16
                   and fp32 against the float64 reference model
  correctness 100  three parts at once, a subprocess each: a 2-layer llama3-8b at 16K tokens under deterministic
                   algorithms, memo offloading every layer (α = 1) bitwise equal to strategy none (loss and every
                   gradient; none run twice shows whether bitwise is meaningful) and α = 0.5 finite and within 1e-2
                   (relative to each gradient's norm); two offloading steps of `tiny` under TORCH_CUDA_SANITIZER=1
                   (buffers emptied across the loss, attention's gradient over each layer's input);
                   the test files that run on the GPU with MEMO_TEST_DEVICE=cuda (CUDA_TESTS)
  bandwidth    40  pinned device->host and host->device GB/s alone and while bf16 matmuls run on the default
                   stream, pinning GB/s (memo.device.HostBuffer: faulting pages in, registering them); attention
                   A/B at 64K tokens with llama3-8b's heads (32, 8 kv, dim 128, bf16): forward and backward
                   seconds and TFLOP/s of each kernel memo offers
  strategies  170  benchmarks/strategies.py on a 4-layer llama3-8b, bf16, 64K and 128K tokens: none, full, memo
                   (α solved, with the solver's log), offload-all: step time, peak allocated / reserved, tokens/s,
                   MFU, OOM rows; of memo's step at 64K: per-layer forward and backward seconds (CUDA events), one
                   profiled step (host-copy seconds, their share concurrent with compute kernels, compute-stream
                   idle time) and the cost model's estimate of it; last, while the box lasts, the reference
                   baselines (autograd, torch.utils.checkpoint, save_on_cpu) at 64K
  planned     100  `memo train` of that model at 64K (memo α = 0.5, 7 steps, --no-save-final) in two processes:
                   the caching allocator (torch.cuda.max_memory_reserved / allocated) and `--arena`, the planned
                   allocator (its CUDA memory pool's high-water marks, memo.plan.allocator.pool_high_water), both
                   over the last step, reset as it began (weights, optimizer state and the arena included, on both
                   sides; each step's record carries them, so a run cut at its box keeps its last step); served,
                   misses, collisions, arena / LOAD, step-time ratio; an OOM is a result

Each section runs in its own subprocess of this script (`--section NAME`), killed with its children when its box
(or what is left of `--budget`) runs out; a section that would start with under 10 s of budget left is skipped.
From the start, a detached subprocess builds the planned allocator's C++ extension (when ninja and a compiler are
there), so that `planned` finds it in torch's extension cache; the results say whether it finished.

Sections write their numbers as they get them, so a timeout or a crash keeps what was measured, and print one
line per measured row, which this process relays to stdout (`strategies 64K memo none: 3.21 s, 61.2 GB peak`).
The results file is rewritten after each section: `--out`, else $OUT/gpu_check.json when OUT is set, else
./gpu_check.json; next to it, gpu_check_logs/ (named after the results file) keeps each section's output
(NAME.log, its tail kept past 2 MiB) and numbers (NAME.json); all of it stays under 100 MB. Training runs, traces
and test folders live in a temporary folder removed at the end; no checkpoint is written. The exit status is 1
only if a correctness check failed (the op smoke test or a correctness part), errored or timed out.

`--quick` runs every section at toy sizes (the `tiny` preset, 128 and 256 tokens, a few tests); with `--device
cpu` it runs end to end without a GPU, and the parts that need CUDA say "skipped: needs CUDA".

    PYTHONPATH=src python benchmarks/gpu_check.py                      # on the GPU machine, from the repo root
    PYTHONPATH=src python benchmarks/gpu_check.py --device cpu --quick --out /tmp/check.json
    PYTHONPATH=src python benchmarks/gpu_check.py --only correctness,planned   # rerun some sections

memo is imported inside the sections, not here, so that a broken `import memo` fails those sections and not the
run (the preflight's environment part still reports).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import importlib.metadata
import importlib.util
import io
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
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = Path(__file__).resolve().parent
NEEDS_CUDA = "skipped: needs CUDA"
CORRECTNESS = ("preflight", "correctness")  # sections whose failure makes the exit status 1
BUDGET_S = 450  # the sections' boxes add up to at most this
MIN_START_S = 10  # a section with less budget than this left is skipped, not started
ROW = "gpu_check row: "  # a section's progress line, relayed to stdout by the parent
LOG_CAP = 2 << 20  # bytes of a log kept (its head and tail): the sanitizer can print a stack per access
RESULTS_CAP = 100 << 20  # the results file and its logs together
POLL_S = 0.5
# the test files that honour MEMO_TEST_DEVICE or need CUDA: streams, swap, the phase planner, layer gradients, attention
STEP_PEAKS = ("device_peak_reserved", "device_peak_allocated")  # a caching-allocator step's, in its record
# (test_offload_states and the rest of test_host_memory run CPU ranks only: minutes of a 100 s box for nothing)
CUDA_TESTS = ("tests/test_layer_gradients.py", "tests/test_documents.py", "tests/test_phases.py")
CUDA_TESTS += ("tests/test_attention.py",)
CUDA_TESTS += ("tests/test_host_memory.py", "-k")
CUDA_TESTS += ("not test_ranks_copy_together and not cgroup and not transformers",)  # transformers runs on CPU


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of a full GPU run or a `--quick` one."""

    model: str  # the long-sequence model of strategies and planned, `layers` deep
    layers: int
    seqs: tuple[int, ...]  # the strategies' lengths; the first is also the reference baselines' and planned's
    repeats: tuple[int, ...]  # timed strategy steps per length
    equivalence: tuple[str, int, int]  # preset, layers, tokens of the bitwise check
    attention_seq: int  # tokens of the attention A/B
    copy_bytes: int
    pin_bytes: int
    matmul_n: int
    sanitizer_seq: int
    tests: tuple[str, ...]  # pytest's arguments
    train_steps: int  # of each planned run: 2 to make the state, 1 more to plan, the rest served


FULL = Sizes(
    model="llama3-8b",
    layers=4,
    seqs=(65536, 131072),
    repeats=(1, 1),
    equivalence=("llama3-8b", 2, 16384),
    attention_seq=65536,
    copy_bytes=1 << 30,
    pin_bytes=4 << 30,
    matmul_n=8192,
    sanitizer_seq=512,
    tests=CUDA_TESTS,
    train_steps=7,
)
QUICK = Sizes(
    model="tiny",
    layers=4,  # with 2, both layers would be the last of their parity, whose tensors stay in the rounding buffers
    seqs=(128, 256),
    repeats=(1, 1),
    equivalence=("tiny", 2, 128),
    attention_seq=256,
    copy_bytes=16 << 20,
    pin_bytes=16 << 20,
    matmul_n=256,
    sanitizer_seq=64,
    tests=("tests/test_layer_gradients.py", "-k", "memo-a0.37-tile-8-tiny-gpt"),
    train_steps=5,
)


class Context:
    """What a section gets: device, sizes, a temporary folder, its deadline, and `put`, which saves a result at
    once (a later kill keeps it)."""

    def __init__(self, device: torch.device, sizes: Sizes, quick: bool, path: Path, tmp: Path, deadline: float):
        self.device, self.sizes, self.quick, self.path, self.tmp = device, sizes, quick, path, tmp
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.deadline = deadline  # time.time() when the parent kills this process
        self.data: dict = {}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        write_json(self.path, self.data)

    def left(self) -> float:
        return self.deadline - time.time()

    def row(self, line: str) -> None:
        print(ROW + line, flush=True)


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


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {next(iter(str(err).splitlines()), '')}"


def _checked(fn) -> dict:
    """Returns fn(), or its error line: one failing check must not cost the others."""
    try:
        return fn()
    except Exception as err:
        return {"passed": False, "error": _first_line(err)}


def _gb(nbytes) -> str:
    return f"{nbytes / 1e9:.1f} GB" if isinstance(nbytes, (int, float)) else "n/a"


# ---- preflight: the machine, then every private op once ---------------------------------------------------------
def _package(name: str) -> str | None:
    """Returns the installed version of an importable package, None when it cannot be imported."""
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except (ImportError, ValueError):  # a blocked module (sys.modules[name] = None) raises here
        return None
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "importable"


def _command(*cmd: str) -> str | None:
    """Returns a command's stripped stdout, None when it is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def toolchain() -> dict:
    """Returns the ninja and C++ compiler torch's cpp_extension would build the planned allocator with."""
    beside = Path(sys.executable).parent / "ninja"  # memo.plan.allocator.extension puts the venv's ninja first
    ninja = str(beside) if beside.exists() else shutil.which("ninja")
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    version = _command(compiler, "--version") if compiler else None
    return {"ninja": ninja, "compiler": compiler, "compiler_version": version.splitlines()[0] if version else None}


def cgroup_memory_limit() -> int | str | None:
    """Returns the memory limit of this process's cgroup (v2, else v1) in bytes, "max" when unlimited."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        return text if text == "max" else int(text)
    return None


def environment(ctx: Context) -> None:
    ctx.put("python", platform.python_version())
    ctx.put("torch", torch.__version__)
    ctx.put("cuda", torch.version.cuda)
    ctx.put("cudnn", torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
    ctx.put("device", ctx.device.type)
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        ctx.put("device_name", props.name)
        ctx.put("device_memory_bytes", props.total_memory)
        ctx.put("capability", f"{props.major}.{props.minor}")
    ctx.put("cpu_count", os.cpu_count())
    ctx.put("host_memory_bytes", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    ctx.put("cgroup_memory_limit", cgroup_memory_limit())
    ctx.put(
        "free_disk_bytes", {"results": shutil.disk_usage(ctx.path.parent).free, "tmp": shutil.disk_usage(ctx.tmp).free}
    )
    names = ("numpy", "numba", "highspy", "pytest", "transformers", "flash_attn")
    ctx.put("packages", {name: _package(name) for name in names})
    ctx.put("toolchain", toolchain())
    commit = _command("git", "rev-parse", "HEAD")
    ctx.put("git_commit", commit)
    if commit:
        ctx.put("git_dirty", bool(_command("git", "status", "--porcelain", "--untracked-files=no")))
    query = "name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current"
    ctx.put("nvidia_smi", _command("nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"))


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Returns the largest absolute difference relative to the reference's largest magnitude."""
    diff = (got.detach().cpu().double() - want.detach().double()).abs().max()
    return float(diff / want.detach().double().abs().max().clamp(min=1e-12))


def _compare(names: tuple[str, ...], got: tuple, meta: tuple, want: tuple, tol: float) -> dict:
    """Returns whether the device outputs have the meta kernel's shapes and dtypes and the reference's values."""
    for name, g, m in zip(names, got, meta):
        if g.shape != m.shape or g.dtype != m.dtype:
            shapes = f"{tuple(g.shape)} {g.dtype} on the device, {tuple(m.shape)} {m.dtype} on meta"
            return {"passed": False, "error": f"{name}: {shapes}"}
    errors = {name: _max_error(g, w) for name, g, w in zip(names, got, want)}
    worst = max(errors, key=errors.get)
    result = {"passed": errors[worst] <= tol, "max_error": errors}
    if not result["passed"]:
        result["error"] = f"{worst} off by {errors[worst]:.2e} of its largest value (tolerance {tol})"
    return result


def _tolerance(dtype: torch.dtype) -> float:
    return 3e-2 if dtype == torch.bfloat16 else 1e-3


def _on(device: torch.device, dtype: torch.dtype, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device, dtype) for t in tensors]


def _attention_reference(q, k, v, dout, scale: float, window: int | None = None) -> tuple[torch.Tensor, ...]:
    """Returns (out, lse, dq, dk, dv) of causal grouped-query attention by autograd in float64 on the CPU, a token
    seeing itself and the `window - 1` before it when given."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    s = q.shape[-2]
    seen = torch.ones(s, s, dtype=torch.bool).tril()
    scores = scores.masked_fill(~(seen if window is None else seen.triu(1 - window)), float("-inf"))
    out = torch.softmax(scores, -1) @ v.repeat_interleave(rep, 1)
    out.backward(dout)
    return out, scores.logsumexp(-1), q.grad, k.grad, v.grad


WINDOW = 48  # of the 128 tokens the attention checks run: the edge falls inside every kernel block


def _attention_op(device: torch.device, dtype: torch.dtype, kernel: str, window: int | None = None) -> dict:
    """Checks one attention kernel's forward and backward, on token-major views as memo's layer passes them (with
    a sliding `window`: the flash kernel's variable-length call with its window arguments)."""
    from memo.attention import attention_backward, attention_forward, refusals
    from memo.device import meta_kernels

    heads, kv_heads, s, d = 4, 2, 128, 64
    q, k, v, dout = (
        torch.randn(1, s, n, d, dtype=torch.float64).transpose(1, 2) for n in (heads, kv_heads, kv_heads, heads)
    )
    scale = d**-0.5

    def run(where: torch.device) -> tuple[tuple, str]:
        q_, k_, v_, dout_ = _on(where, dtype, q, k, v, dout)
        out, lse, aux = attention_forward(q_, k_, v_, scale, kernel=kernel, window=window)
        return (out, lse, *attention_backward(dout_, q_, k_, v_, out, lse, aux, scale)), aux[0]

    got, ran = run(device)
    if ran != kernel:
        return {"passed": False, "error": f"fell back to {ran}: {'; '.join(refusals())}"}
    with meta_kernels(device.type):
        meta, _ = run(torch.device("meta"))
    want = _attention_reference(*(t.to(dtype).double() for t in (q, k, v, dout)), scale, window)
    return _compare(("out", "lse", "dq", "dk", "dv"), got, meta, want, _tolerance(dtype))


def _rms_norm_op(device: torch.device, dtype: torch.dtype) -> dict:
    """Checks memo's RMSNorm forward and backward (aten._fused_rms_norm and its backward on CUDA)."""
    from memo.device import meta_kernels
    from memo.norms import rms_norm, rms_norm_backward

    x, dy = torch.randn(2, 16, 256, dtype=torch.float64), torch.randn(2, 16, 256, dtype=torch.float64)
    weight, eps = 1 + 0.1 * torch.randn(256, dtype=torch.float64), 1e-5

    def run(where: torch.device) -> tuple:
        x_, w_, dy_ = _on(where, dtype, x, weight, dy)
        y, rstd = rms_norm(x_, w_, eps)
        return (y, rstd, *rms_norm_backward(dy_, x_, rstd, w_))

    got = run(device)
    with meta_kernels(device.type):
        meta = run(torch.device("meta"))
    x64, w64 = (t.to(dtype).double().requires_grad_() for t in (x, weight))
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    y = x64 * rstd * w64
    y.backward(dy.to(dtype).double())
    return _compare(("y", "rstd", "dx", "dweight"), got, meta, (y, rstd, x64.grad, w64.grad), _tolerance(dtype))


def _mm_op(device: torch.device) -> dict:
    """Checks memo's float32-accumulating product of bf16 matrices (mm with out_dtype on CUDA)."""
    from memo.device import meta_kernels
    from memo.matmul import accumulating_mm

    a, b = torch.randn(64, 128).bfloat16(), torch.randn(128, 32).bfloat16()
    got = (accumulating_mm(a.to(device), b.to(device)),)
    with meta_kernels(device.type):
        meta = (accumulating_mm(a.to("meta"), b.to("meta")),)
    return _compare(("product",), got, meta, (a.double() @ b.double(),), 1e-2)


MARGIN = {torch.bfloat16: 0.5, torch.float32: 1e-3}  # logits this far apart route alike in the dtype's rounding


def _experts_op(device: torch.device, dtype: torch.dtype) -> dict:
    """Checks a mixture of experts' layers (kept routing, the experts' grouped GEMMs forward and backward, α = 0.5
    in tiles, the load-balancing loss) against the reference model (every expert over every token, masked) in
    float64 on the CPU: loss and every parameter gradient. Routers are drawn wide and the first seed whose every
    token's k-th and (k+1)-th logits are `MARGIN` apart is taken, so the dtype's rounding cannot route the two
    apart."""
    from memo import ActivationPolicy, ModelConfig, Transformer
    from memo.reference import ReferenceTransformer

    config = ModelConfig(
        "llama", 2, 64, 4, 128, 256, n_kv_heads=2, n_experts=8, experts_per_token=2, expert_ffn_size=64,
        router_aux_loss=True, router_aux_loss_coef=0.1,
    )  # fmt: skip
    for seed in range(64):  # deterministic: the reference runs in float64 on the CPU
        torch.manual_seed(seed)
        ref = ReferenceTransformer(config).double()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if "router_experts" in name:
                    p.normal_(0, 10.0 if "router." in name else 0.1)
        ids = torch.randint(0, config.vocab_size, (1, 96))
        want = ref(ids, labels=ids)
        top = [layer.router_experts.logits.detach().topk(3, dim=-1).values for layer in ref.layers]
        margin = min(float((t[..., 1] - t[..., 2]).min()) for t in top)
        if margin >= MARGIN[dtype]:
            break
    else:
        return {"passed": False, "error": f"no seed gave a top-k margin of {MARGIN[dtype]}"}
    want.backward()
    exact = ref.memo_state_dict(keep_vars=True)
    model = Transformer(config, ActivationPolicy("memo", alpha=0.5, tile_tokens=40)).to(device, dtype)
    model.load_state_dict(ref.memo_state_dict())
    same = ReferenceTransformer(config).to(device, dtype)  # the reference in the dtype: the rounding it cannot help
    same.load_state_dict(ref.state_dict())
    errors = {}
    for name, m in (("memo", model), ("reference", same)):
        m.zero_grad()
        loss = m(ids.to(device), labels=ids.to(device))
        loss.backward()
        grads = m.memo_state_dict(keep_vars=True) if m is same else dict(m.named_parameters())
        errors[name] = {
            "loss": _max_error(loss, want),
            **{n: _relative(grads[n].grad, g.grad) for n, g in exact.items()},
        }
    # within 1.5x the dtype's own reference error (docs/testing.md's bf16 rule), or 1e-3 of the float64 values
    bad = [n for n, e in errors["memo"].items() if e > max(1.5 * errors["reference"][n], 1e-3)]
    worst = max(errors["memo"], key=errors["memo"].get)
    result = {"passed": not bad, "worst": worst, "max_error": errors["memo"][worst], "margin": margin}
    if bad:
        result["error"] = (
            f"{bad[0]} off by {errors['memo'][bad[0]]:.2e}, the {dtype} reference by {errors['reference'][bad[0]]:.2e}"
        )
    return result


def op_smoke(ctx: Context) -> dict:
    """Returns pass/fail (and the error line) of each private op memo calls, run once at toy size."""
    from memo.attention import KERNELS, available

    ops: dict = {}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        here = available(ctx.device, dtype)
        for kernel in KERNELS:
            key = f"attention {kernel} {name}"
            ops[key] = (
                _checked(functools.partial(_attention_op, ctx.device, dtype, kernel))
                if kernel in here
                else {"skipped": _unavailable(kernel)}
            )
            ctx.put("ops", ops)
        if dtype == torch.bfloat16 and "flash" in here:  # a window runs on flash alone, 16-bit on CUDA
            window = functools.partial(_attention_op, ctx.device, dtype, "flash", WINDOW)
            ops[f"attention flash window {WINDOW} {name}"] = _checked(window)
        ops[f"rms_norm {name}"] = _checked(functools.partial(_rms_norm_op, ctx.device, dtype))
        ops[f"experts (grouped GEMM) {name}"] = _checked(functools.partial(_experts_op, ctx.device, dtype))
        ctx.put("ops", ops)
    ops["mm out_dtype=float32 bfloat16"] = _checked(functools.partial(_mm_op, ctx.device))
    ctx.put("ops", ops)
    return ops


def _unavailable(kernel: str) -> str:
    if kernel == "fa4" and _package("flash_attn") is None:
        return "not installed (the flash-attn-4 package)"
    return "not available for this device and dtype"


def _tiny_model(device: torch.device, preset: str, dtype: torch.dtype) -> dict:
    """Checks a memo step (every layer offloaded) against the float64 reference model on the same weights."""
    from memo import ActivationPolicy, ModelConfig, Transformer
    from memo.reference import ReferenceTransformer

    cfg = ModelConfig.preset(preset)
    torch.manual_seed(0)
    model = Transformer(cfg, ActivationPolicy("memo", alpha=0.5, offload_last_layers=True)).to(device, dtype)
    ref = ReferenceTransformer(cfg).double()
    ref.load_state_dict({name: t.double().cpu() for name, t in model.state_dict().items()})
    ids = torch.randint(0, cfg.vocab_size, (1, 64))
    loss = model(ids.to(device), labels=ids.to(device))
    loss.backward()
    want = ref(ids, labels=ids)
    want.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    grad_error = max(_relative(grads[name], p.grad) for name, p in ref.named_parameters())
    loss_error = abs(loss.item() - want.item()) / abs(want.item())
    finite = math.isfinite(loss.item()) and all(bool(g.isfinite().all()) for g in grads.values())
    tol = 3 * _tolerance(dtype)  # a whole model's rounding, not one op's
    passed = finite and loss_error <= tol and grad_error <= tol
    result = {"passed": passed, "loss": loss.item(), "loss_error": loss_error, "grad_error": grad_error}
    if not passed:
        result["error"] = f"finite={finite}, loss error {loss_error:.2e}, gradient error {grad_error:.2e} (tol {tol})"
    return result


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Returns |got - want| / |want| in the 2-norm, where `want` lives (a 16-bit one in float32: a model's
    gradients are compared on the device, not copied out)."""
    dtype = torch.promote_types(want.dtype, torch.float32)
    want, got = want.detach().to(dtype), got.detach().to(want.device, dtype)
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


def preflight(ctx: Context) -> None:
    environment(ctx)
    ops = op_smoke(ctx)
    models = {}
    for preset in ("tiny", "tiny-gpt"):
        for dtype in (torch.bfloat16, torch.float32):
            key = f"{preset} {str(dtype).removeprefix('torch.')}"
            models[key] = _checked(functools.partial(_tiny_model, ctx.device, preset, dtype))
            ctx.put("models", models)
    checks = {**ops, **models}
    failed = [name for name, r in checks.items() if r.get("passed") is False]
    for name in failed:
        ctx.row(f"preflight {name}: FAILED {checks[name].get('error')}")
    ran = sum("passed" in r for r in checks.values())
    ctx.row(f"preflight ops and tiny models: {ran - len(failed)} of {ran} passed")
    ctx.put("passed", not failed)


# ---- correctness: bitwise equivalence, the sanitizer, the CUDA tests ---------------------------------------------
def _loss_and_grads(setup, policy, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from memo import Transformer

    strategies = _strategies()
    model = strategies.built(lambda: Transformer(setup.cfg, policy), setup)
    loss = model(ids, labels=ids)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    del model
    strategies.free_device_memory(setup.device)
    return loss.detach(), grads


def _difference(want: tuple, got: tuple) -> dict:
    """Returns whether two (loss, gradients) are bitwise equal, the largest relative gradient difference (of
    the parameter's gradient norm) and where, and whether every number is finite."""
    (loss_a, grads_a), (loss_b, grads_b) = want, got
    relative = {name: _relative(grads_b[name], g) for name, g in grads_a.items()}
    worst = max(relative, key=relative.get)
    return {
        "bitwise": bool(torch.equal(loss_a, loss_b)) and all(torch.equal(g, grads_b[n]) for n, g in grads_a.items()),
        "loss": [loss_a.item(), loss_b.item()],
        "max_relative": relative[worst],
        "worst": worst,
        "finite": bool(loss_b.isfinite()) and all(bool(g.isfinite().all()) for g in grads_b.values()),
    }


def equivalence(ctx: Context) -> None:
    """Runs the bitwise check (a `correctness` part, in its own process with CUBLAS_WORKSPACE_CONFIG set)."""
    from memo import ActivationPolicy, ModelConfig
    from memo.attention import available

    strategies = _strategies()
    preset, layers, seq = ctx.sizes.equivalence
    cfg = ModelConfig.preset(preset, n_layers=layers)
    kernel = "flash" if "flash" in available(ctx.device, ctx.dtype) else "auto"  # deterministic backward
    ctx.put("model", f"{preset}, {layers} layers, {_label(seq)} tokens, {str(ctx.dtype).removeprefix('torch.')}")
    ctx.put("attention", kernel)
    torch.manual_seed(0)
    setup = strategies.Setup(cfg, ctx.device, ctx.dtype, strategies.shared_weights(cfg, ctx.device, ctx.dtype))
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=ctx.device)
    policies = {
        "none again": ActivationPolicy("none", attention=kernel),
        "offload-all": ActivationPolicy("memo", alpha=1.0, offload_last_layers=True, attention=kernel),
        "alpha=0.5": ActivationPolicy("memo", alpha=0.5, offload_last_layers=True, attention=kernel),
    }
    # strictly first: under warn_only PyTorch's flash backward keeps its non-deterministic path, so "bitwise" would
    # quietly mean "within 1e-2"; an op without a deterministic kernel then says so, and the check runs warned
    for warn_only in (False, True):
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                want = _loss_and_grads(setup, ActivationPolicy("none", attention=kernel), ids)
                for name, policy in policies.items():
                    ctx.put(name, _difference(want, _loss_and_grads(setup, policy, ids)))
            break
        except RuntimeError as err:
            if warn_only or "deterministic" not in str(err):
                raise
            ctx.put("strict_refused", str(err).splitlines()[0])
    ctx.put("nondeterministic", sorted({str(w.message).splitlines()[0] for w in caught}))
    ctx.put("verdict", equivalence_verdict(ctx.data))


def equivalence_verdict(data: dict) -> dict:
    """Returns pass/fail of the bitwise check: offload-all bitwise equal to none when none is deterministic
    (within 1e-2 when it is not), α = 0.5 within 1e-2; everything finite."""
    deterministic = data["none again"]["bitwise"]
    offload, half = data["offload-all"], data["alpha=0.5"]
    offload_ok = offload["bitwise"] if deterministic else offload["max_relative"] <= 1e-2
    half_ok = half["max_relative"] <= 1e-2
    finite = all(data[name]["finite"] for name in ("none again", "offload-all", "alpha=0.5"))
    return {
        "passed": offload_ok and half_ok and finite,
        "deterministic": deterministic,
        "offload_all_checked": "bitwise" if deterministic else "within 1e-2: none is not deterministic here",
        "offload_all": offload_ok,
        "alpha_0.5": half_ok,
        "finite": finite,
    }


def sanitized_step(ctx: Context) -> None:
    """Two memo steps with every layer offloaded, the rounding buffers emptied across the loss and attention's
    gradient written over each layer's input (which comes back from host); run by correctness under
    TORCH_CUDA_SANITIZER=1."""
    from memo import ActivationPolicy, ModelConfig, Transformer

    cfg = ModelConfig.preset("tiny")
    torch.manual_seed(0)
    with ctx.device:
        model = Transformer(cfg, ActivationPolicy("memo", alpha=0.5, empty_buffers=True, gradient_over_input=True))
    ids = torch.randint(0, cfg.vocab_size, (1, ctx.sizes.sanitizer_seq), device=ctx.device)
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


def _pythonpath() -> str:
    """Returns PYTHONPATH with the repo's src first (the project is not installed on the GPU machine)."""
    return os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])


def _part(ctx: Context, name: str, box: float, env: dict | None = None, cmd: list[str] | None = None):
    """Runs one part of a section in its own process group, helper `name` of this script unless `cmd` is given;
    returns (its status record, the numbers it wrote). Its numbers and log go beside the section's."""
    out = ctx.path.with_name(f"{ctx.path.stem}_{name}.json")
    log_path = out.with_suffix(".log")
    out.unlink(missing_ok=True)
    box = max(box, 1.0)
    start = time.monotonic()
    status = run_child(cmd or _child_command(name, out, ctx, time.time() + box), box, log_path, env)
    record = {"status": status, "seconds": round(time.monotonic() - start, 1)}
    if status != "ok":
        record["tail"] = _tail(log_path)
    return record, json.loads(out.read_text()) if out.exists() else {}


def _equivalence_part(ctx: Context) -> dict:
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # cuBLAS's deterministic workspace
    record, data = _part(ctx, "equivalence", ctx.left() - 2, env)
    verdict = data.get("verdict", {})
    result = {**record, **data, "passed": record["status"] == "ok" and verdict.get("passed") is True}
    offload, half = data.get("offload-all", {}), data.get("alpha=0.5", {})
    ctx.row(
        f"correctness equivalence {data.get('model', '')}: offload-all bitwise={offload.get('bitwise')}, alpha=0.5 "
        f"max relative {_fmt(half.get('max_relative'), '.1e')}, deterministic={verdict.get('deterministic')}: "
        + ("passed" if result["passed"] else f"FAILED ({record['status']})")
    )
    return result


def _sanitizer_part(ctx: Context) -> dict:
    cuda = ctx.device.type == "cuda"
    env = {**os.environ, **({"TORCH_CUDA_SANITIZER": "1"} if cuda else {})}  # on CPU it would fail every op
    record, step = _part(ctx, "sanitizer", ctx.left() - 2, env)
    checked = step.get("sanitizer_enabled") is True or not cuda  # on CUDA, a step the sanitizer missed proves nothing
    passed = record["status"] == "ok" and step.get("finite_gradients") is True and checked
    sanitizer = "enabled" if step.get("sanitizer_enabled") else "not confirmed enabled (see the log)"
    result = {**record, "step": step, "sanitizer": sanitizer if cuda else f"{NEEDS_CUDA} (the step ran without it)"}
    ctx.row(f"correctness sanitizer: {'passed' if passed else 'FAILED (' + record['status'] + ')'}")
    return {**result, "passed": passed}


def _tests_part(ctx: Context) -> dict:
    env = {**os.environ, "MEMO_TEST_DEVICE": ctx.device.type, "PYTHONPATH": _pythonpath()}
    basetemp = ctx.tmp / "pytest"  # pytest's folders live in the run's temporary folder, and go with it
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}", *ctx.sizes.tests]
    record, _ = _part(ctx, "tests", ctx.left() - 2, env, cmd)
    lines = _tail(ctx.path.with_name(f"{ctx.path.stem}_tests.log"), 5).splitlines() or [""]
    summary = next((line for line in reversed(lines) if " passed" in line or " failed" in line), lines[-1])
    passed = record["status"] == "ok"
    ctx.row(f"correctness tests: {summary} ({record['status']})")
    return {**record, "command": shlex.join(cmd[1:]), "summary": summary, "passed": passed}


def correctness(ctx: Context) -> None:
    """Runs the three parts at once, each a process of its own with the whole box: none waits on another's hang,
    and the GPU holds them together (a 2-layer model at 16K, and toy ones)."""
    parts = {"equivalence": _equivalence_part, "sanitizer": _sanitizer_part, "tests": _tests_part}
    with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
        running = {name: pool.submit(part, ctx) for name, part in parts.items()}
    for name, result in running.items():
        ctx.put(name, result.result())
    ctx.put("passed", all(ctx.data[name]["passed"] for name in parts))


# ---- bandwidth: host copies, pinning, attention kernels ---------------------------------------------------------
def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def _pinning(ctx: Context) -> dict:
    """Returns how fast memo pins host memory (a new host pool costs this before a step can offload): the whole
    HostBuffer construction of `pin_bytes`, and its two parts as it times them (pages faulted in, registered)."""
    from memo.device import HostBuffer

    if ctx.device.type != "cuda":
        return {"skipped": NEEDS_CUDA}
    nbytes = ctx.sizes.pin_bytes
    start = time.perf_counter()
    host = HostBuffer(nbytes, ctx.device)
    seconds = time.perf_counter() - start
    host.release()
    return {
        "bytes": nbytes,
        "construct_GBps": _gbps(nbytes, seconds),
        "fault_GBps": _gbps(nbytes, host.fault_seconds),
        "register_GBps": _gbps(nbytes, host.pin_seconds),
    }


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
    return result


ATTENTION_FLOPS = "causal half matrix, forward 4·s²·heads·d / 2, backward 2.5 × forward (memo.cost.calibrate)"


def attention_flops(seq: int, heads: int, head_dim: int) -> tuple[float, float]:
    """Returns the FLOPs of causal attention's forward and backward as memo.cost.calibrate counts them
    (ATTENTION_FLOPS)."""
    from memo.cost.estimate import ATTENTION_BACKWARD

    forward = 4 * seq * seq * heads * head_dim / 2
    return forward, ATTENTION_BACKWARD * forward


def _time_kernel(ctx: Context, kernel: str, tensors: tuple, scale: float, flops: tuple, first: list) -> dict:
    """Returns one kernel's forward and backward seconds and TFLOP/s, and its output's distance to the first's."""
    from memo.attention import attention_backward, attention_forward, refusals
    from memo.device import timed

    q, k, v, dout = tensors
    out, lse, aux = attention_forward(q, k, v, scale, kernel=kernel)
    if aux[0] != kernel:
        return {"fell_back_to": aux[0], "refusals": refusals()}
    forward_s = timed(lambda: attention_forward(q, k, v, scale, kernel=kernel), ctx.device, repeats=3)
    backward_s = timed(lambda: attention_backward(dout, q, k, v, out, lse, aux, scale), ctx.device, repeats=3)
    if not first:
        first.append(out)  # the first kernel's output: the others are compared with it
    result = {
        "forward_s": forward_s,
        "backward_s": backward_s,
        "forward_TFLOPs": flops[0] / forward_s / 1e12,
        "backward_TFLOPs": flops[1] / backward_s / 1e12,
        "max_abs_diff_vs_first": float((out - first[0]).abs().max()),
    }
    if ctx.device.type == "cuda":
        result.update(_backward_bytes(ctx, kernel, tensors, out, lse, aux, scale))
    return result


def _backward_bytes(ctx: Context, kernel: str, tensors: tuple, out, lse, aux, scale: float) -> dict:
    """Returns the peak bytes one backward call allocates on the device (its gradients, copies and the kernel's
    scratch) beside what the cost model's meta trace of the same call predicts (`plan.scratch` included)."""
    from memo.attention import attention_backward, attention_forward
    from memo.device import meta_kernels
    from memo.plan.trace import Tracer

    q, k, v, dout = tensors
    torch.cuda.synchronize(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    grads = attention_backward(dout, q, k, v, out, lse, aux, scale)
    torch.cuda.synchronize(ctx.device)
    measured = torch.cuda.max_memory_allocated(ctx.device) - base
    del grads
    meta = [t.to("meta") for t in (q, k, v, dout)]
    with meta_kernels("cuda"):
        m_out, m_lse, m_aux = attention_forward(*meta[:3], scale, kernel=kernel)
        tracer = Tracer(scratch=True)
        with tracer:
            attention_backward(meta[3], *meta[:3], m_out, m_lse, m_aux, scale)
    peak = tracer.trace.peak
    return {"backward_bytes": measured, "backward_bytes_predicted": peak, "backward_bytes_ratio": measured / peak}


def attention_ab(ctx: Context) -> dict:
    """Returns each attention kernel's speed at `attention_seq` tokens with llama3-8b's heads."""
    from memo import ModelConfig
    from memo.attention import KERNELS, available, choose

    strategies = _strategies()
    cfg, s = ModelConfig.preset("llama3-8b"), ctx.sizes.attention_seq

    def heads(n: int) -> torch.Tensor:  # token-major, as memo's layer holds q, k, v
        return torch.randn(1, s, n, cfg.head_dim, device=ctx.device, dtype=ctx.dtype).transpose(1, 2)

    tensors = (heads(cfg.n_heads), heads(cfg.n_kv_heads), heads(cfg.n_kv_heads), heads(cfg.n_heads))
    flops = attention_flops(s, cfg.n_heads, cfg.head_dim)
    here = available(ctx.device, ctx.dtype)
    result = {
        "shape": f"{_label(s)} tokens, {cfg.n_heads} heads, {cfg.n_kv_heads} kv heads, dim {cfg.head_dim}",
        "dtype": str(ctx.dtype).removeprefix("torch."),
        "auto": choose("auto", ctx.device, ctx.dtype),
        "flops": {"forward": flops[0], "backward": flops[1], "convention": ATTENTION_FLOPS},
    }
    first: list = []
    for kernel in KERNELS:
        if kernel not in here:
            result[kernel] = _unavailable(kernel)
        else:
            timing = functools.partial(_time_kernel, ctx, kernel, tensors, cfg.head_dim**-0.5, flops, first)
            result[kernel] = strategies.guarded(timing, ctx.device)
        ctx.put("attention", result)
        ctx.row(f"bandwidth attention {_label(s)} {kernel}: {_kernel_cell(result[kernel])}")
    return result


def _kernel_cell(result) -> str:
    if not isinstance(result, dict):
        return result
    if "forward_s" in result:
        cell = (
            f"forward {result['forward_s'] * 1e3:.1f} ms ({result['forward_TFLOPs']:.0f} TFLOP/s), "
            f"backward {result['backward_s'] * 1e3:.1f} ms ({result['backward_TFLOPs']:.0f} TFLOP/s)"
        )
        if "backward_bytes" in result:
            measured, traced = _gb(result["backward_bytes"]), _gb(result["backward_bytes_predicted"])
            cell += f", backward allocates {measured} (traced {traced}, {result['backward_bytes_ratio']:.2f}x)"
        return cell
    if "fell_back_to" in result:
        return f"refused, fell back to {result['fell_back_to']}: {'; '.join(result['refusals'])}"
    return "OOM" if result.get("oom") else str(result.get("error"))


def bandwidth(ctx: Context) -> None:
    """Copies, pinning, then the attention A/B: each part on its own, so one that fails costs only its numbers."""
    for name, part in (("copies", _copies), ("pinning", _pinning_part), ("attention", attention_ab)):
        try:
            part(ctx)
        except Exception as err:
            ctx.put(f"{name}_error", _first_line(err))
            ctx.row(f"bandwidth {name}: error {_first_line(err)}")


def _pinning_part(ctx: Context) -> None:
    ctx.put("pinning", _pinning(ctx))
    ctx.row(f"bandwidth pinning: {_fmt(ctx.data['pinning'].get('construct_GBps', NEEDS_CUDA), '.1f')} GB/s")


def _copies(ctx: Context) -> None:
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
    ctx.row(f"bandwidth alone: d2h {ctx.data['d2h_GBps']:.1f} GB/s, h2d {ctx.data['h2d_GBps']:.1f} GB/s")
    if ctx.device.type != "cuda":
        ctx.put("with_compute", f"{NEEDS_CUDA} (no second stream on CPU)")
    else:
        d2h = functools.partial(host.data.copy_, src, non_blocking=True)
        ctx.put("with_compute", _copies_under_compute(ctx, {"d2h": d2h, "h2d": h2d}, nbytes))
        under = ctx.data["with_compute"]
        ctx.row(
            f"bandwidth under compute: d2h {under['d2h']['copy_GBps']:.1f} GB/s, "
            f"h2d {under['h2d']['copy_GBps']:.1f} GB/s"
        )
    host.release()


# ---- strategies: the table, and what memo's step does inside ----------------------------------------------------
def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Returns the sorted, disjoint union of [start, end) intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(union: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in union)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Returns the length of the intersection of two disjoint sorted unions."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_summary(events: list[dict]) -> dict:
    """Returns, from a Chrome trace's GPU events (µs), the host copies' seconds and bytes per direction, the share
    of their time during which the compute stream (the one with the most kernel time) runs a kernel, the
    compute stream's idle time between its first and last kernel, and each stream's kernel and copy seconds."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
    streams: dict = {}
    for e in gpu:
        kind = "kernel_s" if e["cat"] == "kernel" else "copy_s"
        stream = streams.setdefault(str(e.get("args", {}).get("stream")), {"kernel_s": 0.0, "copy_s": 0.0})
        stream[kind] += e["dur"] / 1e6
    kernels = [e for e in gpu if e["cat"] == "kernel"]
    if not kernels:
        return {"error": "no kernel in the trace"}
    compute_stream = max(streams, key=lambda s: streams[s]["kernel_s"])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if str(e["args"].get("stream")) == compute_stream])
    copies = {"DtoH": [], "HtoD": []}
    for e in gpu:
        for direction in copies:
            if e["cat"] == "gpu_memcpy" and direction in e["name"]:
                copies[direction].append(e)
    copied = _union([(e["ts"], e["ts"] + e["dur"]) for found in copies.values() for e in found])
    span = compute[-1][1] - compute[0][0]
    return {
        "copy_s": {d: sum(e["dur"] for e in found) / 1e6 for d, found in copies.items()},
        "copy_bytes": {d: sum(e.get("args", {}).get("bytes", 0) for e in found) for d, found in copies.items()},
        "copy_concurrent_with_compute_share": _overlap(copied, compute) / _length(copied) if copied else None,
        "compute_stream": compute_stream,
        "compute_span_s": span / 1e6,
        "compute_idle_s": (span - _length(compute)) / 1e6,
        "compute_idle_share": (span - _length(compute)) / span if span else None,
        "streams": streams,
    }


def profiled_step(ctx: Context, model, step) -> dict:
    """Returns overlap_summary of one profiled step; the trace is read from the temporary folder, then deleted."""
    from torch.profiler import ProfilerActivity, profile

    if ctx.device.type != "cuda":
        return {"skipped": NEEDS_CUDA}
    trace = ctx.tmp / "memo_step_trace.json"
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace))
    try:
        return overlap_summary(json.loads(trace.read_text())["traceEvents"])
    finally:
        trace.unlink(missing_ok=True)


def layer_seconds(ctx: Context, model, step) -> dict:
    """Returns each layer's forward and backward seconds of one step, from CUDA events recorded by hooks: forward
    between the layer's pre- and post-hook; backward from its output's gradient to its input's."""
    if ctx.device.type != "cuda":
        return {"skipped": NEEDS_CUDA}
    marks: dict = {}

    def mark(key) -> None:
        marks[key] = torch.cuda.Event(enable_timing=True)
        marks[key].record()

    def before(i, module, args):
        mark(("forward", i, 0))
        args[0].register_hook(lambda grad: mark(("backward", i, 1)))

    def after(i, module, args, out):
        mark(("forward", i, 1))
        out.register_hook(lambda grad: mark(("backward", i, 0)))

    hooks = [layer.register_forward_pre_hook(functools.partial(before, i)) for i, layer in enumerate(model.layers)]
    hooks += [layer.register_forward_hook(functools.partial(after, i)) for i, layer in enumerate(model.layers)]
    try:
        model.zero_grad(set_to_none=True)
        step()
        torch.cuda.synchronize()
    finally:
        for hook in hooks:
            hook.remove()
    n = len(model.layers)
    return {
        phase: [_event_seconds(marks[(phase, i, 0)], marks[(phase, i, 1)]) for i in range(n)]
        for phase in ("forward", "backward")
    }


def predicted_step(ctx: Context, model, seq: int, row: dict) -> dict:
    """Returns the cost model's estimate of memo's step (its published efficiency for this GPU) against the row:
    step seconds without the optimizer (the row has none), and the activation memory (the store's buffers and
    the traced transient peak against the row's peak above the weights, less the weight gradients)."""
    from memo.cost.estimate import estimate
    from memo.cost.hardware import GPUS
    from memo.job import Job

    found = _strategies().gpu_spec(ctx.device)
    name, spec = found or ("H200", GPUS["H200"])
    predicted = estimate(Job(model=model.config, seq=seq), spec, "memo")
    step_s = predicted.step_seconds - predicted.seconds.get("optimizer", 0.0)
    result = {
        "spec": name if found else f"{name} (assumed: this device is not in memo.cost.hardware.GPUS)",
        "predicted": {key: predicted.as_dict()[key] for key in ("alphas", "plan", "tile", "seconds", "device_bytes")},
        "predicted_step_s": step_s,
    }
    if ctx.device.type != "cuda":  # the cost model knows GPUs
        return {**result, "step_measured_over_predicted": NEEDS_CUDA, "activation_measured_over_predicted": NEEDS_CUDA}
    result["step_measured_over_predicted"] = row["step_s"] / step_s
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    want = predicted.device_bytes["skeletal_buffers"] + predicted.device_bytes["transient_peak"]
    return {**result, "activation_measured_over_predicted": (row["activation_bytes"] - grads) / want}


def _inside_memo_step(ctx: Context, seq: int, model, step, row: dict) -> dict:
    """Returns what one memo step does inside: per-layer times, the profiled overlap, the cost model's view."""
    strategies = _strategies()
    found = {}
    for key, fn in (
        ("layer_seconds", functools.partial(layer_seconds, ctx, model, step)),
        ("profile", functools.partial(profiled_step, ctx, model, step)),
        ("prediction", functools.partial(predicted_step, ctx, model, seq, row)),
    ):
        found[key] = strategies.guarded(fn, ctx.device)
    return found


class _Messages(logging.Handler):
    """Keeps the messages of memo.swap while entered (the α solver logs what it measured)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> "_Messages":
        logging.getLogger("memo.swap").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("memo.swap").removeHandler(self)


def _memo_extra(ctx: Context, seq: int, inside: bool, messages: _Messages, model, step, row) -> dict:
    """Returns the extra of memo's α row: the solver's log, and at the first length what the step does inside."""
    found = {"solver_log": list(messages.lines)}
    if inside:
        found.update(_inside_memo_step(ctx, seq, model, step, row))
        ctx.row(f"strategies {_label(seq)} {ALPHA_ROW} inside: {_inside_cell(found)}")
    return found


def _inside_cell(found: dict) -> str:
    profile, prediction = found["profile"], found["prediction"]
    if "copy_s" not in profile:
        return str(profile.get("skipped") or profile.get("error"))
    return (
        f"copies {sum(profile['copy_s'].values()):.2f} s, {_fmt(profile['copy_concurrent_with_compute_share'], '.0%')}"
        f" under compute, compute stream idle {_fmt(profile['compute_idle_share'], '.0%')}; measured / predicted "
        f"step {_fmt(prediction.get('step_measured_over_predicted'))}"
    )


def _row_line(section: str, seq: int, row: dict) -> str:
    if row.get("oom"):
        cell = "OOM"
    elif "step_s" in row:
        cell = f"{row['step_s']:.2f} s, {_gb(row.get('peak_reserved'))} peak reserved"
    else:
        cell = f"error: {row.get('error')}"
    return f"{section} {_label(seq)} {row['name']}: {cell}"


ALPHA_ROW = "memo alpha=auto"
MEMO_ROWS = ("memo none", "memo full", ALPHA_ROW, "memo offload-all")
REFERENCE_ROWS = ("autograd (reference)", "torch.utils.checkpoint", "save_on_cpu")


def _measure(ctx: Context, setup, seq: int, repeats: int, names: tuple, rows: list, inside: bool = False) -> None:
    """Measures `names` at `seq` tokens into `rows` (which already holds what came before at that length); the
    α row with its solver's log and, when `inside`, what its step does inside."""
    strategies = _strategies()
    ids = torch.randint(0, setup.cfg.vocab_size, (1, seq), device=ctx.device)

    def on_row(new: list[dict]) -> None:
        rows.append(new[-1])
        strategies.add_ratios(rows)
        ctx.put(_label(seq), {"rows": rows})
        ctx.row(_row_line("strategies", seq, new[-1]))

    for name in names:
        with _Messages() as messages:
            extras = {ALPHA_ROW: functools.partial(_memo_extra, ctx, seq, inside, messages)}
            strategies.measure(setup, ids, "auto", repeats, on_row=on_row, names=(name,), extras=extras)


def strategies_section(ctx: Context) -> None:
    from memo import ModelConfig
    from memo.attention import choose

    strategies = _strategies()
    cfg = ModelConfig.preset(ctx.sizes.model, n_layers=ctx.sizes.layers)
    spec = strategies.gpu_spec(ctx.device)
    ctx.put("model", f"{cfg.name}, {cfg.n_layers} layers, {str(ctx.dtype).removeprefix('torch.')}, batch 1")
    ctx.put("attention", choose("auto", ctx.device, ctx.dtype))
    ctx.put("peak_flops", {"gpu": spec[0], "flops_per_s": spec[1].peak_flops} if spec else "n/a")
    ctx.put("mfu_convention", strategies.MFU_CONVENTION)
    if ctx.device.type != "cuda":
        ctx.put("memory", f"{NEEDS_CUDA} (benchmarks/strategies.py measures CPU memory in subprocesses)")
    torch.manual_seed(0)
    setup = strategies.Setup(cfg, ctx.device, ctx.dtype, strategies.shared_weights(cfg, ctx.device, ctx.dtype))
    tables: dict[int, list] = {seq: [] for seq in ctx.sizes.seqs}
    for i, (seq, repeats) in enumerate(zip(ctx.sizes.seqs, ctx.sizes.repeats)):
        _measure(ctx, setup, seq, repeats, MEMO_ROWS, tables[seq], inside=i == 0)
    seq = ctx.sizes.seqs[0]
    if ctx.left() < 40:  # the three reference rows take about as long as the four memo rows at this length
        ctx.put("reference_baselines", f"skipped: {ctx.left():.0f} s left of the box")
        return
    _measure(ctx, setup, seq, ctx.sizes.repeats[0], REFERENCE_ROWS, tables[seq])


# ---- planned: the planned allocator against the caching one, like for like -------------------------------------
def _train_flags(ctx: Context, work: Path) -> list[str]:
    from memo import ModelConfig

    model_file = work / "model.json"
    model_file.write_text(json.dumps(asdict(ModelConfig.preset(ctx.sizes.model, n_layers=ctx.sizes.layers))))
    dtype = "bfloat16" if ctx.device.type == "cuda" else "float32"
    flags = ["--model", str(model_file), "--seq-len", str(ctx.sizes.seqs[0]), "--batch-size", "1"]
    flags += ["--steps", str(ctx.sizes.train_steps), "--strategy", "memo", "--alpha", "0.5"]
    flags += ["--device", ctx.device.type, "--dtype", dtype, "--eval-every", "1000", "--eval-batches", "1"]
    return flags + ["--no-save-final", "--json", "--out", str(work / "run")]


class _Records(io.TextIOBase):
    """Takes `memo train --json`'s stdout and hands each record to `on_record` as it is printed, so a run killed at
    its box keeps the steps it finished."""

    def __init__(self, on_record):
        self.records: list[dict] = []
        self.on_record, self._partial = on_record, ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if line.startswith("{"):
                self.records.append(json.loads(line))
                self.on_record(self.records[-1])
        return len(text)


def _train(flags: list[str], on_record) -> tuple[int | None, list[dict], dict]:
    """Runs `memo train` in this process; returns (exit code or None, its JSON records, what went wrong)."""
    from memo import cli

    printed, failure = _Records(on_record), {}
    try:
        with contextlib.redirect_stdout(printed):
            code = cli.main(["train", *flags])
    except torch.OutOfMemoryError as err:
        code, failure = None, {"oom": True, "error": _first_line(err)}
    except Exception as err:
        code, failure = None, {"error": _first_line(err)}
    return code, printed.records, failure


def _written(run: Path) -> dict:
    """Returns the checkpoints and bytes a run left in its folder."""
    from memo.train.checkpoint import list_checkpoints

    if not run.exists():
        return {"checkpoints": 0, "bytes": 0}
    nbytes = sum(f.stat().st_size for f in run.rglob("*") if f.is_file())
    return {"checkpoints": len(list_checkpoints(run)), "bytes": nbytes}


def train_run(ctx: Context, arena: bool) -> None:
    """One `memo train` of the planned section, in a process of its own (the planned allocator owns a process's
    CUDA memory), in a folder of the temporary one removed at the end; reads the process's device footprint."""
    from memo.train.config import TrainConfig

    if "save_final" not in {f.name for f in fields(TrainConfig)}:
        ctx.put("error", "`memo train --no-save-final` is missing: a run would write a checkpoint of every state")
        return
    work = Path(tempfile.mkdtemp(dir=ctx.tmp))

    def latest(record: dict) -> None:
        if "loss" in record:
            ctx.put("latest_step", record)

    try:
        code, records, failure = _train(_train_flags(ctx, work) + (["--arena"] if arena else []), latest)
        ctx.put("exit_code", code)
        ctx.put("written", _written(work / "run"))
        for key, value in failure.items():
            ctx.put(key, value)
        steps = [r for r in records if "loss" in r]
        steady = steps[3:]  # steps 1-3 make the optimizer state and (--arena) record and plan the step
        ctx.put("steps", len(steps))
        if steady:
            ctx.put("step_s", statistics.median(r["seconds"] for r in steady))
            ctx.put("last", steady[-1])
        ctx.put(
            "vs_prediction", next((r["measured_vs_predicted"] for r in records if "measured_vs_predicted" in r), None)
        )
        if ctx.device.type != "cuda":
            ctx.put("footprint", NEEDS_CUDA)
        elif steady:  # the last step's peaks, both reset as that step began: what the step held, survivors included
            last = steady[-1]
            names = ("device_pool_reserved_peak", "device_pool_used_peak") if arena else STEP_PEAKS
            ctx.put("footprint", {"reserved_peak": last.get(names[0]), "used_peak": last.get(names[1])})
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build_state(ctx: Context) -> dict:
    """Returns what the background build of the planned allocator's extension has written so far."""
    path = ctx.path.with_name("build_extension.json")
    return json.loads(path.read_text()) if path.exists() else {"finished": False}


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def planned(ctx: Context) -> None:
    seq = ctx.sizes.seqs[0]
    steps = ctx.sizes.train_steps
    ctx.put("model", f"{ctx.sizes.model}, {ctx.sizes.layers} layers, {_label(seq)} tokens, memo α=0.5, {steps} steps")
    ctx.put("build_at_start", _build_state(ctx))
    runs = {}
    for i, name in enumerate(("caching_allocator", "planned_allocator")):
        box = ctx.left() / (2 - i) - 1  # the first run gets half of what is left, the second the rest
        record, data = _part(ctx, name, box)
        runs[name] = {**record, **data}
        ctx.put(name, runs[name])
        ctx.row(f"planned {_label(seq)} {name}: {_run_cell(runs[name])}")
    caching, arena = (runs[n].get("footprint") for n in ("caching_allocator", "planned_allocator"))
    if isinstance(caching, dict) and isinstance(arena, dict):
        ctx.put("reserved_planned_over_caching", _ratio(arena.get("reserved_peak"), caching["reserved_peak"]))
        ctx.put("used_planned_over_caching", _ratio(arena.get("used_peak"), caching["used_peak"]))
    else:
        ctx.put("reserved_planned_over_caching", caching if isinstance(caching, str) else arena)
    last = runs["planned_allocator"].get("last", {})
    ctx.put("arena_over_load", _ratio(last.get("arena_bytes"), last.get("arena_load_bytes")))
    ctx.put(
        "step_planned_over_caching",
        _ratio(runs["planned_allocator"].get("step_s"), runs["caching_allocator"].get("step_s")),
    )


def _run_cell(run: dict) -> str:
    if run.get("oom"):
        return f"OOM ({run['error']})"
    if "step_s" not in run:
        return f"{run['status']}: {run.get('error') or run.get('tail', '').rpartition(chr(10))[2]}"
    footprint = run.get("footprint")
    peak = _gb(footprint.get("reserved_peak")) if isinstance(footprint, dict) else "n/a"
    return f"{run['step_s']:.2f} s per step, {peak} peak reserved, {run['written']['checkpoints']} checkpoints"


def build_extension(ctx: Context) -> None:
    """Builds the planned allocator's extension into torch's cache (run detached from the start of the check)."""
    from memo.plan.allocator import extension

    start = time.perf_counter()
    try:
        extension()
        ctx.put("built", True)
    except ValueError as err:
        ctx.put("built", False)
        ctx.put("error", str(err))
    ctx.put("finished", True)
    ctx.put("seconds", time.perf_counter() - start)


SECTIONS = {  # name: (time box in seconds, function), in order of value
    "preflight": (40, preflight),
    "correctness": (100, correctness),
    "bandwidth": (40, bandwidth),
    "strategies": (170, strategies_section),
    "planned": (100, planned),
}
HELPERS = {  # run only as another section's subprocess
    "build_extension": build_extension,
    "equivalence": equivalence,
    "sanitizer": sanitized_step,
    "caching_allocator": functools.partial(train_run, arena=False),
    "planned_allocator": functools.partial(train_run, arena=True),
}


# ---- the parent: one subprocess per section ---------------------------------------------------------------------
class _Relay:
    """Prints the row lines a child writes to its log as they come (whole lines only)."""

    def __init__(self, path: Path):
        self.file, self.pending = open(path, errors="replace"), ""

    def __call__(self) -> None:
        self.pending += self.file.read()
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.startswith(ROW):
                print(line.removeprefix(ROW), flush=True)

    def close(self) -> None:
        self.file.close()


def run_child(cmd: list[str], timeout: float, log_path: Path, env: dict | None = None, relay: bool = False) -> str:
    """Runs `cmd` in its own process group with output to `log_path`; returns "ok", "error" or "timeout".

    The whole group is killed at the end, so a hung grandchild (pytest, the sanitized step) cannot outlive it.
    With `relay`, the child's row lines are printed as they come.
    """
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        reader = _Relay(log_path) if relay else None
        deadline, status = time.monotonic() + timeout, None
        try:
            while status is None:
                try:
                    code = proc.wait(timeout=max(min(POLL_S, deadline - time.monotonic()), 0.01))
                    status = "ok" if code == 0 else "error"
                except subprocess.TimeoutExpired:
                    status = "timeout" if time.monotonic() >= deadline else None
                if reader is not None:
                    reader()
        finally:
            _kill_group(proc)
            if reader is not None:
                reader.close()
    cap_log(log_path)
    return status


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def cap_log(path: Path, cap: int = LOG_CAP) -> None:
    """Keeps a log's first and last bytes when it is over `cap`: the start says what ran, the end how it ended."""
    if not path.exists() or path.stat().st_size <= cap:
        return
    data = path.read_bytes()
    head, tail = data[: cap // 8], data[-(cap - cap // 8) :]
    path.write_bytes(head + f"\n[... {len(data) - cap} bytes cut by gpu_check ...]\n".encode() + tail)


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _child_command(name: str, out: Path, ctx, deadline: float) -> list[str]:
    """Returns the command that runs section or helper `name` of this script, with `ctx`'s device, sizes and
    temporary folder (`ctx` is a Context, or the parent's parsed arguments), to be killed at `deadline`
    (time.time(): the child's own parts end before it, whenever the child started)."""
    flags = ["--quick"] if ctx.quick else []
    script = str(Path(__file__).resolve())
    flags += ["--device", str(ctx.device), "--tmp", str(ctx.tmp), "--deadline", f"{deadline:.1f}"]
    return [sys.executable, script, "--section", name, "--section-out", str(out), *flags]


def _child_env(args) -> dict:
    """Returns the environment of the parent's children: the repo's src importable, torch's compile cache (which
    torch makes when it loads its compiler) inside the temporary folder, and under `--quick` one intra-op thread
    (toy sizes gain nothing from more, and a busy machine loses much to their spinning)."""
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "TORCHINDUCTOR_CACHE_DIR": str(args.tmp / "torchinductor")}
    return {**env, **({"OMP_NUM_THREADS": "1"} if args.quick else {})}


def run_section(name: str, args, timeout: float, logs: Path) -> tuple[dict, dict | None]:
    """Returns (the section's status record, whatever numbers it wrote before it ended)."""
    out, log_path = logs / f"{name}.json", logs / f"{name}.log"
    out.unlink(missing_ok=True)
    start = time.monotonic()
    command = _child_command(name, out, args, time.time() + timeout)
    status = run_child(command, timeout, log_path, _child_env(args), relay=True)
    record = {"status": status, "seconds": round(time.monotonic() - start, 1), "error": None, "log": str(log_path)}
    if status == "timeout":
        record["error"] = f"killed after its {timeout:.0f} s box\n{_tail(log_path)}"
    elif status == "error":
        record["error"] = _tail(log_path)
    return record, json.loads(out.read_text()) if out.exists() else None


def start_build(args, logs: Path) -> tuple[subprocess.Popen | None, dict]:
    """Starts the planned allocator's extension build detached, when the toolchain is there; returns (the
    process or None, the record of it)."""
    tools = toolchain()
    record = {"toolchain": tools}
    if not (tools["ninja"] and tools["compiler"]):
        return None, {**record, "started": False, "error": "no ninja or no C++ compiler: `--arena` cannot build"}
    out = logs / "build_extension.json"
    out.unlink(missing_ok=True)
    with open(logs / "build_extension.log", "w") as log_file:
        proc = subprocess.Popen(
            _child_command("build_extension", out, args, math.inf),
            cwd=ROOT,
            env=_child_env(args),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, {**record, "started": True}


def finish_build(proc: subprocess.Popen | None, record: dict, logs: Path) -> dict:
    """Returns the build's record at the end of the run, after stopping it if it still runs."""
    if proc is None:
        return record
    still = proc.poll() is None
    _kill_group(proc)
    out = logs / "build_extension.json"
    done = json.loads(out.read_text()) if out.exists() else {}
    return {**record, **done, "finished": done.get("finished", False), "killed_at_end": still}


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


def summary(results: dict) -> list[str]:
    """Returns a few human lines: each section's status and its headline numbers (the rows came before)."""
    lines = [f"{name}: {r['status']} ({r['seconds']} s)" for name, r in results["sections"].items()]
    for name in CORRECTNESS:
        if name in results:
            lines.append(f"{name} passed: {results[name].get('passed')}")
    tables = [t for t in results.get("strategies", {}).values() if isinstance(t, dict) and "rows" in t]
    memo = [r for t in tables for r in t["rows"] if r.get("name") == "memo alpha=auto" and "profile" in r]
    inside = memo[0]["profile"] if memo else None
    if isinstance(inside, dict) and "copy_s" in inside:
        lines.append(
            f"memo step: copies {_fmt(sum(inside['copy_s'].values()))} s, "
            f"{_fmt(inside['copy_concurrent_with_compute_share'], '.0%')} of it under compute; "
            f"compute stream idle {_fmt(inside['compute_idle_share'], '.0%')}"
        )
    planned_ = results.get("planned", {})
    if "reserved_planned_over_caching" in planned_:
        lines.append(
            f"planned / caching: reserved {_fmt(planned_['reserved_planned_over_caching'])}, "
            f"step time {_fmt(planned_.get('step_planned_over_caching'))}"
        )
    return lines


def _default_out() -> Path:
    return Path(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else Path("gpu_check.json")


def results_bytes(out: Path, logs: Path) -> int:
    files = [out, *logs.iterdir()] if logs.exists() else [out]
    return sum(f.stat().st_size for f in files if f.is_file())


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
    results = {"run": {**run, "seconds": 0.0, "results_bytes": 0}, "sections": {}}
    start = time.monotonic()
    args.tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    build, record = start_build(args, logs) if "planned" in names and args.budget >= MIN_START_S else (None, {})
    try:
        for name in names:
            left = args.budget - (time.monotonic() - start)
            if left < MIN_START_S:
                section = {"status": "skipped", "seconds": 0.0, "error": f"global budget of {args.budget} s spent"}
            else:
                log(f"gpu_check: {name} (box {min(SECTIONS[name][0], left):.0f} s)")
                section, data = run_section(name, args, min(SECTIONS[name][0], left), logs)
                if data is not None:
                    results[name] = data
            results["sections"][name] = section
            results["run"]["seconds"] = round(time.monotonic() - start, 1)
            results["run"]["results_bytes"] = results_bytes(out, logs)
            write_json(out, results)
            log(f"gpu_check: {name} {section['status']} after {section['seconds']} s")
    finally:
        if record:
            results["build_extension"] = finish_build(build, record, logs)
        shutil.rmtree(args.tmp, ignore_errors=True)
    results["run"]["results_bytes"] = results_bytes(out, logs)
    write_json(out, results)
    print("\n".join(summary(results)))
    failed = correctness_failed(results)
    size = results["run"]["results_bytes"]
    over = f"; OVER {RESULTS_CAP / 1e6:.0f} MB" if size > RESULTS_CAP else ""
    print(f"results: {out} ({size / 1e6:.1f} MB)" + (f"; FAILED: {', '.join(failed)}" if failed else "") + over)
    return 1 if failed else 0


def run_one(args) -> int:
    """Runs one section in this process (the parent started it); its numbers go to --section-out."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    sizes = QUICK if args.quick else FULL
    ctx = Context(torch.device(args.device), sizes, args.quick, Path(args.section_out), Path(args.tmp), args.deadline)
    fn = {**{name: fn for name, (_, fn) in SECTIONS.items()}, **HELPERS}[args.section]
    fn(ctx)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="toy sizes: every section in well under a minute")
    p.add_argument("--out", default=None, help="results JSON (default $OUT/gpu_check.json, else ./gpu_check.json)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all sections together")
    p.add_argument("--only", default=None, help="comma-separated sections to run, in the usual order")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)
    p.add_argument("--section-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return run_one(args) if args.section else run_all(args)


if __name__ == "__main__":
    sys.exit(main())
