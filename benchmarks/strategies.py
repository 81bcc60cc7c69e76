"""Step time and activation memory of MEMO's strategies against what users run today, in one run.

Rows: memo.Transformer with strategies none / full / memo (α), memo with the planned arena (§5), and the
plain-autograd reference model (same weights, PyTorch's flash SDPA) under no wrapper, `torch.utils.checkpoint`
per layer, and `torch.autograd.graph.save_on_cpu`. Ratios are against MEMO's `none`.

Memory is measured, the same way for every row: the process's resident-set high-water mark during one
training step minus the resident set before it (CPU), or `torch.cuda.max_memory_allocated` minus the
memory allocated before the step (CUDA), on a fresh MEMO store so that its buffers count. On CPU, host
and "device" are the same memory (measured in a subprocess whose malloc returns freed memory), so the
bytes a strategy parks in host memory (save_on_cpu's copies, MEMO's pool) are shown in their own
column and subtracted from the activation column.

    python benchmarks/strategies.py                   # CPU default: tiny-gpt, 8 layers, 8192 tokens
    python benchmarks/strategies.py --device cuda --model gpt-7b --layers 4 --seq 32768 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from memo import ActivationPolicy, ModelConfig, Transformer  # noqa: E402
from memo.reference import ReferenceTransformer  # noqa: E402
from memo.swap import make_store  # noqa: E402
from memo.units import parse_size  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _return_freed_memory_to_os() -> None:
    """Makes glibc serve every large tensor with mmap, so RSS tracks live bytes (no cached heap)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMemory:
    """Measures the peak bytes allocated during a block, above what was allocated before it."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.base = _rss_bytes("VmRSS:")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
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


def build_rows(args, cfg: ModelConfig, device, dtype):
    """Returns [(name, model, step(ids) -> host_bytes)] sharing one set of weights."""
    ref = ReferenceTransformer(cfg, attention="sdpa").to(device=device, dtype=dtype)
    alpha = None if args.alpha == "auto" else float(args.alpha)
    rows = []
    for name, policy in [
        ("memo none", ActivationPolicy("none")),
        ("memo full", ActivationPolicy("full")),
        (f"memo alpha={args.alpha}", ActivationPolicy("memo", alpha=alpha)),
        (f"memo alpha={args.alpha} + arena", ActivationPolicy("memo", alpha=alpha)),
    ]:
        model = Transformer(cfg, policy).to(device=device, dtype=dtype)
        model.load_state_dict(ref.state_dict())
        if name.endswith("arena"):
            model.plan_memory()
        rows.append((name, model, lambda ids, m=model: _memo_step(m, ids)))
    saver = HostBytes(device)
    rows += [
        ("autograd (reference)", ref, lambda ids: _ref_step(ref, ids)),
        ("torch.utils.checkpoint", ref, lambda ids: _ref_step(ref, ids, block=_checkpointed)),
        ("save_on_cpu", ref, lambda ids: _ref_step(ref, ids, saver=saver)),
    ]
    return rows


def _memo_step(model, ids) -> int:
    model(ids, labels=ids).backward()
    return model.swap_stats().host_pool_bytes


def _ref_step(ref, ids, block=None, saver=None) -> int:
    if saver is None:
        ref(ids, labels=ids, block=block).backward()
        return 0
    with saver:
        loss = ref(ids, labels=ids, block=block)
    loss.backward()
    return saver.nbytes


def _run(step, model, ids, device) -> int:
    model.zero_grad(set_to_none=True)
    host = step(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return host


def measure_time(step, model, ids, device, repeats: int) -> float:
    """Returns the median step seconds after one warm-up step (which sizes buffers and solves alpha)."""
    _run(step, model, ids, device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _run(step, model, ids, device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_memory(step, model, ids, device) -> tuple[int, int]:
    """Returns (peak bytes of one step minus what it parked in host memory, host bytes).

    A MEMO model gets a fresh store first, so its rounding buffers and pool are allocated inside the step
    like every other row's activations.
    """
    _run(step, model, ids, device)
    if isinstance(model, Transformer):
        model.store = make_store(model.policy, model.config.n_layers)
        if model.layers[0].arena is not None:
            model.layers[0].arena.buffer = None  # the arena too is allocated inside the measured step
    with PeakMemory(device) as mem:
        host = _run(step, model, ids, device)
    return (max(mem.peak - host, 0) if device.type == "cpu" else mem.peak), host


def _memory_in_subprocess(argv, row: int) -> tuple[int, int]:
    """Returns measure_memory of `row` from a fresh process whose malloc returns freed memory to the OS."""
    done = subprocess.run(
        [sys.executable, __file__, *argv, "--memory-row", str(row)], capture_output=True, text=True, check=True
    )
    peak, host = done.stdout.split()
    return int(peak), int(host)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-gpt")
    p.add_argument("--layers", type=int, default=8, help="override the preset's depth (0: keep it)")
    p.add_argument("--seq", default="8192", help="tokens per sequence (512K, 1M accepted)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--alpha", default="0.5", help="memo alpha, or 'auto' to solve it")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--memory-row", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cfg = ModelConfig.preset(args.model, **({"n_layers": args.layers} if args.layers else {}))
    seq = parse_size(args.seq)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, seq), device=device)
    rows = build_rows(args, cfg, device, dtype)
    if args.memory_row is not None:
        if device.type == "cpu":
            _return_freed_memory_to_os()
        _, model, step = rows[args.memory_row]
        print(*measure_memory(step, model, ids, device))
        return 0
    print(
        f"# {cfg.name} ({cfg.n_layers} layers, h={cfg.hidden_size}) b={args.batch} s={seq} {args.dtype} on "
        f"{device.type}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        flush=True,
    )
    results = []
    argv = sys.argv[1:] if argv is None else argv
    for row, (name, model, step) in enumerate(rows):
        seconds = measure_time(step, model, ids, device, args.repeats)
        if device.type == "cpu":
            peak, host = _memory_in_subprocess(argv, row)
        else:
            peak, host = measure_memory(step, model, ids, device)
        results.append((name, seconds, peak, host))
        print(f"  measured {name}: {seconds:.3f}s", file=sys.stderr, flush=True)
    base_t, base_m = results[0][1], results[0][2]
    print("| strategy | step s | x none | activation MiB | x none | host MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, seconds, peak, host in results:
        print(
            f"| {name} | {seconds:.3f} | {seconds / base_t:.2f} | {peak / 2**20:.1f} | "
            f"{peak / max(base_m, 1):.2f} | {host / 2**20:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
