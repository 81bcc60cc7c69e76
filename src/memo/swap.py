"""Where skeletal tensors live between a layer's forward and its backward: one store obeying a mode per layer
(policy.py), with two device rounding buffers, a pinned host pool and side streams (docs/method.md §3-4).

- The whole-length tensors (x, q, k, v, attn, lse) of a `memo` or `checkpoint` layer live in rounding buffer
  index % 2; after the forward the offload stream copies its host part (memo: x, attn, lse and α of the rows
  of q, k, v; checkpoint: x) to the layer's pinned host slot; a later layer of the same parity waits for that
  copy before writing the buffer. In backward the prefetch stream copies layer i-1's slot back while layer i
  computes, unless its buffer was never overwritten (the last buffered layer of each parity).
- The token-local tensors run in tiles through two tile slots per buffer (`SlotTiles`); the tile stream
  copies a memo layer's α rows of each tile to host behind the next tile's compute, and back one tile ahead
  in backward. The rest are recomputed, tile by tile.
- A `keep` layer has a slot of its own holding every tensor whole; `recompute` layers (strategy `full`) keep
  their input and rebuild the rest in rounding buffer 0.

`layer_swaps` gives each layer's `LayerSwap` (its mode, α and what goes to host and comes back) and
`StoreLayout` sizes all of it from the layer's skeletal specs: what `_reserve` allocates is what the cost model
predicts. Every call comes from `LayerFunction` (the `layer.Store` protocol):
`begin_step` → per layer `slots` / `after_forward` → per layer (reverse) `before_backward`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from . import device as dev
from .attention import heads_per_call
from .layer import DecoderLayer, FreshTiles, Recompute, SkeletalSpec, bytes_by_role, in_group, rows_of, tile_ranges
from .policy import (
    BUFFERED,
    ActivationPolicy,
    Mode,
    PlanProblem,
    mode_alphas,
    offloaded,
    reloaded,
    slot_survives,
    solve_plan,
    split_row,
)
from .units import format_bytes

log = logging.getLogger(__name__)

ALIGN = 512  # bytes; keeps every view aligned for vectorised kernels and DMA
TILE_GROUPS = ("qkv", "mlp")
BACKWARD_OVER_FORWARD = 2.0  # a layer's backward runs two matmuls per forward one (its dx and dW)


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
    modes: list[str] = field(default_factory=list)
    tile_tokens: int = 0

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


@dataclass(frozen=True, kw_only=True)
class LayerSwap:
    """Where one layer's skeletal tensors live from its forward to its backward (docs/method.md §3-4)."""

    mode: Mode
    alpha: float  # the plan's α; 1 for a memo layer that sends nothing (its tensors all stay on the device)
    split: int  # memo: how many leading token rows of q, k, v and the token-local tensors go to host; else 0
    sent: bool  # its whole-length host part (input; memo: attention output and q, k, v rows) goes to host
    reloaded: bool  # a later layer overwrites its rounding buffer before its backward: the host part comes back
    survives: bool  # its token-local tensors are still in its tile slot at its backward (one tile, not reloaded)

    def host_specs(self, specs: dict[str, SkeletalSpec]) -> dict[str, SkeletalSpec]:
        """Returns what the layer keeps in its host slot: memo sends x, attn, lse and the first `split` rows of the
        other tensors (of its whole-length ones only when `sent`; of its token-local ones unless they survive in
        its tile slot), checkpoint sends x (and a mixture of experts' routing: every tensor of role "input")."""
        if self.mode == "memo":
            kept = {n: (sp.rows(self.split) if sp.role == "other" else sp) for n, sp in specs.items()}
            return {n: sp for n, sp in kept.items() if (self.sent if sp.group == "whole" else not self.survives)}
        if self.mode == "checkpoint" and self.sent:
            return inputs(specs)
        return {}


def inputs(specs: dict[str, SkeletalSpec]) -> dict[str, SkeletalSpec]:
    """Returns what no mode recomputes: the layer input x and a mixture of experts' routing (role "input")."""
    return {n: sp for n, sp in specs.items() if sp.role == "input"}


def layer_swaps(
    modes: list[str], alphas: list[float], seq: int, tile: int, offload_last: bool = False, empty: bool = False
) -> tuple[LayerSwap, ...]:
    """Returns each layer's `LayerSwap` for a plan (mode and α per layer) over `seq` tokens in tiles of `tile`
    rows (`empty`: the rounding buffers freed across the loss): what the store obeys and the cost model sizes."""
    sent, back = offloaded(modes, offload_last, empty), reloaded(modes, empty)
    survive = slot_survives(modes, tile < seq, empty)
    swaps = []
    for i, (mode, alpha) in enumerate(zip(modes, alphas)):
        alpha = 1.0 if survive[i] and not sent[i] else alpha  # nothing of it goes to host: every row stays
        split = split_row(alpha, seq) if mode == "memo" else 0
        swaps.append(
            LayerSwap(mode=mode, alpha=alpha, split=split, sent=sent[i], reloaded=back[i], survives=survive[i])
        )
    return tuple(swaps)


