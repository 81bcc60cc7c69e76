"""A step's allocation trace at any length from the traces of two shorter ones, a unit of tokens apart, and what the
cost model reads of it (its LOAD, the bytes its memory-bound ops write, the caching allocator's overhead) without
writing it out.

Tracing costs its op calls, and a step makes a pass of each token loop per tile (per chunk, the loss). Two lengths
a unit apart (whole tiles, even in number so that α's split falls at the same row of its tile; whole loss chunks),
with the same remainder, trace the same step but for more passes, once the shorter makes two passes of each loop
at least: a loop's first pass frees nothing of a pass before it and its second frees what the first made, so only
the passes after those are alike (`growth` refuses added passes that are not). Cut at the marks that start each pass
(`trace_iteration(tiles=True)`), the two traces are the same pieces in the same order: a piece repeated more times
where a loop runs longer, a piece whose sizes and distances (from an allocation to its free) change by the same
amount per unit where they span the sequence, and the loss, whose chunk loop is not marked, longer by its chunks.
`growth` reads that difference off the two traces; its `program` is the trace any number of units further as
pieces and repeat counts, which `measure` replays pass by pass until a pass leaves everything as an earlier pass of
the run did (the rest repeat that cycle). Tests compare both with direct traces of longer steps, event by event.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

from .caching_sim import CachingAllocator
from .trace import TILE, TILES_DONE, Event, Trace

Program = list[tuple[tuple, int]]  # pieces of tokens, each with how many times it runs in a row
WATCHED = 128  # passes of a run whose states are compared: a run repeats from its first few passes or never
FEW = 64  # tokens left in a run below which replaying them costs less than comparing states


def program(trace_tokens: list[tuple]) -> Program:
    """Returns a trace's tokens (`tokens`) as a program: cut before every mark, runs of equal pieces counted."""
    return [(piece, count) for piece, count in _items(trace_tokens)]


@dataclass(frozen=True)
class Growth:
    """How each item of a program grows per unit of tokens: ("run", piece, count, more per unit), ("scale", piece,
    the piece a unit on) or ("insert", piece, the piece a unit on, where the unit's tokens go in)."""

    items: tuple

    def program(self, units: int) -> Program:
        """Returns the program `units` units past the shorter trace."""
        return [part for item in self.items for part in _grown(item, units)]


def growth(a: list[tuple], b: list[tuple]) -> Growth | None:
    """Returns how the trace of tokens `b` (`tokens`), a unit longer than `a`, grows from it, or None when they do not
    differ as passes of the same loops do."""
    short, long = _items(a), _items(b)
    if len(short) != len(long):
        return None
    items = []
    for (pa, ca), (pb, cb) in zip(short, long):
        if pa == pb and cb >= ca:
            items.append(("run", pa, ca, cb - ca))
        elif ca == cb == 1 and len(pa) == len(pb) and _same_shape(pa, pb):
            items.append(("scale", pa, pb))
        elif (
            ca == cb == 1
            and len(pa) < len(pb)
            and (at := _insertion(pa, pb)) is not None
            and _repeats(pb, at, len(pb) - len(pa))
        ):
            items.append(("insert", pa, pb, at))
        else:
            return None
    return Growth(tuple(items))


def events(p: Program) -> Trace | None:
    """Returns the trace of a program without its tile marks (tensor ids in allocation order, as a Tracer numbers
    them), or None if a free does not point at a live allocation."""
    trace, live, tensors, i = Trace(), {}, 0, 0  # live: token index of an allocation -> (tensor id, bytes)
    for piece, times in p:
        for token in piece * times:
            kind = token[0]
            if kind == "alloc":
                if token[2] <= 0:
                    return None
                live[i] = (tensors, token[2])
                trace.events.append(Event("alloc", tensors, token[2], token[1]))
                tensors += 1
            elif kind == "free":
                born = live.pop(i - token[2], None)
                if born is None:
                    return None
                trace.events.append(Event("free", *born, token[1]))
            elif token[1] not in (TILE, TILES_DONE):
                trace.events.append(Event("mark", -1, 0, token[1]))
            i += 1
    return trace


def tokens(t: Trace) -> list[tuple]:
    """Returns each event as a token that holds no position: ("alloc", op, bytes), ("free", op, events back to its
    allocation) or ("mark", label, 0)."""
    born, tokens = {}, []
    for i, e in enumerate(t.events):
        if e.kind == "alloc":
            born[e.tensor] = i
            tokens.append(("alloc", e.op, e.nbytes))
        elif e.kind == "free":
            tokens.append(("free", e.op, i - born[e.tensor]))
        else:
            tokens.append(("mark", e.op, 0))
    return tokens


