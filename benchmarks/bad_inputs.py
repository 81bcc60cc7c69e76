"""Measures how `memo` answers bad input, as a new user meets it: each case runs `python -m memo ...` in a fresh
folder holding the user's files (copies of the fixtures built once at the start) and checks the answer against
what the case expects:

- error: exit 2, one line on stderr, no traceback, nothing left behind (no run folder in `runs/`, no temporary
  file; a run stopped on a nan loss keeps its folder), and every file that was there before unchanged;
- success: a documented recovery (a damaged newest checkpoint falls back to the older one): exit 0, no
  traceback, the files that must survive unchanged;
- signal: SIGTERM, SIGHUP or SIGINT sent while the command works (once a file it writes appears, or after some
  seconds; some cases send it again later): exit 128 + the signal's number, at most three lines (a run says at
  once what it will do, then where its checkpoint is and how to resume), no traceback, nothing left but what it
  may change;
- reproducible: run twice, the second time beside a busy loop on every core: exit 0 both times, and the output
  (the first path it may change) byte-identical.

Every case also checks that no temporary file or folder (a name holding `.tmp`) and no process of the command's
session outlives it, and that it answers within TIMEOUT_S (no hang). Each command starts with SIGINT, SIGTERM and
SIGHUP at their defaults whatever this script inherited (under `nohup` SIGHUP is ignored, and memo keeps it so),
except those a case ignores on purpose; a case may also cap the size of every file it writes (`ulimit -f`: a disk
that fills up).

Writes the table to docs/bad-inputs.md, prints it, and exits 1 when a case is NOT OK (unless --report-only), so
it doubles as a check.

    PYTHONPATH=src .venv/bin/python benchmarks/bad_inputs.py      # about 4 minutes on the project's 2-core machine
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
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
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
CHAT_TOKENIZER = "--tokenizer chat-tokenizer/tokenizer.json"  # tests/data/chat's, with TRL's Qwen3 template
EST = "--model gpt-7b --gpus 8 --gpu A800-80GB"
PROGRESS = re.compile(r"^[\w ]+:\s*\d+%\|")  # a tqdm bar, e.g. "train:  50%|█████     | 1/2 [00:01<00:01]"
RUNS = (
    "done",
    "big",
    "gone",
    "changed",
    "trunc",
    "allbad",
    "no-ckpt",
    "damaged",
    "killed",
    "killed-bare",
    "lora",
    "based",
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
TINY_HF = {  # a Hugging Face config.json of `tiny`'s shape
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
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
    "held.bin": "ab",  # one token, tokenized by another tokenizer than any run here
    "held.json": json.dumps(
        {"format": "memo-tokens-v1", "dtype": "uint16", "num_tokens": 1, "tokenizer_id": "sha256:" + "1" * 64}
    ),
    "wide.yaml": "arch: llama\nn_layers: 4\nhidden_size: 96\nn_heads: 4\nn_kv_heads: 2\nffn_hidden_size: 176\n"
    "vocab_size: 256\n",
    "overflow.csv": "id,lower,upper,size\n0,0,2,18446744073709551616\n",
    "fractional.csv": "id,lower,upper,size\n0,0,2,4\n1,1,3,2.5\n",
    "sum-overflow.csv": "id,lower,upper,size\n0,0,2,4611686018427387903\n1,1,3,4611686018427387903\n",
    "short-row.csv": "id,lower,upper,size\n0,0,2\n",
    "hf-model/tokenizer.json": "x\n",  # beside the config and weights build_fixtures saves with transformers
    "mine.safetensors": "mine\n",
    "chat.jsonl": json.dumps({"messages": CHAT}) + "\n",  # a conversation; `tiny` has no chat template
    "chat-mixed.jsonl": json.dumps({"messages": CHAT}) + "\n" + json.dumps({"text": "plain"}) + "\n",
    "chat-role.jsonl": json.dumps({"messages": [{"role": "robot", "content": "beep"}]}) + "\n",
    "gpus-inf.json": json.dumps({"L40S": {**GPU_FIELDS, "peak_flops": float("inf")}}),  # JSON's Infinity
    "gpus-nan.json": json.dumps({"L40S": {**GPU_FIELDS, "nvlink_bytes_per_s": float("nan")}}),
    "gpus-fraction.json": json.dumps({"L40S": {**GPU_FIELDS, "gpus_per_node": 7.5}}),
    "hf-heads0/config.json": json.dumps({**TINY_HF, "num_attention_heads": 0}),
    "hf-hidden-text/config.json": json.dumps({**TINY_HF, "hidden_size": "64"}),
    "hf-kv3/config.json": json.dumps({**TINY_HF, "num_key_value_heads": 3}),
    "hf-outside/config.json": json.dumps(TINY_HF),
    "hf-outside/model.safetensors.index.json": json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../notes.txt"}}
    ),
    "hf-no-shard/config.json": json.dumps(TINY_HF),
    "hf-no-shard/model.safetensors.index.json": json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    ),
    "hf-garbage/config.json": json.dumps(TINY_HF),
    "hf-garbage/model.safetensors": "not a safetensors file\n",
    # 27M parameters: an export writes ~110 MB, long enough to be signalled while it writes
    "big.yaml": "arch: llama\nn_layers: 2\nhidden_size: 768\nn_heads: 12\nn_kv_heads: 4\nffn_hidden_size: 2048\n"
    "vocab_size: 8192\nname: big\n",
}
DSA_J = ROOT / "benchmarks" / "dsa-instances" / "minimalloc" / "challenging" / "J.1048576.csv"
BLOW_UP = f"{TINY} --lr 1e30 --schedule constant --warmup-steps 0"  # the loss is nan from step 2
LONG, SAVED = f"{TINY} --steps 100000 --out sig", "sig/checkpoints/step-*"  # a run to signal, and its first save
SLOW = "--model tiny --seq-len 8K --batch-size 1 --steps 100000 --out sig"  # a run whose steps take seconds
FULL = 64 * 1024  # the largest file a case on a "full disk" may write: less than any checkpoint file of `tiny`
START = """import os, resource, signal, sys
ignored, limit = sys.argv[1].split(","), sys.argv[2]
for name in ("INT", "TERM", "HUP"):
    signal.signal(getattr(signal, "SIG" + name), signal.SIG_IGN if name in ignored else signal.SIG_DFL)
