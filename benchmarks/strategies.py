"""Step time and activation memory of MEMO's strategies against what users run today, in one run.

Rows: memo.Transformer with strategies none / full / memo (α), memo with the phase planner (§5), memo
offloading every layer whole (α = 1, last layers too), and the plain-autograd reference model (same weights,
PyTorch's flash SDPA) under no wrapper, `torch.utils.checkpoint` per layer, and
`torch.autograd.graph.save_on_cpu`. Every row computes its loss with memo's chunked cross-entropy
(`memo.loss`), so no row holds the (tokens × vocab) logits: at 128K tokens of a 128K vocabulary they alone
would be ~90 GB, and the reference rows would measure the loss instead of their activations. Ratios are
against MEMO's `none`. Each row builds its own model from the shared weights and frees it before the next, so
one row's memory never counts in another's; a row that runs out of device memory reads OOM.

Memory is measured the same way for every row. CUDA: `torch.cuda.max_memory_allocated` over the row's
steps minus what its freshly built model held before them (weights), plus peak allocated and reserved
bytes as the allocator reports them. CPU: the resident-set high-water mark of one step above the resident
set before it, in a subprocess whose malloc returns freed memory, on a fresh MEMO store so that its buffers
count. On CPU host and "device" are the same memory, so the bytes a strategy parks in host memory
(save_on_cpu's copies, MEMO's pool) are shown in their own column and subtracted from the activation column.

MFU uses `memo.cost.flops.model_flops_per_token` (see MFU_CONVENTION) and the dense bf16 peak of the GPU
named in `memo.cost.hardware.GPUS`; it reads n/a on CPU or an unlisted GPU.

    python benchmarks/strategies.py                   # CPU default: tiny-gpt, 8 layers, 8192 tokens
    python benchmarks/strategies.py --device cuda --model gpt-7b --layers 4 --seq 32K --dtype bfloat16 --json
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from memo import ActivationPolicy, ModelConfig, Transformer  # noqa: E402
from memo.cost.flops import MFU_CAUSAL, MFU_FULL, model_flops_per_token  # noqa: E402
from memo.cost.hardware import GPUSpec, gpu_of  # noqa: E402
from memo.device import DTYPES  # noqa: E402
from memo.loss import shift_labels, target_cross_entropy  # noqa: E402
from memo.plan.phases import attach  # noqa: E402
from memo.reference import ReferenceTransformer  # noqa: E402
from memo.swap import make_store  # noqa: E402
from memo.units import parse_size  # noqa: E402

MFU_CONVENTION = {"mfu": MFU_CAUSAL, "mfu_full": MFU_FULL}  # memo.cost.flops; recomputation is not counted


@dataclass(frozen=True)
class Setup:
    """What every row shares: the model shape, where it runs, and one set of weights kept in host memory."""

    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    weights: dict[str, torch.Tensor]


def shared_weights(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Returns initialised weights in host memory (initialised on `device`, where it is fast)."""
    with device:
        model = Transformer(cfg)
    return {name: t.to("cpu", dtype) for name, t in model.state_dict().items()}


def built(make, setup: Setup):
    """Returns `make()` built on the setup's device in its dtype, holding the shared weights."""
    with setup.device:
        model = make()
    model.to(dtype=setup.dtype)
    model.load_state_dict(setup.weights)
    return model


def _return_freed_memory_to_os() -> None:
    """Makes glibc serve every large tensor with mmap, so RSS tracks live bytes (no cached heap)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def release_heap() -> None:
    """Makes malloc return freed memory to the system now and from here on, so the resident set tracks live
    bytes."""
    _return_freed_memory_to_os()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class RssPeak:
    """Measures the resident-set high-water mark during a block, above the resident set before it (CPU)."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.base = _rss_bytes("VmRSS:")
        return self

    def __exit__(self, *exc):
        self.peak = _rss_bytes("VmHWM:") - self.base


