"""`memo.patch` under TRL's `SFTTrainer` against what people turn on instead, at one fixed shape: a random Llama
(default 16 layers, h = 512) trained on one unpacked sequence of `--tokens` (default 16K) per step, fp32: one step's
peak activation memory and the median step time of each row.

Rows, each a fresh model from the same seed on the same batches, under `SFTTrainer` (`bf16=False`, batch 1,
`packing=False`, TRL's fused LM head computing the loss in every row):
- HF + checkpointing: transformers' activation checkpointing (TRL's default), the baseline of every ratio;
- HF + checkpointing offload=True: the same, its saved layer inputs held in host memory (`save_on_cpu`);
- TRL activation_offloading: `SFTConfig(activation_offloading=True)`, TRL's default checkpointing left on;
- memo.patch: `memo.patch(model, ActivationPolicy("memo", tile_tokens=256, attention_heads=1,
  empty_buffers=True, gradient_over_input=True, shared_layers=14))`: α and plan solved from measured times; tiles of
  `--tile-tokens` rows (the default policy's 8K-row tile is sized for GPU matmuls at 100K+ tokens and would leave
  this sequence one or two tiles); one head a kernel call (`--attention-heads`; memo's CPU default takes all heads
  at once for the threads, and these rows run one); the rounding buffers emptied across TRL's head
  (`--keep-buffers` keeps them); attention's gradient written over each layer's input, which comes back from host
  (`--fresh-gradient` gives it a tensor of its own); the lowest layers on one rounding buffer as far as their
  gradients reach a buffer's bytes (`shared_layers`: 14 of 16 at 16K tokens; `--shared-layers`); TRL's default
  checkpointing left on (memo turns it off);
- HF, no checkpointing: plain autograd, when its estimated activations fit in the memory available.

Memory is measured as `benchmarks/strategies.py` measures it, over one training step (forward and backward,
`Trainer.training_step`) after the timed ones, so the parameter gradients the backward allocates count in every
row, as does TRL's fused head: its (4096 x vocabulary) fp32 tiles are why the default vocabulary is small (2048;
`--vocab`). CPU: the resident-set high-water mark of that step above the resident set before it, in a fresh process
per row whose malloc returns freed memory to the system from its start, as `strategies.py`'s memory rows do (a heap
grown over the earlier steps keeps the pages the measured step frees and takes again: transformers' checkpointing
read 1551-1783 MiB that way at 16K tokens, against 1424 MiB of live bytes); memo's store is rebuilt (same solved
plan) before the step so its buffers and host pool are allocated inside it. On the CPU host and "device" are one memory,
so the bytes a row parks in host memory (memo's host pool, the copies `save_on_cpu` makes) are subtracted and shown
in their own column. CUDA: peak allocated bytes over that step above those before it. Step time is the median of
`--steps` training steps after one warm-up; with `--repeats N` each row runs in N fresh processes and each number is
their median (the activation column shows their range). One CPU thread by default (`--threads`), as in
`packing.py`: on a shared two-core machine a second thread times the scheduler.
The issue's goals: memo at most 0.4x the activation memory and at most 1.0x the step time of HF + checkpointing.

    .venv/bin/python benchmarks/hf_patch.py                 # 16 layers, h=512, 16K tokens: ~10 min a row on 1 CPU
    .venv/bin/python benchmarks/hf_patch.py --tiny          # 2 layers, h=64, 512 tokens: seconds
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:  # absent when run through runpy
    sys.path.insert(0, str(BENCHMARKS))
from strategies import (  # noqa: E402
    RssPeak,
    _cell,
    _cuda_peaks,
    _return_freed_memory_to_os,
    free_device_memory,
    guarded,
    release_heap,
)

from memo import ActivationPolicy, ModelConfig, patch  # noqa: E402
from memo.cost.memory import store_bytes  # noqa: E402
from memo.cost.states import root_parameters  # noqa: E402
from memo.swap import make_store  # noqa: E402
from memo.units import parse_size  # noqa: E402

ROWS = (
    "HF + checkpointing",
    "HF + checkpointing offload=True",
    "TRL activation_offloading",
    "memo.patch",
    "HF, no checkpointing",
)
BASELINE = ROWS[0]
RECORD = "_memo_patch"  # what memo.patch leaves in the causal LM's __dict__
VOCAB = 2048  # small beside h: TRL's fused head holds (4096 x vocab) fp32 tiles, the same in every row
HEAD_DIM = 64
MEMORY_GOAL, TIME_GOAL = 0.4, 1.0  # memo over HF + checkpointing
# what an HF Llama layer saves per token for its backward in fp32 (norm inputs and outputs, q, k, v, attention and
# o_proj inputs, the MLP's gate, up, silu and product): an estimate that only decides whether to try the last row
SAVED_PER_TOKEN = {"hidden": 9, "intermediate": 4}
FITS = 0.6  # of the memory available now
MEDIAN = ("activation_bytes", "host_bytes", "step_s")  # over a row's repeats (`--repeats`)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model and batch every row trains."""

    layers: int
    hidden: int
    tokens: int
    vocab: int = VOCAB
    tile_tokens: int = 256  # memo's token tiles (its default, 8K rows, is sized for GPU matmuls at 100K+ tokens)
    attention_heads: int | None = 1  # query heads per attention call (None: memo's default, all heads on a CPU)
    empty_buffers: bool = True  # memo's rounding buffers freed across TRL's head (`ActivationPolicy.empty_buffers`)
    gradient_over_input: bool = True  # attention's gradient in the layer input's bytes (`ActivationPolicy`)
    shared_layers: int | None = None  # memo's lowest layers holding one rounding buffer (None: `shared_layers`)

    @property
    def intermediate(self) -> int:
        return 3 * self.hidden

    def memo_config(self) -> ModelConfig:
        """Returns memo's config of the Llama `llama(self)` builds."""
        heads = max(1, self.hidden // HEAD_DIM)
        return ModelConfig(
            arch="llama", n_layers=self.layers, hidden_size=self.hidden, n_heads=heads,
            ffn_hidden_size=self.intermediate, vocab_size=self.vocab, n_kv_heads=heads,
        )  # fmt: skip

    def saved_bytes_estimate(self) -> int:
        """Returns the estimated bytes HF's layers save for the backward without checkpointing (fp32)."""
        per_token = SAVED_PER_TOKEN["hidden"] * self.hidden + SAVED_PER_TOKEN["intermediate"] * self.intermediate
        return 4 * per_token * self.tokens * self.layers


TINY = Shape(layers=2, hidden=64, tokens=512, vocab=256)


def tokenizer(vocab: int):
    """Returns a word-level tokenizer of `vocab` ids built in memory (`<pad>` 0, `<eos>` 1): no download."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="<pad>")), pad_token="<pad>", eos_token="<eos>"
    )


def shared_layers(shape: Shape) -> int:
    """Returns how many of memo's lowest layers hold one rounding buffer at their backward (1 with buffers kept): as
    far as their fp32 parameter gradients, all there by the end of the backward, reach one buffer's bytes. Below that
    a second buffer would stack on gradients the double-buffered layers above never hold, so the step's peak is
    theirs; each shared layer costs a reload nothing hides on a GPU (docs/memory.md)."""
    if not shape.empty_buffers:
        return 1
    if shape.shared_layers is not None:
        return shape.shared_layers
    c, n = shape.memo_config(), shape.layers
    buffer = store_bytes(c, shape.tokens, ["memo"] * n, [0.5] * n, shape.tile_tokens, dtype=torch.float32).buffer_bytes
    grads = 4 * (c.num_parameters() - root_parameters(c)) // n  # one layer's, fp32
    return min(n, max(1, -(-buffer // grads)))


def llama(shape: Shape):
    """Returns a random fp32 Llama of `shape`, the same weights on every call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, shape.hidden // HEAD_DIM)
    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=heads, num_key_value_heads=heads,
        head_dim=shape.hidden // heads, max_position_embeddings=shape.tokens, pad_token_id=0, eos_token_id=1,
        bos_token_id=None, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def token_dataset(shape: Shape, n: int):
    """Returns `n` random sequences of `shape.tokens` ids, already tokenized (SFTTrainer keeps them as they are)."""
    import datasets

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, shape.vocab, (n, shape.tokens), generator=g)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """transformers' `save_on_cpu` for offload=True, counting the bytes it copies into host memory (with
    `pin_memory`, as transformers asks, it copies even a CPU tensor)."""

    nbytes = 0

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
        super().__init__(pin_memory=pin_memory, device_type=device_type)
        pack = self.pack_hook

        def counting_pack(t):
            if pin_memory or t.device.type != "cpu":
                CountingSaveOnCpu.nbytes += t.numel() * t.element_size()
            return pack(t)

        self.pack_hook = counting_pack