if limit:
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
os.execv(sys.executable, [sys.executable, "-m", "memo", *sys.argv[3:]])
"""  # `python -m memo ARGS` with the signal dispositions and file size limit a case sets, not this script's


@dataclass(frozen=True)
class Case:
    """One bad input and the answer it should get."""

    args: str  # after `memo`, run in a fresh folder holding FILES and copies of the runs it names
    expect: str = "error"  # "error", "success", "signal" or "reproducible" (see the module's docstring)
    may_change: tuple[str, ...] = ()  # paths it may write; every other file there before must survive
    within_s: float | None = None  # the answer must come in fewer seconds (a length that must not be traced)
    signal: str | None = None  # with expect="signal": TERM, HUP or INT
    when: str = ""  # ... sent once a file matching this glob exists ("file:GLOB", "+S": S seconds later) or after
    # seconds ("after:S")
    again_after: float | None = None  # ... and sent again this many seconds later
    ignored: tuple[str, ...] = ()  # signals the command starts with ignored ("HUP": as under `nohup`)
    file_limit: int | None = None  # bytes: no file it writes may grow larger (a disk that fills up)

    @property
    def signum(self) -> int | None:
        return getattr(signal, f"SIG{self.signal}") if self.signal else None

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
    # packed documents (issue 26)
    Case(f"train {TINY} --pack-documents mask"),  # the generated task has no documents
    Case(f"train {TINY} --pack-documents masked --data notes.txt"),
    Case(f"train {TINY} --data notes.txt --max-documents-per-sequence 0"),
    Case(f"train {TINY} --data chat.jsonl"),
    Case(f"train {TINY} --data chat-mixed.jsonl {CHAT_TOKENIZER}"),
    Case(f"train {TINY} --data chat-role.jsonl {CHAT_TOKENIZER}"),
    Case(f"train {TINY} --data chat.jsonl {CHAT_TOKENIZER} --seq-len 8"),
    Case(f"train {TINY} --data notes.txt --long-conversations truncate"),
    Case(f"train {TINY} --data chat.jsonl --document-separator eos"),
    Case(f"train {TINY} --data notes.txt --max-documents-per-sequence 1.5"),
    Case(f"train {TINY} --data notes.txt --document-separator bos"),  # the byte tokenizer has none
    Case(f"train {TINY} --document-separator eos"),
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
    Case("report done --out new-folder/report.png", expect="success", may_change=("new-folder",)),
    # estimate
    Case(f"estimate {EST} --seq 1T", expect="success", within_s=60),
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
    Case(f"estimate {EST} --sweep --plot notes.txt/sweep.png", within_s=30),
    Case(f"estimate {EST} --seq 1M --calibration missing.json"),
    Case(f"estimate {EST} --seq 1M --mean-document-tokens 0"),
    Case(f"estimate {EST} --seq 1M --mean-document-tokens abc"),
    Case(f"estimate {EST} --seq 1M --document-lengths missing.bin"),
    Case(f"estimate {EST} --seq 1M --document-lengths notes.txt"),
    Case(f"estimate {EST} --seq 1M --mean-document-tokens 4K --document-lengths tokens.bin"),
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
    Case("calibrate --out notes.txt/calibration.json"),
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
    Case("dsa ok.csv --out new-folder/placed.csv", expect="success", may_change=("new-folder",)),
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
    Case("eval done --lengths 128 --passkey-pack 0"),
    Case("eval done --lengths 128 --passkey-pack 100000000"),  # memory, not positions, bounds it
    Case("eval done --lengths 128 --pack-documents mask"),  # no --ppl-file to pack
    Case("eval done --lengths 128 --tokenizer missing.json"),
    Case("eval done --lengths 128 --trials 1 --plot notes.txt/passkey.png"),
    Case("eval trunc --lengths 128 --depths 0.5 --trials 1", expect="success"),
    # RULER: tasks, haystack and chat template checked before any decoding
    Case("eval done --lengths 128 --tasks ruler,needles"),
    Case("eval done --lengths 128 --tasks ruler --trials 0"),
    Case("eval done --lengths 128 --tasks ruler --haystack missing.txt"),
    Case("eval done --lengths 128 --haystack notes.txt"),
    Case("eval done --lengths 128 --tasks ruler --chat on"),  # a byte run has no chat template
    Case("eval done --lengths 128 --tasks vt --plot ruler.png"),  # no needle task, no pass key: nothing to draw
    Case(f"train {TINY} --eval-tasks ruler,needles"),
    Case(f"train {TINY} --eval-tasks ruler --sp 2"),
    # paths are pinned at run start with fingerprints; token files name their tokenizer
    Case(f"train {TINY} --data docs.jsonl --eval-data /dev/null"),
    Case(f"train {TINY} --data /dev/zero"),
    Case(f"train {TINY} --data fifo", within_s=30),
    Case("eval done --lengths 64M", within_s=30),
    Case("eval done --lengths 16K --batch-size 100000", within_s=30),
    Case("train --resume done --model wide.yaml"),
    Case(f"train {TINY.replace('tiny', 'hf-model')} --data docs.jsonl"),  # the folder's tokenizer.json is garbled
    Case(f"train {TINY} --data docs.jsonl --eval-data held.bin"),
    Case("eval done --lengths 128 --trials 0 --ppl-file held.bin"),
    Case("train --resume gone --steps 3"),
    Case("train --resume changed --steps 3"),
    Case("train --resume gone --steps 3 --data docs.jsonl"),  # other data: what trains would change
    # a resume cannot silently change what trains; how it runs may change, and says so
    Case("train --resume lora --steps 3 --lora-rank 0"),
    Case("train --resume lora --steps 3 --lora-targets q"),
    Case("train --resume lora --steps 3 --lora-targets q,v,k"),
    Case("train --resume lora --steps 3 --lora-rank 8"),
    Case("train --resume lora --steps 3 --lora-alpha 64"),
    Case("train --resume lora --steps 3 --lr 1e-4"),
    Case("train --resume lora --steps 3 --seed 1"),
    Case("train --resume lora --steps 3 --data docs.jsonl"),
    Case("train --resume lora --steps 3 --strategy full", expect="success", may_change=("lora",)),
    Case("train --resume based --steps 3", expect="success", may_change=("based",)),  # its base folder is gone
    # flags that cannot take effect are refused wherever they are given
    Case(f"train {TINY} --lora-targets q,v"),
    Case(f"train {TINY} --lora-alpha 32"),
    Case(f"train {TINY.replace('tiny', 'tiny-gpt')} --lora-rank 4 --lora-targets gate"),
    Case(f"train {TINY} --strategy full --plan keep,keep,keep,keep"),
    Case(f"train {TINY} --strategy none --host-budget 1G"),
    Case(f"train {TINY} --data docs.jsonl --pack-documents concat --max-documents-per-sequence 3"),
    Case(f"estimate {EST} --seq 64K --sweep", within_s=30),
    Case(f"estimate {EST} --sweep --max-seq", within_s=30),
    Case(f"estimate {EST} --seq 64K --max-seq", within_s=30),
    Case(f"estimate {EST} --seq 64K --host-memory 1", within_s=30),
    Case("eval done --lengths 128 --trials 1 --bucket-size 64"),
    Case("eval done --lengths 128 --trials 0 --depths 0.5 --ppl-file docs.jsonl"),
    # outputs have owners: nothing a user (or a run) owns is overwritten
    Case("train --model hf-model --seq-len 64 --batch-size 2 --steps 1 --out hf-model"),
    Case("train --seq-len 64 --batch-size 2 --steps 1 --out hf-model"),
    Case("train --seq-len 64 --batch-size 2 --steps 1 --out link-to-hf-model"),
    Case("export done --hf hf-model"),
    Case("export done --hf done"),
    Case("export done --out done/checkpoints/step-0000002/model.safetensors"),
    Case("export done --out done/config.json --overwrite"),
    Case("export done --out mine.safetensors"),
    Case("export done --adapter ."),
    Case("report done --out done/metrics.jsonl"),
    Case("export done --out 'new/a b/ü/m.safetensors'", expect="success", may_change=("new",)),
    Case("export done --hf hf-model --overwrite", expect="success", may_change=("hf-model",)),
    # validation: one validator per quantity, for every verb and file format
    Case(f"estimate {EST} --seq 1M --gpu-file gpus-inf.json"),
    Case(f"estimate {EST} --seq 1M --gpu-file gpus-nan.json"),
    Case(f"estimate {EST} --seq 1M --gpu-file gpus-fraction.json"),
    Case(f"estimate {EST} --seq 1M --gpus 1099511627776", within_s=30),
    Case(f"estimate {EST} --gpus 1099511627776 --max-seq", within_s=30),
    Case(f"estimate {EST} --seq 100"),
    Case(f"estimate {EST} --seq 1M --sp 0"),
    Case(f"estimate {EST} --gpus 6 --sp 6 --sweep"),
    Case("calibrate --device cpu --model tiny --seq 1K --sp 0"),
    Case("estimate --model hf-heads0 --gpus 8 --gpu A800-80GB --seq 1M"),
    Case("estimate --model hf-hidden-text --gpus 8 --gpu A800-80GB --seq 1M"),
    Case("estimate --model hf-kv3 --gpus 8 --gpu A800-80GB --seq 1M"),
    Case(f"train {TINY.replace('tiny', 'hf-heads0')}"),
    Case("dsa overflow.csv"),
    Case("dsa fractional.csv"),
    Case("dsa sum-overflow.csv"),
    Case("dsa short-row.csv"),
    Case("dsa ok.csv --work 0"),
    Case("dsa ok.csv --out ok.csv"),
    Case("dsa ok.csv --out notes.txt"),
    Case("plan --model gpt-7b --seq 96 --tp 3"),
    Case("plan --model tiny --seq 64 --policy none --alpha 0.3"),
    Case("plan --model tiny --seq 64 --plot notes.txt"),
    Case("calibrate --out notes.txt"),
    Case(f"estimate {EST} --sweep --plot notes.txt", within_s=30),
    # third-party errors: shards and safetensors files
    Case(f"train {TINY.replace('tiny', 'hf-outside')}"),
    Case(f"train {TINY.replace('tiny', 'hf-no-shard')}"),
    Case(f"train {TINY.replace('tiny', 'hf-garbage')}"),
    Case("eval hf-garbage --lengths 128 --trials 1"),
    # bounds: work is bounded before it is built
    Case(f"train {TINY} --batch-size 1099511627776 --grad-accum 1099511627776", within_s=30),
    Case(f"train {TINY} --eval-batches 1099511627776", within_s=30),
    # signals: every long verb ends on SIGTERM, SIGHUP or Ctrl-C, cleaning up after itself
    Case(f"train {LONG} --save-every 2", "signal", ("sig",), signal="TERM", when=f"file:{SAVED}"),
    Case(f"train {LONG}", "signal", ("sig",), signal="HUP", when="file:sig/config.json"),
    Case(f"train {LONG} --save-every 2 --nproc 2", "signal", ("sig",), signal="TERM", when=f"file:{SAVED}"),
    Case(f"train {LONG}", "signal", ("sig",), signal="INT", when="file:sig/metrics.jsonl"),
    # ... mid-step (the next step under way once the first checkpoint is whole), and again: it stops at once
    Case(f"train {SLOW} --save-every 1", "signal", ("sig",), signal="TERM", when=f"file:{SAVED}+0.5", again_after=1.5),
    Case(f"train {SLOW} --save-every 1", "signal", ("sig",), signal="INT", when=f"file:{SAVED}+0.5", again_after=1.5),
    Case(f"train {TINY} --steps 20 --out sig", "success", ("sig",), signal="HUP", when="file:sig/*", ignored=("HUP",)),
    Case(
        f"train {TINY} --steps 20 --nproc 2 --out sig",
        "success",
        ("sig",),
        signal="HUP",
        when="file:sig/*",
        ignored=("HUP",),
    ),
    # a disk that fills up during a checkpoint, a run killed before its first one
    Case(f"train {TINY} --save-every 1 --out full", may_change=("full",), file_limit=FULL),
    Case(f"train {TINY} --save-every 1 --nproc 2 --out full", may_change=("full",), file_limit=FULL),
    Case(f"train {TINY} --out killed"),
    Case(f"train {TINY} --out killed-bare"),
    Case(f"train {TINY} --nproc 2 --out killed"),
    # plans: the same input gives the same plan on a loaded machine
    Case("dsa J.csv --work 2G --out placed.csv", "reproducible", ("placed.csv",)),
    Case("dsa G_1.csv --work 2G --out placed.csv", "reproducible", ("placed.csv",)),
    Case("export big --out e/model.safetensors", "signal", signal="TERM", when="file:e/.*"),
    Case("export big --hf hf-out", "signal", signal="HUP", when="file:.hf-out*"),
    Case("dsa J.csv --out placed.csv", "signal", signal="TERM", when="after:12"),
    Case("plan --model gpt-7b --seq 256K --tp 8 --plot plan.png", "signal", signal="HUP", when="after:12"),
    Case("calibrate --model llama3-8b --seq 16K --out c.json", "signal", signal="TERM", when="after:8"),
    Case("eval done --lengths 4K,8K --depths 0.5 --trials 64", "signal", signal="TERM", when="after:8"),
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
    temporaries: list[str]
    orphans: bool
    differs: bool  # a reproducible case's output differed between its two runs

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
        elif self.case.expect == "signal":
            expected = 128 + self.case.signum
            found += [] if self.exit == expected else [f"exit {self.exit}, expected {expected}"]
            found += [] if 1 <= self.lines <= 3 else [f"{self.lines} lines"]
            found += [f"left {p}" for p in self.left if not may_change(self.case, p)]
        elif self.exit != 0:
            found.append(f"exit {self.exit}, expected 0")
        found += [f"changed {p}" for p in self.changed]
        found += [f"left temporary {p}" for p in self.temporaries]
        found += ["left a process running"] if self.orphans else []
        found += [f"{self.case.may_change[0]} differs under load"] if self.differs else []
        if self.case.within_s is not None and self.seconds > self.case.within_s:
            found.append(f"took {self.seconds:.0f} s")
        return found


def build_fixtures(root: Path) -> None:
    """Writes the user's files and the runs once: `done` (tiny, 2 steps, checkpoints at 1 and 2), `trunc` (its
    newest model.safetensors cut in half), `allbad` (both cut), `no-ckpt` (a run that stopped before a save),
    `big` (27M parameters, one step), `killed` (a run killed outright during its first steps), `killed-bare` (only
    its lock and metrics) and the public DSA instance J as `J.csv`."""
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
    big = subprocess.run(
        memo_command("train --model big.yaml --seq-len 64 --batch-size 1 --steps 1 --out big"),
        cwd=root,
        env=memo_env(),
        capture_output=True,
        text=True,
    )
    if big.returncode != 0:
        raise SystemExit(f"building the fixture run `big` failed:\n{big.stderr}")
    shutil.copy2(DSA_J, root / "J.csv")
    shutil.copy2(DSA_J.parents[2] / "idealloc" / "G_1.csv", root / "G_1.csv")
    for name, then in (("gone", Path.unlink), ("changed", lambda p: p.write_text(p.read_text() + "more\n"))):
        data = root / f"{name}-data.txt"  # a run's data that is then deleted, or changed: runs record absolute paths
        data.write_text("some text to train on. " * 30)
        train = f"train {TINY} --data {data.name} --out {name}"
        done = subprocess.run(memo_command(train), cwd=root, env=memo_env(), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"building the fixture run `{name}` failed:\n{done.stderr}")
        then(data)
    hf_model(root / "hf-model")
    shutil.copytree(ROOT / "tests" / "data" / "chat" / "tokenizer", root / "chat-tokenizer")
    (root / "link-to-hf-model").symlink_to("hf-model")
    (root / "no-ckpt" / "checkpoints").mkdir(parents=True)
    shutil.copy2(root / "done" / "config.json", root / "no-ckpt" / "config.json")
    shutil.copy2(root / "done" / "metrics.jsonl", root / "no-ckpt" / "metrics.jsonl")
    killed_run(root)
    adapters_and_based(root)


def adapters_and_based(root: Path) -> None:
    """Trains `lora` (rank-4 adapters on q and v) and `based` (on a copy of `hf-model`, then deleted: a run whose
    base folder is gone)."""
    shutil.copytree(root / "hf-model", root / "base-copy")
    for train in (
        f"train {TINY} --lora-rank 4 --lora-targets q,v --out lora",
        f"train {TINY.replace('tiny', 'base-copy')} --out based",
    ):
        done = subprocess.run(memo_command(train), cwd=root, env=memo_env(), capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"building a fixture run failed ({train}):\n{done.stderr}")
    shutil.rmtree(root / "base-copy")


def killed_run(root: Path) -> None:
    """Trains `killed` until its first step is logged, then kills it outright (SIGKILL: no clean-up, its lock file
    stays), before any checkpoint; `killed-bare` keeps only its lock and metrics."""
    run = root / "killed"
    proc = subprocess.Popen(memo_command(f"train {LONG.replace('sig', 'killed')}"), cwd=root, env=memo_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and '"loss"' in metrics.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("building the fixture run `killed` failed")
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    shutil.copytree(run, root / "killed-bare")
    for name in (".memo", "config.json"):
        (root / "killed-bare" / name).unlink()


def hf_model(folder: Path) -> None:
    """Saves a small Llama checkpoint with transformers (config.json and model.safetensors): a user's model."""
    script = (
        "import sys, transformers as t\n"
        "c = t.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)\n"
        "t.LlamaForCausalLM(c).save_pretrained(sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", script, str(folder)], check=True, capture_output=True)


