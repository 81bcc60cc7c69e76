"""Ctrl-C and preemption: SIGINT or SIGTERM ends a run after its current step with a checkpoint, not a loss.

A long-context step can take minutes and a run days; a cluster's job limit or a requeue sends SIGTERM, a
person presses Ctrl-C. The first signal only asks the trainer to stop: it finishes the step, saves (every
rank together under torchrun) and the CLI exits 128 + the signal's number (130, 143) saying how to resume.
A second Ctrl-C stops at once: checkpoints are written to a temporary folder and renamed, so the last one
stays whole.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """While entered (main thread only), records the first SIGINT/SIGTERM in `signum` instead of dying."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: now
        if self.signum is None:
            self.signum = signum


@dataclass
class Interrupted(Exception):
    """The run stopped on a signal after `step`, with its checkpoint at `checkpoint`."""

    signum: int
    step: int
    checkpoint: Path
    run_dir: Path

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        return (
            f"stopped by {name} after step {self.step}; checkpoint {self.checkpoint}\n"
            f"resume with: memo train --resume {self.run_dir}"
        )