def sft_config(row: str, steps: int, shape: Shape, output_dir: str, device: torch.device):
    """Returns the row's SFTConfig: TRL's defaults but for what the row turns on."""
    from trl import SFTConfig

    row_args = {
        "HF + checkpointing": {"activation_checkpointing": True},
        "HF + checkpointing offload=True": {
            "activation_checkpointing": True,
            "activation_checkpointing_kwargs": {"offload": True},
        },
        "TRL activation_offloading": {"activation_offloading": True},
        "memo.patch": {},
        "HF, no checkpointing": {"activation_checkpointing": False},
    }[row]
    return SFTConfig(
        output_dir=output_dir, bf16=False, per_device_train_batch_size=1, max_length=shape.tokens, packing=False,
        report_to=[], max_steps=steps, save_strategy="no", logging_steps=1, disable_tqdm=True,
        use_cpu=device.type == "cpu", **row_args,
    )  # fmt: skip


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Meter:
    """Wraps `trainer.training_step`: times each step after the warm-up, then measures one more step's memory."""

    def __init__(self, trainer, timed: int, device: torch.device, release_heap: bool):
        self.trainer, self.timed, self.device, self.release_heap = trainer, timed, device, release_heap
        self.inner = trainer.training_step
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self.mlp_calls = 0
        self.memory: dict = {}
        trainer.training_step = self
        if RECORD not in trainer.model.__dict__:  # memo refuses a wrapped MLP; it counts its own recompute
            self._count_calls(trainer.model.model.layers[0].mlp)

    def _count_calls(self, module) -> None:
        """Counts the module's forwards, recomputed ones too (checkpointing's recompute skips forward hooks)."""
        forward = module.forward

        def counted(*args, **kwargs):
            self.mlp_calls += 1
            return forward(*args, **kwargs)

        module.forward = counted

    def __call__(self, *args, **kwargs):
        if len(self.losses) > self.timed:
            return self._measured(*args, **kwargs)
        start = time.perf_counter()
        loss = self.inner(*args, **kwargs)
        _synchronize(self.device)
        if self.losses:
            self.seconds.append(time.perf_counter() - start)
        self.losses.append(loss.item())
        return loss

    def _measured(self, *args, **kwargs):
        """Runs one step and records its activation bytes, host bytes and calls of layer 0's MLP."""
        self._fresh_store()
        if self.release_heap:
            release_heap()  # in a row's own process only: every later allocation maps fresh pages
        base = free_device_memory(self.device)
        self.mlp_calls, CountingSaveOnCpu.nbytes = 0, 0
        with RssPeak() as rss:
            loss = self.inner(*args, **kwargs)
        self.losses.append(loss.item())
        self.memory = self._memory(rss.peak, base)
        return loss

    def _fresh_store(self) -> None:
        """Gives a patched model a new store with the plan it solved: its buffers and host pool are then allocated
        inside the measured step, like every other row's activations (strategies.measure_memory does the same)."""
        record = self.trainer.model.__dict__.get(RECORD)
        if record is not None:
            stats = record.store.stats
            solved = dataclasses.replace(record.policy, alpha=tuple(stats.alphas), plan=tuple(stats.modes))
            record.store = make_store(solved, record.config.n_layers)

    def _memory(self, rss_peak: int, base: int) -> dict:
        """Returns the step's activation bytes (less what it parked in host memory, on the CPU) and host bytes."""
        record = self.trainer.model.__dict__.get(RECORD)
        host = record.store.stats.host_pool_bytes if record is not None else CountingSaveOnCpu.nbytes
        if self.device.type == "cuda":
            activation = _cuda_peaks(self.device, base)["activation_bytes"]
        else:
            activation = max(rss_peak - host, 0)
        return {"activation_bytes": activation, "host_bytes": host, "mlp_calls": self.mlp_calls}