def memo_command(args: str, ignored: tuple[str, ...] = (), file_limit: int | None = None) -> list[str]:
    """Returns the command that runs `python -m memo ARGS` with these signals ignored, the others at their
    defaults, and no file larger than `file_limit` bytes."""
    return [sys.executable, "-c", START, ",".join(ignored), str(file_limit or ""), *shlex.split(args)]


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
        os.mkfifo(folder / "fifo")  # a named pipe nobody writes: reading it would block forever
        for run in case.runs():
            shutil.copytree(fixtures / run, folder / run)
        before = checksums(folder)
        start = time.perf_counter()
        code, out, err, orphans = run_command(case, folder)
        differs = False
        if case.expect == "reproducible" and code == 0:  # again, beside a busy loop on every core
            first = checksums(folder).get(case.may_change[0])
            with busy():
                code, out, err, orphans = run_command(case, folder)
            differs = checksums(folder).get(case.may_change[0]) != first
        seconds = time.perf_counter() - start
        after = checksums(folder)
        temporaries = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if ".tmp" in p.name)
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
        temporaries=temporaries,
        orphans=orphans,
        differs=differs,
    )


def run_command(case: Case, folder: Path) -> tuple[int | None, str, str, bool]:
    """Runs the case's command in its own session (sending its signal when due); returns (exit code or None
    when it did not answer in time, stdout, stderr, whether a process of its session outlived it)."""
    command = memo_command(case.args, case.ignored, case.file_limit)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(command, cwd=folder, env=memo_env(), stdout=out, stderr=err, start_new_session=True)
        if case.signal:
            wait_for(case.when, folder, proc)
            proc.send_signal(case.signum)
        if case.again_after is not None:
            wait_for(f"after:{case.again_after}", folder, proc)
            if proc.poll() is None:
                proc.send_signal(case.signum)
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        orphans = session_alive(proc.pid)
        if code is None or orphans:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        return code, text_of(out.read()), text_of(err.read()), orphans


