"""Where skeletal tensors live between a layer's forward and its backward, one store per strategy.

`KeepStore` (none) keeps them on the device; `RecomputeStore` (full) keeps only layer inputs; `SwapEngine`
(memo, memo-method.md §3-4) keeps two device rounding buffers, a pinned host pool with one slot per
offloaded layer, an offload and a prefetch stream, and prefetches one layer ahead in backward.

Every store has the same interface, called by `LayerFunction`:
`begin_step` → per layer `slots` / `after_forward` → per layer (reverse) `before_backward` / `after_backward`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from . import device as dev
from .layer import DecoderLayer, Recompute, SkeletalSpec, bytes_by_role
from .policy import ActivationPolicy, AlphaProblem, solve_alpha, split_row
from .units import format_bytes

log = logging.getLogger(__name__)

ALIGN = 512  # bytes; keeps every view aligned for vectorised kernels and DMA


@dataclass
class SwapStats:
    """What one step did, for metrics."""

    bytes_offloaded: int = 0
    bytes_prefetched: int = 0
    bytes_recomputed: int = 0
    tokens_recomputed: int = 0
    host_pool_bytes: int = 0
    host_pool_peak: int = 0
    device_skeletal_bytes: int = 0
    alphas: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def pack_layout(specs: dict[str, SkeletalSpec]) -> tuple[dict[str, int], int]:
    """Returns (byte offset of each tensor, total bytes) for laying `specs` out back to back, aligned."""
    offsets, end = {}, 0
    for name, spec in specs.items():
        offsets[name] = end
        end += -(-spec.nbytes // ALIGN) * ALIGN
    return offsets, end


def carve(buffer: torch.Tensor, offsets: dict[str, int], specs: dict[str, SkeletalSpec]) -> dict[str, torch.Tensor]:
    """Returns typed views of the byte `buffer`, one per spec, at `offsets`."""
    return {
        name: buffer[offsets[name] : offsets[name] + spec.nbytes].view(spec.dtype).view(spec.shape)
        for name, spec in specs.items()
    }


def other_rows_bytes(specs: dict[str, SkeletalSpec], n_rows: int) -> int:
    """Returns the bytes of `n_rows` token rows of the token-split ("other") skeletal tensors."""
    return sum(sp.rows(n_rows).nbytes for sp in specs.values() if sp.role == "other")


class ActivationStore:
    """Shared bookkeeping: the step counter that guards against a backward reading another step's tensors."""

    def __init__(self, policy: ActivationPolicy, n_layers: int):
        self.policy, self.n_layers = policy, n_layers
        self.step = 0
        self.stats = SwapStats()
        self.specs: dict[str, SkeletalSpec] = {}
        self._shape: tuple | None = None

    def begin_step(self, layers, batch: int, seq: int, dtype: torch.dtype, device: torch.device) -> None:
        """Starts a forward pass; (re)sizes buffers when the input shape or dtype changes."""
        self.step += 1
        shape = (batch, seq, dtype, torch.device(device))
        if shape != self._shape:
            self.specs = layers[0].skeletal_specs(batch, seq, dtype, device)
            self._reserve(layers, batch, seq, dtype, torch.device(device))
            self._shape = shape
        self.stats = SwapStats(
            host_pool_bytes=self.stats.host_pool_bytes,
            device_skeletal_bytes=self.stats.device_skeletal_bytes,
            alphas=self.stats.alphas,
        )

    def _reserve(self, layers, batch, seq, dtype, device) -> None:
        pass

    def _check_step(self, index: int, step: int) -> None:
        if step != self.step:
            raise RuntimeError(
                f"layer {index}: backward of step {step} after the forward of step {self.step}; "
                "run backward before the next forward (one forward per backward)"
            )

    def after_forward(self, index: int, aux: tuple) -> None:
        pass

    def after_backward(self, index: int) -> None:
        pass


