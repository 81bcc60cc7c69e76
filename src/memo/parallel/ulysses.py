"""Ulysses sequence parallelism: each rank of an sp group holds a contiguous 1/sp of every sequence's tokens;
attention alone needs all tokens, so q, k, v go from token shards to head shards (all tokens, 1/sp of the
heads) through all-to-alls, and the attention output comes back the same way (DeepSpeed-Ulysses).

The layer's token-local work (norms, projections, MLP, offload and token-wise recompute) stays on the
rank's own tokens. Grouped-query attention: k and v heads are replicated up to lcm(kv heads, sp), so each
rank receives whole query groups whatever the kv head count; their gradients are folded back.

One all-to-all per tensor: at these lengths each is bandwidth-bound, and a tensor's send buffer is freed
before the next one is packed, so the exchange holds one tensor's copy beside its results; with one
sequence per rank (b = 1) a received buffer already is the head shard, with no reordering copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

Exchange = Callable[[torch.Tensor, torch.Tensor], None]  # (receive into, send): an all-to-all of equal chunks


class Ulysses:
    """The all-to-alls of one sp group, between token-major layouts: token shards (b, s/sp, H, d) on each
    rank <-> head shards (b, s, H/sp, d), the heads of rank r being [r·H/sp, (r+1)·H/sp)."""

    def __init__(self, size: int, rank: int, n_heads: int, n_kv_heads: int, exchange: Exchange):
        if n_heads % size:
            raise ValueError(f"`--sp` ({size}) must divide the number of attention heads ({n_heads})")
        self.size, self.rank, self.exchange = size, rank, exchange
        self.kv_repeat = math.lcm(n_kv_heads, size) // n_kv_heads

    @classmethod
    def over(cls, group: dist.ProcessGroup, n_heads: int, n_kv_heads: int) -> "Ulysses":
        """Returns the all-to-alls of the process `group`."""
        return cls(
            dist.get_world_size(group),
            dist.get_rank(group),
            n_heads,
            n_kv_heads,
            lambda recv, send: dist.all_to_all_single(recv, send, group=group),
        )

    @classmethod
    def traced(cls, size: int, n_heads: int, n_kv_heads: int) -> "Ulysses":
        """Returns a stand-in of rank 0 of `size` ranks whose exchange moves nothing: tracing a rank's step on
        `meta` (the cost model) allocates all its buffers without any process group."""
        return cls(size, 0, n_heads, n_kv_heads, lambda recv, send: None)

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

    def to_heads(self, *tokens: torch.Tensor, heads: tuple[slice, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """Returns each token shard (b, s/sp, H_i, d) as its head shard (b, s, H_i/sp, d), or only the shard's
        heads `heads[i]` (indices within each rank's H_i/sp)."""
        return tuple(self._to_heads(t, slice(None) if heads is None else heads[i]) for i, t in enumerate(tokens))

    def _to_heads(self, t: torch.Tensor, heads: slice) -> torch.Tensor:
        n = self.size
        b, s_loc, _, d = t.shape
        chosen = t.unflatten(2, (n, -1))[:, :, :, heads]  # (b, s/sp, n, w, d): rank j's heads of my tokens
        w = chosen.shape[3]
        send = chosen.permute(2, 0, 1, 3, 4).contiguous()  # chunk j to rank j: its heads, my tokens
        recv = torch.empty_like(send)
        self.exchange(recv, send)  # chunk j: rank j's tokens, my heads
        del send
        return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s_loc, w, d)  # tokens in global order

    def to_tokens(
        self, *shards: torch.Tensor, out: tuple[torch.Tensor, ...] | None = None, heads: tuple[slice, ...] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Returns each head shard (b, s, H_i/sp, d) as its token shard (b, s/sp, H_i, d), written into `out`
        when given: into its heads `heads[i]` (indices within each rank's shard) when those are given."""
        return tuple(
            self._to_tokens(h, None if out is None else out[i], slice(None) if heads is None else heads[i])
            for i, h in enumerate(shards)
        )

    def _to_tokens(self, h: torch.Tensor, out: torch.Tensor | None, heads: slice) -> torch.Tensor:
        n = self.size
        b, s, w, d = h.shape
        s_loc = s // n
        send = h.unflatten(1, (n, s_loc)).permute(1, 0, 2, 3, 4).contiguous()  # chunk j to rank j: its tokens
        recv = torch.empty_like(send)
        self.exchange(recv, send)  # chunk j: my tokens, rank j's heads
        del send
        out = h.new_empty(b, s_loc, n * w, d) if out is None else out
        out.unflatten(2, (n, -1))[:, :, :, heads].copy_(recv.permute(1, 2, 0, 3, 4))
        return out


def apply_ulysses(layers: nn.ModuleList, group: dist.ProcessGroup) -> None:
    """Makes every decoder layer run attention over the whole sequence of the sp `group` (a no-op for one rank)."""
    if dist.get_world_size(group) == 1:
        return
    for layer in layers:
        if layer.phases is not None:
            raise ValueError("the phase planner does not support sequence parallelism (`--sp` > 1)")
        layer.seq_parallel = Ulysses.over(group, layer.config.n_heads, layer.config.n_kv_heads)
