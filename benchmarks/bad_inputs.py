"""Measures how `memo` answers bad input, as a new user meets it: each case runs `python -m memo ...` in a fresh
folder holding the user's files (copies of the fixtures built once at the start) and checks the answer against
what the case expects:

- error: exit 2, one line on stderr, no traceback, nothing left behind (no run folder in `runs/`, no temporary
  file; a run stopped on a nan loss keeps its folder), and every file that was there before unchanged;
- success: a documented recovery (a damaged newest checkpoint falls back to the older one): exit 0, no
  traceback, the files that must survive unchanged.

Writes the table to docs/bad-inputs.md, prints it, and exits 1 when a case is NOT OK (unless --report-only), so
it doubles as a check.

    PYTHONPATH=src .venv/bin/python benchmarks/bad_inputs.py      # about 4 minutes on the project's 2-core machine
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bad-inputs.md"
TIMEOUT_S = 120
TINY = "--model tiny --seq-len 64 --batch-size 2 --steps 2"
EST = "--model gpt-7b --gpus 8 --gpu A800-80GB"
PROGRESS = re.compile(r"^[\w ]+:\s*\d+%\|")  # a tqdm bar, e.g. "train:  50%|█████     | 1/2 [00:01<00:01]"
RUNS = (
    "done",
    "trunc",
    "allbad",
    "no-ckpt",
    "damaged",
)  # run folders: copied into a case's folder only when it uses them
GPU_FIELDS = {
    "peak_flops": 362e12,
    "hbm_bytes": 48e9,
    "hbm_bytes_per_s": 864e9,
    "host_link_bytes_per_s": 25e9,
    "host_link_shared_by": 1,
    "nvlink_bytes_per_s": 25e9,
    "network_bytes_per_s": 12.5e9,
    "host_memory_per_node": 1e12,
    "gpus_per_node": 8,
}
FILES = {  # the user's files, in every case's folder
    "notes.txt": "my notes\n",
    "empty.txt": "",
    "docs.jsonl": "".join(json.dumps({"text": f"Document {i}: a short text for training."}) + "\n" for i in range(20)),
    "run.yaml": "steps: 3\n",
    "broken.yaml": "steps: [1, 2\nlr: 3\n",
    "unknown-field.yaml": "model: tiny\nlearning_rate: 0.1\n",
    "wrong-type.yaml": "lr: fast\n",
    "list.yaml": "- steps\n- 2\n",
    "model-unknown-field.yaml": "name: mine\nhidden: 64\n",
    "bad-line.jsonl": '{"text": "one document"}\n{"text": \n',
    "no-text.jsonl": '{"body": "one document"}\n',
    "tokenizer-garbled.json": "not json at all\n",
    "hf-broken/config.json": '{"model_type": "llama", "hidden_size": 64,',
    "hf-partial/config.json": '{"model_type": "llama"}\n',
    "hf-empty/.keep": "",
    "out-dir/kept.txt": "kept\n",
    "garbled.csv": "\x00\x01 hello,,,\n;;;\n",
    "bad-header.csv": "a,b,c\n1,2,3\n",
    "bad-row.csv": "id,lower,upper,size\n0,0,x,4\n",
    "negative-size.csv": "id,lower,upper,size\n0,0,2,-4\n",
    "empty-lifetime.csv": "id,lower,upper,size\n0,3,3,4\n",
    "ok.csv": "id,lower,upper,size\n0,0,2,4\n1,1,3,4\n",
    "gpus-malformed.json": "{L40S: 1",
    "gpus-list.json": "[1, 2]\n",
    "gpus-not-object.json": '{"L40S": 5}\n',
    "gpus-partial.json": json.dumps({"L40S": {"peak_flops": 362e12}}),
    "gpus-negative.json": json.dumps({"L40S": {**GPU_FIELDS, "hbm_bytes": -48e9}}),
    "calibration-empty.json": "{}\n",
    "calibration-cpu.json": json.dumps({"device": "cpu", "matmul_flops_per_s": 1e11, "attention_flops_per_s": 5e10}),
    "null-field.yaml": "eval_batches: null\n",
    "nan-field.yaml": "weight_decay: .nan\n",
    "tokens.bin": "h\0e\0l\0l\0o\0" * 40,  # 200 uint16 ids, the largest 111 ('o')
    "tokens.json": json.dumps({"format": "memo-tokens-v1", "dtype": "uint16", "num_tokens": 200, "max_token_id": 7}),
    "tokens-dtype.bin": "h\0e\0l\0l\0o\0" * 40,
    "tokens-dtype.json": json.dumps({"format": "memo-tokens-v1", "dtype": "uint32", "num_tokens": 200}),
}
BLOW_UP = f"{TINY} --lr 1e30 --schedule constant --warmup-steps 0"  # the loss is nan from step 2


@dataclass(frozen=True)
class Case:
    """One bad input and the answer it should get."""

    args: str  # after `memo`, run in a fresh folder holding FILES and copies of the runs it names
    expect: str = "error"  # "error" or "success" (see the module's docstring)
    may_change: tuple[str, ...] = ()  # paths it may write; every other file there before must survive
    within_s: float | None = None  # the answer must come in fewer seconds (a length that must not be traced)

    def runs(self) -> list[str]:
        """Returns the fixture runs the arguments name: only those are copied (a few MB each)."""
        words = shlex.split(self.args)
        return [r for r in RUNS if r in words or any(w.startswith(f"{r}/") for w in words)]


CASES = [
    Case(""),
    Case("nosuch"),
    # train: flags and sizes
    Case(f"train {TINY} --no-such-flag"),
    Case("train --model tiny --seq-len 0 --steps 2"),
    Case("train --model tiny --seq-len -64 --steps 2"),
    Case("train --model tiny --seq-len abc --steps 2"),
    Case("train --model tiny --seq-len 64.5 --steps 2"),
    Case("train --model tiny --seq-len 1T --steps 2", within_s=30),
    Case("train --model tiny --seq-len 64 --steps -1"),
    Case("train --model tiny --seq-len 64 --steps 0"),
    Case(f"train {TINY} --lr nan"),
    Case(f"train {TINY} --lr inf"),
    Case(f"train {TINY} --lr -1"),
    Case(f"train {TINY} --lr 0.1 --min-lr 1"),
    Case(f"train {TINY} --warmup-steps -5"),
    Case(f"train {TINY} --keep-checkpoints 0"),
    Case("train --model tiny --seq-len 64 --steps 2 --batch-size 3 --grad-accum 2"),
    Case(f"train {TINY} --dtype float16"),
    Case(f"train {TINY} --alpha 1.5"),
    Case(f"train {TINY} --alpha abc"),
    Case(f"train {TINY} --alpha 0.1,0.5"),
    Case(f"train {TINY} --strategy nosuch"),
    Case(f"train {TINY} --strategy full --alpha 0.3"),
    Case(f"train {TINY} --device tpu9"),
    Case(f"train {TINY} --device cuda"),
    Case(f"train {TINY} --host-budget 1K"),
    Case(f"train {TINY} --host-budget lots"),
    Case(f"train {TINY} --eval-split 0.1"),
    Case(f"train {TINY} --rope-scaling yarn"),
    Case(f"train {TINY} --nproc 0"),
    Case(f"train {TINY} --nnodes 2 --node-rank 2"),
    Case(f"train {TINY} --master-port 70000"),
    Case(f"train {TINY} --skip-nonfinite -1"),
    Case(f"train {TINY} --out ''"),
    Case(f"train {TINY} --config null-field.yaml"),
    Case(f"train {TINY} --config nan-field.yaml"),
    Case(f"train {BLOW_UP} --save-every 1 --out blown", may_change=("blown",)),
    Case(f"train {BLOW_UP} --skip-nonfinite 1 --out skipped", expect="success", may_change=("skipped",)),
    Case(f"train {TINY} --data tokens.bin"),
    Case(f"train {TINY} --data tokens-dtype.bin"),
    Case("train --model tiny --seq-len 96 --batch-size 4 --steps 2 --nproc 4 --sp 3"),
    Case(f"train {TINY} --nproc 4"),
    # train: model, config, data, tokenizer
    Case(f"train {TINY.replace('tiny', 'nosuch')}"),
    Case(f"train {TINY.replace('tiny', 'no-such-folder/')}"),
    Case(f"train {TINY.replace('tiny', 'hf-empty')}"),
    Case(f"train {TINY.replace('tiny', 'hf-broken')}"),
    Case(f"train {TINY.replace('tiny', 'hf-partial')}"),
    Case(f"train {TINY.replace('tiny', 'model-unknown-field.yaml')}"),
    Case(f"train {TINY} --config missing.yaml"),
    Case(f"train {TINY} --config broken.yaml"),
    Case(f"train {TINY} --config unknown-field.yaml"),
    Case(f"train {TINY} --config wrong-type.yaml"),
    Case(f"train {TINY} --config list.yaml"),
    Case(f"train {TINY} --config notes.txt"),
    Case(f"train {TINY} --data missing.txt"),
    Case(f"train {TINY} --data empty.txt"),
    Case(f"train {TINY} --data bad-line.jsonl"),
    Case(f"train {TINY} --data no-text.jsonl"),
    Case(f"train {TINY} --tokenizer tokenizer-garbled.json"),
    Case(f"train {TINY} --data docs.jsonl --eval-split 0.1 --tokenizer missing.json"),
    Case(f"train {TINY} --data docs.jsonl --eval-split 0.1 --tokenizer tokenizer-garbled.json"),
    # train: runs and checkpoints
    Case(f"train {TINY} --out done"),
    Case(f"train {TINY} --out notes.txt"),
    Case("train --resume no-such-run"),
    Case("train --resume hf-empty"),
    Case("train --resume no-ckpt"),
    Case("train --resume allbad"),
    Case("train --resume done --config run.yaml"),
    Case("train --resume done --steps 1"),
    Case("train --resume done", expect="success"),
    Case(
        "train --resume trunc",
        expect="success",
        may_change=("trunc/checkpoints/step-0000002", "trunc/config.json", "trunc/metrics.jsonl"),
    ),
    # export
    Case("export no-such-run"),
    Case("export no-ckpt"),
    Case("export allbad"),
    Case("export done --out a.safetensors --hf b"),
    Case("export done --out notes.txt/model.safetensors"),
    Case("export done --out out-dir"),
    Case("export done --hf notes.txt"),
    Case("export trunc", expect="success", may_change=("trunc/export",)),
    Case("export ''"),
    Case("report damaged --out r.png", expect="success", may_change=("r.png",)),
    Case("train --resume damaged --steps 3", expect="success", may_change=("damaged",)),
    # report
    Case("report"),
    Case("report no-such-run"),
    Case("report hf-empty"),
    Case("report done --out no-such-folder/report.png"),
    # estimate
    Case(f"estimate {EST} --seq 1T", expect="success", within_s=30),
    Case(f"estimate {EST}"),
    Case(f"estimate {EST} --seq 0"),
    Case(f"estimate {EST} --seq 1M --gpus 0"),
    Case(f"estimate {EST} --seq 1M --gpus -8"),
    Case(f"estimate {EST} --seq 1M --sp 3"),
    Case("estimate --model nosuch --gpus 8 --gpu A800-80GB --seq 1M"),
    Case("estimate --model gpt-7b --gpus 8 --gpu nosuch --seq 1M"),
    Case("estimate --model gpt-7b --gpus 8 --gpu h100-pcie --seq 1M"),
    Case("estimate --model hf-broken --gpus 8 --gpu A800-80GB --seq 1M"),
    Case("estimate --model model-unknown-field.yaml --gpus 8 --gpu A800-80GB --seq 1M"),
    Case(f"estimate {EST} --seq 1M --plot x.png"),
    Case(f"estimate {EST} --sweep --plot no-such-folder/sweep.png"),
    Case(f"estimate {EST} --seq 1M --calibration missing.json"),
    Case(f"estimate {EST} --seq 1M --calibration calibration-empty.json"),
    Case(f"estimate {EST} --seq 1M --calibration calibration-cpu.json"),
    Case("estimate --model gpt-7b --gpus 8 --gpu L40S --seq 1M --gpu-file missing.json"),
    Case("estimate --model gpt-7b --gpus 8 --gpu L40S --seq 1M --gpu-file gpus-malformed.json"),
    Case("estimate --model gpt-7b --gpus 8 --gpu L40S --seq 1M --gpu-file gpus-list.json"),
    Case("estimate --model gpt-7b --gpus 8 --gpu L40S --seq 1M --gpu-file gpus-not-object.json"),
    Case("estimate --model gpt-7b --gpus 8 --gpu L40S --seq 1M --gpu-file gpus-partial.json"),
    Case("estimate --model gpt-7b --gpus 8 --gpu L40S --seq 1M --gpu-file gpus-negative.json"),
    # calibrate
    Case("calibrate --device tpu9"),
    Case("calibrate --device cuda"),
    Case("calibrate --out no-such-folder/calibration.json"),
    Case("calibrate --model tiny"),
    Case("calibrate --model tiny --seq 2K --sp 3"),
    Case("calibrate --model hf-partial --seq 2K"),
    # dsa
    Case("dsa missing.csv"),
    Case("dsa garbled.csv"),
    Case("dsa bad-header.csv"),
    Case("dsa bad-row.csv"),
    Case("dsa negative-size.csv"),
    Case("dsa empty-lifetime.csv"),
    Case("dsa ok.csv --time-limit 0"),
    Case("dsa ok.csv --out no-such-folder/placed.csv"),
    # plan
    Case("plan --model tiny --seq 0"),
    Case("plan --model tiny --seq 1G", within_s=30),
    Case("plan --model gpt-65b --seq 4M", within_s=30),
    Case("plan --model nosuch --seq 64"),
    Case("plan --model hf-empty --seq 64"),
    Case("plan --model tiny --seq 64 --tp 3"),
    Case("plan --model tiny --seq 64 --batch 0"),
    Case("plan --model tiny --seq 64 --alpha 1.5"),
    Case("plan --model tiny --seq 64 --time-limit 0"),
    # eval
    Case("eval no-such-path"),
    Case("eval no-ckpt"),
    Case("eval allbad"),
    Case("eval hf-broken"),
    Case("eval hf-partial"),
    Case("eval done --device tpu9"),
    Case("eval done --device cuda"),
    Case("eval done --lengths 0"),
    Case("eval done --lengths 128 --depths 1.5"),
    Case("eval done --lengths 128 --trials -1"),
    Case("eval done --lengths 128 --trials 0"),
    Case("eval done --lengths 128 --batch-size 0"),
    Case("eval done --lengths 128 --trials 0 --ppl-file notes.txt --max-sequences 0"),
    Case("eval done --lengths 128 --ppl-file missing.txt"),
    Case("eval done --lengths 128 --tokenizer missing.json"),
    Case("eval done --lengths 128 --trials 1 --plot no-such-folder/passkey.png"),
    Case("eval trunc --lengths 128 --depths 0.5 --trials 1", expect="success"),
]


@dataclass(frozen=True)
class Result:
    """What one case got; `problems` says why it is NOT OK (empty: ok)."""

    case: Case
    exit: int | None  # None: no answer within TIMEOUT_S
    message: str
    lines: int
    traceback: bool
    seconds: float
    left: list[str]
    changed: list[str]

    def problems(self) -> list[str]:
        if self.exit is None:
            return [f"no answer in {TIMEOUT_S} s"]
        found = ["traceback"] if self.traceback else []
        if self.case.expect == "error":
            if self.exit == 0:
                found.append("accepted (exit 0)")
            else:
                found += [] if self.exit == 2 else [f"exit {self.exit}"]
                found += [] if self.lines == 1 else [f"{self.lines} lines"]
            found += [f"left {p}" for p in self.left if not may_change(self.case, p)]
        elif self.exit != 0:
            found.append(f"exit {self.exit}, expected 0")
        found += [f"changed {p}" for p in self.changed]
        if self.case.within_s is not None and self.seconds > self.case.within_s:
            found.append(f"took {self.seconds:.0f} s")
        return found


def build_fixtures(root: Path) -> None:
    """Writes the user's files and the runs once: `done` (tiny, 2 steps, checkpoints at 1 and 2), `trunc` (its
    newest model.safetensors cut in half), `allbad` (both cut), `no-ckpt` (a run that stopped before a save)."""
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    train = f"train {TINY} --save-every 1 --keep-checkpoints 2 --out done"
    done = subprocess.run(memo_command(train), cwd=root, env=memo_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"building the fixture run failed:\n{done.stderr}")
    for name, cut in (("trunc", ("step-0000002",)), ("allbad", ("step-0000001", "step-0000002"))):
        shutil.copytree(root / "done", root / name)
        for step in cut:
            weights = root / name / "checkpoints" / step / "model.safetensors"
            os.truncate(weights, weights.stat().st_size // 2)
    shutil.copytree(root / "done", root / "damaged")  # foreign lines in its metrics, foreign checkpoint entries
    with (root / "damaged" / "metrics.jsonl").open("a") as f:
        f.write('["a list"]\n{"no": "step"}\n{torn')
    for name in ("step-0000002-backup", "step-abc", "notes"):
        (root / "damaged" / "checkpoints" / name).mkdir()
    (root / "no-ckpt" / "checkpoints").mkdir(parents=True)
    shutil.copy2(root / "done" / "config.json", root / "no-ckpt" / "config.json")
    shutil.copy2(root / "done" / "metrics.jsonl", root / "no-ckpt" / "metrics.jsonl")


def memo_command(args: str) -> list[str]:
    return [sys.executable, "-m", "memo", *shlex.split(args)]


def memo_env() -> dict[str, str]:
    """The user's environment plus this checkout's source, with the GPUs hidden (a new user on a CPU machine)."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}