@dataclass(frozen=True)
class StoreLayout:
    """The bytes a plan takes, from the skeletal specs alone (the store allocates exactly these)."""

    whole_bytes: int  # one rounding buffer's whole-length tensors
    slot_bytes: int  # one tile slot (the larger tile group)
    n_slots: int  # per buffer: two, used in turn, or one when a single tile covers the sequence
    n_buffers: int
    keep_bytes: int  # the keep layers' slots, summed
    n_keep: int
    kept_input_bytes: int  # the inputs (and routing) `recompute` layers hold
    host_bytes: tuple[int, ...]  # per layer

    @property
    def buffer_bytes(self) -> int:
        return self.whole_bytes + self.n_slots * self.slot_bytes

    @property
    def device_bytes(self) -> int:
        return self.n_buffers * self.buffer_bytes + self.keep_bytes + self.kept_input_bytes

    @property
    def host_total(self) -> int:
        return sum(self.host_bytes)


def store_layout(
    specs: dict[str, SkeletalSpec] | list[dict[str, SkeletalSpec]], swaps: tuple[LayerSwap, ...], tile: int
) -> StoreLayout:
    """Returns the device and host bytes of the layers' `swaps` for their skeletal `specs` (whole-length; one dict
    when every layer has the same, else one per layer: a mixture of experts' dense and sparse layers) and `tile`
    rows. The rounding buffers and tile slots fit the largest kind of layer."""
    per_layer = specs if isinstance(specs, list) else [specs] * len(swaps)
    kinds = layer_kinds(per_layer)[0]
    seq = per_layer[0]["x"].shape[1]
    modes = [swap.mode for swap in swaps]
    buffers = 2 if any(m in BUFFERED for m in modes) else 1 if "recompute" in modes else 0
    return StoreLayout(
        whole_bytes=max(pack_layout(in_group(k, "whole"))[1] for k in kinds),
        slot_bytes=max(pack_layout(tile_specs(k, g, tile))[1] for k in kinds for g in TILE_GROUPS),
        n_slots=1 if tile >= seq else 2,
        n_buffers=buffers,
        keep_bytes=sum(pack_layout(sp)[1] for sp, m in zip(per_layer, modes) if m == "keep"),
        n_keep=modes.count("keep"),
        kept_input_bytes=sum(
            sp["x"].nbytes + pack_layout(routing(sp))[1] for sp, m in zip(per_layer, modes) if m == "recompute"
        ),
        host_bytes=tuple(pack_layout(swap.host_specs(sp))[1] for sp, swap in zip(per_layer, swaps)),
    )


def layer_kinds(per_layer: list[dict[str, SkeletalSpec]]) -> tuple[list[dict[str, SkeletalSpec]], list[int]]:
    """Returns (the distinct skeletal tables among the layers', the index of each layer's)."""
    kinds, keys, which = [], {}, []
    for specs in per_layer:
        key = tuple(specs.items())
        if key not in keys:
            keys[key] = len(kinds)
            kinds.append(specs)
        which.append(keys[key])
    return kinds, which


def tile_specs(specs: dict[str, SkeletalSpec], group: str, tile: int) -> dict[str, SkeletalSpec]:
    """Returns the specs of one tile of `tile` rows of the group's tensors."""
    return {n: sp.rows(tile) for n, sp in in_group(specs, group).items()}


def routing(specs: dict[str, SkeletalSpec]) -> dict[str, SkeletalSpec]:
    """Returns what a `recompute` layer keeps beside its input: a mixture of experts' routing."""
    return {n: sp for n, sp in inputs(specs).items() if n != "x"}


def plan_problem(
    specs: dict[str, SkeletalSpec],
    n_layers: int,
    seconds: dict[str, float],
    bandwidth: float,
    host_budget: int,
    device_budget: int = 0,
    offload_last: bool = False,
    tile: int | None = None,
    empty: bool = False,
) -> PlanProblem:
    """Returns the plan problem (policy.py) of layers of `specs` with one layer's `seconds` (forward, backward,
    and the forward's qkv, attention, mlp parts) and the host link's `bandwidth`; the host budget less the room
    each host slot's tensors take to align; `tile` the tile length (None: one tile covers the sequence)."""
    by_role = bytes_by_role(specs)
    return PlanProblem(
        n_layers=n_layers,
        input_bytes=by_role["input"],
        attention_bytes=by_role["attention"],
        other_bytes=by_role["other"],
        local_bytes=sum(sp.nbytes for sp in specs.values() if sp.group != "whole"),
        keep_bytes=pack_layout(specs)[1],
        bandwidth=bandwidth,
        layer_seconds=seconds["forward"],
        backward_seconds=seconds["backward"],
        attention_seconds=seconds["attention"],
        qkv_seconds=seconds["qkv"],
        mlp_seconds=seconds["mlp"],
        host_budget=host_budget - n_layers * len(specs) * ALIGN,
        device_budget=device_budget,
        offload_last_layers=offload_last,
        empty_buffers=empty,
        tiled=tile is not None and tile < specs["x"].shape[1],
    )


