"""Stream ordering of the activation store, checked on CPU by a vector-clock race detector.

The stream and event functions of `memo.device` are replaced by fakes that keep one vector clock per stream
(the idea of torch.cuda._sanitizer). A dispatch mode logs which bytes of the two rounding buffers (with their
tile slots) and the host pool every aten op reads or writes, and on which stream; two accesses to the same byte, one of them a
write, on different streams, are a race unless the later one's stream had waited for the earlier one.
On CPU every op still runs at once in program order, so the fakes change no arithmetic.
"""

import contextlib
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memo import ActivationPolicy, ModelConfig, Transformer
from memo import device as dev
from memo.swap import ActivationStore, SlotTiles

SEQ, STEPS = 32, 3
MAX_STREAMS = 8  # the compute stream plus the engine's side streams, with room for one resize


class FakeStream:
    """A stream as a vector clock: entry j counts the ops of stream j known to precede its next op."""

    def __init__(self, name: str, index: int):
        self.name, self.index = name, index
        self.clock = np.zeros(MAX_STREAMS, dtype=np.int32)

    def tick(self) -> int:
        """Returns the position of a newly issued op in this stream's program order (from 1)."""
        self.clock[self.index] += 1
        return int(self.clock[self.index])


@dataclass(frozen=True)
class FakeEvent:
    """An event: its stream's clock when it was recorded."""

    stream: FakeStream
    clock: np.ndarray


class FakeStreams:
    """Recording stand-ins for `memo.device`'s stream and event functions, for any device."""

    def __init__(self):
        self.all = [FakeStream("compute", 0)]
        self.current = self.all[0]
        self._dropped: str | None = None

    def new_stream(self, device) -> FakeStream:
        assert len(self.all) < MAX_STREAMS
        stream = FakeStream(f"side stream {len(self.all)}", len(self.all))
        self.all.append(stream)
        return stream

    @contextlib.contextmanager
    def on_stream(self, stream: FakeStream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def record_event(self, device, stream: FakeStream | None = None) -> FakeEvent:
        stream = stream if stream is not None else self.current
        return FakeEvent(stream, stream.clock.copy())

    def wait_event(self, event: FakeEvent | None, stream: FakeStream | None = None, device=None) -> None:
        if event is None or event.stream.name == self._dropped:
            return
        waiter = stream if stream is not None else self.current
        np.maximum(waiter.clock, event.clock, out=waiter.clock)

    def synchronize(self, device) -> None:
        joined = np.max([s.clock for s in self.all], axis=0)
        for stream in self.all:
            stream.clock[:] = joined

    @contextlib.contextmanager
    def dropping_waits_on(self, stream_name: str):
        """Makes `wait_event` skip events recorded on the named stream: a schedule with those waits deleted."""
        self._dropped = stream_name
        try:
            yield
        finally:
            self._dropped = None

    def install(self, monkeypatch) -> None:
        for name in ("new_stream", "on_stream", "record_event", "wait_event", "synchronize"):
            monkeypatch.setattr(dev, name, getattr(self, name))


@dataclass(frozen=True)
class Access:
    op: str
    stream: FakeStream
    tick: int
    write: bool
    region: str
    step: int
    phase: str

    def __str__(self) -> str:
        return f"{self.op} {'write' if self.write else 'read'} on {self.stream.name} (step {self.step}, {self.phase})"


@dataclass(frozen=True)
class Race:
    earlier: Access
    later: Access
    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.later.region}[{self.lo}:{self.hi}): {self.later} not ordered after {self.earlier}"

    @property
    def kind(self) -> tuple[str, str, str, str]:
        """Returns (earlier stream, read/write, later stream, read/write)."""
        rw = ("read", "write")
        return self.earlier.stream.name, rw[self.earlier.write], self.later.stream.name, rw[self.later.write]


