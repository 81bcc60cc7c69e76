"""Packed documents: a batch's sequences cut into documents that attend only to themselves.

A batch carries `positions` (b, S), each token's position within its document, as transformers' packed
sequences do (`position_ids`): a document starts where the position is 0 (every sequence begins with one) and
counts 0, 1, 2, ... from there. RoPE rotates each token by that position, so a document sees what it would
alone; attention is causal within a document and blind across its bounds (a block-diagonal causal mask).

`Documents` is what the layers need of it: the positions on the device, and the documents' bounds over the
b·S tokens taken as one stream (row-major), both as a host list (a loop of kernel calls, one per document) and
as cumulative lengths on the device (the variable-length kernels' `cu_seqlens`). Under Ulysses the positions
are the whole sequence's, the same on every rank: attention sees every token, RoPE slices its rank's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class Documents:
    """The documents of a (b, S) batch: positions (b, S) int64 on the device, bounds (start, stop) of each over the
    b·S tokens in row-major order (host), the same as cumulative lengths (n + 1,) int32 on the device."""

    positions: torch.Tensor
    bounds: tuple[tuple[int, int], ...]
    cu_seqlens: torch.Tensor
    max_length: int

    @classmethod
    def of(cls, positions: torch.Tensor | None, batch: int, seq: int, device) -> "Documents | None":
        """Returns the documents `positions` (b, S) describe, None when every sequence is one document (the plain
        causal path, bitwise as without positions); ValueError when they do not count up within documents."""
        if positions is None:
            return None
        if tuple(positions.shape) != (batch, seq) or positions.dtype.is_floating_point or positions.is_complex():
            raise ValueError(
                f"`positions` must be integer (batch, tokens) = ({batch}, {seq}) (under sequence parallelism the "
                f"whole sequence's), got {tuple(positions.shape)} {positions.dtype}"
            )
        host = positions.detach().to("cpu", torch.int64)  # a no-op for a batch from the data (on the host)
        follows = host[:, 1:] == host[:, :-1] + 1
        if bool(host[:, 0].ne(0).any()) or not bool((host[:, 1:].eq(0) | follows).all()):
            raise ValueError("`positions` must count 0, 1, 2, ... from 0 within each document (0 starts one)")
        if not bool(host[:, 1:].eq(0).any()):
            return None
        edges = _edges(host)
        bounds = tuple(zip(edges[:-1].tolist(), edges[1:].tolist()))
        cu = edges.to(device=device, dtype=torch.int32)
        return cls(host.to(device), bounds, cu, int(edges.diff().max()))

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Returns the positions (b, r) of token rows [start, stop) of every sequence."""
        return self.positions[:, start:stop]


def document_positions(starts: torch.Tensor) -> torch.Tensor:
    """Returns the positions (b, S) int64 of tokens within their documents from `starts` (b, S) bool, True where a
    document begins (a sequence's first token always does)."""
    starts = starts.clone()
    starts[:, 0] = True
    index = torch.arange(starts.shape[1]).expand_as(starts)
    begin = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - begin


def attended_tokens(positions: torch.Tensor) -> float:
    """Returns Σ dᵢ² / tokens of a (b, S) batch's documents: how many tokens a token attends to on average (whole
    d × d matrices), the length that stands for S in attention FLOPs (S itself for one document per sequence)."""
    return float((_edges(positions.cpu()).diff().double() ** 2).sum()) / positions.numel()


def _edges(positions: torch.Tensor) -> torch.Tensor:
    """Returns the documents' bounds (n + 1,) over the b·S tokens of host `positions` in row-major order: where a
    position is 0, and the end."""
    return torch.cat((positions.flatten().eq(0).nonzero().flatten(), torch.tensor([positions.numel()])))