class HostBytes:
    """save_on_cpu that also counts the bytes it copies to host."""

    def __init__(self, device: torch.device):
        self.nbytes, self.pin = 0, device.type == "cuda"

    def __enter__(self):
        self.nbytes = 0
        self.inner = torch.autograd.graph.save_on_cpu(pin_memory=self.pin)
        pack, unpack = self.inner.pack_hook, self.inner.unpack_hook

        def counting_pack(t):
            if t.device.type != "cpu":  # on CPU save_on_cpu keeps the tensor itself: nothing moves
                self.nbytes += t.numel() * t.element_size()
            return pack(t)

        self.inner.pack_hook = counting_pack
        self.inner.unpack_hook = unpack
        return self.inner.__enter__()

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def _checkpointed(layer, x):
    return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)


def _memo_row(policy: ActivationPolicy, setup: Setup, phases: bool = False):
    model = built(lambda: Transformer(setup.cfg, policy), setup)
    if phases:
        attach(model)
    return model, functools.partial(_memo_step, model)


def _ref_row(setup: Setup, block=None, save_on_cpu: bool = False):
    ref = built(lambda: ReferenceTransformer(setup.cfg, attention="sdpa"), setup)
    saver = HostBytes(setup.device) if save_on_cpu else None
    return ref, functools.partial(_ref_step, ref, block=block, saver=saver)


def row_builders(alpha: str) -> list[tuple[str, object]]:
    """Returns [(row name, build(setup) -> (model, step(ids) -> host bytes))], in table order."""
    a = None if alpha == "auto" else float(alpha)
    offload_all = ActivationPolicy("memo", alpha=1.0, offload_last_layers=True)
    return [
        ("memo none", functools.partial(_memo_row, ActivationPolicy("none"))),
        ("memo full", functools.partial(_memo_row, ActivationPolicy("full"))),
        (f"memo alpha={alpha}", functools.partial(_memo_row, ActivationPolicy("memo", alpha=a))),
        (
            f"memo alpha={alpha} + phase planner",
            functools.partial(_memo_row, ActivationPolicy("memo", alpha=a), phases=True),
        ),
        ("memo offload-all", functools.partial(_memo_row, offload_all)),
        ("autograd (reference)", _ref_row),
        ("torch.utils.checkpoint", functools.partial(_ref_row, block=_checkpointed)),
        ("save_on_cpu", functools.partial(_ref_row, save_on_cpu=True)),
    ]


def _memo_step(model, ids) -> int:
    model(ids, labels=ids).backward()
    return model.swap_stats().host_pool_bytes


def reference_loss(ref: ReferenceTransformer, ids: torch.Tensor, block=None) -> torch.Tensor:
    """Returns the reference model's mean next-token loss through memo's chunked cross-entropy (the final
    norm and the logits chunk by chunk, as memo.Transformer computes it), each layer wrapped by `block`."""
    x = ref.embed(ids)
    for layer in ref.layers:
        x = layer(x) if block is None else block(layer, x)
    weight = ref.embed.weight if ref.head is None else ref.head.weight
    return target_cross_entropy(x, weight, shift_labels(ids), norm=ref.norm)


def _ref_step(ref, ids, block=None, saver=None) -> int:
    if saver is None:
        reference_loss(ref, ids, block).backward()
        return 0
    with saver:
        loss = reference_loss(ref, ids, block)
    loss.backward()
    return saver.nbytes


