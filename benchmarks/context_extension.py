"""Context extension end to end on a CPU, as a user would run it: train a small Llama-3.2-shaped model on
pass-key documents at a short length, export it as a Hugging Face checkpoint, then fine-tune it at 4x the
length with and without YaRN (`--rope-scaling yarn --rope-factor 4`), and score pass-key retrieval by length
before and after with `memo eval`. Everything goes through the `memo` verbs (in-process).

    python benchmarks/context_extension.py                  # about 10 minutes on 2 cores; work in ./ctx-ext
    python benchmarks/context_extension.py --quick          # a smoke run in a minute (numbers meaningless)

The training documents are pass-key prompts of exactly the sequence length, answer included, generated with
memo.eval's own generator under other seeds than the evaluation's, so the model learns the task (copy the
five digits from the needle) at the short length and the question is whether it still can when longer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from memo.cli import main as memo  # noqa: E402
from memo.eval import PasskeyTask  # noqa: E402
from memo.train.data import ByteTokenizer  # noqa: E402

MODEL = """\
arch: llama            # Llama-3.2-shaped: SwiGLU, RMSNorm, grouped-query attention, tied embeddings
n_layers: 4
hidden_size: 128
n_heads: 4
n_kv_heads: 2
ffn_hidden_size: 384
vocab_size: 256        # bytes
tie_embeddings: true
name: small-llama
"""


def write_documents(path: Path, length: int, count: int, seed: int) -> None:
    """Writes `count` pass-key documents of exactly `length` byte tokens (prompt + answer) as JSONL."""
    task = PasskeyTask(ByteTokenizer())
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for trial in range(count):
            key = task.key(length, 0.0, seed, trial)
            answer = task.encode(key)
            prompt = task.prompt(length - len(answer), float(rng.uniform()), seed, trial)
            text = bytes(prompt.ids.tolist() + task.encode(prompt.key)).decode()
            f.write(json.dumps({"text": text}) + "\n")


def run(*argv: str) -> None:
    print("$ memo " + " ".join(argv), file=sys.stderr, flush=True)
    if memo(list(argv)) != 0:
        raise SystemExit(f"memo {argv[0]} failed")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="ctx-ext", help="folder for data, runs, exports and pictures")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    short, long = (128, 512) if args.quick else (256, 1024)
    steps, tune_steps, trials = (20, 5, 1) if args.quick else (600, 150, 8)
    (work / "model.yaml").write_text(MODEL)
    write_documents(work / "short.jsonl", short, 100 if args.quick else 4000, seed=1)
    write_documents(work / "long.jsonl", long, 25 if args.quick else 1000, seed=2)
    start = time.time()
    common = ["--warmup-steps", "20", "--eval-every", "1000000", "--json"]
    run("train", "--model", str(work / "model.yaml"), "--data", str(work / "short.jsonl"), "--seq-len", str(short),
        "--batch-size", "16", "--steps", str(steps), "--lr", "3e-3", "--min-lr", "3e-4", "--out", str(work / "base"),
        *common)  # fmt: skip
    run("export", str(work / "base"), "--hf", str(work / "base-hf"))
    variants = {
        "fine-tuned at 4x, plain RoPE": [],
        "fine-tuned at 4x, YaRN x4": ["--rope-scaling", "yarn", "--rope-factor", "4"],
    }
    lengths = f"{short // 2},{short},{2 * short},{long}"
    results = {"trained at short length": _eval(work / "base-hf", lengths, trials, work / "base-eval")}
    for name, flags in variants.items():
        tag = "yarn" if flags else "plain"
        run("train", "--model", str(work / "base-hf"), *flags, "--data", str(work / "long.jsonl"),
            "--seq-len", str(long), "--batch-size", "4", "--steps", str(tune_steps), "--lr", "1e-3", "--min-lr",
            "1e-4", "--out", str(work / tag), *common)  # fmt: skip
        run("export", str(work / tag), "--hf", str(work / f"{tag}-hf"))
        results[name] = _eval(work / f"{tag}-hf", lengths, trials, work / f"{tag}-eval")
    print(f"# pass-key accuracy by prompt length ({trials} trials x 5 depths per cell), {time.time() - start:.0f} s")
    print("| model | " + " | ".join(lengths.split(",")) + " |")
    print("|---|" + "---:|" * len(lengths.split(",")))
    for name, by_length in results.items():
        print(f"| {name} | " + " | ".join(f"{a:.0%}" for a in by_length.values()) + " |")
    return 0


def _eval(model: Path, lengths: str, trials: int, out: Path) -> dict[int, float]:
    """Returns pass-key accuracy per length over all depths, from `memo eval --json` written to `out`.json."""
    import contextlib
    import io

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        run("eval", str(model), "--lengths", lengths, "--depths", "0,0.25,0.5,0.75,1", "--trials", str(trials),
            "--json", "--plot", str(out.with_suffix(".png")))  # fmt: skip
    report = json.loads(buffer.getvalue())
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    by_length: dict[int, list[int]] = {}
    for cell in report["passkey"]:
        hits = by_length.setdefault(cell["length"], [0, 0])
        hits[0] += cell["correct"]
        hits[1] += cell["trials"]
    return {length: correct / total for length, (correct, total) in by_length.items()}


if __name__ == "__main__":
    sys.exit(main())
