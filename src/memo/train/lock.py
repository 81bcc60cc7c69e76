"""One trainer per run folder: an OS lock on RUN_DIR/.lock, held for the trainer's whole life.

On clusters a requeued job may start while its first attempt still runs; two trainers in one folder replace
each other's metrics and remove each other's temporary checkpoints. `flock` is released by the kernel when
the process ends however it ends, so a crash leaves no stale lock to clean up by hand. The file says who
holds it (pid and host) for the second trainer's one-line error, and goes when the trainer ends.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from ..files import LOCK as NAME
from ..files import lock_held


class RunLock:
    """Holds the lock on `run_dir` (which must exist) until `release()` or the process ends."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / NAME
        while True:
            self._file = self.path.open("a+")
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._file.close()
                raise _in_use(run_dir) from None
            if _same_file(self._file, self.path):
                break
            self._file.close()  # its holder removed it as we opened it: lock the file there now
        self._file.truncate(0)
        self._file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
        self._file.flush()

    def release(self) -> None:
        """Removes the lock file, then unlocks (whoever opened it meanwhile sees it gone and opens anew)."""
        if not self._file.closed:
            self.path.unlink(missing_ok=True)
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def check_free(run_dir: Path) -> None:
    """Raises the in-use error when a trainer holds `run_dir`'s lock, changing nothing on disk: a probe before a
    resume reads the run (a killed run's leftover lock file stays, so the folder is still known as killed)."""
    if lock_held(run_dir):
        raise _in_use(run_dir)


def _in_use(run_dir: Path) -> ValueError:
    return ValueError(
        f"{run_dir} is in use by another `memo train` ({_holder(run_dir / NAME)}): wait for it to end or stop it, "
        "or give another `--out`"
    )


def _same_file(file, path: Path) -> bool:
    """Returns whether `path` still names the open `file` (not removed or replaced since it was opened)."""
    try:
        return os.stat(path).st_ino == os.fstat(file.fileno()).st_ino
    except FileNotFoundError:
        return False


def _holder(path: Path) -> str:
    """Returns "pid N on host H" from the lock file (its holder wrote it), or what is known."""
    try:
        who = json.loads(path.read_text())
        return f"pid {who['pid']} on host {who['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder did not say who it is yet"
