"""A second process that computes one thing while this one computes another: a child forked from this process the
first time it is asked (same code, imports and op memo: no start-up), fed over a pipe.

Tracing a step on `meta` is pure Python on one core, and the cost model traces two lengths at a time
(`cost.memory._program`): on a machine with a second core the child traces one while this process traces the other.
The child is only forked where that is safe (`os.fork`, one thread, CUDA untouched); elsewhere, or if the child
fails, both run here, one after the other. It ends with this process: it reads the end of the pipe, and dies on
SIGINT, SIGTERM and SIGHUP as a plain process does.
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import signal
import struct
import threading

import torch

_HEADER = struct.Struct("<Q")  # the length of the pickle that follows
_child: _Child | None = None
_tried = False


def both(fn, first: tuple, second: tuple) -> tuple:
    """Returns (fn(*first), fn(*second)): the second computed in the child while this process computes the first,
    when there is one. `fn` and its arguments and results must pickle (a module-level function)."""
    child = _get()
    if child is None or not child.send((fn, second)):
        return fn(*first), fn(*second)
    try:
        mine = fn(*first)
    except BaseException:
        _drop()  # its answer would be read as the next request's
        raise
    theirs = child.receive()
    return mine, (fn(*second) if theirs is None else theirs[0])


def _get() -> _Child | None:
    """Returns the child, forking it on the first call where this process may fork (None where it may not)."""
    global _child, _tried
    if not _tried:
        _tried = True
        safe = hasattr(os, "fork") and (os.cpu_count() or 1) > 1 and threading.active_count() == 1
        if safe and not torch.cuda.is_initialized():
            _child = _Child()
            atexit.register(_child.close)
    return _child


def _drop() -> None:
    """Ends the child for good: what follows runs here."""
    global _child
    if _child is not None:
        _child.close()
        _child = None


class _Child:
    """The forked process and the two pipes to it; one request at a time."""

    def __init__(self) -> None:
        from_parent, to_child = os.pipe()  # (read end, write end)
        from_child, to_parent = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(to_child)
            os.close(from_child)
            _serve(from_parent, to_parent)
        os.close(from_parent)
        os.close(to_parent)
        self.requests, self.answers = os.fdopen(to_child, "wb"), os.fdopen(from_child, "rb")

    def send(self, request) -> bool:
        """Sends a request; False if the child is gone."""
        try:
            _write(self.requests, request)
            return True
        except (OSError, ValueError):
            return False

    def receive(self):
        """Returns (the answer,), or None if it raised there (this process then meets the error itself) or the
        child is gone (for good)."""
        try:
            ok, answer = _read(self.answers)
        except (OSError, EOFError, pickle.UnpicklingError, struct.error):
            _drop()
            return None
        return (answer,) if ok else None

    def close(self) -> None:
        """Ends the child at once (it holds nothing to clean up) and waits for it."""
        for pipe in (self.requests, self.answers):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _serve(requests_fd: int, answers_fd: int) -> None:
    """The child's life: answers requests until the pipe ends, then exits at once (no cleanup of the parent's)."""
    gc.enable()  # it may be forked while the parent traces with the collector paused
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, signal.SIG_DFL)
    code = 0
    try:
        with os.fdopen(requests_fd, "rb") as requests, os.fdopen(answers_fd, "wb") as answers:
            while True:
                try:
                    fn, args = _read(requests)
                except EOFError:
                    break
                try:
                    answer = (True, fn(*args))
                except Exception as err:  # the parent computes it again and meets the error itself
                    answer = (False, repr(err))
                _write(answers, answer)
    except BaseException:
        code = 1
    os._exit(code)


def _write(pipe, value) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(_HEADER.pack(len(data)) + data)
    pipe.flush()


def _read(pipe):
    header = pipe.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    return pickle.loads(pipe.read(size))
