"""Ulysses sequence parallelism: each rank of an sp group holds a contiguous 1/sp of every sequence's tokens;
attention alone needs all tokens, so q, k, v go from token shards to head shards (all tokens, 1/sp of the
heads) through one all-to-all, and the attention output comes back through another (DeepSpeed-Ulysses).

The layer's token-local work (norms, projections, MLP, offload and token-wise recompute) stays on the
rank's own tokens. Grouped-query attention: k and v heads are replicated up to lcm(kv heads, sp), so each
rank receives whole query groups whatever the kv head count; their gradients are folded back.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


class Ulysses:
    """The all-to-alls of one sp group, between token-major layouts: token shards (b, s/sp, H, d) on each
    rank <-> head shards (b, s, H/sp, d), the heads of rank r being [r·H/sp, (r+1)·H/sp)."""

    def __init__(self, group: dist.ProcessGroup, n_heads: int, n_kv_heads: int):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if n_heads % self.size:
            raise ValueError(f"`--sp` ({self.size}) must divide the number of attention heads ({n_heads})")
        self.kv_repeat = math.lcm(n_kv_heads, self.size) // n_kv_heads

    def token_offset(self, local_len: int) -> int:
        """Returns the global position of this rank's first token when it holds `local_len` tokens."""
        return self.rank * local_len

    def expand_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """Returns k or v (b, s, g, d) with each head repeated so that sp divides the head count."""
        return kv if self.kv_repeat == 1 else kv.repeat_interleave(self.kv_repeat, dim=2)

    def fold_kv(self, grad: torch.Tensor) -> torch.Tensor:
        """Returns the gradient of `expand_kv`'s output summed back onto the original heads."""
        if self.kv_repeat == 1:
            return grad
        b, s, heads, d = grad.shape
        return grad.view(b, s, heads // self.kv_repeat, self.kv_repeat, d).sum(3)

    def to_heads(self, *tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Returns each token shard (b, s/sp, H_i, d) as its head shard (b, s, H_i/sp, d); one all-to-all."""
        n = self.size
        b, s_loc, _, d = tokens[0].shape
        widths = [t.shape[2] // n for t in tokens]
        send = tokens[0].new_empty(n, b, s_loc, sum(widths), d)  # chunk j goes to rank j: its heads, my tokens
        lo = 0
        for t, w in zip(tokens, widths):
            send[..., lo : lo + w, :].copy_(t.unflatten(2, (n, w)).permute(2, 0, 1, 3, 4))
            lo += w
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # chunk j: rank j's tokens, my heads
        heads = recv.permute(1, 0, 2, 3, 4).reshape(b, n * s_loc, sum(widths), d)  # tokens in global order
        return heads.split(widths, dim=2)

    def to_tokens(self, *heads: torch.Tensor, out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """Returns each head shard (b, s, H_i/sp, d) as its token shard (b, s/sp, H_i, d), written into `out`
        when given; one all-to-all."""
        n = self.size
        b, s, _, d = heads[0].shape
        s_loc, widths = s // n, [h.shape[2] for h in heads]
        send = heads[0].new_empty(n, b, s_loc, sum(widths), d)  # chunk j goes to rank j: its tokens, my heads
        lo = 0
        for h, w in zip(heads, widths):
            send[..., lo : lo + w, :].copy_(h.unflatten(1, (n, s_loc)).permute(1, 0, 2, 3, 4))
            lo += w
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # chunk j: my tokens, rank j's heads
        out = out or tuple(h.new_empty(b, s_loc, n * w, d) for h, w in zip(heads, widths))
        lo = 0
        for o, w in zip(out, widths):
            o.view(b, s_loc, n, w, d).copy_(recv[..., lo : lo + w, :].permute(1, 2, 0, 3, 4))
            lo += w
        return out


def apply_ulysses(layers: nn.ModuleList, group: dist.ProcessGroup) -> None:
    """Makes every decoder layer run attention over the whole sequence of the sp `group` (a no-op for one rank)."""
    if dist.get_world_size(group) == 1:
        return
    for layer in layers:
        if layer.arena is not None:
            raise ValueError("the planned arena (`plan_memory`) does not support sequence parallelism (`--sp` > 1)")
        layer.seq_parallel = Ulysses(group, layer.config.n_heads, layer.config.n_kv_heads)
