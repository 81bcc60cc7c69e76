"""One-GPU check of the CUDA paths (streams, events, pinned pool, flash kernels), under 8 minutes.

1. Gradient parity on CUDA: tests/test_layer_gradients.py with MEMO_TEST_DEVICE=cuda (every strategy, α,
   per-layer α, all layers offloaded; fp32 through the efficient kernel, bf16 through flash).
2. Copy bandwidth device->pinned host, and the α the solver picks for a gpt-7b layer at 32K tokens.
3. `memo calibrate` on this GPU, and the measured step time of a 4-layer gpt-7b-shaped model (memo, 32K
   tokens, bf16) against the cost model's prediction with that calibration (ratio measured / predicted).
4. The run-time arena: tests/test_arena.py on CUDA, and peak reserved / allocated memory and step time of the
   same 4-layer model with and without `plan_memory()`.
5. benchmarks/strategies.py on CUDA: a gpt-7b-shaped model (6 layers, bf16) at 32K tokens.

    python benchmarks/gpu_check.py            # prints a report; writes $OUT/gpu_check.json if $OUT is set
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import strategies  # noqa: E402

from memo import ActivationPolicy, ModelConfig, Transformer  # noqa: E402
from memo.cost.calibrate import calibrate  # noqa: E402
from memo.cost.estimate import estimate  # noqa: E402
from memo.cost.hardware import GPUS, efficiency_from_calibration  # noqa: E402
from memo.device import timed  # noqa: E402
from memo.swap import measure_copy_bandwidth  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def gradient_parity(test_file: str) -> tuple[bool, str]:
    """Runs a test file on CUDA; returns (passed, pytest's summary line)."""
    env = {**os.environ, "MEMO_TEST_DEVICE": "cuda"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / test_file)],
        env=env,
        capture_output=True,
        text=True,
    )
    print(done.stdout[-3000:], flush=True)
    return done.returncode == 0, done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]


def prediction_check(model: Transformer, ids: torch.Tensor) -> dict:
    """Returns calibration, measured and predicted step seconds of `model` on `ids` (one GPU)."""
    calibration = calibrate(torch.device("cuda"))
    print(f"calibration: {calibration}", flush=True)
    seconds = timed(lambda: model(ids, labels=ids).backward(), torch.device("cuda"), repeats=3)
    spec = GPUS["H200"]
    predicted = estimate(
        model.config, ids.shape[1], 1, spec, "memo", eff=efficiency_from_calibration(calibration, spec)
    )
    ratio = seconds / predicted.step_seconds
    print(
        f"4-layer gpt-7b, 32K tokens: measured {seconds:.3f}s, predicted {predicted.step_seconds:.3f}s, "
        f"ratio {ratio:.2f}",
        flush=True,
    )
    return {
        "calibration": calibration,
        "measured_step_s": seconds,
        "predicted_step_s": predicted.step_seconds,
        "measured_over_predicted": ratio,
    }


def arena_check(model: Transformer, ids: torch.Tensor) -> dict:
    """Returns peak reserved/allocated bytes and step seconds of `model` unplanned, then with the arena."""
    result = {}
    for name in ("unplanned", "arena"):
        if name == "arena":
            arena = model.plan_memory(time_limit=5.0)
            model(ids, labels=ids).backward()  # plans every phase
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        seconds = timed(lambda: model(ids, labels=ids).backward(), torch.device("cuda"), repeats=3)
        result[name] = {
            "step_s": seconds,
            "peak_reserved": torch.cuda.max_memory_reserved(),
            "peak_allocated": torch.cuda.max_memory_allocated(),
        }
    result["arena"]["summary"] = arena.summary()
    print(f"arena: {json.dumps(result, indent=1)}", flush=True)
    for layer in model.layers:
        layer.arena = None
    return result


def main() -> int:
    assert torch.cuda.is_available(), "gpu_check needs a CUDA device"
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    start = time.time()
    passed, report["gradient_parity"] = gradient_parity("test_layer_gradients.py")
    arena_passed, report["arena_parity"] = gradient_parity("test_arena.py")
    passed = passed and arena_passed
    x = torch.empty(1 << 28, dtype=torch.bfloat16, device="cuda")  # 512 MiB
    report["d2h_pinned_GBps"] = measure_copy_bandwidth(x) / 1e9
    print(f"device->pinned host copy: {report['d2h_pinned_GBps']:.1f} GB/s", flush=True)
    del x
    model = Transformer(ModelConfig.preset("gpt-7b", n_layers=4), ActivationPolicy("memo")).cuda().bfloat16()
    ids = torch.randint(0, 50257, (1, 32768), device="cuda")
    model(ids, labels=ids).backward()
    report["solved_alpha_gpt7b_32k"] = model.swap_stats().alphas[0]
    print(f"solved alpha, gpt-7b layer at 32K tokens on one GPU: {report['solved_alpha_gpt7b_32k']:.3f}", flush=True)
    report.update(prediction_check(model, ids))
    report["arena"] = arena_check(model, ids)
    del model
    torch.cuda.empty_cache()
    print(f"checks took {time.time() - start:.0f}s; strategy benchmark:", flush=True)
    strategies.main(
        [
            "--device",
            "cuda",
            "--model",
            "gpt-7b",
            "--layers",
            "6",
            "--seq",
            "32K",
            "--dtype",
            "bfloat16",
            "--alpha",
            "auto",
        ]
    )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(report, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