def _run(step, model, ids, device) -> int:
    model.zero_grad(set_to_none=True)
    host = step(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return host


def measure_time(step, model, ids, device, repeats: int) -> tuple[float, int]:
    """Returns (median step seconds, host bytes) after one warm-up step (which sizes buffers and solves α)."""
    _run(step, model, ids, device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        host = _run(step, model, ids, device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), host


def free_device_memory(device: torch.device) -> int:
    """Returns the bytes still allocated after collecting garbage, emptying the cache and resetting the peaks."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _cuda_peaks(device: torch.device, base: int) -> dict:
    if device.type != "cuda":
        return {"activation_bytes": None, "peak_allocated": None, "peak_reserved": None}
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return {"activation_bytes": peak - base, "peak_allocated": peak, "peak_reserved": torch.cuda.max_memory_reserved()}


def _first_line(err: BaseException) -> str:
    return next(iter(str(err).splitlines()), "")


def guarded(fn, device: torch.device) -> dict:
    """Returns fn(), or what went wrong: running out of device memory is a result to record, not a crash."""
    try:
        return fn()
    except torch.OutOfMemoryError as err:
        return {"oom": True, "error": _first_line(err)}
    except Exception as err:  # one broken row must not cost the others their numbers
        return {"error": f"{type(err).__name__}: {_first_line(err)}"}
    finally:
        free_device_memory(device)


def measure_row(name: str, build, ids: torch.Tensor, repeats: int, extra=None) -> dict:
    """Returns one row: step seconds, host bytes, α per layer (memo rows) and, on CUDA, memory peaks;
    `extra(model, step, row)`, when given (`step()` runs one more step), adds what else the caller measures of the
    same model after that."""
    device = ids.device

    def run() -> dict:
        model, step = build()
        base = free_device_memory(device)
        seconds, host = measure_time(step, model, ids, device, repeats)
        row = {"step_s": seconds, "host_bytes": host, **_cuda_peaks(device, base)}
        if isinstance(model, Transformer):
            row["alphas"] = model.swap_stats().alphas
        if extra is not None:
            row.update(extra(model, functools.partial(step, ids), row))
        return row

    return {"name": name, **guarded(run, device)}


def gpu_spec(device: torch.device) -> tuple[str, GPUSpec] | None:
    """Returns the GPUS entry whose model name (H200, A100, ...) appears in the device's name, if any."""
    if device.type != "cuda":
        return None
    spec = gpu_of(torch.cuda.get_device_name(device))
    return (spec.name, spec) if spec else None


def _throughput(row: dict, cfg: ModelConfig, ids: torch.Tensor, peak_flops: float | None) -> None:
    if "step_s" not in row:
        return
    tokens_per_s = ids.numel() / row["step_s"]
    seq = ids.shape[1]
    row["tokens_per_s"] = tokens_per_s
    row["mfu"] = model_flops_per_token(cfg, seq) * tokens_per_s / peak_flops if peak_flops else None
    row["mfu_full"] = model_flops_per_token(cfg, seq, causal=False) * tokens_per_s / peak_flops if peak_flops else None


def add_ratios(rows: list[dict]) -> None:
    """Sets each row's step time and activation memory over the first row's (MEMO's `none`), where both exist."""
    base = rows[0]
    for row in rows:
        for key, ratio in (("step_s", "step_over_none"), ("activation_bytes", "activation_over_none")):
            both = row.get(key) is not None and bool(base.get(key))
            row[ratio] = row[key] / base[key] if both else None


def measure(
    setup: Setup, ids: torch.Tensor, alpha: str, repeats: int, on_row=None, names=None, extras=None
) -> list[dict]:
    """Returns one dict per row (see row_builders; only those in `names` when given); calls `on_row(rows so
    far)` after each row; `extras` maps a row's name to its `measure_row` extra."""
    spec = gpu_spec(setup.device)
    rows = []
    for name, build in row_builders(alpha):
        if names is not None and name not in names:
            continue
        print(f"  measuring {name} at {ids.shape[1]} tokens", file=sys.stderr, flush=True)
        extra = (extras or {}).get(name)
        rows.append(measure_row(name, functools.partial(build, setup), ids, repeats, extra))
        _throughput(rows[-1], setup.cfg, ids, spec[1].peak_flops if spec else None)
        add_ratios(rows)
        if on_row is not None:
            on_row(rows)
    return rows


def measure_memory(step, model, ids) -> tuple[int, int]:
    """Returns (resident peak of one CPU step minus what it parked in host memory, host bytes).

    A MEMO model gets a fresh store first, so its rounding buffers and pool are allocated inside the step
    like every other row's activations.
    """
    _run(step, model, ids, ids.device)
    if isinstance(model, Transformer):
        model.store = make_store(model.policy, model.config.n_layers)
        if model.layers[0].phases is not None:
            model.layers[0].phases.buffer = None  # the phase planner's buffer too is allocated inside the measured step
    with RssPeak() as mem:
        host = _run(step, model, ids, ids.device)
    return max(mem.peak - host, 0), host


def _memory_in_subprocess(argv, row: int) -> tuple[int, int]:
    """Returns measure_memory of `row` from a fresh process whose malloc returns freed memory to the OS."""
    done = subprocess.run(
        [sys.executable, __file__, *argv, "--memory-row", str(row)], capture_output=True, text=True, check=True
    )
    peak, host = done.stdout.split()
    return int(peak), int(host)


def _cell(value, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value / scale, fmt)


def print_table(rows: list[dict]) -> None:
    print("| strategy | step s | x none | tokens/s | MFU | activation MiB | x none | peak reserved MiB | host MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if "error" in row:
            print(f"| {row['name']} | {'OOM' if row.get('oom') else 'error'} |  |  |  |  |  |  |  |")
            continue
        print(
            f"| {row['name']} | {row['step_s']:.3f} | {_cell(row['step_over_none'], '.2f')} | "
            f"{row['tokens_per_s']:.0f} | {_cell(row['mfu'], '.1%')} | "
            f"{_cell(row['activation_bytes'], '.1f', 2**20)} | {_cell(row['activation_over_none'], '.2f')} | "
            f"{_cell(row['peak_reserved'], '.1f', 2**20)} | {row['host_bytes'] / 2**20:.1f} |"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-gpt")
    p.add_argument("--layers", type=int, default=8, help="override the preset's depth (0: keep it)")
    p.add_argument("--seq", default="8192", help="tokens per sequence (512K, 1M accepted)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--alpha", default="0.5", help="memo alpha, or 'auto' to solve it")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))  # trained: no float16
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--memory-row", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.memory_row is not None:
        _return_freed_memory_to_os()
    cfg = ModelConfig.preset(args.model, **({"n_layers": args.layers} if args.layers else {}))
    seq = parse_size(args.seq)
    torch.manual_seed(0)
    setup = Setup(cfg, device, dtype, shared_weights(cfg, device, dtype))
    ids = torch.randint(0, cfg.vocab_size, (args.batch, seq), device=device)
    if args.memory_row is not None:
        model, step = row_builders(args.alpha)[args.memory_row][1](setup)
        print(*measure_memory(step, model, ids))
        return 0
    rows = measure(setup, ids, args.alpha, args.repeats)
    if device.type == "cpu":
        argv = sys.argv[1:] if argv is None else argv
        for i, row in enumerate(rows):
            if "error" not in row:
                row["activation_bytes"], row["host_bytes"] = _memory_in_subprocess(argv, i)
        add_ratios(rows)
    spec = gpu_spec(device)
    if args.json:
        print(
            json.dumps(
                {
                    "model": cfg.name,
                    "layers": cfg.n_layers,
                    "batch": args.batch,
                    "seq": seq,
                    "dtype": args.dtype,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "peak_flops": {"gpu": spec[0], "flops_per_s": spec[1].peak_flops} if spec else None,
                    "mfu_convention": MFU_CONVENTION,
                    "rows": rows,
                },
                indent=1,
            )
        )
        return 0
    print(
        f"# {cfg.name} ({cfg.n_layers} layers, h={cfg.hidden_size}) b={args.batch} s={seq} {args.dtype} on "
        f"{device.type}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"MFU against {spec[0] if spec else 'n/a'}: {MFU_CAUSAL} (mfu_full in the JSON: {MFU_FULL})"
    )
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