@contextlib.contextmanager
def busy():
    """Keeps every core busy with a spinning process while the block runs: a machine under someone else's load
    (the tests' too). The spinners are this process's children, ended and reaped after."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def wait_for(when: str, folder: Path, proc: subprocess.Popen) -> None:
    """Returns once `when` ("file:GLOB" exists under `folder`, "after:SECONDS" passed; "file:GLOB+SECONDS": that
    much later) or the command ended."""
    kind, _, what = when.partition(":")
    what, _, later = what.partition("+")
    deadline = time.monotonic() + (float(what) if kind == "after" else TIMEOUT_S)
    while proc.poll() is None and time.monotonic() < deadline:
        if kind == "file" and any(folder.glob(what)):
            return wait_for(f"after:{later}", folder, proc) if later else None
        time.sleep(0.002)


def session_alive(pid: int) -> bool:
    """Returns whether a process of the session `pid` leads is still running (a worker the command left)."""
    time.sleep(0.2)  # a child's exit may trail its parent's by a moment
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


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

Each input runs as `python -m memo ...` in a fresh folder holding the user's files (YAML, JSON, CSV, JSONL and
model folders, see `FILES` in the script) and the runs it names: `done` (a finished `tiny` run of 2 steps with
checkpoints at steps 1 and 2), `trunc` (its copy with step 2's `model.safetensors` cut in half), `allbad` (both
cut), `no-ckpt` (a run that stopped before its first checkpoint), `killed` (a run killed outright, SIGKILL, during
its first steps: its lock file left behind, no checkpoint) and `killed-bare` (its lock and metrics only), `big` (a
27M-parameter run whose export takes long enough to be signalled), `gone` and `changed` (runs whose `--data` was
then deleted, or changed), a Llama checkpoint saved by transformers (`hf-model`) and public DSA instances. Each
command starts with SIGINT, SIGTERM and SIGHUP at their defaults, whatever the shell that ran the script left
ignored, except where a case ignores SIGHUP as `nohup` does; the "full disk" cases cap every file the command
writes at {FULL // 1024} KiB (`ulimit -f`), less than any checkpoint file. An error is ok with exit 2, one line on
stderr, no traceback, nothing left behind (a run stopped on a nan loss or a failed save keeps its folder) and every
file that was there before unchanged; a success (a documented recovery) with exit 0 and no traceback; a signal
(SIGTERM, SIGHUP or SIGINT sent once a file the command writes appears, or after some seconds of work, and in some
cases sent again 1.5 seconds later) with exit 128 + its number, at most three lines (a run says at once what it
will do, then names its checkpoint and how to resume) and nothing left but what it may change; a reproducible case
(a DSA plan) runs twice, the second time beside a busy loop on every core, with exit 0 and byte-identical output.
Every case also leaves no temporary (a name holding `.tmp`) and no process of its session, and answers within
{TIMEOUT_S} s. `message` is the last line on stderr (progress bars left out), or on stdout when stderr is empty;
`s` is the wall time of the command.

Measured {datetime.date.today()} on {platform.platform()} ({os.cpu_count()} cores), Python {platform.python_version()},
torch {importlib.metadata.version("torch")}, GPUs hidden: {len(results)} cases, {len(results) - bad} ok, {bad} NOT OK,
{seconds:.0f} s in all.

{table(results)}
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=3, help="cases run at once (default: %(default)s)")
    p.add_argument("--report-only", action="store_true", help="exit 0 even when a case is NOT OK")
    p.add_argument("--only", metavar="REGEX", help="run only the cases whose arguments match (no table written)")
    args = p.parse_args(argv)
    cases = [c for c in CASES if not args.only or re.search(args.only, c.args)]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memo-bad-input-fixtures-") as tmp:
        fixtures = Path(tmp)
        build_fixtures(fixtures)
        with ThreadPoolExecutor(args.workers) as pool:
            results = list(pool.map(lambda case: announced(run_case(case, fixtures)), cases))
    seconds = time.perf_counter() - start
    if not args.only:
        DOC.write_text(document(results, seconds))
    print(table(results))
    failed = [i for i, r in enumerate(results, 1) if r.problems()]
    wrote = "" if args.only else f"; wrote {DOC.relative_to(ROOT)}"
    print(f"\n{len(results)} cases, {len(results) - len(failed)} ok, {seconds:.0f} s{wrote}")
    if failed:
        print("NOT OK: " + ", ".join(f"#{i} memo {results[i - 1].case.args}" for i in failed))
    return 1 if failed and not args.report_only else 0


if __name__ == "__main__":
    sys.exit(main())
