"""Cost model (docs/method.md §3, §7, §8): hardware specs, FLOPs, memory and time of MEMO and the baselines."""