class KeepStore(ActivationStore):
    """Strategy `none`: each layer's skeletal tensors are fresh device tensors kept until its backward."""

    def __init__(self, policy, n_layers):
        super().__init__(policy, n_layers)
        self._kept: dict[int, tuple[dict, tuple]] = {}

    def _reserve(self, layers, batch, seq, dtype, device) -> None:
        self.stats.device_skeletal_bytes = self.n_layers * sum(sp.nbytes for sp in self.specs.values())

    def slots(self, index: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
        t = {n: torch.empty(sp.shape, dtype=sp.dtype, device=x.device) for n, sp in self.specs.items() if n != "x"}
        t["x"] = x
        self._kept[index] = (t, ())
        return t

    def after_forward(self, index, aux) -> None:
        self._kept[index] = (self._kept[index][0], aux)

    def before_backward(self, index: int, step: int):
        self._check_step(index, step)
        t, aux = self._kept.pop(index)
        return t, aux, None


class RecomputeStore(ActivationStore):
    """Strategy `full`: keeps each layer's input; everything else is rebuilt in one shared scratch area."""

    def __init__(self, policy, n_layers):
        super().__init__(policy, n_layers)
        self._inputs: dict[int, torch.Tensor] = {}
        self._scratch: dict[str, torch.Tensor] = {}

    def _reserve(self, layers, batch, seq, dtype, device) -> None:
        others = {n: sp for n, sp in self.specs.items() if n != "x"}
        offsets, total = pack_layout(others)
        self._scratch = carve(torch.empty(total, dtype=torch.uint8, device=device), offsets, others)
        self.stats.device_skeletal_bytes = self.n_layers * self.specs["x"].nbytes + total

    def slots(self, index: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self._inputs[index] = x
        return {**self._scratch, "x": x}

    def before_backward(self, index: int, step: int):
        self._check_step(index, step)
        self.stats.bytes_recomputed += sum(sp.nbytes for n, sp in self.specs.items() if n != "x")
        self.stats.tokens_recomputed += self.specs["x"].shape[0] * self.specs["x"].shape[1]
        return {**self._scratch, "x": self._inputs.pop(index)}, None, Recompute(0, attention=True)


class HostPool:
    """One host allocation (pinned for CUDA) sized up front with a byte cap, carved into per-layer slots."""

    def __init__(self, nbytes: int, cap: int, device: torch.device):
        if nbytes > cap:
            raise ValueError(
                f"the pinned host pool needs {format_bytes(nbytes)} but the host budget is {format_bytes(cap)}; "
                "lower `--alpha`, keep more layers on device, or raise `--host-budget`"
            )
        self.cap, self.nbytes = cap, nbytes
        self.host = dev.HostBuffer(nbytes, device)
        self.buffer = self.host.data
        self.in_use = 0
        self.peak = 0

    def occupy(self, nbytes: int) -> None:
        """Marks `nbytes` of slots as holding data; the pool can never hold more than its cap."""
        if self.in_use + nbytes > self.cap:
            raise RuntimeError(f"host pool over its cap: {self.in_use + nbytes} > {self.cap} bytes")
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)

    def release(self, nbytes: int) -> None:
        self.in_use -= nbytes

    def close(self) -> None:
        """Unpins the pool once the device has finished every copy into or out of it."""
        self.host.release()


class SwapEngine(ActivationStore):
    """Strategy `memo`: layer-wise offload with token-wise swap/recompute (memo-method.md §3-4)."""

    def __init__(self, policy, n_layers):
        super().__init__(policy, n_layers)
        self.offloaded = set(policy.offloaded_layers(n_layers))
        self.reloaded = set(policy.reloaded_layers(n_layers))
        self.pool: HostPool | None = None
        self._buffers: list[dict[str, torch.Tensor]] = []
        self._host: dict[int, dict[str, torch.Tensor]] = {}
        self._split: list[int] = []
        self._aux: dict[int, tuple] = {}
        self._offload_done: dict[int, object] = {}
        self._prefetch_done: dict[int, object] = {}
        self._device = torch.device("cpu")

    # ---- sizing -----------------------------------------------------------------------------------------
    def _reserve(self, layers, batch, seq, dtype, device) -> None:
        self._drop_buffers()
        self._device = device
        offsets, total = pack_layout(self.specs)
        self._buffers = [
            carve(torch.empty(total, dtype=torch.uint8, device=device), offsets, self.specs) for _ in (0, 1)
        ]
        budget = self.policy.host_budget_bytes or int(0.8 * dev.available_host_bytes())
        alphas = self.policy.layer_alphas(self.n_layers) or self._solve_alphas(layers[0], batch, seq, budget)
        self._split = [split_row(a, seq) for a in alphas]
        host_specs = {i: self._host_specs(self._split[i]) for i in sorted(self.offloaded)}
        layouts = {i: pack_layout(s) for i, s in host_specs.items()}
        self.pool = HostPool(sum(total_i for _, total_i in layouts.values()), budget, device)
        self._host, base = {}, 0
        for i, (offs, size) in layouts.items():
            self._host[i] = carve(self.pool.buffer[base : base + size], offs, host_specs[i])
            base += size
        self._streams = (dev.new_stream(device), dev.new_stream(device))
        self.stats.host_pool_bytes = self.pool.nbytes
        self.stats.device_skeletal_bytes = 2 * total
        self.stats.alphas = [a if i in self.offloaded else 1.0 for i, a in enumerate(alphas)]
        log.info("memo: alpha per layer %s, host pool %s", self.stats.alphas, format_bytes(self.pool.nbytes))

    def _host_specs(self, split: int) -> dict[str, SkeletalSpec]:
        return {n: (sp.rows(split) if sp.role == "other" else sp) for n, sp in self.specs.items()}

    def _solve_alphas(self, layer: DecoderLayer, batch: int, seq: int, budget: int) -> list[float]:
        """Returns α per layer solved from the measured layer time and copy bandwidth (§3)."""
        if self._device.type == "meta":
            raise ValueError("alpha=None needs a real device to measure layer time; give `--alpha` on meta")
        by_role = bytes_by_role(self.specs)
        problem = AlphaProblem(
            input_bytes=by_role["input"],
            attention_bytes=by_role["attention"],
            other_bytes=by_role["other"],
            bandwidth=measure_copy_bandwidth(self._buffers[0]["x"]),
            layer_seconds=measure_layer_seconds(layer, self._buffers[0]),
            host_budget=budget - len(self.offloaded) * len(self.specs) * ALIGN,  # room for slot alignment
            offloaded_layers=len(self.offloaded),
        )
        alpha = solve_alpha(problem)
        log.info("memo: solved alpha=%.3f from %s", alpha, problem)
        return [alpha] * self.n_layers

    # ---- forward ----------------------------------------------------------------------------------------
    def slots(self, index: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Returns rounding buffer index%2 with x copied in, once layer index-2's offload has read it."""
        dev.wait_event(self._offload_done.pop(index - 2, None), device=self._device)
        t = self._buffers[index % 2]
        t["x"].copy_(x)
        return t

    def after_forward(self, index: int, aux: tuple) -> None:
        """Starts the copy of the layer's input, attention output and α token rows to its host slot."""
        self._aux[index] = aux
        if index not in self.offloaded:
            return
        ready = dev.record_event(self._device)
        offload_stream = self._streams[0]
        with dev.on_stream(offload_stream):
            dev.wait_event(ready, offload_stream)
            moved = self._copy_slot(index, to_host=True)
            self._offload_done[index] = dev.record_event(self._device, offload_stream)
        self.pool.occupy(moved)
        self.stats.bytes_offloaded += moved
        self.stats.host_pool_peak = max(self.stats.host_pool_peak, self.pool.peak)

    def _copy_slot(self, index: int, to_host: bool) -> int:
        """Copies layer `index`'s host slot from/to its rounding buffer (kept rows only); returns bytes."""
        host, buf, moved = self._host[index], self._buffers[index % 2], 0
        for name, h in host.items():
            d = buf[name]
            # one contiguous block per sequence: a strided copy would stage through a device temporary
            pairs = zip(h, d[:, : h.shape[1]]) if self.specs[name].role == "other" else [(h, d)]
            for h_part, d_part in pairs:
                (h_part if to_host else d_part).copy_(d_part if to_host else h_part, non_blocking=True)
            moved += h.numel() * h.element_size()
        return moved

    # ---- backward ---------------------------------------------------------------------------------------
    def _prefetch(self, index: int) -> None:
        """Starts the copy of layer `index`'s host slot into its (now free) rounding buffer."""
        if index not in self.reloaded or index in self._prefetch_done:
            return
        ready = dev.record_event(self._device)
        prefetch_stream = self._streams[1]
        with dev.on_stream(prefetch_stream):
            dev.wait_event(ready, prefetch_stream)  # the offload of `index` is before it: layer index+2 waited
            moved = self._copy_slot(index, to_host=False)
            self._prefetch_done[index] = dev.record_event(self._device, prefetch_stream)
        self.stats.bytes_prefetched += moved

    def before_backward(self, index: int, step: int):
        """Returns the layer's full skeletal tensors: prefetched, next layer's prefetch started, rest to rebuild."""
        self._check_step(index, step)
        self._prefetch(index)
        self._prefetch(index - 1)
        recompute = None
        if index in self.offloaded:
            self.pool.release(sum(h.numel() * h.element_size() for h in self._host[index].values()))
        if index in self.offloaded and index not in self.reloaded:
            # nothing to load or rebuild; the offload must still finish reading before layer index-2's
            # prefetch (ordered after this layer's backward) writes the buffer
            dev.wait_event(self._offload_done.pop(index, None), device=self._device)
        elif index in self.reloaded:
            dev.wait_event(self._prefetch_done.pop(index), device=self._device)
            split, seq = self._split[index], self.specs["x"].shape[1]
            if split < seq:
                recompute = Recompute(split)
                self.stats.tokens_recomputed += (seq - split) * self.specs["x"].shape[0]
                self.stats.bytes_recomputed += other_rows_bytes(self.specs, seq - split)
        return self._buffers[index % 2], self._aux.pop(index), recompute

    def _drop_buffers(self) -> None:
        """Frees the buffers of the previous shape (before allocating new ones), once no stream uses them:
        side-stream copies may still read or write them, and the caching allocator only knows the compute
        stream."""
        self._sync_all()
        dev.synchronize(self._device)
        if self.pool is not None:
            self.pool.close()
        self._buffers, self._host, self.pool = [], {}, None

    def _sync_all(self) -> None:
        for event in (*self._offload_done.values(), *self._prefetch_done.values()):
            dev.wait_event(event, device=self._device)
        self._offload_done.clear()
        self._prefetch_done.clear()
        if self.pool is not None:
            self.pool.in_use = 0

    def begin_step(self, layers, batch, seq, dtype, device) -> None:
        self._sync_all()
        self._aux.clear()
        super().begin_step(layers, batch, seq, dtype, device)


def measure_copy_bandwidth(src: torch.Tensor) -> float:
    """Returns device-to-host bytes/s measured by copying `src` into fresh (pinned on CUDA) host memory."""
    nbytes = src.numel() * src.element_size()
    host = dev.HostBuffer(nbytes, src.device)  # held (and so pinned) until the timing is over
    dst = host.data.view(src.dtype).view(src.shape)
    seconds = dev.timed(lambda: dst.copy_(src, non_blocking=True), src.device, repeats=3)
    host.release()
    return nbytes / max(seconds, 1e-9)


def measure_layer_seconds(layer: DecoderLayer, t: dict[str, torch.Tensor]) -> float:
    """Returns the forward seconds of `layer` measured on the tensors `t` (random input, no autograd)."""
    t["x"].normal_()

    def run():
        with torch.no_grad():
            layer.fill(t)
            layer.output(t)

    return dev.timed(run, t["x"].device)


def make_store(policy: ActivationPolicy, n_layers: int) -> ActivationStore:
    """Returns the store implementing `policy.strategy`."""
    cls = {"none": KeepStore, "full": RecomputeStore, "memo": SwapEngine}[policy.strategy]
    return cls(policy, n_layers)
