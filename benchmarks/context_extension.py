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
import contextlib
import io
import json
import sys
import sysconfig
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


def write_documents(path: Path, length: int, count: int, seed: int, asks: int = 3) -> None:
    """Writes `count` pass-key documents of exactly `length` byte tokens as JSONL: a prompt as `memo eval`
    builds it, its answer, and the question answered `asks - 1` more times (the copy is the only thing to
    learn in a document whose filler and key are otherwise noise: more answers, a stronger signal)."""
    task = PasskeyTask(ByteTokenizer())
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for trial in range(count):
            key = task.key(length, 0.0, seed, trial)
            tail = (task.encode(key) + task.question) * (asks - 1) + task.encode(key)
            prompt = task.prompt(length - len(tail), float(rng.uniform()), seed, trial)
            tail = (task.encode(prompt.key) + task.question) * (asks - 1) + task.encode(prompt.key)
            f.write(json.dumps({"text": bytes(prompt.ids.tolist() + tail).decode()}) + "\n")


def write_corpus(work: Path, length: int, passkeys: int) -> tuple[Path, Path]:
    """Returns (training folder, held-out folder): Python's standard-library sources as text documents (the
    text this machine has; the last 16 files by name held out) and, for training, `passkeys` pass-key
    documents of `length` tokens."""
    train, held_out = work / "train", work / "held-out"
    for folder in (train, held_out):
        folder.mkdir(exist_ok=True)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    for i, source in enumerate(sources):
        text = source.read_bytes().decode("ascii", errors="ignore")  # bytes tokenizer: keep it one byte a char
        ((held_out if i >= len(sources) - 16 else train) / f"{source.stem}.txt").write_text(text)
    write_documents(train / "passkey.jsonl", length, passkeys, seed=1)
    return train, held_out


def run(*argv: str, log: Path | None = None) -> str:
    """Runs `memo ARGV` in this process; returns what it printed (also written to `log`)."""
    print("$ memo " + " ".join(argv), file=sys.stderr, flush=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = memo(list(argv))
    if log is not None:
        log.write_text(out.getvalue())
    if status != 0:
        raise SystemExit(f"memo {argv[0]} failed")
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="ctx-ext", help="folder for data, runs, exports and pictures")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    short, long = (256, 512) if args.quick else (256, 1024)
    steps, tune_steps, trials = (20, 5, 1) if args.quick else (1500, 200, 8)
    (work / "model.yaml").write_text(MODEL)
    train, held_out = write_corpus(work, short, 200 if args.quick else 3000)
    start = time.time()
    common = ["--warmup-steps", "20", "--eval-every", "1000000", "--json"]
    run("train", "--model", str(work / "model.yaml"), "--data", str(train), "--seq-len", str(short),
        "--batch-size", "16", "--steps", str(steps), "--lr", "3e-3", "--min-lr", "3e-4", "--out", str(work / "base"),
        *common, log=work / "base.log")  # fmt: skip
    run("export", str(work / "base"), "--hf", str(work / "base-hf"))
    variants = {
        "fine-tuned at 4x, plain RoPE": [],
        "fine-tuned at 4x, YaRN x4": ["--rope-scaling", "yarn", "--rope-factor", "4"],
    }
    lengths = ",".join(str(n) for n in sorted({short, 2 * short, long, 2 * long}))
    results = {"trained at short length": _eval(work / "base-hf", lengths, trials, held_out, work / "base-eval")}
    for name, flags in variants.items():
        tag = "yarn" if flags else "plain"
        run("train", "--model", str(work / "base-hf"), *flags, "--data", str(train),
            "--seq-len", str(long), "--batch-size", "4", "--steps", str(tune_steps), "--lr", "1e-3", "--min-lr",
            "1e-4", "--out", str(work / tag), *common, log=work / f"{tag}.log")  # fmt: skip
        run("export", str(work / tag), "--hf", str(work / f"{tag}-hf"))
        results[name] = _eval(work / f"{tag}-hf", lengths, trials, held_out, work / f"{tag}-eval")
    print(f"# pass-key accuracy by prompt length ({trials} trials x 5 depths per cell), {time.time() - start:.0f} s")
    _table({name: accuracy for name, (accuracy, _) in results.items()}, "{:.0%}")
    print(f"\n# held-out loss by token position (unseen Python standard-library files, {2 * long}-token sequences)")
    _table({name: losses for name, (_, losses) in results.items()}, "{:.3f}")
    return 0


def _table(rows: dict[str, dict], cell: str) -> None:
    columns = list(next(iter(rows.values())))
    print("| model | " + " | ".join(map(str, columns)) + " |")
    print("|---|" + "---:|" * len(columns))
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(cell.format(values[c]) for c in columns) + " |")


def _eval(model: Path, lengths: str, trials: int, held_out: Path, out: Path) -> tuple[dict, dict]:
    """Returns (pass-key accuracy per length over all depths, held-out loss per position bucket), from
    `memo eval --json` (kept in `out`.json, its heatmap in `out`.png)."""
    printed = run("eval", str(model), "--lengths", lengths, "--depths", "0,0.25,0.5,0.75,1", "--trials", str(trials),
                  "--ppl-file", str(held_out), "--json", "--plot", str(out.with_suffix(".png")),
                  log=out.with_suffix(".json"))  # fmt: skip
    report = json.loads(printed)
    by_length: dict[int, list[int]] = {}
    for cell in report["passkey"]:
        hits = by_length.setdefault(cell["length"], [0, 0])
        hits[0] += cell["correct"]
        hits[1] += cell["trials"]
    accuracy = {length: correct / total for length, (correct, total) in by_length.items()}
    losses = {f"[{b['start']}, {b['end']})": b["loss"] for b in report["perplexity"]["buckets"]}
    return accuracy, losses


if __name__ == "__main__":
    sys.exit(main())
