"""The training loop: builds the model, data, optimizer and run directory from a `TrainConfig`, and yields one
metrics record per optimizer step (and one per evaluation). Resuming restores everything the next step
depends on (weights, AdamW state, fp32 masters, solved α, RNG; data and learning rate are functions of the
step), so a resumed run's losses equal an uninterrupted run's.

Under torchrun (WORLD_SIZE > 1) every rank runs the same loop on a dp × sp mesh (memo.parallel): it builds
the same model (same seed), shards it, and takes its slice of each global batch; the loss is already the
mean over all ranks' tokens, so its value, the gradient norm and every optimizer step are the ones of one
process training the same batches. Rank 0 alone writes the run directory's files and the metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil
import statistics
import time
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import device as dev
from .. import parallel
from ..attention import choose as choose_attention
from ..config import ModelConfig
from ..cost.estimate import ATTENTION_CHOICES
from ..cost.flops import model_flops_per_token
from ..cost.hardware import gpu_of
from ..cost.memory import training_lower_bound
from ..cost.predict import compare, host_pool_bytes, pinned_host_line, predict_run
from ..cost.states import host_bytes as state_host_bytes
from ..documents import DocumentLengths, attended_tokens
from ..files import RUN, claim_folder, mark, write_text
from ..job import Job
from ..lora import apply_lora
from ..loss import IGNORE_INDEX, shift_labels
from ..model import Transformer
from ..parallel import faults
from ..plan.allocator import PlannedAllocator, pool_high_water, reset_pool_high_water
from ..ruler import Ruler
from ..ruler_eval import RulerGrid, end_of_text, eval_task_names, ruler_cells
from ..units import format_bytes, format_count, parse_size
from . import checkpoint
from .config import (
    TrainConfig,
    run_tokenizer_id,
    with_packing,
)
from .data import (
    RetrievalTask,
    Source,
    TokenDataset,
    answer_counts,
    check_vocab,
    load_tokenizer,
    make_source,
    split_documents,
    token_dataset,
)
from .defaults import with_defaults
from .lock import RunLock
from .metrics import MetricsLog
from .optim import MasterAdamW, learning_rate
from .signals import Interrupted, StopRequest

log = logging.getLogger(__name__)


def build_model(cfg: TrainConfig, job: Job, device: torch.device, dtype: torch.dtype) -> Transformer:
    """Returns the model `job` trains with its policy (a Hugging Face `--model` folder's weights loaded) on
    `device` and `dtype`, initialised from `cfg.seed` (the same on every rank)."""
    torch.manual_seed(cfg.seed)
    if Path(cfg.model).is_dir():
        from ..hf import from_hf

        try:
            model = from_hf(cfg.model, policy=job.policy, config=job.model)
        except FileNotFoundError as err:
            raise ValueError(str(err)) from None
    else:
        model = Transformer(job.model, job.policy)
    if job.lora is not None:
        apply_lora(model, job.lora)
    return model.to(device=device, dtype=dtype)


class Trainer:
    """One run: `records()` trains from the current step to `cfg.steps`, checkpointing as configured. Under
    torchrun every rank makes its own Trainer; `rank == 0` is the one that writes."""

    def __init__(
        self,
        cfg: TrainConfig,
        resume: bool = False,
        base: ModelConfig | None = None,
        say: Callable[[str], None] = log.info,
    ):
        world = parallel.world_size()
        cfg.check_world(world)
        self.job = cfg.job(world, base)  # `--model` read once (`base`: already read by the caller)
        cfg = cfg if resume else with_defaults(with_packing(cfg))  # saved resolved: a resume keeps them
        self.mesh: DeviceMesh | None = _mesh(cfg, world)
        self.watch = faults.FaultWatch(faults.connect() if self.mesh else None).start()  # another rank's failure
        self.rank = dist.get_rank() if self.mesh else 0
        if self.mesh:
            cfg = _record_launch(cfg)
        self.cfg = cfg
        self.run_dir = Path(cfg.out) if cfg.out else self._agreed(_new_run_dir())
        if self.rank == 0 and not resume:  # a new or empty folder, or memo's run: before the lock or any work
            inputs = {"`--model`": cfg.model, "`--data`": cfg.data, "`--eval-data`": cfg.eval_data}
            claim_folder(self.run_dir, "--out", RUN, {**inputs, "`--tokenizer`": cfg.tokenizer}, overwrite=None)
        # one trainer per folder: rank 0 locks an existing one before reading its checkpoints, a new one once made
        self.lock = RunLock(self.run_dir) if self.rank == 0 and self.run_dir.is_dir() else None
        self.log = None
        self.created = []  # directories this run made, deepest first: a start that fails removes them
        self.say = say  # what rank 0 tells the user before the first step (the pinned host, before pinning it)
        try:  # a start that fails (or is signalled) before the first step leaves nothing behind
            self._start(resume)
            self.peak_flops = _peak_flops(self.device)
            self.prediction = self._predict() if self.rank == 0 and self.step < cfg.steps else None  # a run to go
        except BaseException:
            self.discard()
            raise
        self.steady: list[dict] = []  # the records of this run's steps after its first (warm-up, sizing)
        self.comparison: dict | None = None  # measured against predicted, once the run is done

    def _start(self, resume: bool) -> None:
        """Reads the checkpoint to resume, builds model, data and optimizer, and (rank 0) writes the run folder."""
        cfg = self.cfg
        saved = checkpoint.load_latest(self.run_dir) if resume else None
        if not resume and checkpoint.list_checkpoints(self.run_dir):
            raise ValueError(f"{self.run_dir} already holds a run: `--resume {self.run_dir}` or another `--out`")
        self.device = self._device()
        self.arena = self._planned_allocator() if cfg.arena else None  # on CUDA: before any CUDA allocation
        if self.device.type == "cuda" and not cfg.arena:
            log.info("CUDA allocator: %s", dev.use_expandable_segments())
        self.attention = choose_attention(cfg.attention, self.device, self.job.torch_dtype)  # impossible: before work
        check_memory(cfg, self.job, self.device, self.mesh)
        if self.device.type == "cuda" and self.rank == 0:  # host memory is pinned for a GPU's copies only
            pins = pinned_host_line(
                self.job, parallel.local_world_size(), _host_budget(cfg) - state_host_bytes(self.job)
            )
            if pins:
                self.say(pins)
        # a solved α and plan are pinned to the checkpoint's (they decide which rows are recomputed); given ones win
        pinned = saved.state.get("alphas") if saved and cfg.alpha is None else None
        modes = saved.state.get("modes") if saved and cfg.alpha is None and cfg.plan is None else None
        self.model = self._build_model(pinned, modes)
        self.source, self.held_out = self._sources()
        self.job = dataclasses.replace(self.job, policy=self.model.policy, documents=_document_lengths(self.source))
        for source in (self.source, self.held_out):
            if source is not None:
                check_vocab(source, self.model.config.vocab_size, cfg.model)
        clip = partial(parallel.clip_grad_norm, self.model) if self.mesh else None
        self.schedule = cfg.optimizer()
        self.optimizer = MasterAdamW(self.model, self.schedule, clip)
        self.step = 0
        self.skipped = 0  # steps whose loss or gradient norm was not finite (`--skip-nonfinite`)
        if saved:
            self._restore(saved)
        if self.rank == 0:
            self.created = [p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.lock = self.lock or RunLock(self.run_dir)
            mark(self.run_dir, RUN)
            if self.step < cfg.steps:  # a finished run resumed again (a requeued job) changes nothing
                write_text(self.run_dir / "config.json", json.dumps(cfg.to_dict(), indent=1))
            self.log = MetricsLog(self.run_dir, cfg.tensorboard, resume_after=self.step)

    def _device(self) -> torch.device:
        """Returns `--device`, or under torchrun this rank's GPU (cuda:LOCAL_RANK) or the CPU, as the mesh is."""
        if parallel.world_size() == 1:  # a one-rank mesh (`--offload-states`) is on `--device` too
            return dev.check_device(self.cfg.device)
        kind = self.mesh.device_type
        if dev.check_device(self.cfg.device).type != kind:
            raise ValueError(
                f"`--device {self.cfg.device}`: distributed runs use {kind} on this machine (one GPU per rank when "
                "CUDA is available); give `--device cuda`, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on CPUs"
            )
        return torch.device(kind, parallel.local_rank()) if kind == "cuda" else torch.device(kind)

    def _build_model(self, alphas: list[float] | None, modes: list[str] | None) -> Transformer:
        """Returns the model; on a mesh (torchrun, or `--offload-states`) sharded over it, float32 with FSDP's bf16
        mixed precision (its fp32 parameters are the masters; frozen ones are kept in the training dtype), after
        checking that the node's host memory holds the offload: the activation pool and any offloaded states."""
        cfg, job = self.cfg, self.job
        dtype = job.torch_dtype
        if not self.mesh:
            return build_model(
                cfg, dataclasses.replace(job, policy=cfg.policy(alphas, modes=modes)), self.device, dtype
            )
        budget = _host_budget(cfg)
        states = state_host_bytes(job)  # the cost model's count of the offloaded states (0 when on the device)
        # offloaded: built on the host, where FSDP keeps the shards (never the whole fp32 model on the device)
        where = torch.device("cpu") if job.offload_states else self.device
        policy = cfg.policy(alphas, budget - states, modes)
        model = build_model(cfg, dataclasses.replace(job, policy=policy), where, torch.float32)
        _frozen_in(model, dtype)
        parallel.check_host_budget(model, job.micro_batch, job.seq // job.sp, dtype, budget, states)
        return parallel.parallelize(model, self.mesh, job.dtype == "bfloat16", job.offload_states)

    def _planned_allocator(self) -> PlannedAllocator:
        """Returns the planned allocator `--arena` trains with (one process, on the CPU or one GPU)."""
        if self.mesh or self.device.type not in ("cpu", "cuda"):
            where = "distributed runs" if self.mesh else f"{self.device.type} devices"
            raise ValueError(f"`--arena` (the planned allocator) runs in one process on a CPU or a GPU, not {where}")
        return PlannedAllocator(self.device)

    def _sources(self) -> tuple[Source, Source | None]:
        """Returns (training data, held-out data or None): the generated task holds out a stream of its own,
        and file data `--eval-data` or a `--eval-split` of its documents."""
        cfg = self.cfg
        tokenizer = run_tokenizer_id(cfg)  # every token source must hold this tokenizer's ids
        packing = {
            "pack_documents": cfg.packing(),
            "max_documents": cfg.max_documents_per_sequence,
            "separator": cfg.document_separator,
            "long_conversations": cfg.long_conversations,
        }
        source = make_source(cfg.data, cfg.seq_len, cfg.seed, cfg.tokenizer, cfg.text_field, tokenizer, **packing)
        if isinstance(source, RetrievalTask):
            return source, source
        if cfg.eval_data is not None:
            held_out = token_dataset(
                cfg.eval_data, cfg.seq_len, cfg.seed, cfg.tokenizer, cfg.text_field, "--eval-data", tokenizer, **packing
            )
        elif cfg.eval_split:
            source, held_out = split_documents(source, cfg.eval_split, cfg.seed)
        else:
            held_out = None
            if self.rank == 0:
                log.warning("no held-out evaluation: give `--eval-data` or `--eval-split` with `--data`")
        if self.rank == 0:
            for name, data in (("training", source), ("held-out", held_out)):
                _log_joined(name, data)
        return source, held_out

    def _agreed(self, path: Path) -> Path:
        """Returns rank 0's `path` on every rank (a run directory named after the time of day)."""
        if not self.mesh:
            return path
        text = torch.zeros(1024, dtype=torch.uint8, device=self.mesh.device_type)
        raw = str(path).encode()[:1024]
        text[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        dist.broadcast(text, src=0)
        return Path(bytes(text.cpu().tolist()).rstrip(b"\0").decode())

    def discard(self) -> None:
        """Removes the run directory (and `runs/`) if this run made them, and unlocks it: a start that failed
        before its first step leaves nothing behind."""
        if self.log is not None:
            self.log.close()
        self._unlock()
        for path in self.created:
            if path == self.run_dir:
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        self.created = []

    def close(self) -> None:
        """Ends the process group a distributed Trainer started, after every rank arrives (the fault watch runs
        until then: a rank that fails on its way still ends the others)."""
        self._unlock()
        if self.mesh and dist.is_initialized():
            dist.barrier()
            self.watch.stop()
            dist.destroy_process_group()

    def abandon(self) -> None:
        """Ends the process group after this rank failed: no barrier, the others may never arrive (the fault
        watch of each ends it once the failure is reported)."""
        self._unlock()
        self.watch.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _unlock(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def records(self, stop: StopRequest | None = None) -> Iterator[dict]:
        """Trains; yields each step's record, then (at evaluation steps) an evaluation record. When `stop` has
        caught a signal, the run ends after the current step with a checkpoint (`signals.Interrupted`). A run
        that ends writes its measurements against the cost model's prediction (`comparison`)."""
        planned = self.arena or contextlib.nullcontext()
        try:
            with planned:
                yield from self._steps(stop)
            if self.prediction is not None and self.steady:
                self.comparison = compare(self.prediction, self._measured())
                self._write({"step": self.step, "measured_vs_predicted": self.comparison})
                for warning in self.comparison["warnings"]:
                    log.warning(warning)
        finally:
            if self.log is not None:
                self.log.close()
            self._unlock()  # the run's files are written: another trainer may take the folder

    def _steps(self, stop: StopRequest | None) -> Iterator[dict]:
        first = self.step + 1
        while self.step < self.cfg.steps:
            self.step += 1
            record = self._train_step()
            if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
                record = self._skip(record)
            elif self.step > first:
                self.steady.append(record)
            self._write(record)
            yield record
            if self.held_out is not None and (self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps):
                record = {"step": self.step, **self.evaluate()}
                self._write(record)
                yield record
            saved = None
            final = self.step == self.cfg.steps and self.cfg.save_final
            if final or (self.cfg.save_every and self.step % self.cfg.save_every == 0):
                saved = self.save()
            signum = self._agreed_signal(stop)
            if signum and self.step < self.cfg.steps:
                raise Interrupted(signum, self.step, saved or self.save(), self.run_dir)

    def _skip(self, record: dict) -> dict:
        """Returns the record of a step whose loss or gradient norm is not finite (the weights were not updated),
        or raises ValueError once more than `--skip-nonfinite` steps were: the last checkpoint stays the last
        finite state."""
        what, value = (
            ("loss", record["loss"]) if not math.isfinite(record["loss"]) else ("gradient norm", record["grad_norm"])
        )
        self.skipped += 1
        allowed = self.cfg.skip_nonfinite
        if self.skipped > allowed:
            newest = checkpoint.list_checkpoints(self.run_dir)
            kept = f"the newest checkpoint, {newest[-1].name}, is untouched" if newest else "no checkpoint was written"
            skipped = f" after skipping {allowed} such step(s)" if allowed else ""
            raise ValueError(
                f"step {self.step}: the {what} is {value}{skipped}; stopped without updating the weights, {kept}; "
                "lower `--lr` or raise `--skip-nonfinite`"
            )
        if self.rank == 0:
            log.warning(f"step {self.step}: the {what} is {value}: skipped ({self.skipped} of {allowed})")
        return {"step": self.step, "skipped": what, "skipped_steps": self.skipped}

    def _agreed_signal(self, stop: StopRequest | None) -> int:
        """Returns the signal any rank caught (0: none), the same on every rank, so that all save together; one
        process asks no device (reading a device tensor back would sync the host with it every step)."""
        signum = (stop.signum or 0) if stop else 0
        if not self.mesh:
            return signum
        caught = torch.tensor([signum], device=self.device)
        dist.all_reduce(caught, op=dist.ReduceOp.MAX)
        return int(caught)

    def _predict(self) -> dict:
        """Returns (and records) what the cost model predicts for this run on this rank."""
        spec = gpu_of(torch.cuda.get_device_name(self.device)) if self.device.type == "cuda" else None
        job = dataclasses.replace(self.job, attention=_timed_kernel(self.attention))
        predicted = predict_run(job, self.device.type, spec, self.model.loss_chunk_tokens)
        self._write({"step": self.step, "predicted": predicted})
        return predicted

    def _measured(self) -> dict:
        """Returns this run's steady steps as the quantities `predict_run` predicts: memory peaks, the host pool at
        the α it ran with, and on a GPU the median step time and MFU."""
        last = self.steady[-1]
        measured = {"host_pool_bytes": last["host_pool_bytes"] or None}
        if last["alphas"] and self.prediction.get("host_pool_bytes") is None:  # α was solved in the first step
            self.prediction["host_pool_bytes"] = host_pool_bytes(self.job, last["modes"], last["alphas"])
        if "device_peak_allocated" in last:
            measured["device_peak_bytes"] = max(r["device_peak_allocated"] for r in self.steady)
        if last.get("arena_load_bytes"):  # the planned allocator's recorded step: its transient peak
            measured["step_transient_bytes"] = last["arena_load_bytes"]
        if last["mfu"] is not None:
            measured["step_seconds"] = statistics.median(r["seconds"] for r in self.steady)
            measured["mfu"] = statistics.median(r["mfu"] for r in self.steady)
        return measured

    def _write(self, record: dict) -> None:
        if self.log is not None:
            self.log.write(record)

    def evaluate(self) -> dict:
        """Returns the held-out loss, a mean over the target tokens of `--eval-batches` fixed batches never
        trained on, and on the generated task the answer accuracy; under torchrun each rank scores its shard
        of every batch and the counts are summed over the ranks."""
        retrieval = isinstance(self.held_out, RetrievalTask)
        batches = self.held_out.eval_batches(self.cfg.eval_batches, self.cfg.batch_size // self.cfg.grad_accum)
        loss_sum, targets_seen = 0.0, 0
        counts = torch.zeros(2, dtype=torch.long, device=self.device)
        with torch.no_grad():
            for ids, labels, positions in batches:
                count = int((shift_labels(labels) != IGNORE_INDEX).sum())  # over every rank's rows
                if count == 0:
                    continue
                ids, targets, positions = self._local(ids, labels, positions)
                loss = self.model(ids, targets=targets, positions=positions)
                loss_sum += loss.item() * count  # the mean over every rank's tokens
                targets_seen += count
                if retrieval:
                    counts += answer_counts(self.model, ids, targets)
        if targets_seen == 0:
            raise ValueError("the held-out data has no target tokens (every document is one token long)")
        record = {"eval_loss": loss_sum / targets_seen}
        if retrieval:
            if self.mesh:
                dist.all_reduce(counts)
            record["eval_accuracy"] = int(counts[0]) / int(counts[1])
        if self.cfg.eval_tasks:
            record.update(self._ruler())
        return record

    def _ruler(self) -> dict:
        """Returns RULER's scores at the run's length (`--eval-tasks`): each task's at depth 0.5 over 2 fixed
        prompts, and their mean (`eval_ruler`, None when no task fits the length with this tokenizer)."""
        tokenizer = load_tokenizer(self.cfg.tokenizer)
        grid = RulerGrid(
            tasks=eval_task_names(self.cfg.eval_tasks), lengths=(self.cfg.seq_len,), depths=(0.5,), samples=2,
            seed=self.cfg.seed, eos=end_of_text(tokenizer),
        )  # fmt: skip
        cells = list(ruler_cells(self.model, Ruler(tokenizer), grid))
        scores = {c.task: c.score for c in cells}
        scored = [s for s in scores.values() if s is not None]
        return {"eval_ruler": sum(scored) / len(scored) if scored else None, "eval_ruler_tasks": scores}

    def _local(
        self, ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Returns (input ids, shifted targets, positions) of this rank's part of a global batch: ids and targets
        of its rows and tokens on its device, positions (or None) of its rows and every token of them (the
        attention of a sequence-parallel rank needs every document's bounds), left on the host, where the model
        reads the documents' bounds from them."""
        if self.mesh and positions is not None:
            positions = positions[parallel.shard_of(self.mesh).rows(ids.shape[0])]
        ids, targets = parallel.shard_batch(ids, labels, self.mesh) if self.mesh else (ids, shift_labels(labels))
        return ids.to(self.device), targets.to(self.device), positions

    def _train_step(self) -> dict:
        cfg, model = self.cfg, self.model
        caching = self.device.type == "cuda" and self.arena is None  # its peak statistics (the planned one: its own)
        pooled = self.device.type == "cuda" and self.arena is not None  # the planned allocator's memory pool
        if caching:
            torch.cuda.reset_peak_memory_stats(self.device)
        if pooled:
            reset_pool_high_water()
        start = time.perf_counter()
        ids, labels, positions = self.source.batch(self.step, cfg.batch_size)  # global, the same on every rank
        parts = [None] * cfg.grad_accum if positions is None else positions.chunk(cfg.grad_accum)
        micro = list(zip(ids.chunk(cfg.grad_accum), labels.chunk(cfg.grad_accum), parts))
        # each micro-batch's loss is its own token mean: weighting it by its share of the step's targets makes
        # the step's gradient that of one mean over all its tokens, whatever the split
        counts = [int((shift_labels(lab) != IGNORE_INDEX).sum()) for _, lab, _ in micro]
        targets_in_step = sum(counts)
        if targets_in_step == 0:
            raise ValueError(f"step {self.step}: no target tokens in the batch (every label is ignored)")
        lr = learning_rate(self.schedule, self.step)
        before = self.arena.counters() if self.arena else None
        with self.arena.step() if self.arena else contextlib.nullcontext():  # the step the allocator plans
            loss_value, grad_norm = self._update(micro, counts, lr)
        seconds = time.perf_counter() - start
        tokens = cfg.batch_size * cfg.seq_len  # over all ranks
        # MFU in both conventions (flops.MFU_CAUSAL, the "mfu" of the records, and flops.MFU_FULL); packed documents
        # count the attention they need, Σ dᵢ² of this batch rather than s² (flops.MFU_PACKED, MFU_PACKED_FULL)
        attended = cfg.seq_len if positions is None else attended_tokens(positions)
        attended = self.job.model.attended(cfg.seq_len, attended)
        flops = model_flops_per_token(self.job.model, attended, lora=self.job.lora) * tokens / seconds
        full_flops = model_flops_per_token(self.job.model, attended, False, self.job.lora) * tokens / seconds
        peak = (self.mesh.size() if self.mesh else 1) * self.peak_flops if self.peak_flops else None  # all ranks
        stats = model.swap_stats()
        record = {
            "step": self.step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_norm,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "tflops": flops / 1e12,
            "mfu": flops / peak if peak else None,
            "mfu_full": full_flops / peak if peak else None,
            "host_pool_bytes": stats.host_pool_bytes,
            "bytes_offloaded": stats.bytes_offloaded,
            "bytes_recomputed": stats.bytes_recomputed,
            "alphas": stats.alphas,
            "modes": stats.modes,
            "tile_tokens": stats.tile_tokens,
            "attention": model.attention_report(),
        }
        if positions is not None:
            record["attended_tokens"] = attended  # Σ dᵢ² / tokens: the MFU counts this attention, not s²
        if caching:
            record["device_peak_allocated"] = torch.cuda.max_memory_allocated(self.device)
            record["device_peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
        if self.arena:
            record.update(_arena_record(self.arena, before))
        if pooled:  # the pool's peaks over this step, like the caching allocator's above
            record.update({f"device_pool_{k}": v for k, v in (pool_high_water() or {}).items() if k.endswith("peak")})
        return record

    def _update(self, micro: list, counts: list[int], lr: float) -> tuple[float, float]:
        """Runs forward and backward over the micro-batches and the optimizer step; returns (loss, gradient norm),
        nan for a norm not computed because the loss is not finite (nothing is updated then)."""
        total = torch.zeros((), device=self.device)
        for index, (batch, count) in enumerate(zip(micro, counts)):
            if count == 0:
                continue
            local_ids, targets, positions = self._local(*batch)
            # LoRA dropout's masks: a function of seed, step and micro-batch, so a resumed run drops the same
            self.model.dropout_key = (self.cfg.seed * 1_000_003 + self.step) * 1_000_003 + index
            loss = self.model(local_ids, targets=targets, positions=positions) * (count / sum(counts))
            loss.backward()
            self.optimizer.accumulate()  # into fp32: a bf16 .grad would round every micro-batch's sum
            total += loss.detach().float()
        # one device sync for loss and norm (the same on every rank); one that is not finite updates nothing
        return self.optimizer.step(lr, self.cfg.grad_clip, total)

    def save(self) -> Path:
        """Writes a checkpoint of the current step (atomically); under torchrun every rank writes its shards
        (collective)."""
        state = {
            "config": self.cfg.to_dict(),
            "model_config": dataclasses.asdict(self.model.config),  # export and eval need not find --model again
            "alphas": self.model.swap_stats().alphas or None,
            "modes": self.model.swap_stats().modes or None,
            "rng": _rng_state(self.device),
            "data": {"next_step": self.step + 1},
            "skipped_steps": self.skipped,
        }
        save = checkpoint.save_sharded if self.mesh else checkpoint.save
        tensors = self.model.state_dict(), self.optimizer.state_tensors()
        return save(self.run_dir, self.step, *tensors, state, self.cfg.keep_checkpoints)

    def _restore(self, saved: checkpoint.Checkpoint) -> None:
        """Loads a checkpoint of either layout, written on any number of ranks."""
        try:
            self._load_into(saved)
        except (RuntimeError, KeyError, AssertionError) as err:
            raise ValueError(f"checkpoint {saved.path} does not fit this model: {err}") from None
        _set_rng_state(saved.state["rng"], self.device)
        self.step = saved.step
        self.skipped = saved.state.get("skipped_steps", 0)

    def _load_into(self, saved: checkpoint.Checkpoint) -> None:
        """Reads the checkpoint into this rank's parameters and optimizer state (only the slices it holds).
        The fp32 masters of a bf16 one-process run become the weights of a float32 model, and the float32
        weights of a distributed run the masters of a bf16 one."""
        model_shapes, optim_shapes = saved.shapes("model"), saved.shapes("optimizer")
        params = self.model.state_dict()
        if not self.optimizer.separate:
            params = {f"{k}.master" if f"{k}.master" in model_shapes else k: v for k, v in params.items()}
        missing = sorted(set(params) - set(model_shapes))
        if missing:
            raise KeyError(f"missing weights {', '.join(missing[:3])}")
        saved.load_into("model", params)
        state = self.optimizer.empty_state_tensors(optim_shapes)
        saved.load_into("optimizer", state)
        if self.optimizer.separate and not any(k.endswith(".master") for k in state):
            masters = {name: torch.zeros_like(m) for name, m in zip(self.optimizer.names, self.optimizer.master)}
            saved.load_into("model", masters)
            state.update({f"{name}.master": m for name, m in masters.items()})
        _check_all_read(set(model_shapes) | set(optim_shapes), set(params) | set(state))
        self.optimizer.load_state_tensors(state)


def _check_all_read(saved: set[str], read: set[str]) -> None:
    """Raises RuntimeError when a checkpoint holds tensors this run does not read (adapters of targets it lacks, of
    another rank): loading the rest would silently drop what they trained. A bf16 run's weights are read as their
    fp32 masters (`name.master`) by a float32 run: those are not lost."""
    unread = sorted(name for name in saved - read if f"{name}.master" not in read)
    weights = [name for name in unread if not name.endswith((".master", ".exp_avg", ".exp_avg_sq", ".step"))] or unread
    if unread:
        shown = ", ".join(weights[:3]) + (", ..." if len(weights) > 3 else "")
        raise RuntimeError(f"it holds {len(weights)} tensor(s) this model has no place for ({shown})")


def _document_lengths(source: Source) -> DocumentLengths | None:
    """Returns the lengths of the documents a mask-packed source trains on (the cost model times their Σ dᵢ²)."""
    if not isinstance(source, TokenDataset) or source.pack_documents != "mask":
        return None
    return DocumentLengths.of_lengths(source.document_lengths(), "the training data")


def _log_joined(name: str, data: Source | None) -> None:
    """Logs, once per run and source, how many documents `--max-documents-per-sequence` joins to others."""
    joined, sequences = data.joined_documents() if isinstance(data, TokenDataset) else (0, 0)
    if joined:
        log.warning(
            "%s data: %d document(s) in %d of %d sequences join the document before them (they attend to it as in "
            "concat packing): `--max-documents-per-sequence` %d keeps that many apart per sequence",
            name, joined, sequences, data.num_sequences, data.max_documents,
        )  # fmt: skip


def _arena_record(arena: PlannedAllocator, before: dict) -> dict:
    """Returns a step's planned-allocator metrics: the arena and the LOAD of the step it was planned from, and
    this step's requests served from it, misses (another step shape), collisions avoided, and the most bytes it
    held at once outside the arena (in a recorded step: the default allocator's peak of the whole step)."""
    now = arena.counters()
    return {
        "arena_bytes": now["arena_bytes"],
        "arena_load_bytes": arena.plan.load_bytes if arena.plan else 0,
        "arena_served": now["served"] - before["served"],
        "arena_misses": now["misses"] - before["misses"],
        "arena_collisions": now["collisions"] - before["collisions"],
        "arena_pass_peak_bytes": now["pass_peak_bytes"] - before["pass_live_bytes"],  # what the step adds
    }


BATCH_BYTES_PER_TOKEN = 8  # of each int64 tensor of a batch: token ids, labels, and positions in mask packing


def check_memory(cfg: TrainConfig, job: Job, device: torch.device, mesh: DeviceMesh | None) -> None:
    """Raises ValueError when the run cannot fit: a lower bound of the memory one rank needs (model states,
    the strategy's skeletal activations, memo's host pool, the token ids of a step's batch and of an
    evaluation; no tracing)
    against what `device` (and for a GPU's batch, the host) has free, and the
    host pool (with `--offload-states` beside the states) against the host budget. Seconds at any length,
    before any folder, model or progress bar."""
    need = training_lower_bound(job)
    if job.offload_states:
        need["states"] = _offloaded_states(cfg, job, device, need["host_pool"])
    step_rows, eval_rows = _held_sequences(cfg)
    tensors = 3 if cfg.packing() == "mask" else 2
    need["batch"] = tensors * BATCH_BYTES_PER_TOKEN * (step_rows + eval_rows) * cfg.seq_len
    hint = ", or `--eval-batches`" if eval_rows > step_rows else ""  # an evaluation's batches outweigh the step's
    free = dev.free_memory_bytes(device)
    on_host = need["host_pool"] + need["batch"]
    on_device = need["states"] + need["activations"] + (on_host if device.type == "cpu" else 0)
    ranks = parallel.local_world_size() if mesh and device.type == "cpu" else 1  # ranks on one host share its memory
    model = job.model.name
    what = f"`--seq-len` {format_count(cfg.seq_len)} with `--batch-size` {cfg.batch_size} (model {model})"
    if free is not None and on_device * ranks > free:
        parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in need.items() if v)
        raise ValueError(
            f"{what} needs at least {format_bytes(on_device * ranks)} on {device} ({parts}"
            f"{f' per rank, x{ranks}' if ranks > 1 else ''}), {format_bytes(free)} available; "
            f"lower `--seq-len` or `--batch-size`{hint}"
        )
    host = dev.available_host_bytes() if device.type != "cpu" else None
    if host is not None and need["batch"] > host:
        raise ValueError(
            f"{what}: the batch's token ids take {format_bytes(need['batch'])} of host memory, "
            f"{format_bytes(host)} available; lower `--batch-size` or `--seq-len`{hint}"
        )
    if mesh is None and need["host_pool"]:
        budget = parse_size(cfg.host_budget) if cfg.host_budget else parallel.host_budget_per_rank()
        if need["host_pool"] > budget:
            raise ValueError(
                f"{what}: memo's host pool needs at least {format_bytes(need['host_pool'])}, the host budget is "
                f"{format_bytes(budget)}; lower `--alpha` or `--seq-len`, or raise `--host-budget`"
            )


def _held_sequences(cfg: TrainConfig) -> tuple[int, int]:
    """Returns the sequences of token ids every rank holds at once: the step's global batch, and an evaluation's
    batches (built all at once; none without held-out data)."""
    evaluates = cfg.data is None or cfg.eval_data is not None or bool(cfg.eval_split)
    return cfg.batch_size, cfg.eval_batches * (cfg.batch_size // cfg.grad_accum) if evaluates else 0


def _offloaded_states(cfg: TrainConfig, job: Job, device: torch.device, host_pool: int) -> int:
    """Returns the bytes of model states an `--offload-states` rank holds on `device` (the weights FSDP gathers;
    on a CPU, whose memory is the host's, the offloaded states too), after refusing states that do not fit in
    its host budget beside the activation pool `host_pool`: the host's counted as the cost model predicts them."""
    host = state_host_bytes(job)
    parallel.check_host_fits(host, host_pool, _host_budget(cfg))
    return parallel.gathered_bytes(_shapes(job), job.torch_dtype) + (host if device.type == "cpu" else 0)


def _host_budget(cfg: TrainConfig) -> int:
    """Returns this rank's share of the node's host budget (`--host-budget`, default `device.HOST_USABLE` of what
    is available)."""
    return parallel.host_budget_per_rank(parse_size(cfg.host_budget) if cfg.host_budget else None)


def _shapes(job: Job) -> Transformer:
    """Returns the job's model on `meta` (nothing allocated, adapters included): the shapes its states take."""
    with torch.device("meta"):
        model = Transformer(job.model)
    return apply_lora(model, job.lora) if job.lora is not None else model


def _frozen_in(model: Transformer, dtype: torch.dtype) -> None:
    """Stores the frozen parameters (LoRA's base) in the training `dtype`: nothing updates them, so an fp32 copy
    would only double what FSDP keeps and gathers."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(dtype)


def _mesh(cfg: TrainConfig, world: int) -> DeviceMesh | None:
    """Returns the mesh of torchrun's ranks, or with `--offload-states` of this process alone (FSDP offloads only
    on a mesh); None for one process keeping its states on its device."""
    if world > 1:
        return parallel.init_mesh(cfg.sp, offload=cfg.offload_states)
    return parallel.init_local_mesh(dev.check_device(cfg.device)) if cfg.offload_states else None


def _timed_kernel(kernel: str) -> str:
    """Returns the cost model's name for the attention kernel this run takes ("auto" where none is published:
    fp32's efficient kernel)."""
    return kernel if kernel in ATTENTION_CHOICES else "auto"


def _record_launch(cfg: TrainConfig) -> TrainConfig:
    """Returns `cfg` with `nproc` and `nnodes` set to the ranks started on this node and the nodes, as the run
    really ran (under plain torchrun too)."""
    ranks = parallel.local_world_size()
    return dataclasses.replace(cfg, nproc=ranks, nnodes=parallel.world_size() // ranks)  # no to_dict: no fingerprints


def _new_run_dir() -> Path:
    """Returns runs/<date-time>, with a suffix if a run started in the same second."""
    base = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _peak_flops(device: torch.device) -> float | None:
    """Returns the dense bf16 peak of a known GPU (for MFU), else None."""
    if device.type != "cuda":
        return None
    spec = gpu_of(torch.cuda.get_device_name(device))
    return spec.peak_flops if spec else None


def _rng_state(device: torch.device) -> dict:
    """Returns the RNG states this run uses (the CPU's and its own GPU's: touching others would start CUDA
    contexts on every GPU)."""
    state = {"torch": torch.get_rng_state().tolist()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)