def what_ran(row: str, trainer, meter: Meter) -> str:
    """Returns what shows that the row did what it claims: checkpointing recomputes (layer 0's MLP runs twice),
    offloading moved bytes, memo's forward ran its plan."""
    model = trainer.model
    record = model.__dict__.get(RECORD)
    if record is not None:
        stats = record.store.stats
        modes = dict(collections.Counter(stats.modes))
        alphas = sorted({round(a, 3) for a in stats.alphas})
        return (
            f"memo plan {modes}, alpha {alphas}, {stats.bytes_offloaded / 2**20:.0f} MiB offloaded, "
            f"{stats.tokens_recomputed} token-rows recomputed; HF checkpointing {model.model.gradient_checkpointing}"
        )
    calls = f"layer 0 MLP ran {meter.memory['mlp_calls']}x"
    if row == "TRL activation_offloading":
        offload = trainer.maybe_activation_offload_context
        return f"{calls}; {type(offload).__name__} packed {offload.tensor_id} tensors"
    if meter.memory["host_bytes"]:
        return f"{calls}; save_on_cpu copied {meter.memory['host_bytes'] / 2**20:.0f} MiB"
    return calls


def run_row(row: str, shape: Shape, timed: int, device: torch.device, release_heap: bool = False) -> dict:
    """Returns one row: median step seconds, the activation and host bytes of the step after them, the losses, what
    ran; `release_heap` (a fresh process only) makes the CPU's resident set track live bytes in that step."""
    import transformers.modeling_utils
    from transformers import PrinterCallback, ProgressCallback
    from trl import SFTTrainer

    model = llama(shape)
    if row == "memo.patch":
        policy = ActivationPolicy(
            "memo",
            tile_tokens=shape.tile_tokens,
            attention_heads=shape.attention_heads,
            empty_buffers=shape.empty_buffers,
            gradient_over_input=shape.gradient_over_input,
            shared_layers=shared_layers(shape),
        )
        patch(model, policy)  # before SFTTrainer, which wraps the causal LM's forward with its fused LM head
    steps = timed + 2
    with (
        tempfile.TemporaryDirectory() as output_dir,
        mock.patch.object(transformers.modeling_utils, "save_on_cpu", CountingSaveOnCpu),
    ):
        trainer = SFTTrainer(
            model=model,
            args=sft_config(row, steps, shape, output_dir, device),
            train_dataset=token_dataset(shape, steps),
            processing_class=tokenizer(shape.vocab),
        )
        for callback in (PrinterCallback, ProgressCallback):  # stdout is the table's
            trainer.remove_callback(callback)
        meter = Meter(trainer, timed, device, release_heap)
        trainer.train()
    return {
        "step_s": statistics.median(meter.seconds),
        **meter.memory,
        "loss": meter.losses[0],
        "losses": meter.losses,
        "ran": what_ran(row, trainer, meter),
    }


