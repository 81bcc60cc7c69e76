"""Signals: SIGINT, SIGTERM or SIGHUP end every verb cleanly, and end a training run after its step with a checkpoint.

A long-context step can take minutes and a run days; a cluster's job limit or a requeue sends SIGTERM, a closed
terminal SIGHUP, a person presses Ctrl-C. Python's default for SIGTERM and SIGHUP is to die on the spot, skipping
every `finally`: a temporary export file, a half-made run folder or a checkpoint's temporary folder would stay.
`Stopping` turns each into an exception (`Terminated`, a BaseException like KeyboardInterrupt, so that no
`except Exception` swallows it) in every verb: cleanups run, the CLI exits 128 + the signal's number.

While a run trains, `StopRequest` takes over: the first signal only asks the trainer to stop, and rank 0 says at
once what will happen (a step can take minutes: a run that is stopping must not look like one that ignored the
user); it finishes the step, saves (every rank together under torchrun) and the CLI exits 128 + the signal's number
(130, 143, 129) saying how to resume. The same signal again, or Ctrl-C, stops at once: checkpoints are written to
a temporary folder and renamed, so the last one stays whole. A repeat of a SIGTERM or SIGHUP within
`REPEAT_SECONDS` is the first one delivered twice, not a second request: memo's launcher passes on what a
scheduler or a closed terminal may have sent every rank already.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
REPEAT_SECONDS = 1.0  # a forwarded signal arrives again within milliseconds; a person's second try takes longer


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived while a verb worked (SIGINT stays Python's KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


def nohup(signum: int) -> bool:
    """Returns whether `signum` is a hangup this process was started to ignore (`nohup`): it stays ignored. (A
    shell's background job ignores SIGINT too, yet `kill -INT` to it still means stop.)"""
    return signum == signal.SIGHUP and signal.getsignal(signum) is signal.SIG_IGN


class _Handlers:
    """While entered (main thread only), `handle` receives SIGINT, SIGTERM and SIGHUP; the previous handlers
    come back on exit."""

    def __enter__(self):
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            kept = [s for s in SIGNALS if not nohup(s)]
            self._previous = {s: signal.signal(s, self._handle) for s in kept}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame) -> None:
        raise NotImplementedError


class Stopping(_Handlers):
    """Every verb runs inside: SIGTERM and SIGHUP raise `Terminated` where the work is, SIGINT KeyboardInterrupt."""

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)


class StopRequest(_Handlers):
    """While entered, records the first signal in `signum` instead of stopping and tells `say` at once what will
    happen to the step `step()` names; the same signal again (`REPEAT_SECONDS` later), or Ctrl-C, stops at once."""

    def __init__(self, say: Callable[[str], None] | None, step: Callable[[], int]):
        self.signum: int | None = None
        self._say, self._step = say, step
        self._first_at = 0.0

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            if self._say is not None:
                self._say(notice(signum, self._step()))
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: now
        elif signum == self.signum and now - self._first_at > REPEAT_SECONDS:  # not the launcher's copy
            raise Terminated(signum)


def notice(signum: int, step: int) -> str:
    """Returns what a run does on its first `signum` during `step`, and how to stop it at once instead."""
    name = signal.Signals(signum).name
    again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {name} again"
    return f"{name}: finishing step {step}, then saving a checkpoint; {again} to stop now without saving"


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
