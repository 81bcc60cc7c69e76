"""Static memory planning (docs/method.md §5-6): traces, DSA solvers, bi-level plans, the phase planner, the planned
allocator (`--arena`) and the caching-allocator simulator."""