def measured_row(index: int, shape: Shape, timed: int, device: torch.device, release_heap: bool = False) -> dict:
    """Returns run_row of ROWS[index], or what went wrong: a row that fails is a result, not a crash."""
    return guarded(lambda: run_row(ROWS[index], shape, timed, device, release_heap), device)


def skip_reason(row: str, shape: Shape) -> str | None:
    """Returns why `row` is not run at `shape` (HF without checkpointing when its activations would not fit)."""
    if row != "HF, no checkpointing":
        return None
    import psutil

    need, available = shape.saved_bytes_estimate(), psutil.virtual_memory().available
    if need > FITS * available:
        return f"skipped: ~{need / 2**30:.1f} GiB of activations estimated, {available / 2**30:.1f} GiB available"
    return None


def _row_in_subprocess(argv: list[str], index: int) -> dict:
    """Returns run_row of ROWS[index] from a fresh process (malloc returning freed memory, nothing of another row)."""
    done = subprocess.run([sys.executable, __file__, *argv, "--row", str(index)], capture_output=True, text=True)
    if done.returncode != 0:  # killed, or broken before the row could say so
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit status {done.returncode}"}
    return json.loads(done.stdout.splitlines()[-1])


def repeated(runs: list[dict]) -> dict:
    """Returns one row from fresh-process runs of it: the median of each measured number, the range of its
    activation bytes (transformers' rows read differently from one process to the next), the first run's losses
    and what ran; the first error if any run failed."""
    failed = [run for run in runs if "error" in run]
    if failed or len(runs) == 1:
        return failed[0] if failed else runs[0]
    activation = [run["activation_bytes"] for run in runs]
    medians = {k: statistics.median(run[k] for run in runs) for k in MEDIAN}
    return {**runs[0], **medians, "activation_range": [min(activation), max(activation)]}


