"""The caching-allocator simulator against hand-worked cases of each rule (docs/method.md §6)."""

from memo.plan.caching_sim import CachingAllocator, replay, round_size, segment_size

MiB = 1 << 20


def test_requests_round_up_to_512_bytes():
    assert (round_size(1), round_size(512), round_size(513)) == (512, 512, 1024)


def test_segment_sizes_follow_the_pool_rules():
    assert segment_size(1000) == 2 * MiB  # small pool: 2 MiB segments
    assert segment_size(MiB) == 2 * MiB
    assert segment_size(MiB + 512) == 20 * MiB  # 1-10 MiB: 20 MiB segments
    assert segment_size(10 * MiB) == 10 * MiB  # >= 10 MiB: rounded to 2 MiB
    assert segment_size(11 * MiB + 512) == 12 * MiB


def test_small_requests_share_a_2mib_segment():
    sim = CachingAllocator()
    a, b = sim.malloc(1000), sim.malloc(3000)
    assert sim.reserved == 2 * MiB and sim.allocated == 1024 + 3072
    assert a.segment == b.segment and b.address == a.address + 1024  # split, next block follows


def test_large_block_is_not_split_when_at_most_1mib_remains():
    sim = CachingAllocator()
    a = sim.malloc(12 * MiB)
    sim.release(a)
    b = sim.malloc(11 * MiB)  # the 12 MiB block fits; 1 MiB would remain: kept whole
    assert b.size == 12 * MiB and sim.allocated == 12 * MiB and sim.reserved == 12 * MiB


def test_large_block_is_split_when_more_than_1mib_remains():
    sim = CachingAllocator()
    sim.release(sim.malloc(16 * MiB))
    b = sim.malloc(12 * MiB)
    assert b.size == 12 * MiB and sim.reserved == 16 * MiB
    c = sim.malloc(4 * MiB)  # served by the 4 MiB tail, no new segment
    assert c.address == b.address + 12 * MiB and sim.reserved == 16 * MiB


def test_best_fit_takes_the_smallest_block_that_fits():
    sim = CachingAllocator()
    big, small = sim.malloc(16 * MiB), sim.malloc(12 * MiB)
    sim.release(big)
    sim.release(small)
    assert sim.malloc(11 * MiB).segment == small.segment


def test_freed_neighbours_merge():
    sim = CachingAllocator()
    a, b, c = sim.malloc(2 * MiB), sim.malloc(2 * MiB), sim.malloc(2 * MiB)  # one 20 MiB segment
    assert sim.reserved == 20 * MiB and a.segment == b.segment == c.segment
    sim.release(b)
    sim.release(a)
    merged = sim.malloc(4 * MiB)  # best fit: the merged 4 MiB hole, not the 14 MiB tail
    assert merged.address == a.address and merged.size == 4 * MiB


def test_cached_segments_are_released_before_running_out_of_memory():
    events = [("alloc", 0, 12 * MiB), ("free", 0, 12 * MiB), ("alloc", 1, 14 * MiB), ("alloc", 2, 12 * MiB)]
    result = replay(events, capacity=24 * MiB)
    assert result.segments_released == 1  # the free 12 MiB segment went back to make room for 14 MiB
    assert result.oom_at == 3  # 14 + 12 MiB cannot both fit in 24 MiB


def test_fragmentation_is_reserved_minus_allocated():
    # two 8 MiB tensors in one 20 MiB segment; freeing the first leaves a hole a 12 MiB request cannot use
    events = [("alloc", 0, 8 * MiB), ("alloc", 1, 8 * MiB), ("free", 0, 8 * MiB), ("alloc", 2, 12 * MiB)]
    result = replay(events)
    assert result.peak_reserved == 20 * MiB + 12 * MiB
    assert result.max_fragmentation == 12 * MiB  # 32 MiB reserved, 20 MiB allocated


def test_expandable_segments_grow_in_pages_instead_of_new_segments():
    events = [("alloc", 0, 8 * MiB), ("alloc", 1, 8 * MiB), ("free", 0, 8 * MiB), ("alloc", 2, 12 * MiB)]
    result = replay(events, expandable_segments=True)
    # one 20 MiB page holds 8 + 8 (split down to 512 B); 12 MiB fits neither free hole (8, 4), so the free
    # 4 MiB tail grows by one more 20 MiB page instead of a new segment
    assert result.peak_reserved == 40 * MiB
    assert result.peak_allocated == 20 * MiB


def test_empty_requests_allocate_nothing():
    assert replay([("alloc", 0, 0), ("free", 0, 0)]).peak_reserved == 0