def checksums(folder: Path) -> dict[str, str]:
    """Returns the SHA-256 of every file under `folder`, by relative path, to tell what a command touched."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def run_case(case: Case, fixtures: Path) -> Result:
    """Runs one case in a fresh folder holding the user's files, and compares the folder before and after."""
    with tempfile.TemporaryDirectory(prefix="memo-bad-input-") as tmp:
        folder = Path(tmp)
        shutil.copytree(fixtures, folder, dirs_exist_ok=True, ignore=lambda d, names: ignored(fixtures, d, names))
        for run in case.runs():
            shutil.copytree(fixtures / run, folder / run)
        before = checksums(folder)
        start = time.perf_counter()
        try:
            done = subprocess.run(
                memo_command(case.args), cwd=folder, env=memo_env(), capture_output=True, text=True, timeout=TIMEOUT_S
            )
            code, out, err = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as timeout:
            code, out, err = None, text_of(timeout.stdout), text_of(timeout.stderr)
        seconds = time.perf_counter() - start
        after = checksums(folder)
    lines = [s.strip() for s in re.split(r"[\r\n]", err) if s.strip() and not PROGRESS.match(s.strip())]
    printed = [s.strip() for s in out.splitlines() if s.strip()]
    created = sorted({"/".join(p.split("/")[:2]) for p in set(after) - set(before)})
    return Result(
        case=case,
        exit=code,
        message=(lines or printed or [""])[-1],
        lines=len(lines),
        traceback="Traceback (most recent call last)" in err,
        seconds=seconds,
        left=created,
        changed=[p for p, digest in before.items() if after.get(p) != digest and not may_change(case, p)],
    )