def named(rows: list[dict], name: str) -> dict:
    return next(row for row in rows if row["name"] == name)


def add_ratios(rows: list[dict]) -> None:
    """Sets each row's activation bytes and step time over HF + checkpointing's, where both exist."""
    base = named(rows, BASELINE)
    for row in rows:
        for key in ("activation_bytes", "step_s"):
            both = row.get(key) is not None and bool(base.get(key))
            row[f"{key}_ratio"] = row[key] / base[key] if both else None


def verdict(rows: list[dict]) -> str:
    """Returns the line saying whether memo meets the issue's memory and time goals against HF + checkpointing, and
    how far apart the rows' first losses are (same weights, same batch)."""
    losses = [row["loss"] for row in rows if "loss" in row]
    spread = (max(losses) - min(losses)) / abs(losses[0]) if losses else 0.0
    memo, base = named(rows, "memo.patch"), named(rows, BASELINE)
    memory, speed = memo.get("activation_bytes_ratio"), memo.get("step_s_ratio")
    if memory is None or speed is None:
        why = "a row failed" if all("skipped" not in row for row in (memo, base)) else "a row not run"
        return f"memo vs HF + checkpointing: no ratio ({why}); first losses within {spread:.1e} (relative)"
    return (
        f"memo activation memory {memory:.2f}x HF + checkpointing (goal <= {MEMORY_GOAL}x): "
        f"{'met' if memory <= MEMORY_GOAL else 'NOT met'}; step time {speed:.2f}x (goal <= {TIME_GOAL}x): "
        f"{'met' if speed <= TIME_GOAL else 'NOT met'}; first losses within {spread:.1e} (relative)"
    )