def _items(tokens: list[tuple]) -> list[list]:
    """Returns the tokens cut before every mark into pieces, runs of equal pieces as [piece, count]."""
    cuts = [0, *(i for i, t in enumerate(tokens) if t[0] == "mark" and i), len(tokens)]
    items: list[list] = []
    for lo, hi in zip(cuts, cuts[1:]):
        piece = tuple(tokens[lo:hi])
        if items and items[-1][0] == piece:
            items[-1][1] += 1
        else:
            items.append([piece, 1])
    return items


def _same_shape(pa: tuple, pb: tuple) -> bool:
    """Returns whether two pieces differ in sizes and distances only: the kinds, ops and labels are the same."""
    return all(x[:2] == y[:2] for x, y in zip(pa, pb))


def _insertion(pa: tuple, pb: tuple) -> int | None:
    """Returns where in `pa` the tokens a unit adds go (`pb` is `pa` with them), or None: of the places that keep
    every token's kind and op, the one that changes fewest tokens' sizes and distances (inside a run of equal
    passes, where any place is as good)."""
    grown = len(pb) - len(pa)
    head = next((i for i, (x, y) in enumerate(zip(pa, pb)) if x[:2] != y[:2]), len(pa))
    tail = next((i for i, (x, y) in enumerate(zip(reversed(pa), reversed(pb))) if x[:2] != y[:2]), len(pa))
    if len(pa) - tail > head:
        return None
    before = [0, *accumulate(x != y for x, y in zip(pa, pb))]  # tokens changed in front of each place
    after = [*accumulate((x != y for x, y in zip(reversed(pa), reversed(pb[grown:]))), initial=0)][::-1]
    return min(range(len(pa) - tail, head + 1), key=lambda i: before[i] + after[i])


def _repeats(pb: tuple, at: int, grown: int) -> bool:
    """Returns whether the tokens a unit adds (`pb[at:at + grown]`) can follow themselves: each that frees an
    allocation made before them would, one repetition on, free an allocation like it made in the repetition before.
    A loop's second pass, which frees what its first (shorter) pass made, cannot: the passes a longer step repeats
    free what a pass like themselves made."""
    for j in range(at, at + grown):
        kind, _, back = pb[j]
        if kind == "free" and j - back < at and (j - back + grown < 0 or pb[j - back + grown] != pb[j - back]):
            return False
    return True


def _grown(item: tuple, units: int) -> Program:
    """Returns one item `units` units past the shorter trace, as program parts."""
    if item[0] == "run":
        _, piece, count, more = item
        return [(piece, count + more * units)]
    if item[0] == "scale":
        return [(tuple(_scaled(x, y, units) for x, y in zip(item[1], item[2])), 1)]
    _, pa, pb, at = item
    grown = len(pb) - len(pa)
    head = tuple(_scaled(x, y, units) for x, y in zip(pa[:at], pb[:at]))
    tail = tuple(_scaled(x, y, units) for x, y in zip(pa[at:], pb[at + grown :]))
    return [(head, 1), (pb[at : at + grown], units), (tail, 1)]


def _scaled(x: tuple, y: tuple, units: int) -> tuple:
    """Returns token `x` `units` units on, `y` being it one unit on: its size or distance changed as from x to y."""
    return x if x == y else (*x[:2], x[2] + (y[2] - x[2]) * units)


@dataclass(frozen=True)
class Measure:
    """What the cost model reads of a step: its LOAD, the bytes its memory-bound ops write inside the layers'
    forward and backward windows (`trace.windows`) and outside them, and the caching allocator's reserved beyond its
    allocated peak (0 when not asked)."""

    load: int
    written_in_layers: int
    written_outside: int
    overhead: int


def measure(p: Program, written: Callable[[str], bool], allocator: str | None = None) -> Measure:
    """Returns the `Measure` of a program; `written` says whether an op's output counts as memory-bound bytes;
    `allocator` is None, "caching" or "expandable" (`plan.caching_sim`'s replay, with expandable segments)."""
    run = _Replay(p, written, allocator)
    for piece, times in p:
        run.piece(piece, times)
    sim = run.sim_peaks
    return Measure(run.load, run.written[True], run.written[False], sim[1] - sim[0])