class Shadow:
    """Per byte of one tracked storage: its last write and, per stream, its last read since that write.

    Checking a new access against these alone finds a race whenever any earlier access races with it:
    an access before the last write that was ordered before it is ordered before anything after it.
    """

    def __init__(self, name: str, nbytes: int, n_streams: int):
        self.name, self.n_streams = name, n_streams
        self.write_stream = np.full(nbytes, -1, dtype=np.int32)
        self.write_tick = np.zeros(nbytes, dtype=np.int32)
        self.write_id = np.full(nbytes, -1, dtype=np.int32)
        self.read_tick = np.zeros((n_streams, nbytes), dtype=np.int32)
        self.read_id = np.full((n_streams, nbytes), -1, dtype=np.int32)

    def unordered(self, lo: int, hi: int, access: Access) -> tuple[np.ndarray, np.ndarray]:
        """Returns (earlier access ids, byte offsets) of the conflicting accesses `access` is not ordered after."""
        clock, s = access.stream.clock[: self.n_streams], access.stream.index
        writer, wtick = self.write_stream[lo:hi], self.write_tick[lo:hi]
        racing_write = (writer >= 0) & (writer != s) & (wtick > clock[writer])
        ids, offsets = [self.write_id[lo:hi][racing_write]], [np.flatnonzero(racing_write) + lo]
        if access.write:
            racing_read = self.read_tick[:, lo:hi] > clock[:, None]
            racing_read[s] = False
            streams, at = np.nonzero(racing_read)
            ids.append(self.read_id[:, lo:hi][streams, at])
            offsets.append(at + lo)
        return np.concatenate(ids), np.concatenate(offsets)

    def record(self, lo: int, hi: int, access: Access, access_id: int) -> None:
        s = access.stream.index
        if access.write:
            self.write_stream[lo:hi], self.write_tick[lo:hi], self.write_id[lo:hi] = s, access.tick, access_id
            self.read_tick[:, lo:hi], self.read_id[:, lo:hi] = 0, -1
        else:
            self.read_tick[s, lo:hi], self.read_id[s, lo:hi] = access.tick, access_id


def tensor_accesses(func, args, kwargs):
    """Yields (tensor, is_write) for each tensor whose bytes the op reads or writes.

    Writes are the arguments the schema marks mutated (in-place and out=); a view only aliases its input
    and a `*_like`/`new_*` factory only reads its shape, so neither is an access.
    """
    name = func._schema.name.split("::")[-1]
    if name.startswith("new_") or name.endswith("_like"):
        return
    for i, arg in enumerate(func._schema.arguments):
        alias = arg.alias_info
        if alias is not None and not alias.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.numel():
                yield leaf, alias is not None


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """Returns [lo, hi): the bytes of t's storage between its first and one past its last element."""
    lo = t.data_ptr() - t.untyped_storage().data_ptr()
    last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * t.element_size()


class RaceDetector(TorchDispatchMode):
    """Logs every aten op's accesses to the engine's rounding buffers and host pool and collects the races."""

    def __init__(self, streams: FakeStreams):
        super().__init__()
        self.streams = streams
        self.shadows: dict[int, Shadow] = {}  # by storage data_ptr
        self.accesses: list[Access] = []
        self.races: list[Race] = []
        self.step, self.phase = 0, "before the first step"

    def watch(self, engine: ActivationStore) -> None:
        """Labels accesses with the step and layer phase, and tracks the engine's buffers once sized."""

        def labelled(method, phase: str):
            def call(index, *args):
                self.step, self.phase = engine.step, f"{phase} of layer {index}"
                return method(index, *args)

            return call

        engine.slots = labelled(engine.slots, "forward")
        engine.after_forward = labelled(engine.after_forward, "offload")
        engine.before_backward = labelled(engine.before_backward, "backward")
        begin_step = engine.begin_step

        def begin_and_track(*args):
            begin_step(*args)
            self.track(engine)

        engine.begin_step = begin_and_track
        refill = engine._refill

        def refill_and_track(buffers):  # emptied buffers come back in new bytes (`empty_buffers`)
            refill(buffers)
            if engine._buffers:
                self.track(engine)

        engine._refill = refill_and_track

    def track(self, engine: ActivationStore) -> None:
        """Shadows the rounding buffers and host pool (a storage in new bytes anew: after a resize, or emptied
        buffers given their bytes back); names the engine's streams."""
        storages = {
            f"rounding buffer {i}": next(iter(kinds[0].values())).untyped_storage()  # every kind's views: one storage
            for i, kinds in enumerate(engine._buffers)
        }
        storages["host pool"] = engine.pool.buffer.untyped_storage()
        n_streams, before = len(self.streams.all), self.shadows
        self.shadows = {}
        for name, s in storages.items():
            kept = before.get(s.data_ptr())
            self.shadows[s.data_ptr()] = kept if kept and kept.name == name else Shadow(name, s.nbytes(), n_streams)
        offload, prefetch, tile = engine._streams
        offload.name, prefetch.name, tile.name = "offload", "prefetch", "tile"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        touched = [(t, w) for t, w in tensor_accesses(func, args, kwargs) if self._shadow(t) is not None]
        if touched:
            stream = self.streams.current
            tick = stream.tick()  # one op: its reads and writes share a place in the stream's order
            for tensor, write in touched:
                shadow = self._shadow(tensor)
                access = Access(str(func.overloadpacket), stream, tick, write, shadow.name, self.step, self.phase)
                self._check(shadow, *byte_span(tensor), access)
        return func(*args, **kwargs)

    def _shadow(self, t: torch.Tensor) -> Shadow | None:
        return self.shadows.get(t.untyped_storage().data_ptr())

    def _check(self, shadow: Shadow, lo: int, hi: int, access: Access) -> None:
        ids, offsets = shadow.unordered(lo, hi, access)
        for earlier in np.unique(ids):
            at = offsets[ids == earlier]
            self.races.append(Race(self.accesses[earlier], access, int(at.min()), int(at.max()) + 1))
        shadow.record(lo, hi, access, len(self.accesses))
        self.accesses.append(access)


