"""What a plan may spend: work, counted the same on any machine, and a clock that is only a safety net.

A DSA solve is budgeted in the search kernel's loop iterations (`SearchStats.work`), so equal inputs give
byte-identical plans on an idle and on a loaded machine; its time limit is set far above what the work takes and
reports when it cuts a solve, because that plan then depends on the machine's speed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..units import format_count, parse_size

# Measured on this project's 2-core CPU machine, idle: the kernel runs about 0.8G units/s on MiniMalloc's D and
# J, which spend this budget (23.6e9 units) in about 30 s, `memo dsa`'s old default time limit, and 0.47G units/s
# on idealloc's pangu_2.6B (about 50 s; it had 60 s in benchmarks/dsa.py before).
DEFAULT_WORK = 22 << 30
PLAN_WORK = 16 << 30  # `memo plan`: its solves shared 20 s before; a step that reaches LOAD stops early
PHASE_WORK = 256 << 20  # a layer phase's plan (`phases.attach`): under 0.6 s (most pack at LOAD at once), its cap 2 s
ALLOCATOR_WORK = 2 << 30  # a step's plan in `memo train --arena`: ~3 s at most
# The safety net: 20 times what the default work takes on D and J (12 on pangu); the project's 2-core machine, shared
# by other jobs at a load of 9, took D 9 times as long as alone.
SAFETY_SECONDS = 600.0
WORK_HELP = (
    "search budget in kernel work units (K/M/G suffixes; a 2-core CPU does about 0.5-0.8G a second): the same "
    "input gives the same plan on any machine at any load (default: %(default)s)"
)
TIME_LIMIT_HELP = (
    "safety cap in seconds, far above what --work takes; a solve it cuts says so, as its plan then depends on the "
    "machine's speed and load (default: %(default)s)"
)


def work_value(text: str) -> int:
    """Returns a `--work` budget: a positive count, with binary K/M/G/T suffixes as sizes take."""
    work = parse_size(text)
    if work <= 0:
        raise ValueError(f"`--work` must be a positive number of work units, got {text!r}")
    return work


def describe(work: int, limit: int, clock_cut: bool) -> str:
    """Returns what a solve spent, as the CLI prints it: 'work 3.1G of 22G' (and whether the clock cut it)."""
    cut = ", cut by --time-limit: not reproducible" if clock_cut else ""
    return f"work {work / (1 << 30):.1f}G of {format_count(limit)}{cut}"


@dataclass
class Budget:
    """What a solve has left: kernel work, and a deadline on the clock (None: none) that only a safety net reads."""

    deadline: float | None
    work: int
    clock_cut: bool = False  # the deadline, not the work, ended a step

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.perf_counter()

    def clock_spent(self) -> bool:
        """Returns whether the deadline has passed, and remembers that it cut the solve if so."""
        seconds = self.seconds_left()
        self.clock_cut |= seconds is not None and seconds <= 0.05
        return self.clock_cut

    def spent(self) -> bool:
        return self.work <= 0 or self.clock_spent()