def ignored(fixtures: Path, directory: str, names: list[str]) -> list[str]:
    """Leaves the runs out of the copy of the user's files: a case gets only the runs it names."""
    return [n for n in names if Path(directory) == fixtures and n in RUNS]


def may_change(case: Case, path: str) -> bool:
    return any(path == p or path.startswith(f"{p}/") for p in case.may_change)


def text_of(captured: bytes | str | None) -> str:
    return captured.decode(errors="replace") if isinstance(captured, bytes) else captured or ""


def announced(result: Result) -> Result:
    """Prints one line per finished case on stderr, so a long run shows where it is."""
    verdict = "NOT OK" if result.problems() else "ok"
    print(f"{verdict:6} {result.seconds:5.1f} s  memo {result.case.args}", file=sys.stderr, flush=True)
    return result


def code_span(text: str) -> str:
    """Returns `text` as a markdown code span inside a table cell (it may hold backticks and pipes)."""
    return f"`` {text.replace('|', chr(92) + '|')} ``"


def table(results: list[Result]) -> str:
    rows = ["| # | input | exit | s | message | ok |", "|---:|---|---:|---:|---|---|"]
    for i, r in enumerate(results, 1):
        message = r.message if len(r.message) <= 160 else r.message[:157] + "..."
        problems = r.problems()
        verdict = "ok" if not problems else "**NOT OK**: " + ", ".join(problems).replace("|", "\\|")
        command = code_span(f"memo {r.case.args}".strip())
        exit_code = "-" if r.exit is None else str(r.exit)
        rows.append(f"| {i} | {command} | {exit_code} | {r.seconds:.1f} | {code_span(message)} | {verdict} |")
    return "\n".join(rows)


