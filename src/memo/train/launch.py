"""Starts this node's ranks of a distributed `memo train` (`--nproc`, `--nnodes`, `--node-rank`, `--master-addr`).

Why not torchrun's agent: it starts each rank in a session of its own, passes a signal on once and kills the
ranks 30 s later (a long-context step and its checkpoint can take longer), and buries the failing rank's
one-line message under a launcher traceback. Here the ranks stay in the terminal's process group, so Ctrl-C
reaches each of them once (they finish the step and save together, rank 0 alone saying so at once; a second
Ctrl-C stops them at once); the launcher passes SIGTERM and SIGHUP on (preemption, a closed session), hosts the
rendezvous store on node 0 as torchrun's agent does (the ranks join it through torch's
TORCHELASTIC_USE_AGENT_STORE protocol), so that the store outlives any rank, and exits with the failing rank's
code. Plain torchrun works as well: nothing in the ranks depends on this launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from ..parallel import faults
from .config import TrainConfig, model_config
from .signals import nohup

GRACE_SECONDS = 5.0  # after a rank fails, how long this node's other ranks get to end on their own (then SIGKILL)
FORWARDED = (signal.SIGTERM, signal.SIGHUP)  # preemption, a closed session: passed on to every rank
STOPPED = (0, 128 + signal.SIGINT, *(128 + s for s in FORWARDED))  # a finished run, or one that saved on a signal


def launch(cfg: TrainConfig, argv: list[str]) -> int:
    """Runs `memo train argv` as `cfg.nproc` ranks on this node (of `cfg.nnodes`); returns the run's exit code."""
    cfg.check_world(cfg.nproc * cfg.nnodes)  # before starting processes that would each fail alike
    model_config(cfg)
    store = _host_store(cfg) if cfg.node_rank == 0 else None
    port = store.port if store is not None else cfg.master_port
    command = [sys.executable, "-m", "memo", *argv]
    ranks = [subprocess.Popen(command, env=_rank_env(cfg, i, port)) for i in range(cfg.nproc)]
    # Ctrl-C reaches every rank from the terminal; this process only waits (and passes SIGTERM on)
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    # a rank sent one directly too gets it twice at once: it stops once (`signals.REPEAT_SECONDS`)
    for signum in FORWARDED:  # `nohup`'s hangup stays ignored
        if not nohup(signum):
            previous[signum] = signal.signal(signum, lambda signum, frame: [r.send_signal(signum) for r in ranks])
    try:
        return _wait(cfg, port, ranks)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()


def _host_store(cfg: TrainConfig) -> dist.TCPStore:
    """Returns the run's rendezvous store, served from this process (node 0) on `--master-port` (one node: any
    free port)."""
    port = cfg.master_port if cfg.master_port is not None else (0 if cfg.nnodes == 1 else 29500)
    try:
        return dist.TCPStore(
            cfg.master_addr, port, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=15)
        )
    except RuntimeError as err:
        raise ValueError(f"cannot serve the rendezvous on `--master-port` {port}: {err}") from None


def _rank_env(cfg: TrainConfig, local_rank: int, port: int) -> dict[str, str]:
    """Returns the environment of one rank: torch.distributed's env:// variables and torchrun's local ones."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // cfg.nproc))
    return {
        **os.environ,
        "MASTER_ADDR": cfg.master_addr,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(cfg.nproc * cfg.nnodes),
        "RANK": str(cfg.node_rank * cfg.nproc + local_rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(cfg.nproc),
        "GROUP_RANK": str(cfg.node_rank),
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "OMP_NUM_THREADS": threads,
    }


def _wait(cfg: TrainConfig, port: int, ranks: list[subprocess.Popen]) -> int:
    """Waits for this node's ranks; after one fails, ends the others (a hard kill is reported for it). Returns
    the code of the first rank that ended badly, else 0 (or the signal stop's 130 / 143)."""
    codes: list[int] = []
    failed_at = None
    while len(codes) < len(ranks):
        for i, rank in enumerate(ranks):
            if rank.returncode is None and rank.poll() is not None:
                code = _exit_code(rank.returncode)
                codes.append(code)
                if rank.returncode < 0:  # killed (out of memory, a segfault): it could not say so itself
                    _report_kill(cfg, port, cfg.node_rank * cfg.nproc + i, -rank.returncode)
                if code not in STOPPED and failed_at is None:
                    failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_SECONDS:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
        time.sleep(0.1)
    return next((c for c in codes if c not in STOPPED), next((c for c in codes if c), 0))


def _exit_code(returncode: int) -> int:
    """Returns a process's exit code as a shell shows it (128 + the signal that killed it)."""
    return 128 - returncode if returncode < 0 else returncode


def _report_kill(cfg: TrainConfig, port: int, rank: int, signum: int) -> None:
    """Tells every rank that `rank` was killed, and says so here unless another failure came first."""
    name = signal.Signals(signum).name
    store = faults.connect(cfg.master_addr, port, timeout=2.0)
    if faults.report(store, f"rank {rank} was killed by {name}", 128 + signum, rank):
        print(f"memo train: error: rank {rank} was killed by {name}", file=sys.stderr)
