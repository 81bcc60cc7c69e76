"""Cost model (memo-method.md §3, §7, §8): hardware specs, FLOPs, memory and time of MEMO and the baselines."""
