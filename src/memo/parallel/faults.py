"""One rank's failure ends every rank within seconds, on every node, with that rank's message said once.

Without this a rank that raises leaves its peers blocked in their next collective until its timeout (half an
hour by default), and on other nodes nothing ever tells them. Every rank of a run reaches the rendezvous store
(MASTER_ADDR:MASTER_PORT: node 0's launcher, memo's or torchrun's), so a failing rank writes its message and
exit code there; a watch thread in every other rank polls for it and ends its process with the same code. The
first rank to report is the one that prints, so an error every rank meets alike (a bad flag) is one line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from . import mesh

FAILURE = "memo/failure"  # the first failure's {"rank", "code", "message"}
REPORTS = "memo/failures"  # how many ranks (and launchers) reported one
POLL_SECONDS = 0.5


def connect(host: str | None = None, port: int | None = None, timeout: float = 10.0) -> dist.TCPStore | None:
    """Returns a client of the run's rendezvous store (by default this rank's, from torch.distributed's env://
    variables), or None outside a distributed launch or when it is gone."""
    if host is None:
        if mesh.world_size() < 2 or (address := mesh.rendezvous()) is None:
            return None
        host, port = address
    try:
        return dist.TCPStore(
            host,
            port,
            is_master=False,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError):  # DistStoreError is a RuntimeError
        return None


def report(store: dist.TCPStore | None, message: str, code: int, rank: int) -> bool:
    """Records a failure for every rank to see; returns whether it is the run's first (the one to print)."""
    if store is None:
        return True
    try:
        first = store.add(REPORTS, 1) == 1
        if first:
            store.set(FAILURE, json.dumps({"rank": rank, "code": code, "message": message}))
        return first
    except RuntimeError:  # the store's host ended already: say it here
        return True


def failure(store: dist.TCPStore) -> dict | None:
    """Returns the reported failure, if any (raises RuntimeError when the store is gone)."""
    if not store.check([FAILURE]):
        return None
    return json.loads(store.get(FAILURE))


def awaited_failure(seconds: float = 3.0) -> dict | None:
    """Returns another rank's failure reported within `seconds` (a rank that lost a peer mid-collective learns
    why once the peer's launcher reports the kill), else None."""
    store = connect(timeout=seconds)
    deadline = time.monotonic() + seconds
    while store is not None and time.monotonic() < deadline:
        try:
            found = failure(store)
        except RuntimeError:
            return None
        if found is not None and found["rank"] != mesh.rank():
            return found
        time.sleep(0.1)
    return None


class FaultWatch:
    """While started, ends this process with the exit code of another rank's reported failure (or 1 when the
    store is gone: node 0's launcher died). Stop it once every rank has passed the final barrier."""

    def __init__(self, store: dist.TCPStore | None):
        self.store = store
        self.rank = mesh.rank()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="memo-fault-watch", daemon=True)

    def start(self) -> "FaultWatch":
        if self.store is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                found = failure(self.store)
            except RuntimeError:
                found = {"code": 1, "rank": None}
            if found is not None and found["rank"] != self.rank and not self._stop.is_set():
                _end(found)


def _end(found: dict) -> None:
    """Ends the process at once: the main thread may be blocked in a collective that will never complete."""
    if found["rank"] is None and mesh.local_rank() == 0:
        print("memo train: error: lost the run's rendezvous store (node 0 ended)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(found["code"])
