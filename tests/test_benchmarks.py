"""The benchmark scripts run end to end at toy sizes (their numbers live in the README, not here)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import strategies  # noqa: E402


@pytest.mark.slow
def test_strategies_benchmark_prints_a_row_per_alternative(capsys):
    assert strategies.main(["--layers", "4", "--seq", "128", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    for row in (
        "memo none",
        "memo full",
        "memo alpha=0.5",
        "memo alpha=0.5 + arena",
        "autograd (reference)",
        "torch.utils.checkpoint",
        "save_on_cpu",
    ):
        assert f"| {row} |" in out
