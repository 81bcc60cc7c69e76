"""Makes tests/data/pretrained-tiny: a small pretrained checkpoint that `memo train --model` fine-tunes, for the test
of the fine-tuning defaults (tests/test_finetune_defaults.py).

`tiny` (Llama-shaped, bytes for tokens) is pretrained from scratch with memo's from-scratch defaults on generated
farm sentences ("the brown goat follows the old hen near the barn."), then written as a Hugging Face folder in bf16
(model/: config.json + model.safetensors, about 430 KB). Beside it: text of the same generator from another seed,
not trained on (pretrain-heldout.txt), and the fine-tuning text, sales sentences of the same farm ("the farmer sells
seven brown goats near the barn on monday."): its words and places, and words it never saw.

    python benchmarks/pretrained_checkpoint.py              # about 10 minutes on the project's 2-core machine

It prints the files it wrote, then the loss on fixed batches of both texts of the checkpoint, and of the checkpoint
fine-tuned for 8 steps with `memo train`'s defaults and with the old ones (`--compare-only`: that table alone).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from memo import to_hf  # noqa: E402
from memo.cli import main as memo  # noqa: E402
from memo.eval import load  # noqa: E402
from memo.files import MARK  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "pretrained-tiny"
SEQ = 128  # pretraining length
SHORT = ["--seq-len", "64", "--batch-size", "4", "--steps", "8", "--strategy", "none", "--eval-every", "1000"]
OLD = ["--lr", "3e-3", "--min-lr", "3e-4", "--warmup-steps", "20", "--beta2", "0.95"]  # every run's, before
FARM = {
    "animal": "goat hen cow pig dog cat horse duck sheep mule".split(),
    "adjective": "brown old small white black young lazy fat quiet big".split(),
    "verb": "follows watches chases feeds finds sees hears greets".split(),
    "place": "near the barn|in the field|by the pond|under the tree|behind the gate|on the hill".split("|"),
}
SALES = {
    "verb": "sells buys counts weighs brings loads".split(),
    "number": "two three four five six seven eight nine".split(),
    "day": "monday tuesday wednesday thursday friday saturday".split(),
}


def farm_sentence(rng: random.Random) -> str:
    """Returns one sentence of the pretraining text."""
    w = {k: rng.choice(v) for k, v in FARM.items()}
    other = f"{rng.choice(FARM['adjective'])} {rng.choice(FARM['animal'])}"
    return f"the {w['adjective']} {w['animal']} {w['verb']} the {other} {w['place']}."


def sales_sentence(rng: random.Random) -> str:
    """Returns one sentence of the fine-tuning text."""
    w = {k: rng.choice(v) for k, v in {**FARM, **SALES}.items()}
    return f"the farmer {w['verb']} {w['number']} {w['adjective']} {w['animal']}s {w['place']} on {w['day']}."


def text(sentence, n: int, seed: int) -> str:
    """Returns `n` sentences of generator `sentence` from `seed`, one a line."""
    rng = random.Random(seed)
    return "".join(sentence(rng) + "\n" for _ in range(n))


def losses(path: Path, texts: dict[str, Path]) -> dict[str, float]:
    """Returns the loss (nats per byte) of the model in `path` (a run or a Hugging Face folder) on fixed batches of
    each of `texts`: its first 8 sequences of 64 bytes, as tests/test_finetune_defaults.py measures it."""
    model = load(path, torch.device("cpu"), torch.float32).model
    out = {}
    for name, text in texts.items():
        ids = torch.tensor(list(text.read_bytes()[: 8 * 64])).view(8, 64)
        with torch.inference_mode():
            out[name] = model(ids, labels=ids).item()
    return out


def pretrain(out: Path, steps: int) -> None:
    """Writes the checkpoint (out/model) and both texts."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "pretrain-heldout.txt").write_text(text(farm_sentence, 200, seed=1))  # seed 0 is pretrained on
    (out / "finetune.txt").write_text(text(sales_sentence, 300, seed=2))
    with tempfile.TemporaryDirectory(prefix="memo-pretrain-") as work:
        corpus, run = Path(work) / "farm.txt", Path(work) / "run"
        corpus.write_text(text(farm_sentence, 40_000, seed=0))
        flags = ["--model", "tiny", "--data", str(corpus), "--seq-len", str(SEQ), "--batch-size", "16"]
        flags += ["--steps", str(steps), "--strategy", "none", "--eval-every", str(steps), "--out", str(run)]
        quiet(["train", *flags])
        model = load(run, torch.device("cpu"), torch.float32).model
        to_hf(model.to(torch.bfloat16), out / "model", seq_len=SEQ, overwrite=True)
        (out / "model" / MARK).unlink()  # shipped as a user's checkpoint, not as memo's export


def compare(out: Path) -> None:
    """Prints, as markdown, the losses of the checkpoint in `out` before and after 8 steps of fine-tuning with the
    fine-tuning defaults and with the from-scratch ones."""
    texts = {"fine-tuning": out / "finetune.txt", "held-out pretraining": out / "pretrain-heldout.txt"}
    rows = {"the checkpoint": losses(out / "model", texts)}
    with tempfile.TemporaryDirectory(prefix="memo-finetune-") as work:
        for name, flags in (("8 steps, the defaults", []), ("8 steps, " + " ".join(OLD), OLD)):
            run = Path(work) / str(len(rows))
            quiet(
                [
                    "train",
                    "--model",
                    str(out / "model"),
                    "--data",
                    str(texts["fine-tuning"]),
                    *SHORT,
                    "--out",
                    str(run),
                    *flags,
                ]
            )
            rows[name] = losses(run, texts)
    print("| model | " + " | ".join(f"loss, {name} text" for name in texts) + " |")
    print("|---|" + "---:|" * len(texts))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{value:.4f}" for value in row.values()) + " |")


def quiet(argv: list[str]) -> None:
    """Runs `memo` with `argv`, its records hidden; exits if it fails."""
    with contextlib.redirect_stdout(io.StringIO()):
        if memo([*argv, "--json"]) != 0:
            raise SystemExit(f"memo {' '.join(argv)} failed")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=OUT, help="folder to write (default: tests/data/pretrained-tiny)")
    p.add_argument("--steps", type=int, default=600, help="pretraining steps")
    p.add_argument("--compare-only", action="store_true", help="fine-tune the checkpoint already in --out only")
    args = p.parse_args(argv)
    if not args.compare_only:
        pretrain(args.out, args.steps)
        for path in sorted(args.out.rglob("*")):
            if path.is_file():
                print(f"{path.relative_to(args.out.parent)}: {path.stat().st_size / 1024:.0f} KB")
    compare(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
