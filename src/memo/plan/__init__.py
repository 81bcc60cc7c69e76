"""Static memory planning (docs/method.md §5-6): traces, DSA solvers, bi-level plans, arena, allocator simulator."""