def document(results: list[Result], seconds: float) -> str:
    bad = sum(1 for r in results if r.problems())
    return f"""# How `memo` answers bad input

Generated by `benchmarks/bad_inputs.py`; regenerate with

```bash
PYTHONPATH=src .venv/bin/python benchmarks/bad_inputs.py      # exits 1 while a row is NOT OK; --report-only: 0
```

Each input runs as `python -m memo ...` in a fresh folder holding the user's files (YAML, JSON, CSV, JSONL
and model folders, see `FILES` in the script) and the runs it names: `done` (a finished `tiny` run of 2 steps
with checkpoints at steps 1 and 2), `trunc` (its copy with step 2's `model.safetensors` cut in half), `allbad`
(both cut) and `no-ckpt` (a run that stopped before its first checkpoint). An error is ok with exit 2, one line on
stderr, no traceback, nothing left behind (a run stopped on a nan loss keeps its folder) and every file that was
there before unchanged; a success (a documented recovery) with exit 0 and no traceback. `message` is the last line
on stderr (progress bars left out), or on stdout when stderr is empty; `s` is the wall time of the command.

Measured {datetime.date.today()} on {platform.platform()} ({os.cpu_count()} cores), Python {platform.python_version()},
torch {importlib.metadata.version("torch")}, GPUs hidden: {len(results)} cases, {len(results) - bad} ok, {bad} NOT OK,
{seconds:.0f} s in all.

{table(results)}
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=3, help="cases run at once (default: %(default)s)")
    p.add_argument("--report-only", action="store_true", help="exit 0 even when a case is NOT OK")
    args = p.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memo-bad-input-fixtures-") as tmp:
        fixtures = Path(tmp)
        build_fixtures(fixtures)
        with ThreadPoolExecutor(args.workers) as pool:
            results = list(pool.map(lambda case: announced(run_case(case, fixtures)), CASES))
    seconds = time.perf_counter() - start
    text = document(results, seconds)
    DOC.write_text(text)
    print(table(results))
    failed = [i for i, r in enumerate(results, 1) if r.problems()]
    print(f"\n{len(results)} cases, {len(results) - len(failed)} ok, {seconds:.0f} s; wrote {DOC.relative_to(ROOT)}")
    if failed:
        print("NOT OK: " + ", ".join(f"#{i} memo {results[i - 1].case.args}" for i in failed))
    return 1 if failed and not args.report_only else 0


if __name__ == "__main__":
    sys.exit(main())
