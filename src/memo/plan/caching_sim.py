"""A model of PyTorch's CUDA caching allocator, replaying an alloc/free trace (docs/method.md §6).

The rules follow `c10/cuda/CUDACachingAllocator.cpp` with default settings:
- requests are rounded up to 512 B;
- requests of at most 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the large
  pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded up to 2 MiB otherwise;
- a request takes the smallest free block of its pool that fits (lowest address on ties);
- a block is split when the rest is at least 512 B (small pool) or more than 1 MiB (large pool);
- a freed block merges with free neighbours of its segment; segments go back to the driver only when a
  new segment would not fit the capacity (then every fully free segment is released and the request is
  retried) — an out-of-memory happens only after that;
- with `expandable_segments`, each pool is one segment that grows in 20 MiB (large) / 2 MiB (small) pages,
  and any block is split when at least 512 B remain;
- a request of 0 bytes allocates nothing.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    """Returns the request rounded up to a multiple of 512 B (at least 512 B)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(rounded: int) -> int:
    """Returns the size of the segment cudaMalloc'ed for a request that no cached block serves."""
    if rounded <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


class Block:
    """A block of a segment; its neighbours by address are `prev` and `next` (None at the segment's ends)."""

    __slots__ = ("segment", "address", "size", "free", "prev", "next")

    def __init__(self, segment: int, address: int, size: int, free: bool = True, prev=None, next=None):
        self.segment, self.address, self.size, self.free = segment, address, size, free
        self.prev, self.next = prev, next


@dataclass
class SimResult:
    peak_allocated: int = 0
    peak_reserved: int = 0
    max_fragmentation: int = 0  # reserved − allocated, at its worst
    oom_at: int | None = None  # index of the event that ran out of memory
    segments_released: int = 0
    timeline: list[tuple[int, int]] = field(default_factory=list)  # (allocated, reserved) after each event


class CachingAllocator:
    """The allocator's state: segments split into blocks linked by address, per-pool free lists ordered by (size,
    address); every step is a dictionary lookup or a bisection, so a step of a million events replays in seconds."""

    def __init__(self, capacity: int | None = None, expandable_segments: bool = False):
        self.capacity, self.expandable = capacity, expandable_segments
        self.last: dict[int, Block] = {}  # segment id -> its block of the highest address
        self.segment_pool: dict[int, bool] = {}  # segment id -> is small pool
        self.free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # (size, address, segment)
        self._free_at: dict[int, Block] = {}  # address -> free block (addresses are unique across segments)
        self.reserved = self.allocated = 0
        self._next_segment = 0
        self._next_address = 0
        self.released = 0

    def malloc(self, nbytes: int) -> Block | None:
        """Returns the block serving `nbytes`, or None when the capacity is exhausted (OOM)."""
        size = round_size(nbytes)
        small = size <= SMALL_REQUEST
        block = self._take_free(size, small) or self._grow(size, small)
        if block is None:
            return None
        block.free = False
        self.allocated += block.size
        return block

    def release(self, block: Block) -> None:
        """Frees `block` and merges it with free neighbours in its segment."""
        block.free = True
        self.allocated -= block.size
        for other in (block.next, block.prev):
            if other is not None and other.free:
                self._unlist(other)
                self._unlink(other)
                block.address, block.size = min(block.address, other.address), block.size + other.size
        self._list(block)

    def _take_free(self, size: int, small: bool) -> Block | None:
        free = self.free[small]
        k = bisect.bisect_left(free, (size, -1, -1))
        if k == len(free):
            return None
        _, address, _ = free.pop(k)
        block = self._free_at.pop(address)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if (small or self.expandable) else (rest > SMALL_REQUEST):
            tail = Block(block.segment, block.address + size, rest, prev=block, next=block.next)
            if block.next is None:
                self.last[block.segment] = tail
            else:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._list(tail)
        return block

    def _grow(self, size: int, small: bool) -> Block | None:
        if self.expandable:
            return self._expand(size, small)
        seg_size = segment_size(size)
        if not self._fits(seg_size):
            return None
        seg = self._new_segment(seg_size, small)
        self.last[seg] = Block(seg, self._next_address, seg_size)
        self._next_address += seg_size
        self._list(self.last[seg])
        return self._take_free(size, small)

    def _expand(self, size: int, small: bool) -> Block | None:
        """Grows the pool's single segment by whole pages at its end (expandable segments)."""
        seg = next((s for s, is_small in self.segment_pool.items() if is_small == small), None)
        if seg is None:
            seg = self._new_segment(0, small)
        last = self.last.get(seg)
        tail_free = last.size if last is not None and last.free else 0
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        grow = -(-(size - tail_free) // page) * page
        if not self._fits(grow):
            return None
        self.reserved += grow
        if tail_free:
            self._unlist(last)
            last.size += grow
        else:
            end = last.address + last.size if last is not None else seg << 48
            last = self.last[seg] = Block(seg, end, grow, prev=last)
            if last.prev is not None:
                last.prev.next = last
        self._list(last)
        return self._take_free(size, small)

    def _fits(self, extra: int) -> bool:
        if self.capacity is None or self.reserved + extra <= self.capacity:
            return True
        self._release_cached()
        return self.reserved + extra <= self.capacity

    def _release_cached(self) -> None:
        """Returns every fully free segment to the driver (what the allocator does before reporting OOM)."""
        for seg, block in list(self.last.items()):
            if block.prev is None and block.free:
                self._unlist(block)
                self.reserved -= block.size
                del self.last[seg], self.segment_pool[seg]
                self.released += 1

    def _new_segment(self, seg_size: int, small: bool) -> int:
        seg = self._next_segment
        self._next_segment += 1
        self.segment_pool[seg] = small
        self.reserved += seg_size
        return seg

    def _unlink(self, block: Block) -> None:
        """Takes a merged block out of its segment's chain."""
        if block.prev is not None:
            block.prev.next = block.next
        if block.next is not None:
            block.next.prev = block.prev
        else:
            self.last[block.segment] = block.prev

    def _list(self, block: Block) -> None:
        bisect.insort(self.free[self.segment_pool[block.segment]], (block.size, block.address, block.segment))
        self._free_at[block.address] = block

    def _unlist(self, block: Block) -> None:
        free = self.free[self.segment_pool[block.segment]]
        free.pop(bisect.bisect_left(free, (block.size, block.address, block.segment)))
        del self._free_at[block.address]


def replay(events, capacity: int | None = None, expandable_segments: bool = False) -> SimResult:
    """Returns peaks, fragmentation and OOM of replaying (kind, tensor id, nbytes) events; kind is alloc/free."""
    sim = CachingAllocator(capacity, expandable_segments)
    result, live = SimResult(), {}
    for index, (kind, tensor, nbytes) in enumerate(events):
        if nbytes == 0:
            continue  # PyTorch returns no block for an empty request
        if kind == "alloc":
            block = sim.malloc(nbytes)
            if block is None:
                result.oom_at = index
                break
            live[tensor] = block
        else:
            sim.release(live.pop(tensor))
        result.peak_allocated = max(result.peak_allocated, sim.allocated)
        result.peak_reserved = max(result.peak_reserved, sim.reserved)
        result.max_fragmentation = max(result.max_fragmentation, sim.reserved - sim.allocated)
        result.timeline.append((sim.allocated, sim.reserved))
    result.segments_released = sim.released
    return result