def make_model(preset: str, policy: ActivationPolicy) -> Transformer:
    torch.manual_seed(0)
    n_layers = len(policy.plan) if policy.plan else 4
    return Transformer(ModelConfig.preset(preset, n_layers=n_layers), policy)


def train(model: Transformer, batch: int) -> list[torch.Tensor]:
    """Returns the losses of STEPS forward+backward passes on fixed tokens (gradients accumulate)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, SEQ), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(STEPS):
        loss = model(ids, labels=ids)
        loss.backward()
        losses.append(loss.detach())
    return losses


@pytest.fixture
def streams(monkeypatch) -> FakeStreams:
    fakes = FakeStreams()
    fakes.install(monkeypatch)
    return fakes


def detect(model: Transformer, batch: int, streams: FakeStreams) -> tuple[RaceDetector, list[torch.Tensor]]:
    """Returns the detector after training `model` STEPS steps under it, and the losses."""
    detector = RaceDetector(streams)
    detector.watch(model.store)
    with detector:
        losses = train(model, batch)
    return detector, losses


def drop_waits(monkeypatch, cls: type, method: str, recorded_on: str, streams: FakeStreams) -> None:
    """Makes `cls.method` skip its waits for events recorded on stream `recorded_on`.

    The rest of the method is swap.py's own, so the check keeps up with changes to the store.
    """
    original = getattr(cls, method)

    def without_wait(self, *args, **kwargs):
        with streams.dropping_waits_on(recorded_on):
            return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, without_wait)


def report(races: list[Race]) -> str:
    return f"{len(races)} races, first ones:\n" + "\n".join(map(str, races[:10]))


# what each stream reads (False) and writes (True): layers compute in the rounding buffers, the offload
# stream copies them to the host pool, the prefetch stream copies the host pool back, the tile stream copies
# tile slots to the host pool (forward) and back (backward)
BUFFERS = ("rounding buffer 0", "rounding buffer 1")
DATA_FLOW = {
    *{("compute", buf, w) for buf in BUFFERS for w in (False, True)},
    *{("offload", buf, False) for buf in BUFFERS},
    ("offload", "host pool", True),
    ("prefetch", "host pool", False),
    *{("prefetch", buf, True) for buf in BUFFERS},
    *{("tile", buf, w) for buf in BUFFERS for w in (False, True)},
    *{("tile", "host pool", w) for w in (False, True)},
}
INPUT_BACK = ("compute", "host pool", False)  # gradient_over_input: a layer input back into q's bytes

CASES = {
    "tiny-last-two-on-device": ("tiny", ActivationPolicy("memo", alpha=0.5), 2),
    "tiny-tiled": ("tiny", ActivationPolicy("memo", alpha=0.5, tile_tokens=6), 2),
    "tiny-gpt-tiled-plan": (
        "tiny-gpt",
        ActivationPolicy("memo", alpha=0.6, plan=("checkpoint", "memo", "keep", "memo", "memo", "memo"), tile_tokens=5),
        2,
    ),
    "tiny-all-offloaded": ("tiny", ActivationPolicy("memo", alpha=0.5, offload_last_layers=True), 1),
    "tiny-emptied-buffers": ("tiny", ActivationPolicy("memo", alpha=0.5, tile_tokens=6, empty_buffers=True), 2),
    "tiny-emptied-buffers-shared": (  # the lowest three layers hold one buffer
        "tiny",
        ActivationPolicy("memo", alpha=0.5, tile_tokens=6, empty_buffers=True, shared_layers=3, plan=("memo",) * 6),
        2,
    ),
    "tiny-gradient-over-input": (
        "tiny",
        ActivationPolicy("memo", alpha=0.5, tile_tokens=6, empty_buffers=True, gradient_over_input=True),
        2,
    ),
    "tiny-gpt-last-two-on-device": ("tiny-gpt", ActivationPolicy("memo", alpha=0.5), 1),
    "tiny-gpt-all-offloaded": ("tiny-gpt", ActivationPolicy("memo", alpha=0.5, offload_last_layers=True), 2),
    "tiny-uneven-alpha-all-offloaded": (
        "tiny",
        ActivationPolicy("memo", alpha=[0.0, 0.55, 1.0, 0.3], offload_last_layers=True, tile_tokens=12),
        2,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_swap_engine_orders_every_cross_stream_access_without_changing_gradients(case, streams, monkeypatch):
    """Each read and write of a rounding buffer or host slot in three steps waits for the other streams'
    conflicting accesses; the check is not vacuous (all three streams move bytes) and changes no number."""
    preset, policy, batch = CASES[case]
    model = make_model(preset, policy)
    detector, losses = detect(model, batch, streams)
    assert detector.races == [], report(detector.races)

    per_stream = Counter(a.stream.name for a in detector.accesses)
    assert all(per_stream[name] > 0 for name in ("compute", "offload", "prefetch", "tile")), per_stream
    flow = DATA_FLOW | ({INPUT_BACK} if policy.gradient_over_input else set())
    assert {(a.stream.name, a.region, a.write) for a in detector.accesses} == flow
    assert {a.step for a in detector.accesses} == set(range(1, STEPS + 1))

    monkeypatch.undo()  # the same run on the real (synchronous CPU) device functions
    reference = make_model(preset, policy)
    torch.testing.assert_close(losses, train(reference, batch), rtol=0, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


DELETED_WAITS = {
    # layer index overwrites rounding buffer index%2 while layer index-2's offload may still read it
    "slots-offload-event-last-two-on-device": (
        ActivationStore, "slots", "offload", False, ("offload", "read", "compute", "write")
    ),
    "slots-offload-event-all-offloaded": (
        ActivationStore, "slots", "offload", True, ("offload", "read", "compute", "write")
    ),
    # the prefetch for layer index-1 overwrites the rounding buffer layer index+1's backward may still read
    "prefetch-compute-event": (ActivationStore, "_prefetch", "compute", False, ("compute", "read", "prefetch", "write")),
    # a last layer keeps its buffer for its backward, but its offload must end before layer index-2's prefetch
    # (ordered after this layer's backward) writes the buffer
    "backward-offload-event-all-offloaded": (
        ActivationStore, "before_backward", "offload", True, ("offload", "read", "prefetch", "write")
    ),
    # a tile's compute overwrites its slot while the copy of the tile two before may still read it
    "tile-slot-copy-event": (SlotTiles, "_take", "tile", False, ("tile", "read", "compute", "write")),
    # a tile copy reads its slot before the compute stream has written it
    "tile-copy-compute-event": (SlotTiles, "_copy", "compute", False, ("compute", "write", "tile", "read")),
}


@pytest.mark.parametrize("deleted", list(DELETED_WAITS))
def test_deleting_one_wait_from_the_schedule_is_reported_as_a_race(deleted, streams, monkeypatch):
    """The detector catches a schedule that is one wait short, and names the two streams and accesses."""
    cls, method, recorded_on, offload_last_layers, expected = DELETED_WAITS[deleted]
    policy = ActivationPolicy("memo", alpha=0.5, offload_last_layers=offload_last_layers, tile_tokens=8)
    model = make_model("tiny", policy)
    drop_waits(monkeypatch, cls, method, recorded_on, streams)
    races = detect(model, 2, streams)[0].races
    assert expected in {r.kind for r in races}, report(races)
