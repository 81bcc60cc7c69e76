import socket
import time

import pytest
import torch

# Seconds after which a test calls a wait hung. A guard against waiting forever, never what a healthy run is judged
# by: tests wait for events (a step logged, a checkpoint whole, a process gone), however slow the machine.
HANG = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """Returns a function giving a TCP port free on 127.0.0.1 now: the rendezvous of a test's ranks."""
    return _free_port


def _wait_until(condition, what: str, process=None) -> None:
    start = time.monotonic()
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"the process ended (exit {process.returncode}) before {what}")
        if time.monotonic() - start > HANG:
            pytest.fail(f"still waiting for {what} after {HANG} s")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def wait_until():
    """Returns a function that polls `condition()` until it holds, failing (naming `what`) if `process` ends first
    or after HANG seconds."""
    return _wait_until


@pytest.fixture(autouse=True)
def _single_thread_determinism():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """A tiny `memo train` run (64 tokens, bytes, one step) for the tests that evaluate a run."""
    from memo.cli import main

    out = tmp_path_factory.mktemp("eval") / "run"
    argv = ["train", "--seq-len", "64", "--batch-size", "2", "--steps", "1", "--eval-batches", "1", "--out", str(out)]
    assert main([*argv, "--json"]) == 0
    return out