class HostPool:
    """One host allocation (pinned for CUDA) sized up front with a byte cap, carved into per-layer slots."""

    def __init__(self, nbytes: int, cap: int, device: torch.device):
        if nbytes > cap:
            raise ValueError(
                f"the pinned host pool needs {format_bytes(nbytes)} but the host budget is {format_bytes(cap)}; "
                "lower `--alpha`, checkpoint or keep more layers (`--plan`), or raise `--host-budget`"
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


@dataclass(frozen=True)
class KeptTiles:
    """Tiles of a `keep` layer: row views of its whole token-local tensors; nothing to copy or recompute."""

    names: tuple[tuple[str, str], ...]  # (name, group)
    seq: int
    tile: int
    heads: int

    def ranges(self, start: int = 0) -> list[slice]:
        return tile_ranges(start, self.seq, self.tile)

    def open(self, t, rows, group):
        return {n: t[n][:, rows] for n, g in self.names if g == group}

    def close(self, rows, group) -> None:
        pass

    def restore(self, t, rows, group):
        return self.open(t, rows, group), rows.stop - rows.start


class SlotTiles:
    """Tiles of a buffered or recomputed layer in two tile-sized slots used in turn (one when a single tile
    covers the sequence): a memo layer's rows [0, split) go to `host` behind the next tile's compute (forward)
    and come back one tile ahead (backward), on the tile stream; the other rows are recomputed. Events order
    every slot and its copies."""

    def __init__(
        self, slots, host: dict[str, torch.Tensor], split: int, seq: int, tile: int, heads: int, stream, survives=False
    ):
        self.slots = slots  # per slot: group -> {name: (b, tile, ...)}; the groups share a slot's bytes
        self.host, self.split, self.seq, self.tile, self.heads, self.stream = host, split, seq, tile, heads, stream
        self.survives = survives  # the MLP group written last in the forward is still in the slot
        self.device = next(iter(slots[0]["mlp"].values())).device
        self._uses = 0  # slot of the next tile: 0, 1, 0, ...
        self._copied = [None] * len(slots)  # per slot: the tile stream's last copy into or out of it
        self._loading = None  # (rows, group) whose load into the next slot is already under way
        self._open = 0

    def ranges(self, start: int = 0) -> list[slice]:
        return tile_ranges(start, self.seq, self.tile)

    def _take(self, rows: slice, group: str) -> tuple[int, dict[str, torch.Tensor]]:
        """Returns the next slot and its views of `rows`, once its last copy is done."""
        j, self._uses = self._uses % len(self.slots), self._uses + 1
        dev.wait_event(self._copied[j], device=self.device)
        return j, {n: s[:, : rows.stop - rows.start] for n, s in self.slots[j][group].items()}

    def _kept(self, rows: slice) -> int:
        """Returns how many of `rows` (from its start) are kept on host."""
        return max(0, min(rows.stop, self.split) - rows.start) if self.host else 0

    def open(self, t, rows, group):
        self._open, views = self._take(rows, group)
        return views

    def close(self, rows, group) -> None:
        n = self._kept(rows)
        if n:
            self._copy(self._open, rows, group, n, to_host=True)

    def restore(self, t, rows, group):
        if self.survives and group == "mlp":  # as the forward left it (the qkv group shares its bytes: gone)
            return self._take(rows, group)[1], rows.stop - rows.start
        if self._loading != (rows.start, group):  # not started one tile ahead
            n = self._kept(rows)
            if n:
                self._copy(self._uses % len(self.slots), rows, group, n, to_host=False)
        j, views = self._take(rows, group)
        self._loading = None
        later = [r for r in self.ranges() if r.start > rows.start]
        if len(self.slots) == 2 and later and self._kept(later[0]):  # the next tile's rows come while this one computes
            self._copy(1 - j, later[0], group, self._kept(later[0]), to_host=False)
            self._loading = (later[0].start, group)
        return views, self._kept(rows)

    def _copy(self, j: int, rows: slice, group: str, n: int, to_host: bool) -> None:
        """Copies the first `n` rows of slot j's `group` tensors to (from) host rows [rows.start, +n) on the tile
        stream, after everything the compute stream has queued so far (its last use of the slot)."""
        ready = dev.record_event(self.device)
        with dev.on_stream(self.stream):
            dev.wait_event(ready, self.stream)
            for name, slot in self.slots[j][group].items():
                h = self.host[name]
                for h_row, s_row in zip(h, slot):  # one contiguous block per sequence
                    dst, src = (h_row[rows.start : rows.start + n], s_row[:n])
                    (dst if to_host else src).copy_(src if to_host else dst, non_blocking=True)
            self._copied[j] = dev.record_event(self.device, self.stream)


def _flatten_slot_tiles(t: SlotTiles):
    names = tuple((j, g, n) for j in range(len(t.slots)) for g in TILE_GROUPS for n in t.slots[j][g])
    leaves = [t.slots[j][g][n] for j, g, n in names] + list(t.host.values())
    return leaves, (names, tuple(t.host), t.split, t.seq, t.tile, t.heads, t.stream, t.survives)


def _unflatten_slot_tiles(leaves, context) -> SlotTiles:
    names, host_names, split, seq, tile, heads, stream, survives = context
    leaves = list(leaves)
    slots = tuple({g: {} for g in TILE_GROUPS} for _ in range(1 + max(j for j, _, _ in names)))
    for (j, g, n), leaf in zip(names, leaves):
        slots[j][g][n] = leaf
    host = dict(zip(host_names, leaves[len(names) :]))
    meta = leaves and leaves[0].device.type == "meta"  # the phase planner's meta twin: no streams
    return SlotTiles(slots, host, split, seq, tile, heads, None if meta else stream, survives)


# the phase planner traces a phase on `meta` twins of its arguments: SlotTiles twins like any tensor container
pytree.register_pytree_node(SlotTiles, _flatten_slot_tiles, _unflatten_slot_tiles)


class ActivationStore:
    """The activations of one model: every layer where its mode says, sized once per input shape."""

    def __init__(self, policy: ActivationPolicy, n_layers: int):
        self.policy, self.n_layers = policy, n_layers
        self.step = 0
        self.stats = SwapStats()
        self.specs: dict[str, SkeletalSpec] = {}  # the largest layer's: the one the plan problem stands on
        self.layer_specs: list[dict[str, SkeletalSpec]] = []  # each layer's (a dense and a sparse kind may mix)
        self._kind: list[int] = []  # each layer's index into its distinct kinds (rounding buffers' views)
        self.kinds: list[dict[str, SkeletalSpec]] = []  # the distinct skeletal tables among the layers'
        self.swaps: tuple[LayerSwap, ...] = ()
        self.layout: StoreLayout | None = None
        self.pool: HostPool | None = None
        self._shape: tuple | None = None
        self._tile = self._heads = 0
        self._buffers: list[dict[str, torch.Tensor]] = []  # whole-length views per rounding buffer
        self._slots: list[tuple] = []  # two tile slots per rounding buffer
        self._keep: dict[int, dict[str, torch.Tensor]] = {}
        self._routing: dict[int, dict[str, torch.Tensor]] = {}  # a recompute layer's kept routing (mixture of experts)
        self._host: dict[int, dict[str, torch.Tensor]] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self._aux: dict[int, tuple] = {}
        self._busy: dict[int, list] = {}  # rounding buffer -> its side-stream copies still to finish
        self._prefetch_done: dict[int, object] = {}
        self._streams: tuple = (None, None, None)  # offload, prefetch, tile
        self._device = torch.device("cpu")
        self._raw: dict[tuple, torch.Tensor] = {}  # the bytes under the views, kept for a shape that fits in them
        self._used: set[tuple] = set()  # the raw buffers the current plan carves
        self._solved: dict[tuple, tuple] = {}  # (batch, dtype, device) -> (seq, modes, α) of the longest solved
        self._emptied: set[int] = set()  # rounding buffers whose bytes are given back (`empty_buffers`)
        self._shared = -1  # layers up to this one hold one rounding buffer at their backward (`empty_buffers`)

    def tiling(self, layer: DecoderLayer, seq: int, device: torch.device) -> tuple[int, int]:
        """Returns (tile length, query heads per attention call) for `seq` of `layer`'s tokens: the policy's, or
        by default the tile of `ActivationPolicy.tile_for` and the heads of `attention.heads_per_call` (inference
        runs tiled too)."""
        tile = self.policy.tile_for(seq)
        heads, _, tokens = layer.attention_shape(seq)
        return tile, self.policy.attention_heads or heads_per_call(heads, tokens, tile, device)

    # ---- sizing -----------------------------------------------------------------------------------------
    def begin_step(self, layers, batch: int, seq: int, dtype: torch.dtype, device: torch.device) -> None:
        """Starts a forward pass; (re)sizes buffers when the input shape or dtype changes. A shorter sequence
        than one sized before (a trainer's packed batches vary in length) reuses its bytes and its solved plan:
        nothing is allocated, pinned or measured again."""
        self._sync_all()
        self._refill(range(len(self._buffers)))
        self._aux.clear()
        self._inputs.clear()
        self.step += 1
        shape = (batch, seq, dtype, torch.device(device))
        if shape != self._shape:
            self._reserve(layers, batch, seq, dtype, torch.device(device))
            self._shape = shape
        keep = ("host_pool_bytes", "device_skeletal_bytes", "alphas", "modes", "tile_tokens")
        self.stats = SwapStats(**{k: getattr(self.stats, k) for k in keep})

    def _reserve(self, layers, batch, seq, dtype, device) -> None:
        if torch.device(device) != self._device:
            self._drop_buffers()
        self._sync_all()
        dev.synchronize(self._device)
        self._buffers, self._slots, self._keep, self._host, self._used = [], [], {}, {}, set()
        self._device = device
        self.layer_specs = [layer.skeletal_specs(batch, seq, dtype, device) for layer in layers]
        self.kinds, self._kind = layer_kinds(self.layer_specs)
        largest = max(range(len(layers)), key=lambda i: pack_layout(self.layer_specs[i])[1])
        self.specs = self.layer_specs[largest]
        self._tile, self._heads = self.tiling(layers[0], seq, device)
        budget = self.policy.host_budget_bytes or int(dev.HOST_USABLE * dev.available_host_bytes())
        modes, alphas = self._plan(layers[largest], batch, seq, budget)
        self.swaps = layer_swaps(
            modes, alphas, seq, self._tile, self.policy.offload_last_layers, self.policy.empty_buffers
        )
        self.layout = store_layout(self.layer_specs, self.swaps, self._tile)
        lowest = min((i for i, swap in enumerate(self.swaps) if swap.mode in BUFFERED), default=0)
        self._shared = lowest + self.policy.shared_layers - 1 if self.policy.empty_buffers else -1
        self._allocate_device(device)
        for key in set(self._raw) - self._used:  # what the last plan had and this one does not (a layer kept)
            del self._raw[key]
        if self.pool is None or self.pool.nbytes < self.layout.host_total:
            if self.pool is not None:
                self.pool.close()
            self.pool = HostPool(self.layout.host_total, budget, device)
        self._host, base = {}, 0
        for i, swap in enumerate(self.swaps):
            specs = swap.host_specs(self.layer_specs[i])
            offsets, size = pack_layout(specs)
            if size:
                self._host[i] = carve(self.pool.buffer[base : base + size], offsets, specs)
            base += size
        self._streams = tuple(dev.new_stream(device) for _ in range(3))
        alphas = [swap.alpha for swap in self.swaps]
        self.stats.host_pool_bytes = self.pool.nbytes
        self.stats.device_skeletal_bytes = self.layout.device_bytes
        self.stats.modes, self.stats.tile_tokens = [swap.mode for swap in self.swaps], self._tile
        self.stats.alphas = alphas if self.policy.strategy == "memo" else []
        log.info(
            "activations: modes %s, alpha %s, tile %d tokens, host pool %s",
            self.stats.modes,
            alphas,
            self._tile,
            format_bytes(self.pool.nbytes),
        )

    def _allocate_device(self, device: torch.device) -> None:
        """Allocates the rounding buffers (whole-length tensors, then two tile slots; views for each kind of layer
        over the same bytes), the keep slots and a recompute layer's routing."""
        layout = self.layout
        self._buffers, self._slots = [], []  # per buffer: per kind, its views
        for _ in range(layout.n_buffers):
            buffer = self._bytes(("buffer", len(self._buffers)), layout.buffer_bytes, device)
            at = [layout.whole_bytes + j * layout.slot_bytes for j in range(layout.n_slots)]
            slots = [buffer[a : a + layout.slot_bytes] for a in at]
            self._buffers.append([_carved(buffer, in_group(specs, "whole")) for specs in self.kinds])
            self._slots.append(
                [
                    tuple({g: _carved(slot, tile_specs(specs, g, self._tile)) for g in TILE_GROUPS} for slot in slots)
                    for specs in self.kinds
                ]
            )
        self._keep, self._routing = {}, {}
        for i, swap in enumerate(self.swaps):
            specs = self.layer_specs[i]
            if swap.mode == "keep":
                self._keep[i] = _carved(self._bytes(("keep", i), pack_layout(specs)[1], device), specs)
            if swap.mode == "recompute" and routing(specs):
                kept = routing(specs)
                self._routing[i] = _carved(self._bytes(("routing", i), pack_layout(kept)[1], device), kept)

    def _bytes(self, key: tuple, nbytes: int, device: torch.device) -> torch.Tensor:
        """Returns `nbytes` of the raw buffer `key`, allocated anew only when the one kept is shorter."""
        self._used.add(key)
        if key not in self._raw or self._raw[key].numel() < nbytes:
            self._raw.pop(key, None)  # the old bytes go before the new ones come
            self._raw[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._raw[key][:nbytes]

    def _plan(self, layer: DecoderLayer, batch: int, seq: int, budget: int) -> tuple[list[str], list[float]]:
        """Returns (mode, α) per layer: the policy's, or solved from measured times and the budgets (§3)."""
        n, p = self.n_layers, self.policy
        modes, alphas = p.layer_modes(n), p.layer_alphas(n)
        if p.strategy != "memo":
            return modes, [0.0] * n
        if modes is not None and alphas is not None:
            return modes, mode_alphas(modes, alphas)
        if self._device.type == "meta":
            raise ValueError("a solved plan needs a real device to measure layer time; give `--alpha` on meta")
        key = (batch, self.specs["x"].dtype, self._device)
        if key in self._solved and self._solved[key][0] >= seq:  # within the longest solved: its plan fits
            return self._solved[key][1:]
        problem = self._plan_problem(layer, batch, seq, budget)
        modes, alphas = solve_plan(problem, modes)
        log.info("memo: solved plan %s, alpha %s from %s", modes, alphas, problem)
        self._solved[key] = (seq, modes, alphas)
        return modes, alphas

    def _plan_problem(self, layer: DecoderLayer, batch: int, seq: int, budget: int) -> PlanProblem:
        """Returns the plan problem of this rank with the layer's measured seconds and copy bandwidth; attention's
        scaled from the measured layer to the mean of the model's (sliding and full layers attend to more or fewer
        tokens: `ModelConfig.attended`), the one layer every layer of the plan problem stands for."""
        whole = {
            n: torch.empty(sp.shape, dtype=sp.dtype, device=self._device)
            for n, sp in in_group(self.specs, "whole").items()
        }
        seconds = measure_layer_seconds(layer, whole, FreshTiles.of(self.specs, self._tile, self._heads))
        tokens, c = layer.attention_shape(seq)[2], layer.config
        seconds["attention"] *= c.attended(tokens, tokens) / c.layer_attended(layer.index, tokens, tokens)
        forward = sum(seconds.values())
        seconds.update(forward=forward, backward=BACKWARD_OVER_FORWARD * forward)
        p = self.policy
        return plan_problem(
            self.specs,
            self.n_layers,
            seconds,
            measure_copy_bandwidth(whole["x"]),
            budget,
            p.device_budget_bytes or 0,
            p.offload_last_layers,
            self._tile,
            p.empty_buffers,
        )

    # ---- forward ----------------------------------------------------------------------------------------
    def slots(self, index: int, x: torch.Tensor):
        """Returns (the layer's whole-length tensors with x in place, its tiles)."""
        mode = self.swaps[index].mode
        if mode == "keep":
            t = self._keep[index]
            t["x"].copy_(x)
            return t, self._kept_tiles(index)
        kind = self._kind[index]
        if mode == "recompute":
            self._inputs[index] = x
            return {**self._buffers[0][kind], "x": x, **self._routing.get(index, {})}, self._slot_tiles(index)
        j = index % 2
        for event in self._busy.pop(j, ()):  # a layer before, of the same parity, may still be copying out
            dev.wait_event(event, device=self._device)
        t = self._buffers[j][kind]
        t["x"].copy_(x)
        return t, self._slot_tiles(index)

    def _kept_tiles(self, index: int) -> KeptTiles:
        specs = self.layer_specs[index]
        names = tuple((n, sp.group) for n, sp in specs.items() if sp.group != "whole")
        return KeptTiles(names, specs["x"].shape[1], self._tile, self._heads)

    def _slot_tiles(self, index: int) -> SlotTiles:
        swap = self.swaps[index]
        j = 0 if swap.mode == "recompute" else index % 2
        specs = self.layer_specs[index]
        host = {n: h for n, h in self._host.get(index, {}).items() if specs[n].group != "whole"}
        seq, stream = specs["x"].shape[1], self._streams[2]
        return SlotTiles(
            self._slots[j][self._kind[index]], host, swap.split, seq, self._tile, self._heads, stream, swap.survives
        )

    def after_forward(self, index: int, aux: tuple) -> None:
        """Starts the copy of the layer's whole-length host part; notes the tile copies still running. After the
        last layer, with `empty_buffers`, frees the rounding buffers until the first backward."""
        self._aux[index] = aux
        if self._host.get(index) is not None:
            self._send(index)
        if self.policy.empty_buffers and index == self.n_layers - 1:
            self._give_back(range(len(self._buffers)))

    def _send(self, index: int) -> None:
        """Starts the copies of layer `index`'s host part out of its rounding buffer; notes them as busy."""
        host = self._host[index]
        j = index % 2
        busy = [dev.record_event(self._device, self._streams[2])]  # the last tile copies
        if self.swaps[index].sent:
            ready = dev.record_event(self._device)
            offload_stream = self._streams[0]
            with dev.on_stream(offload_stream):
                dev.wait_event(ready, offload_stream)
                self._copy_whole(index, to_host=True)
                busy.append(dev.record_event(self._device, offload_stream))
        self._busy[j] = busy
        moved = _nbytes(host)
        self.pool.occupy(moved)
        self.stats.bytes_offloaded += moved
        self.stats.host_pool_peak = max(self.stats.host_pool_peak, self.pool.peak)

    def _copy_whole(self, index: int, to_host: bool) -> int:
        """Copies the whole-length part of layer `index`'s host slot from/to its rounding buffer (kept rows
        only); returns the bytes."""
        buf, moved = self._buffers[index % 2][self._kind[index]], 0
        for name, h in self._host[index].items():
            spec = self.layer_specs[index][name]
            if spec.group != "whole":
                continue
            d = buf[name]
            # one contiguous block per sequence: a strided copy would stage through a device temporary
            pairs = zip(h, d[:, : h.shape[1]]) if spec.role == "other" else [(h, d)]
            for h_part, d_part in pairs:
                (h_part if to_host else d_part).copy_(d_part if to_host else h_part, non_blocking=True)
            moved += h.numel() * h.element_size()
        return moved

    def _give_back(self, buffers) -> None:
        """Frees the bytes of the rounding `buffers` (their views stay, over no memory) once the copies out of them
        are done: the compute stream waits for those, so what it allocates next may take the bytes."""
        for j in (j for j in buffers if j < len(self._buffers)):  # one layer: one buffer
            for event in self._busy.pop(j, ()):
                dev.wait_event(event, device=self._device)
            self._raw["buffer", j].untyped_storage().resize_(0)
            self._emptied.add(j)

    def _refill(self, buffers) -> None:
        """Gives the rounding `buffers` their bytes back (contents to come from host) after `_give_back`."""
        for j in set(buffers) & self._emptied:
            raw = self._raw["buffer", j]
            raw.untyped_storage().resize_(raw.numel())
            self._emptied.discard(j)

    # ---- backward ---------------------------------------------------------------------------------------
    def _prefetch(self, index: int) -> None:
        """Starts the copy of layer `index`'s host slot into its rounding buffer, after everything the compute
        stream has queued (the backward of the later layer that last used the buffer)."""
        if not (0 <= index < self.n_layers and self.swaps[index].reloaded) or index in self._prefetch_done:
            return
        self._refill([index % 2])
        ready = dev.record_event(self._device)
        prefetch_stream = self._streams[1]
        with dev.on_stream(prefetch_stream):
            dev.wait_event(ready, prefetch_stream)
            moved = self._copy_whole(index, to_host=False)
            self._prefetch_done[index] = dev.record_event(self._device, prefetch_stream)
        self.stats.bytes_prefetched += moved

    def before_backward(self, index: int, step: int):
        """Returns (whole-length tensors, aux, tiles, what to recompute) for the layer's backward; starts the
        prefetch of the layer below. With `empty_buffers` the lowest `shared_layers` layers hold one buffer: each
        gives the other back instead of prefetching the layer below into it, which reloads at its own backward."""
        self._check_step(index, step)
        swap = self.swaps[index]
        mode, specs, kind = swap.mode, self.layer_specs[index], self._kind[index]
        b, s = specs["x"].shape[:2]
        if mode == "keep":
            return self._keep[index], self._aux.pop(index), self._kept_tiles(index), None
        if mode == "recompute":
            self._refill([0])
            self._count_recompute(specs, b, s, attention=True, qkv=True)
            t = {**self._buffers[0][kind], "x": self._inputs.pop(index), **self._routing.get(index, {})}
            return t, None, self._slot_tiles(index), Recompute(0, attention=True)
        j = index % 2
        for event in self._busy.pop(j, ()):  # this layer's own copies out of the buffer
            dev.wait_event(event, device=self._device)
        shared = index <= self._shared
        if shared:  # nothing needs the other buffer before this backward is done
            self._give_back([1 - j])
        self._refill([j])
        self._prefetch(index)
        if not shared:
            self._prefetch(index - 1)
        host = self._host.get(index, {})
        self.pool.release(_nbytes(host))
        self.stats.bytes_prefetched += _nbytes({n: h for n, h in host.items() if specs[n].group != "whole"})
        back, split = swap.reloaded, swap.split
        if back:
            dev.wait_event(self._prefetch_done.pop(index), device=self._device)
        attention = back and mode == "checkpoint"
        if swap.survives:  # its MLP tensors are still in the tile slot: only n1 runs again
            self.stats.bytes_recomputed += sum(sp.nbytes for sp in in_group(specs, "qkv").values())
            self.stats.tokens_recomputed += b * s
        else:
            self._count_recompute(specs, b, s - split, attention, qkv=back)
        recompute = Recompute(split, attention) if back and split < s else None
        t = self._buffers[j][kind]
        if self.policy.gradient_over_input and "x" in host:  # the backward may write over its input
            t = {**t, "x_host": host["x"]}
        return t, self._aux.pop(index), self._slot_tiles(index), recompute

    def _count_recompute(self, specs: dict, b: int, rows: int, attention: bool, qkv: bool) -> None:
        """Adds the last `rows` token rows of the layer's (`specs`) recomputed tensors to the stats: the token-local
        ones, q, k, v too when `qkv`, and the attention output when `attention`."""
        if rows <= 0:
            return
        names = [n for n, sp in specs.items() if sp.role == "other" and (qkv or sp.group != "whole")]
        self.stats.bytes_recomputed += sum(specs[n].rows(rows).nbytes for n in names)
        if attention:
            self.stats.bytes_recomputed += sum(sp.nbytes for sp in specs.values() if sp.role == "attention")
        self.stats.tokens_recomputed += b * rows

    def _check_step(self, index: int, step: int) -> None:
        if step != self.step:
            raise RuntimeError(
                f"layer {index}: backward of step {step} after the forward of step {self.step}; "
                "run backward before the next forward (one forward per backward)"
            )

    def _drop_buffers(self) -> None:
        """Frees the buffers of the previous shape (before allocating new ones), once no stream uses them:
        side-stream copies may still read or write them, and the caching allocator only knows the compute
        stream."""
        self._sync_all()
        dev.synchronize(self._device)
        if self.pool is not None:
            self.pool.close()
        self._buffers, self._slots, self._keep, self._host, self.pool = [], [], {}, {}, None
        self._raw.clear()

    def _sync_all(self) -> None:
        for event in (*(e for es in self._busy.values() for e in es), *self._prefetch_done.values()):
            dev.wait_event(event, device=self._device)
        self._busy.clear()
        self._prefetch_done.clear()
        if self.pool is not None:
            self.pool.in_use = 0


def _carved(buffer: torch.Tensor, specs: dict[str, SkeletalSpec]) -> dict[str, torch.Tensor]:
    """Returns views of `specs` laid out back to back from the start of the byte `buffer`."""
    return carve(buffer, pack_layout(specs)[0], specs)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def measure_copy_bandwidth(src: torch.Tensor) -> float:
    """Returns device-to-host bytes/s measured by copying `src` into fresh (pinned on CUDA) host memory.

    Under torch.distributed every rank copies at once and all return the slowest rank's number: a node's GPUs
    share PCIe uplinks while they train, and every rank must solve α from the same bandwidth (§3)."""
    nbytes = src.numel() * src.element_size()
    host = dev.HostBuffer(nbytes, src.device)  # held (and so pinned) until the timing is over
    dst = host.data.view(src.dtype).view(src.shape)
    together = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if together:
        _least_over_ranks(0.0, src.device)  # a barrier: no rank starts copying before every rank is ready
    seconds = dev.timed(lambda: dst.copy_(src, non_blocking=True), src.device, repeats=3)
    host.release()
    bandwidth = nbytes / max(seconds, 1e-9)
    return _least_over_ranks(bandwidth, src.device) if together else bandwidth


def _least_over_ranks(value: float, device: torch.device) -> float:
    """Returns the least `value` over all ranks, once every rank has given its own (on `device`: nccl or gloo)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.item()


def measure_layer_seconds(layer: DecoderLayer, t: dict[str, torch.Tensor], tiles: FreshTiles) -> dict[str, float]:
    """Returns the forward seconds of `layer`'s three parts (token-local before attention, attention, after),
    measured on random inputs without autograd."""
    t["x"].normal_()
    s = t["x"].shape[1]

    def qkv():
        for rows in tiles.ranges():
            layer.fill_qkv({**rows_of(t, rows), **tiles.open(t, rows, "qkv")}, rows, s)

    def mlp():
        y = torch.empty_like(t["x"])
        for rows in tiles.ranges():
            v = {**rows_of(t, rows), **tiles.open(t, rows, "mlp")}
            layer.fill_mlp(v)
            layer.output(v, y[:, rows])

    with torch.no_grad():
        return {
            "qkv": dev.timed(qkv, t["x"].device),
            "attention": dev.timed(lambda: layer.attend(t, tiles.heads), t["x"].device),
            "mlp": dev.timed(mlp, t["x"].device),
        }


def make_store(policy: ActivationPolicy, n_layers: int) -> ActivationStore:
    """Returns the store implementing `policy`."""
    return ActivationStore(policy, n_layers)