class _Replay:
    """The state of a program's replay: live allocations by token index, bytes live, the layer windows open, and the
    caching allocator's blocks."""

    def __init__(self, p: Program, written: Callable[[str], bool], allocator: str | None) -> None:
        self.counts = {}  # op -> whether its bytes are written (each op asked once)
        self.is_written = written
        self.closing = _closed_windows(p)
        self.position = self.live_bytes = self.load = 0
        self.live: dict[int, tuple] = {}  # token index -> (bytes, block)
        self.open: set = set()
        self.written = {True: 0, False: 0}  # in a layer window, outside
        self.sim = None if allocator is None else CachingAllocator(expandable_segments=allocator == "expandable")
        self.sim_peaks = [0, 0]  # allocated, reserved

    def piece(self, piece: tuple, times: int) -> None:
        """Runs `piece` `times` times; once a pass leaves the state as an earlier pass of the run left it (seen from
        the start of the run), skips the whole cycles of passes left: each would do what the cycle did."""
        start, seen = self.position, {}
        for done in range(1, times + 1):
            self._pass(piece)
            if done > WATCHED or len(piece) * (times - done) < FEW:
                continue  # a run that has not settled in its first passes is replayed whole
            state = self._state(start)
            if state in seen:
                first, written = seen[state]
                cycles = (times - done) // (done - first)
                grown = {k: (v - written[k]) * cycles for k, v in self.written.items()}
                self._skip(start, len(piece) * (done - first) * cycles, grown)
                for _ in range(times - done - cycles * (done - first)):
                    self._pass(piece)
                return
            seen[state] = done, dict(self.written)

    def _pass(self, piece: tuple) -> None:
        """Runs the tokens of one pass (the replay's inner loop: locals only)."""
        live, sim, counts, written, peaks = self.live, self.sim, self.counts, self.written, self.sim_peaks
        position, live_bytes, load = self.position, self.live_bytes, self.load
        for kind, op, value in piece:
            if kind == "alloc":
                block = None if sim is None else sim.malloc(value)
                live[position] = (value, block)
                live_bytes += value
                load = max(load, live_bytes)
                counted = counts.get(op)
                if counted is None:
                    counted = counts[op] = self.is_written(op)
                if counted:
                    written[bool(self.open)] += value
            elif kind == "free":
                nbytes, block = live.pop(position - value)
                live_bytes -= nbytes
                if block is not None:
                    sim.release(block)
            else:
                self._mark(op)
            if sim is not None:
                peaks[0], peaks[1] = max(peaks[0], sim.allocated), max(peaks[1], sim.reserved)
            position += 1
        self.position, self.live_bytes, self.load = position, live_bytes, load

    def _mark(self, label) -> None:
        if isinstance(label, tuple):
            phase, layer, edge = label
            if edge == "start" and (phase, layer) in self.closing:
                self.open.add((phase, layer))
            elif edge != "start":
                self.open.discard((phase, layer))

    def _state(self, start: int) -> tuple:
        """Returns what the next pass depends on: allocations before the run by index, those of the run by distance
        back, their blocks, the allocator's free blocks and totals."""
        live = tuple(
            sorted(
                (("at", i) if i < start else ("back", self.position - i), nbytes, _where(block))
                for i, (nbytes, block) in self.live.items()
            )
        )
        sim = self.sim
        held = None if sim is None else (sim.allocated, sim.reserved, tuple(sim.free[True]), tuple(sim.free[False]))
        return live, held, self.live_bytes, frozenset(self.open)

    def _skip(self, start: int, shift: int, written: dict) -> None:
        """Moves `shift` tokens on in a run whose passes repeat, writing `written` bytes: the run's live allocations
        move along."""
        self.live = {(i + shift if i >= start else i): v for i, v in self.live.items()}
        self.position += shift
        for k, v in written.items():
            self.written[k] += v


def _where(block) -> tuple | None:
    return None if block is None else (block.address, block.size)


def _closed_windows(p: Program) -> set:
    """Returns the layer windows that end in the program (`trace.windows` keeps only those)."""
    started, closed = set(), set()
    for piece, _ in p:
        for token in piece:
            if token[0] == "mark" and isinstance(token[1], tuple):
                phase, layer, edge = token[1]
                if edge == "start":
                    started.add((phase, layer))
                elif (phase, layer) in started:
                    closed.add((phase, layer))
    return closed