def print_table(rows: list[dict]) -> None:
    print("| row | activation MiB | x HF+AC | host MiB | step s | x HF+AC | loss | what ran |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for row in rows:
        if "error" in row or "skipped" in row:
            print(f"| {row['name']} |  |  |  |  |  |  | {row.get('error') or row['skipped']} |")
            continue
        memory, speed = _cell(row["activation_bytes_ratio"], ".2f"), _cell(row["step_s_ratio"], ".2f")
        activation = f"{row['activation_bytes'] / 2**20:.0f}"
        if "activation_range" in row:
            activation += " ({:.0f}-{:.0f})".format(*(b / 2**20 for b in row["activation_range"]))
        print(
            f"| {row['name']} | {activation} | {memory} | {row['host_bytes'] / 2**20:.0f} | "
            f"{row['step_s']:.2f} | {speed} | {row['loss']:.6f} | {row['ran']} |"
        )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", default="16K", help="tokens of the one sequence each step trains (16K, 4096)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size (32000: Llama 2's)")
    p.add_argument("--tiny", action="store_true", help="2 layers, h=64, 512 tokens, a 256-id vocabulary")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the one warm-up")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of each row (see above)")
    p.add_argument("--tile-tokens", type=int, default=Shape.tile_tokens, help="memo's token tile (rows)")
    p.add_argument(
        "--attention-heads",
        type=int,
        default=Shape.attention_heads,
        help="memo's query heads per attention call (0: its default, all heads on a CPU)",
    )
    p.add_argument(
        "--keep-buffers", action="store_true", help="keep memo's rounding buffers across the loss (no empty_buffers)"
    )
    p.add_argument(
        "--fresh-gradient",
        action="store_true",
        help="memo's attention gradient in a tensor of its own (no gradient_over_input)",
    )
    p.add_argument(
        "--shared-layers",
        type=int,
        default=None,
        help="memo's lowest layers holding one rounding buffer (default: as far as their gradients reach a buffer)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="fresh processes per row: each number is their median, the activation column shows their range too",
    )
    p.add_argument("--rows", help="the rows to run, by number from 0 (default all): 0,3 is HF + checkpointing, memo")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--row", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"`--steps` must be at least 1, got {args.steps}")
    if args.shared_layers is not None and not 1 <= args.shared_layers <= args.layers:
        p.error(f"`--shared-layers` must be in [1, --layers], got {args.shared_layers}")
    if args.repeats < 1:
        p.error(f"`--repeats` must be at least 1, got {args.repeats}")
    if args.threads < 1:
        p.error(f"`--threads` must be at least 1, got {args.threads}")
    if args.tiny:
        shape = TINY
    else:
        heads = args.attention_heads or None
        tokens = parse_size(args.tokens)
        shape = Shape(
            args.layers, args.hidden, tokens, args.vocab, args.tile_tokens, heads, not args.keep_buffers,
            not args.fresh_gradient, args.shared_layers,
        )  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.row is not None:
        _return_freed_memory_to_os()  # from the start: a heap kept from earlier steps would count freed bytes
        torch.set_num_threads(args.threads)
        print(json.dumps(measured_row(args.row, shape, args.steps, device, release_heap=True)))
        return 0
    argv = sys.argv[1:] if argv is None else list(argv)
    rows = []
    chosen = range(len(ROWS)) if args.rows is None else [int(i) for i in args.rows.split(",")]
    for i, name in enumerate(ROWS):
        reason = "not asked for (--rows)" if i not in chosen else skip_reason(name, shape)
        print(f"  {name}: {reason or 'running'}", file=sys.stderr, flush=True)
        runs = [] if reason else [_row_in_subprocess(argv, i) for _ in range(args.repeats)]
        rows.append({"name": name, **({"skipped": reason} if reason else repeated(runs))})
    add_ratios(rows)
    if args.json:
        print(json.dumps({"shape": dataclasses.asdict(shape), "device": device.type, "rows": rows}, indent=1))
        return 0
    print(
        f"# Llama {shape.layers} layers, h={shape.hidden}, I={shape.intermediate}, vocab {shape.vocab}, "
        f"{shape.tokens} tokens unpacked, batch 1, fp32, SFTTrainer, memo tiles {shape.tile_tokens}, "
        f"{shape.attention_heads or 'all'} head(s) a call, buffers {'emptied' if shape.empty_buffers else 'kept'} "
        f"across the loss, the lowest {shared_layers(shape)} layers on one buffer, "
        f"attention's gradient {'over the input' if shape.gradient_over_input else 'apart'}; "
        f"{device.type}, "
        f"{args.threads} thread(s), {args.repeats} fresh process(es) a row (medians), "
        f"torch {torch.__version__}"
    )
    if device.type == "cpu":
        print(
            "# CPU: host and device are one memory; bytes parked in host memory (memo's host pool, save_on_cpu's "
            "copies) are subtracted from the activation column and shown in the host column"
        )
    print_table(rows)
    print(verdict(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
